"""The batch-level estimators and kl.placement=reward from the command line (math.md#batch-level-estimators,
#kl-in-the-reward): each trains the default task, a prompt task and rollout files; reward/kl is a declared column in
place of kl_ref; a data kind where the KL cannot go into the reward is one message, exit 2."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from factories import make_arithmetic_dataset, make_tiny_qwen2, rollout_record, write_jsonl
from tools.docgen.metrics import declared, matches
from train_helpers import run_rlcli

pytestmark = pytest.mark.slow
KL_IN_REWARD = ["kl.placement=reward", "kl.coef=0.1"]


def metrics(run: Path) -> list[dict]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def train(tmp_path, *overrides, steps=2):
    result = run_rlcli(["train", *overrides, f"trainer.max_steps={steps}", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(tmp_path / "run")


@pytest.mark.parametrize("overrides", [["advantage.estimator=reinforce_pp_baseline"],
                                       ["advantage.estimator=grpo_batch_std"],
                                       KL_IN_REWARD,
                                       [*KL_IN_REWARD, "advantage.estimator=reinforce_pp_baseline",
                                        "loss.old_logprobs=recompute"]],
                         ids=["reinforce_pp_baseline", "grpo_batch_std", "kl-in-reward", "kl-in-reward-rpp"])
def test_the_default_task_trains(tmp_path, overrides):
    rows = train(tmp_path, *overrides)
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(float(r["num_documents"]) == 64 for r in rows)
    names = [name for name, _ in declared()]
    assert [c for c in rows[0] if c != "step" and not any(matches(name, c) for name in names)] == []  # declared
    if "kl.placement=reward" in overrides:
        assert "kl_ref" not in rows[0] and all(float(r["reward/kl"]) >= -1.0 for r in rows)
    else:
        assert "reward/kl" not in rows[0]


def test_a_prompt_task_with_the_kl_in_the_reward(tmp_path):
    model = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 16, seed=1)
    rows = train(tmp_path, "model=hf", f"model.path={model}", "task=prompts", f"task.paths=[{data}]",
                 "rollout.max_new_tokens=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                 "advantage.estimator=grpo_batch_std", *KL_IN_REWARD)
    assert len(rows) == 2 and "reward/kl" in rows[0]


def test_rollout_files_with_their_reference_logprobs(tmp_path):
    records = [rollout_record(g, ref_logprobs=[-3.5 - 0.02 * i for i in range(4)]) for g in range(8)]
    data = write_jsonl(tmp_path / "r.jsonl", records)
    rows = train(tmp_path, "data=rollouts", f"data.paths=[{data}]", "kl.reference=rollouts",
                 "advantage.estimator=reinforce_pp_baseline", *KL_IN_REWARD, steps=1)
    assert len(rows) == 1 and "kl_ref" not in rows[0]


def test_the_stream_is_one_message(tmp_path):
    result = run_rlcli(["train", "data=stream", "data.url=redis://127.0.0.1:1/0", *KL_IN_REWARD], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "kl.placement: reward subtracts the KL from the rewards before rlcli computes" in result.stderr
    assert "got data=stream" in result.stderr
