"""``completions.jsonl`` (``rollout.log_completions``, ``data.log_completions``): what the model wrote, read
back against the run's own rollout file; reward terms of task=prompts; token ids of rollout files;
resume; TensorBoard text and a wandb table."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from factories import make_arithmetic_dataset, make_tiny_qwen2
from rlcli.commands.train import train
from rlcli.rollout.tasks import ReverseTask
from train_helpers import compose_train_config, straight_and_resumed

SMALL = ["trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.save=true"]


def lines(run_dir: Path, name: str = "completions.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def round_robin(group_ids: list, n: int) -> list[int]:
    """The positions of the first of each group, then the second of each, ... (n of them, ascending)."""
    groups = defaultdict(list)
    for i, group in enumerate(group_ids):
        groups[group].append(i)
    order = []
    for depth in range(max(map(len, groups.values()))):
        order += [members[depth] for members in groups.values() if depth < len(members)]
    return sorted(order[:n])


def test_generated_lines_are_the_decoded_rollouts_one_of_each_group_in_turn(tmp_path):
    """Each step's lines are the rollouts of rollouts.jsonl (the same run) that the test picks, decoded by the
    reverse task's tokenizer; a wrong choice, decoding, reward, advantage or stop flag fails it."""
    run = tmp_path / "run"
    train(compose_train_config([*SMALL, "rollout.log_completions=3", "logger=none"]), run)
    records = lines(run, "rollouts.jsonl")
    tokenizer = ReverseTask().tokenizer
    expected = []
    for step in (1, 2):
        batch = records[(step - 1) * 6: step * 6]
        assert round_robin([r["group_id"] for r in batch], 3) == [0, 1, 3]  # 2 groups of 3: #0, #0's 2nd, #1
        for i in (0, 1, 3):
            record = batch[i]
            ids = record["completion_ids"]
            expected.append({
                "step": step, "prompt": tokenizer.decode(record["prompt_ids"]), "completion": tokenizer.decode(ids),
                "rewards": {}, "reward": record["reward"], "advantage": record["advantages"][0], "length": len(ids),
                "stopped": ids[-1] == tokenizer.eos_id, "group_id": record["group_id"],
            })
    assert lines(run) == expected
    assert all(line["prompt"].endswith(">") for line in expected)  # readable text, not ids


def test_zero_writes_no_file(tmp_path):
    train(compose_train_config([*SMALL, "rollout.log_completions=0", "logger=none"]), tmp_path / "run")
    assert not (tmp_path / "run" / "completions.jsonl").exists()


def test_a_prompts_task_logs_each_reward_term(tmp_path):
    """exact_match and length_penalty recomputed by hand from the logged completion text, which is the
    Hugging Face tokenizer's decoding of rollouts.jsonl's ids; their sum is the reward."""
    model = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 20, seed=1)
    answers = {json.loads(line)["prompt"]: json.loads(line)["answer"] for line in data.read_text().splitlines()}
    run = tmp_path / "run"
    train(compose_train_config([
        "model=hf", f"model.path={model}", "task=prompts", f"task.paths=[{data}]", "rollout.max_new_tokens=3",
        "task.rewards=[{name: exact_match}, {name: length_penalty, max_chars: 1, per_char: 0.5}]",
        *SMALL, "rollout.log_completions=2", "logger=none"]), run)
    hf = AutoTokenizer.from_pretrained(model)
    records = lines(run, "rollouts.jsonl")
    logged = lines(run)
    assert len(logged) == 4
    for line in logged:
        step_records = records[(line["step"] - 1) * 6: line["step"] * 6]
        [record] = [r for r in step_records if r["group_id"] == line["group_id"]][:1]  # the first of its group
        ids = record["completion_ids"]
        ids = ids[:ids.index(hf.eos_token_id)] if hf.eos_token_id in ids else ids
        assert line["completion"] == hf.decode(ids, skip_special_tokens=True)
        assert line["prompt"] in answers
        exact = float(" ".join(line["completion"].split()).casefold() == answers[line["prompt"]])
        penalty = -0.5 * max(0, len(line["completion"]) - 1)
        assert line["rewards"] == {"exact_match": exact, "length_penalty": pytest.approx(penalty)}
        assert line["reward"] == pytest.approx(exact + penalty) == record["reward"]


