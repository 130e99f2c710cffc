"""From a JSONL of questions to a trained, evaluated model with the README's three commands: a local
BPE tokenizer with a chat template, a tiny Qwen2 and a generated arithmetic dataset, `math_verify`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from factories import make_arithmetic_dataset, make_tiny_qwen2
from train_helpers import run_rlcli

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


def test_a_bad_reward_config_is_one_message_naming_the_key(assets, tmp_path):
    result = run_rlcli(["train", "model=hf", f"model.path={assets['model']}", "task=prompts",
                        f"task.paths=[{assets['train']}]", "task.rewards=[{name: regex, pattern: '('}]",
                        "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2
    assert "task.rewards[0].pattern" in result.stderr and "Traceback" not in result.stderr
