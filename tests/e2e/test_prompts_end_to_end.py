"""From a JSONL of questions to a trained, evaluated model with the three commands of
docs/how-to/own-task.md: a local BPE tokenizer with a chat template, a tiny Qwen2 and a generated arithmetic
dataset, `math_verify`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from factories import make_arithmetic_dataset, make_tiny_qwen2
from rlcli.commands.train import train
from train_helpers import compose_train_config, run_rlcli

TASK = ["task=prompts", "rollout.max_new_tokens=2"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    make_tiny_qwen2(root / "model")  # with the tokenizer in the same directory, as a downloaded model has
    return {"model": root / "model", "train": make_arithmetic_dataset(root / "train.jsonl", 200, seed=1),
            "eval": make_arithmetic_dataset(root / "eval.jsonl", 24, seed=2), "root": root}


def paths(assets) -> list[str]:
    return [f"task.paths=[{assets['train']}]", f"task.eval_paths=[{assets['eval']}]"]


def evaluate(model: Path, assets, run: str) -> dict:
    result = run_rlcli(["eval", str(model), *TASK, *paths(assets), "eval.samples=4", f"hydra.run.dir={run}"],
                       assets["root"])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((assets["root"] / run / "eval.json").read_text())["metrics"]


@pytest.mark.slow
def test_train_on_a_prompt_file_with_math_verify_then_the_export_evaluates_better(assets):
    before = evaluate(assets["model"], assets, "eval-initial")
    trained = run_rlcli(["train", "model=hf", f"model.path={assets['model']}", *TASK, *paths(assets),
                         "optimizer.lr=1e-2", "trainer.max_steps=80", "logger=none", "hydra.run.dir=run"],
                        assets["root"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    with (assets["root"] / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    rewards = [float(r["reward"]) for r in rows]
    assert [float(r["reward/math_verify"]) for r in rows] == rewards  # math_verify alone, weight 1
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last > first + 0.05, (first, last)
    after = evaluate(assets["root"] / "run" / "export", assets, "eval-trained")
    assert after["reward"] > before["reward"], (before, after)


def test_a_broken_record_is_one_message_naming_its_line(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"answer": "3"}\n')
    result = run_rlcli(["train", "model=hf", f"model.path={assets['model']}", "task=prompts",
                        f"task.paths=[{bad}]", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2
    assert f"{bad}:2" in result.stderr and "prompt" in result.stderr and "Traceback" not in result.stderr


def test_a_prompt_without_room_for_a_completion_in_data_max_tokens_is_refused_before_training(assets, tmp_path):
    """Line 2 fits task.max_prompt_tokens but not data.max_tokens=48 beside rollout.max_new_tokens=2: before the
    fix the run trained until a step drew it and then died (here, with one step, it may never have)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                       + json.dumps({"prompt": "1+1+" * 40 + "1=", "answer": "41"}) + "\n")
    result = run_rlcli(["train", "model=hf", f"model.path={assets['model']}", *TASK, f"task.paths=[{prompts}]",
                        "data.max_tokens=48", "trainer.max_steps=1", "logger=none", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "data.max_tokens: training prompts longer than the 46 tokens that data.max_tokens=48 leaves beside " \
           "rollout.max_new_tokens=2" in result.stderr
    assert f"{prompts}:2: " in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_a_bad_reward_config_is_one_message_naming_the_key(assets, tmp_path):
    result = run_rlcli(["train", "model=hf", f"model.path={assets['model']}", "task=prompts",
                        f"task.paths=[{assets['train']}]", "task.rewards=[{name: regex, pattern: '('}]",
                        "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2
    assert "task.rewards[0].pattern" in result.stderr and "Traceback" not in result.stderr


def test_rlcli_eval_evaluates_the_eval_paths_of_task_prompts(tmp_path):
    """`rlcli eval EXPORT task=prompts task.eval_paths=[f]` needs no training prompts; with task.paths the same
    file it evaluates it all the same (eval trains nothing)."""
    model_dir = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "test.jsonl", 3, seed=0)
    for name, extra in (("eval_paths", []), ("both", [f"task.paths=[{data}]"])):
        run_dir = tmp_path / name
        result = run_rlcli(["eval", str(model_dir), "task=prompts", f"task.eval_paths=[{data}]", *extra,
                            "eval.samples=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads((run_dir / "eval.json").read_text())
        assert report["prompts"] == 3 and report["samples"] == 2
        assert [row["answer"] for row in report["rows"]] == [
            json.loads(line)["answer"] for line in data.read_text().splitlines()]


@pytest.mark.slow
def test_rlcli_train_on_a_prompt_dataset_with_a_tiny_qwen2(tmp_path):
    """A few steps of `rlcli train` log the rewards per term; ``rollout.stop`` ends the completions
    (half of the vocabulary are stop ids here, so most completions stop early)."""
    model_dir = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 32, seed=0, chat=True)
    stop_ids = list(range(0, 320, 2))
    cfg = compose_train_config([
        "model=hf", f"model.path={model_dir}", "task=prompts", f"task.paths=[{data}]", "task.eval_fraction=0.25",
        "trainer.max_steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        f"rollout.stop=[\"+\",{','.join(map(str, stop_ids))}]", "rollout.save=true", "optimizer.lr=1e-3",
    ])
    train(cfg, tmp_path / "run")
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= float(row["reward"]) <= 1.0 and float(row["reward/math_verify"]) == float(row["reward"])
        assert float(row["reward_errors"]) == 0.0
    hf = AutoTokenizer.from_pretrained(model_dir)
    completions = [json.loads(line)["completion_ids"] for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    assert len(completions) == 32 and sum(len(c) < 6 for c in completions) > 16
    for ids in completions:
        assert not set(ids[:-1]) & set(stop_ids) and "+" not in hf.decode(ids[:-1])


def test_rlcli_eval_of_a_prompts_task_evaluates_its_held_out_split(tmp_path):
    model = make_tiny_qwen2(tmp_path / "model")
    train = make_arithmetic_dataset(tmp_path / "train.jsonl", 20, seed=0)
    held_out = make_arithmetic_dataset(tmp_path / "eval.jsonl", 5, seed=1)
    result = run_rlcli(["eval", str(model), "task=prompts", f"task.paths=[{train}]", f"task.eval_paths=[{held_out}]",
                        "eval.samples=2", "eval.prompts=3", "rollout.max_new_tokens=3", "hydra.run.dir=run"],
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    records = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert [(row["prompt"], row["answer"]) for row in report["rows"]] == [(r["prompt"], r["answer"]) for r in records]
    assert report["prompts"] == 5 and set(report["reward_stats"]) == {"reward/math_verify", "reward_errors"}
