"""On-policy distillation in the live loop (math.md#on-policy-distillation): the samplers compute the rewards'
part with distill.rewards, the trainer adds the teacher's term to what it reads."""

from __future__ import annotations

import csv
import json

import pytest

from factories import tiny_policy
from rlcli.rollout.tasks import ReverseTask
from train_helpers import run_rlcli


@pytest.mark.slow
def test_loop_samplers_use_distill_rewards_and_the_trainer_the_teacher(tmp_path):
    """Fails if rlcli sample computes distill's 0 in place of grpo's advantages, or the trainer adds no term."""
    vocab = ReverseTask(min_len=1, max_len=2, alphabet="abcd").tokenizer.vocab_size  # the default task's
    teacher = tmp_path / "teacher"
    tiny_policy(vocab, hidden_size=32, num_heads=2, seed=7).save_pretrained(teacher)
    result = run_rlcli(["loop", "sample.workers=1", "trainer.max_steps=3", "advantage.estimator=distill",
                        f"teacher.path={teacher}", "distill.rewards=grpo", "hydra.run.dir=run"], cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(float(row["distill/reverse_kl"]) != 0 for row in rows)
    logged = [json.loads(line) for line in
              (tmp_path / "run" / "sampler-0" / "completions.jsonl").read_text().splitlines()]
    assert any(line["advantage"] != 0 for line in logged)  # grpo's, from the rewards
