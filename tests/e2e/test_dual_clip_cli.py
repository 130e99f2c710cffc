"""`loss.dual_clip` (math.md#dual-clip) from the command line: it trains the default task and a `task=prompts`
run, its bound and its losses are config errors naming the key (exit 2, no traceback).

How they fail when broken: a key missing from the loss group's YAML fails the Hydra override; a schema or loss
that drops the option leaves `dual_clipped_fraction` out of metrics.csv or 0 where ratios exceed c; a missing
bound lets `loss.dual_clip=1` train."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from factories import make_arithmetic_dataset, make_tiny_qwen2
from rlcli.commands.train import train
from train_helpers import compose_train_config, run_rlcli


def _rows(tmp_path: Path, *overrides: str) -> list[dict]:
    train(compose_train_config(["logger=none", "trainer.max_steps=2", "trainer.minibatches=2", *overrides]),
          tmp_path / "run")
    with (tmp_path / "run" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_loss_dual_clip_3_trains_the_default_task(tmp_path):
    rows = _rows(tmp_path, "loss.dual_clip=3")
    assert [row["step"] for row in rows] == ["1", "2"]
    # the first update is on-policy (every r_t = 1 <= c); the toy run's ratios stay far below 3
    assert [float(row["dual_clipped_fraction"]) for row in rows] == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo", "gspo_token"])
def test_a_dual_clip_near_1_caps_tokens_after_the_first_update(tmp_path, loss):
    """The second update of a batch has moved the ratios: with c = 1.01 some negative-advantage tokens exceed it
    (a small rate keeps the ratios around 1; at 1e-3 gspo_token's all fall below it)."""
    rows = _rows(tmp_path, f"loss={loss}", "loss.dual_clip=1.01", "optimizer.lr=3e-4")
    first, second = (float(row["dual_clipped_fraction"]) for row in rows)
    assert first == 0.0 and 0 < second < 1


@pytest.mark.slow
def test_loss_dual_clip_trains_a_prompt_task(tmp_path):
    make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 40, seed=1)
    rows = _rows(tmp_path, "model=hf", f"model.path={tmp_path / 'model'}", "task=prompts", f"task.paths=[{data}]",
                 "rollout.max_new_tokens=2", "loss.dual_clip=2")
    assert len(rows) == 2 and all(float(row["dual_clipped_fraction"]) >= 0 for row in rows)


@pytest.mark.parametrize(("args", "message"), [
    (["loss.dual_clip=1"], "loss.dual_clip: must be > 1, got 1"),
    (["loss=gspo_token", "loss.dual_clip=1e39"], "loss.dual_clip: must be <= 3.40282e+38, got 1e+39"),
    # gspo has no such option: Hydra refuses the override, and an added key is an unknown key
    (["loss=gspo", "loss.dual_clip=3"], "Could not override 'loss.dual_clip'"),
    (["loss=gspo", "+loss.dual_clip=3"], "loss.dual_clip: unknown key (valid keys: eps_low, eps_high,"),
])
def test_a_bad_dual_clip_is_a_config_error_naming_the_key(tmp_path, args, message):
    result = run_rlcli(["train", *args], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert message in output and "Traceback" not in output