def test_rollout_files_log_the_token_ids_of_the_steps_documents(small_rollouts, tmp_path):
    """The ids of each line are those of the file's line named in documents.jsonl for that step, chosen one
    of each group in turn."""
    run = tmp_path / "run"
    train(compose_train_config([
        "data=rollouts", f"data.paths=[{small_rollouts}]", "data.shuffle=false", "trainer.max_steps=3",
        "trainer.accumulate_microbatches=2", "data.max_tokens=24", "data.log_completions=3", "logger=none"]), run)
    file = [json.loads(line) for line in small_rollouts.read_text().splitlines()]
    expected = []
    for step in lines(run, "documents.jsonl"):
        docs = [(name, file[int(name.rsplit(":", 1)[1]) - 1]) for name in step["ids"]]
        for i in round_robin([record["group_id"] for _, record in docs], 3):
            name, record = docs[i]
            expected.append({"step": step["step"], "source": name, "prompt_ids": record["prompt_ids"],
                             "completion_ids": record["completion_ids"], "reward": record["reward"],
                             "length": len(record["completion_ids"]), "group_id": record["group_id"]})
    logged = lines(run)
    assert len(logged) == len(expected) > 3
    assert [{k: v for k, v in line.items() if k != "advantage"} for line in logged] == expected
    assert all(isinstance(line["advantage"], float) for line in logged)  # grpo's, from the file's rewards


def test_a_resumed_run_cuts_the_file_back_to_its_checkpoint(tmp_path):
    """A run whose last checkpoint is lost resumes from step 2: its file holds each step once and equals a
    straight run's (without the cut, steps 3 and 4 would appear twice)."""
    common = [*SMALL, "trainer.max_steps=4", "trainer.checkpoint_every=2", "logger=none"]
    straight, run = straight_and_resumed(common, tmp_path)
    steps = [line["step"] for line in lines(run)]
    assert steps == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert lines(run) == lines(straight)


def tfrecords(path: Path):
    """The serialized records of a TFRecord file (length, crc, data, crc)."""
    raw = path.read_bytes()
    at = 0
    while at < len(raw):
        (length,) = struct.unpack("<Q", raw[at: at + 8])
        yield raw[at + 12: at + 12 + length]
        at += 12 + length + 4


def test_tensorboard_gets_the_lines_as_text(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    run = tmp_path / "run"
    train(compose_train_config([*SMALL, "rollout.log_completions=2", "logger=tensorboard"]), run)
    texts = {}
    for path in (run / "tensorboard").glob("events.out.tfevents.*"):
        for record in tfrecords(path):
            event = Event.FromString(record)
            for value in event.summary.value:
                if value.tag.startswith("completions"):
                    texts[event.step] = value.tensor.string_val[0].decode()
    assert sorted(texts) == [1, 2]
    for line in lines(run):
        assert f"| {line['step']} | {line['prompt']} | {line['completion']} |" in texts[line["step"]]


def test_wandb_offline_gets_a_table_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    train(compose_train_config([*SMALL, "rollout.log_completions=2", "logger=wandb"]), run)
    [offline] = (run / "wandb").glob("offline-run-*")
    tables = sorted((offline / "files" / "media" / "table").glob("completions_*.table.json"))
    assert len(tables) == 2
    logged = lines(run)
    for table, step in zip(sorted(tables, key=lambda p: int(p.name.split("_")[1])), (1, 2)):
        content = json.loads(table.read_text())
        rows = [dict(zip(content["columns"], row)) for row in content["data"]]
        assert [(r["step"], r["prompt"], r["completion"]) for r in rows] == [
            (line["step"], line["prompt"], line["completion"]) for line in logged if line["step"] == step]
