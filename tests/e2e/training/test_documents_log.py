"""``documents.jsonl``: every update's documents, named by where they came from, for every data kind."""

from __future__ import annotations

import json

from rlcli.callbacks.documents import DocumentsLog
from rlcli.commands.train import train
from train_helpers import compose_train_config


def steps(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "documents.jsonl").read_text().splitlines()]


def test_rollout_files_are_named_by_path_and_line_each_trained_once(small_rollouts, tmp_path):
    run = tmp_path / "run"
    train(compose_train_config([
        "data=rollouts", f"data.paths=[{small_rollouts}]", "data.shuffle=false", "trainer.max_steps=20",
        "trainer.accumulate_microbatches=1", "data.max_tokens=24", "logger=none"]), run)
    lines = steps(run)
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    ids = [i for line in lines for i in line["ids"]]
    assert ids == [f"{small_rollouts}:{n}" for n in range(1, 17)]  # unshuffled: file order, once each


def test_generated_rollouts_have_stable_unique_names(tmp_path):
    common = ["data=generate", "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=3",
              "logger=none"]
    train(compose_train_config(common), tmp_path / "a")
    train(compose_train_config(common), tmp_path / "b")
    first, second = steps(tmp_path / "a"), steps(tmp_path / "b")
    assert first == second  # the same seed names the same documents
    ids = [i for line in first for i in line["ids"]]
    assert len(ids) == 12 and len(set(ids)) == 12


def test_a_fresh_run_starts_the_file_anew_and_a_resumed_one_keeps_its_steps(tmp_path):
    path = tmp_path / "documents.jsonl"
    path.write_text('{"step": 1, "ids": ["old"]}\n')
    log = DocumentsLog(path)
    log.append(1, ["new"])
    assert steps(tmp_path) == [{"step": 1, "ids": ["new"]}]

    path.write_text('{"step": 1, "ids": ["a"]}\n{"step": 2, "ids": ["b"]}\n{"step": 3, "ids": ["c"]}\n{"step": 4, "i')
    resumed = DocumentsLog(path)
    resumed.resume_at(2)  # a killed run's torn last line goes with the steps after the checkpoint
    resumed.append(3, ["c2"])
    assert steps(tmp_path) == [{"step": 1, "ids": ["a"]}, {"step": 2, "ids": ["b"]}, {"step": 3, "ids": ["c2"]}]
