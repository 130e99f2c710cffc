"""Dynamic sampling end to end (math.md#dynamic-sampling): `rlcli train rollout.filter=zero_variance` on the
default task, the filter of rollout files on read (rejected.jsonl, counts, what trains), and the config errors."""

from __future__ import annotations

import csv
import json
import logging
from collections import defaultdict
from pathlib import Path

import pytest

from factories import rollout_record, write_jsonl
from rlcli.commands.train import train
from rlcli.conf.validate import ConfigError, validate_config
from rlcli.data.errors import DataError
from train_helpers import compose_train_config, run_rlcli, straight_and_resumed


def read_metrics(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_cli_trains_the_default_task_with_the_filter(tmp_path):
    """The command line of the docs: every step logs its counts, never more than prompts_per_step (8) kept groups,
    and num_documents is the kept groups' completions (group_size 8 each, no masking)."""
    result = run_rlcli(["train", "rollout.filter=zero_variance", "trainer.max_steps=3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = list((tmp_path / "outputs").glob("*/*"))
    rows = read_metrics(run_dir)
    assert len(rows) == 3
    for row in rows:
        kept, rounds = float(row["groups_kept"]), float(row["sampling_rounds"])
        assert 0 < kept <= 8 and 1 <= rounds <= 4 and float(row["groups_filtered"]) >= 0
        assert float(row["num_documents"]) == 8 * kept


def test_on_policy_documents_are_the_kept_groups(tmp_path):
    """rollouts.jsonl holds only groups whose task rewards differ (the reverse task has no accuracy term and no
    shaping here, so the saved reward is the task's), each whole; documents.jsonl and num_documents count them;
    groups_kept is their number. Groups of two, so that ties (dropped groups) are common."""
    cfg = compose_train_config(["rollout.filter=zero_variance", "rollout.filter_metric=reward", "trainer.max_steps=2",
                                "rollout.save=true", "rollout.group_size=2", "rollout.prompts_per_step=6"])
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    groups = defaultdict(list)
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    for record in records:
        groups[record["group_id"]].append(record["reward"])
    assert all(len(rewards) == 2 and rewards[0] != rewards[1] for rewards in groups.values())
    assert sum(float(r["groups_kept"]) for r in rows) == len(groups)
    assert sum(float(r["num_documents"]) for r in rows) == len(records)
    assert sum(float(r["groups_filtered"]) for r in rows) > 0, "groups of two often tie on this seed"


def test_rollout_files_are_filtered_on_read(tmp_path, caplog):
    """Groups a (rewards 1, 1), b (0, 1), c (2, 2, 2), d (0.5, 0.25), and a record without a group: a, c and the
    lone record are dropped, written to rejected.jsonl with the reason (after the one invalid record), and the log
    counts them; the run trains the 4 records of b and d only. Filtering after the advantages, or dropping silently,
    fails."""
    groups = [("a", 1.0), ("a", 1.0), ("b", 0.0), ("b", 1.0), ("c", 2.0), ("c", 2.0), ("c", 2.0), ("d", 0.5),
              ("d", 0.25), (None, 3.0)]
    records = [rollout_record(i, group_id=g, reward=r) for i, (g, r) in enumerate(groups)]
    records[9].pop("group_id")
    records.append(rollout_record(10, old_logprobs=[0.5, -1, -1, -1]))  # invalid: a positive log-probability
    data = write_jsonl(tmp_path / "r.jsonl", records)
    cfg = compose_train_config(["data=rollouts", f"data.paths=[{data}]", "data.filter=zero_variance",
                                "data.on_invalid=skip", "data.shuffle=false", "trainer.max_steps=100"])
    with caplog.at_level(logging.INFO, logger="rlcli"):
        module = train(cfg, tmp_path / "run")
    rejected = [json.loads(line) for line in (tmp_path / "run" / "rejected.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rejected] == [f"{data}:{n}" for n in (11, 1, 2, 5, 6, 7, 10)]
    assert rejected[1]["reason"] == "data.filter=zero_variance: all 2 documents of group 'a' have reward 1.0"
    assert rejected[3]["reason"] == "data.filter=zero_variance: all 3 documents of group 'c' have reward 2.0"
    assert rejected[6]["reason"] == f"data.filter=zero_variance: all 1 documents of group '{data}:10' have reward 3.0"
    assert all(r["field"] == "reward" for r in rejected[1:]) and rejected[2]["record"]["group_id"] == "a"
    assert module.documents_seen == 4
    assert ("data: data.filter=zero_variance kept 2 of 5 groups; dropped the 6 records of the 3 groups whose "
            f"rewards are all equal, listed in {tmp_path / 'run' / 'rejected.jsonl'}") in caplog.messages


def test_records_without_a_reward_are_an_error_under_the_filter(tmp_path):
    records = [rollout_record(0, group_id="a"), rollout_record(1, group_id="a", drop=("reward",), advantage=0.5)]
    data = write_jsonl(tmp_path / "r.jsonl", records)
    cfg = compose_train_config(["data=rollouts", f"data.paths=[{data}]", "data.filter=zero_variance"])
    with pytest.raises(DataError, match=rf"^{data}:2: no 'reward', and data.filter=zero_variance judges each group "
                                        r"by its records' rewards \(1 records lack one\)"):
        train(cfg, tmp_path / "run")


def test_every_group_equal_is_an_error(tmp_path):
    data = write_jsonl(tmp_path / "r.jsonl", [rollout_record(i, group_id="a", reward=1.0) for i in range(2)])
    result = run_rlcli(["train", "data=rollouts", f"data.paths=[{data}]", "data.filter=zero_variance"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.filter=zero_variance: every group of" in result.stderr


@pytest.mark.parametrize("overrides, problem", [
    (["rollout.filter_metric=accuracy"], "rollout.filter_metric: only valid with rollout.filter=zero_variance, "
                                         "not 'none'"),
    (["rollout.filter=zero_variance", "rollout.group_size=1"], "rollout.filter: zero_variance drops every group "
                                                               "whose completions all score the same, so with "
                                                               "rollout.group_size=1 it drops every group"),
    (["rollout.filter=zero_variance", "trainer.minibatches=2"], "rollout.filter: zero_variance may keep fewer "
                                                                "groups than trainer.minibatches=2"),
    (["rollout.filter=some"], "rollout.filter"),
    (["rollout.filter=zero_variance", "rollout.filter_metric=loss"], "rollout.filter_metric"),
    (["rollout.filter=zero_variance", "rollout.max_sampling_rounds=0"], "rollout.max_sampling_rounds: must be >= 1"),
])
def test_config_errors(overrides, problem):
    with pytest.raises(ConfigError) as info:
        validate_config(compose_train_config(overrides))
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


def test_two_processes_sample_their_own_rounds(tmp_path):
    """Two CPU processes (ddp), groups of two so that ties are common: each process samples its own rounds (no
    collective waits for the other's), and num_documents counts both processes' kept groups: 2 processes x mean
    groups_kept x 2 completions. A collective inside a round, or counts of one process only, fail."""
    result = run_rlcli(["train", "rollout.filter=zero_variance", "rollout.group_size=2", "trainer.devices=2",
                        "trainer.accelerator=cpu", "strategy=ddp", "trainer.max_steps=3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = list((tmp_path / "outputs").glob("*/*"))
    rows = read_metrics(run_dir)
    assert [float(r["num_documents"]) for r in rows] == [2 * float(r["groups_kept"]) * 2 for r in rows]
    assert any(float(r["sampling_rounds"]) > 1 for r in rows)


def test_a_prompts_task_filters_on_accuracy_by_default(tmp_path):
    """task=prompts with math_verify (an accuracy term): the default metric is accuracy. An untrained tiny model
    answers nothing right, so every group of every round is dropped: the step logs groups_filtered = 2 x 3 rounds
    (no group kept, each round draws both again), and trainer.max_bad_steps=2 empty steps stop the run with the
    filter's error (exit 2). Judged on the reward with a length penalty that differs between completions, the same
    run trains."""
    from factories import make_arithmetic_dataset, make_tiny_qwen2

    model = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 8, seed=0)
    common = ["train", "model=hf", f"model.path={model}", "task=prompts", f"task.paths=[{data}]",
              "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=4",
              "rollout.filter=zero_variance", "rollout.max_sampling_rounds=3", "trainer.max_bad_steps=2",
              "trainer.max_steps=2"]
    result = run_rlcli([*common, "hydra.run.dir=accuracy"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "rollout.filter: 2 steps in a row kept no document" in result.stderr
    rows = read_metrics(tmp_path / "accuracy")
    assert [(float(r["groups_kept"]), float(r["groups_filtered"]), float(r["sampling_rounds"])) for r in rows] == [
        (0.0, 6.0, 3.0)]  # the second empty step stops the run before its row
    rewards = "task.rewards=[{name: math_verify}, {name: length_penalty, max_chars: 0, per_char: 0.1}]"
    result = run_rlcli([*common, rewards, "rollout.filter_metric=reward", "hydra.run.dir=reward"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(float(r["groups_kept"]) > 0 for r in read_metrics(tmp_path / "reward"))


def test_a_resumed_run_samples_the_same_rounds(tmp_path):
    """Every round is seeded from (seed, step, process, round): a run resumed from its step-2 checkpoint samples
    steps 3 and 4 exactly as the run that went straight through (the same kept rollouts, the same counts), with
    groups of two so that steps take several rounds. Seeds kept in state, or drawn from a shared generator, fail."""
    common = ["rollout.filter=zero_variance", "rollout.save=true", "rollout.prompts_per_step=3",
              "rollout.group_size=2", "trainer.max_steps=4", "trainer.checkpoint_every=2"]
    straight_dir, run = straight_and_resumed(common, tmp_path)
    assert (run / "rollouts.jsonl").read_text() == (straight_dir / "rollouts.jsonl").read_text()
    counts = ("groups_kept", "groups_filtered", "sampling_rounds", "reward", "num_documents")
    straight, resumed = read_metrics(straight_dir), read_metrics(run)
    assert [[r[c] for c in counts] for r in resumed] == [[r[c] for c in counts] for r in straight]
    assert any(float(r["sampling_rounds"]) > 1 for r in straight[2:])
