"""Overlong shaping in real on-policy runs (math.md#overlong-shaping): the float64 rewards of
rollouts.jsonl, and truncated completions absent from every count and file."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from rlcli.commands.train import train
from rlcli.errors import UserError
from rlcli.rollout.tasks import CharTokenizer, ReverseTask
from train_helpers import compose_train_config

MAX_NEW_TOKENS = 4


def r_len(length: int, max_new_tokens: int, buffer: int) -> float:
    """R_len of math.md#overlong-shaping, written from the formula."""
    if length <= max_new_tokens - buffer:
        return 0.0
    if length <= max_new_tokens:
        return ((max_new_tokens - buffer) - length) / buffer
    return -1.0


def run(tmp_path: Path, *overrides: str, steps: int = 1):
    """One on-policy run: its rollouts.jsonl records, metrics.csv rows and documents.jsonl lines."""
    cfg = compose_train_config(["data=generate", f"trainer.max_steps={steps}", "rollout.save=true",
                                f"rollout.max_new_tokens={MAX_NEW_TOKENS}", *overrides])
    train(cfg, tmp_path / "run")
    read = lambda name: [json.loads(line) for line in (tmp_path / "run" / name).read_text().splitlines()]  # noqa: E731
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    return read("rollouts.jsonl"), rows, read("documents.jsonl")


def test_the_overlong_reward_adds_p_times_r_len_to_each_saved_reward(tmp_path):
    """Step 1 samples the same completions with and without the shaping (same seed, same weights): each
    saved reward is the plain one plus 0.5 x R_len(|y|), recomputed in float64 from the logged
    completion's length, and reward/overlong is their mean R_len. Any other formula fails."""
    plain, plain_rows, _ = run(tmp_path / "plain")
    shaped, rows, _ = run(tmp_path / "shaped", "reward.overlong_buffer=2", "reward.overlong_penalty=0.5")
    assert [r["completion_ids"] for r in shaped] == [r["completion_ids"] for r in plain]
    penalties = [r_len(len(r["completion_ids"]), MAX_NEW_TOKENS, 2) for r in plain]
    assert len(set(penalties)) > 1  # lengths on both sides of L - L_c
    assert [r["reward"] for r in shaped] == [p["reward"] + 0.5 * o for p, o in zip(plain, penalties)]
    assert float(rows[0]["reward/overlong"]) == pytest.approx(sum(penalties) / len(penalties), rel=1e-6)
    assert float(rows[0]["reward"]) == pytest.approx(
        float(plain_rows[0]["reward"]) + 0.5 * float(rows[0]["reward/overlong"]), rel=1e-6)


def test_truncated_completions_are_in_no_count(tmp_path):
    """With rollout.mask_truncated the saved and trained documents are exactly the plain run's completions
    that end with eos, with the plain run's advantages (computed over the whole group); num_documents,
    num_tokens and documents.jsonl count them only, and truncated_fraction is the share of the others."""
    plain, _, _ = run(tmp_path / "plain")
    masked, rows, documents = run(tmp_path / "masked", "rollout.mask_truncated=true")
    stopped = [r for r in plain if r["completion_ids"][-1] == CharTokenizer.eos_id]
    assert 0 < len(stopped) < len(plain)
    assert masked == stopped
    assert float(rows[0]["num_documents"]) == len(stopped)
    assert float(rows[0]["num_tokens"]) == sum(len(r["completion_ids"]) for r in stopped)
    assert len(documents[0]["ids"]) == len(stopped)
    assert float(rows[0]["truncated_fraction"]) == pytest.approx(1 - len(stopped) / len(plain), rel=1e-6)


class NoStopTask(ReverseTask):
    """The reverse task with an eos id beyond the model's vocabulary: every completion is truncated."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer.eos_id = self.tokenizer.vocab_size


def test_steps_whose_completions_are_all_truncated_are_empty_steps_and_stop_the_run(tmp_path):
    """Every completion truncated: a step trains nothing (no update, empty_steps counts it) instead of ending
    the run as if its data were used up; trainer.max_bad_steps such steps in a row stop it with a clear error."""
    overrides = ["rollout.mask_truncated=true", "~task", "+task._target_=test_overlong_runs.NoStopTask",
                 "allow_targets=[test_overlong_runs]", "trainer.max_bad_steps=3"]
    with pytest.raises(UserError, match=r"^rollout.mask_truncated: every completion of 3 steps in a row reached "
                                        r"rollout.max_new_tokens=4 without a stop"):
        run(tmp_path, *overrides, steps=10)
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert [float(r["num_documents"]) for r in rows] == [0.0, 0.0]
    assert [float(r["truncated_fraction"]) for r in rows] == [1.0, 1.0]
    assert [float(r["empty_steps"]) for r in rows] == [1.0, 2.0]
