"""`correction.mode=reject` (math.md#mismatch-correction) from the command line: it trains the default task and
a `task=prompts` run and logs `is_rejected_fraction`; on-policy (the trainer samples its own rollouts, so
ρ = 1 up to rounding) it keeps every token and trains exactly as no correction; bounds that exclude 1 reject
every token and document, so the step has T = D = 0 and makes no update, and trainer.max_bad_steps such batches
in a row stop the run; it needs loss.old_logprobs=recompute.

How they fail when broken: a mode missing from the registry fails the override; a rejection that is not applied
at the batch stage leaves num_tokens and num_documents at their full counts with bounds that exclude 1; a
metric that is not all-reduced or not put in the batch's statistics is missing from metrics.csv."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from factories import make_arithmetic_dataset, make_tiny_qwen2
from rlcli.commands.train import train
from rlcli.errors import UserError
from train_helpers import compose_train_config, run_rlcli

COMMON = ["logger=none", "trainer.max_steps=2", "trainer.minibatches=2", "loss.old_logprobs=recompute"]


def _rows(run: Path, *overrides: str) -> list[dict]:
    train(compose_train_config([*COMMON, *overrides]), run)
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_reject_on_policy_keeps_every_token_and_trains_as_no_correction(tmp_path):
    rejected = _rows(tmp_path / "reject", "correction.mode=reject")
    plain = _rows(tmp_path / "none", "correction.mode=none")
    assert [float(row["is_rejected_fraction"]) for row in rejected] == [0.0, 0.0]
    for name in ("loss", "num_tokens", "num_documents", "grad_norm"):
        assert [row[name] for row in rejected] == [row[name] for row in plain], name


@pytest.mark.slow
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_bounds_that_exclude_1_reject_every_token_and_stop_the_run(tmp_path, level):
    """Nothing kept: each step has T = D = 0 and makes no update; trainer.max_bad_steps=2 such batches in a row
    stop the run (on-policy it would never reach trainer.max_steps)."""
    with pytest.raises(UserError, match="every labelled token of 2 batches in a row"):
        _rows(tmp_path / "run", "correction.mode=reject", f"correction.level={level}", "correction.low=1.5",
              "correction.high=2", "trainer.max_bad_steps=2")
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2  # the first batch's two updates; the second batch stops the run
    for row in rows:
        assert float(row["is_rejected_fraction"]) == 1.0
        assert (float(row["num_tokens"]), float(row["num_documents"]), float(row["grad_norm"])) == (0.0, 0.0, 0.0)


@pytest.mark.slow
def test_reject_trains_a_prompt_task(tmp_path):
    make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 40, seed=1)
    rows = _rows(tmp_path / "run", "model=hf", f"model.path={tmp_path / 'model'}", "task=prompts",
                 f"task.paths=[{data}]", "rollout.max_new_tokens=2", "correction.mode=reject",
                 "correction.level=geometric")
    assert len(rows) == 2 and all(0 <= float(row["is_rejected_fraction"]) <= 1 for row in rows)


def test_reject_needs_the_trainer_log_probs(tmp_path):
    result = run_rlcli(["train", "correction.mode=reject", "loss.old_logprobs=sampler"], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "loss.old_logprobs: correction.mode=reject" in output and "Traceback" not in output
