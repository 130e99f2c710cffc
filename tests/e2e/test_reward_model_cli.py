"""A tiny reward model trains a policy end to end: `rlcli train ... 'task.rewards=[{name: model, path: RM}]'` with a
hand-built reward model (`make_suffix_reward_model`: +1 for a text that ends with a digit, else -1), then
`rlcli eval` of the export with the same reward."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from factories import make_arithmetic_dataset, make_suffix_reward_model, make_tiny_qwen2
from train_helpers import run_rlcli

DIGITS = "0123456789"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    return {"root": root, "policy": make_tiny_qwen2(root / "policy"),
            "rm": make_suffix_reward_model(root / "rm", DIGITS),
            "train": make_arithmetic_dataset(root / "train.jsonl", 200, seed=1),
            "eval": make_arithmetic_dataset(root / "eval.jsonl", 24, seed=2)}


def task(assets) -> list[str]:
    return ["task=prompts", f"task.paths=[{assets['train']}]", f"task.eval_paths=[{assets['eval']}]",
            f"task.rewards=[{{name: model, path: {assets['rm']}, batch_size: 16}}]", "rollout.max_new_tokens=2"]


def evaluate(model: Path, assets, run: str) -> dict:
    result = run_rlcli(["eval", str(model), *task(assets), "eval.samples=4", f"hydra.run.dir={run}"], assets["root"])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((assets["root"] / run / "eval.json").read_text())


@pytest.mark.slow
def test_a_tiny_reward_model_trains_a_policy_and_rlcli_eval_scores_with_it(assets):
    """The reward rises from mostly -1 (a random policy rarely ends with a digit) to mostly +1 in 16 steps; each
    logged completion's reward is the model's hand-derived score of prompt + completion; `rlcli eval` of the export
    scores with the model too, as high as the last steps."""
    trained = run_rlcli(["train", "model=hf", f"model.path={assets['policy']}", *task(assets), "optimizer.lr=1e-2",
                         "trainer.max_steps=16", "logger=none", "hydra.run.dir=run"], assets["root"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    with (assets["root"] / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    rewards = [float(r["reward/model"]) for r in rows]
    assert rewards == [float(r["reward"]) for r in rows] and all(-1 <= r <= 1 for r in rewards)  # alone, weight 1
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.5, rewards
    logged = [json.loads(line) for line in (assets["root"] / "run" / "completions.jsonl").open()]
    assert len(logged) == 16 * 4
    for line in logged:
        expected = 1.0 if (line["prompt"] + line["completion"]).endswith(tuple(DIGITS)) else -1.0
        assert line["rewards"]["model"] == pytest.approx(expected, abs=1e-6), line
    after = evaluate(assets["root"] / "run" / "export", assets, "eval-trained")
    assert set(after["reward_stats"]) == {"reward/model", "reward_errors"}
    assert after["metrics"]["reward"] > 0.5, (rewards, after["metrics"])

