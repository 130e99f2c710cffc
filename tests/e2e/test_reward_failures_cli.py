"""Issue 29's third "done when": `rlcli train task=prompts` with a reward that sleeps forever, one that calls
os._exit and one that returns a string, beside math_verify, trains to its last step; each failing term scores 0
on every completion, `reward_errors` counts them, and each step logs every failing term's reason once (train.log)."""

from __future__ import annotations

import csv
import textwrap

import pytest

from factories import make_arithmetic_dataset, make_tiny_qwen2
from train_helpers import run_rlcli

STEPS, COMPLETIONS = 3, 4  # rollout.prompts_per_step=2 x rollout.group_size=2


@pytest.mark.slow
def test_a_hanging_a_crashing_and_a_string_reward_leave_the_run_training(tmp_path):
    """Inline, `hangs` would stop the run at its first completion and `exits` would end it (exit code 3, no
    metrics); a pool without replacement would fail every call of step 2 with a broken pool."""
    model = make_tiny_qwen2(tmp_path / "model")
    train = make_arithmetic_dataset(tmp_path / "train.jsonl", 20, seed=1)
    (tmp_path / "failing_rewards.py").write_text(textwrap.dedent("""
        import os, time

        def hangs(completion):
            time.sleep(3600)

        def exits(completion):
            os._exit(3)

        def says_one(completion):
            return "1.0"
    """))
    rewards = ", ".join(f"{{_target_: failing_rewards.{name}}}" for name in ("hangs", "exits", "says_one"))
    result = run_rlcli(["train", "model=hf", f"model.path={model}", "task=prompts", f"task.paths=[{train}]",
                        f"task.rewards=[{rewards}, {{name: math_verify}}]", "task.reward_timeout=1",
                        "task.reward_workers=2", "allow_targets=[failing_rewards]", "rollout.filter=none",
                        "rollout.max_new_tokens=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                        f"trainer.max_steps={STEPS}", "logger=none", "hydra.run.dir=run"], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward_errors")]
    assert len(rows) == STEPS
    for row in rows:
        assert float(row["reward_errors"]) == 3 * COMPLETIONS
        assert [float(row[f"reward/{name}"]) for name in ("hangs", "exits", "says_one")] == [0.0] * 3
        assert float(row["reward"]) == float(row["reward/math_verify"])  # the failing terms add 0
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    reasons = {"hangs": "timed out after 1 s", "exits": "its worker process died (exit code 3",
               "says_one": "returned '1.0', not a number"}
    for name, reason in reasons.items():
        lines = [line for line in log if f"reward {name} failed" in line]
        assert len(lines) == STEPS, (name, lines)
        assert all(f"on {COMPLETIONS} of {COMPLETIONS} completions" in line and reason in line for line in lines)
