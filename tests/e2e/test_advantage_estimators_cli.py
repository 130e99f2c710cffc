"""`rlcli train advantage.estimator=rloo|opo|passk` from the command line (math.md#advantages): each trains, a
pass@k run on partial-credit rewards stops with one message, and the docs' sweep over estimators runs."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from factories import make_arithmetic_dataset, make_tiny_qwen2, rollout_record, write_jsonl
from train_helpers import run_rlcli

ECHO = ["~task", "+task._target_=train_helpers.EchoTask", "allow_targets=[train_helpers]"]  # rewards 0 or 1
TESTS = {"PYTHONPATH": str(Path(__file__).parents[1])}  # where train_helpers is


def metrics(run: Path) -> list[dict]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("overrides", [["advantage.estimator=rloo"], ["advantage.estimator=opo"],
                                       [*ECHO, "advantage.estimator=passk", "advantage.k=2"]],
                         ids=["rloo", "opo", "passk"])
def test_each_estimator_trains_from_the_command_line(tmp_path, overrides):
    result = run_rlcli(["train", *overrides, "trainer.max_steps=3", "hydra.run.dir=run"], tmp_path, extra_env=TESTS)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(float(r["num_documents"]) == 64 for r in rows)  # 8 prompts x 8 completions


def test_passk_on_the_partial_credit_of_the_default_task_is_one_message(tmp_path):
    result = run_rlcli(["train", "advantage.estimator=passk", "advantage.k=2", "trainer.max_steps=1",
                        "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2
    assert "advantage.estimator=passk needs rewards of 0 or 1" in result.stderr and "group 's0-r0-p" in result.stderr
    assert "Traceback" not in result.stderr


def test_passk_trains_a_prompt_task_with_math_verify(tmp_path):
    """task=prompts scores with math_verify alone: rewards 0 or 1."""
    model = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 16, seed=1)
    result = run_rlcli(["train", "model=hf", f"model.path={model}", "task=prompts", f"task.paths=[{data}]",
                        "rollout.max_new_tokens=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                        "advantage.estimator=passk", "advantage.k=3", "trainer.max_steps=2", "hydra.run.dir=run"],
                       tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(metrics(tmp_path / "run")) == 2


def test_passk_reads_rollout_files_and_names_a_group_smaller_than_k(tmp_path):
    """Four groups of 4 with binary rewards train; a fifth group of 1 stops the run before training."""
    records = [rollout_record(g, reward=float(i == g % 4), group_id=g) for g in range(4) for i in range(4)]
    data = write_jsonl(tmp_path / "r.jsonl", records)
    common = ["train", "data=rollouts", "advantage.estimator=passk", "trainer.max_steps=1"]
    trained = run_rlcli([*common, f"data.paths=[{data}]", "advantage.k=4", "hydra.run.dir=run"], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    short = write_jsonl(tmp_path / "s.jsonl", [*records, rollout_record(9, reward=1.0, group_id="lone")])
    refused = run_rlcli([*common, f"data.paths=[{short}]", "advantage.k=2", "hydra.run.dir=short"], tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (f"group 'lone' (first document {short}:17, 1 in all): 1 documents, fewer than advantage.k=2"
            in refused.stderr)


@pytest.mark.slow
def test_the_documented_sweep_over_estimators_runs(tmp_path):
    """`rlcli train -m advantage.estimator=grpo,rloo,reinforce_pp_baseline seed=0,1` (math.md#advantages), one step
    each."""
    result = run_rlcli(["train", "-m", "advantage.estimator=grpo,rloo,reinforce_pp_baseline", "seed=0,1",
                        "trainer.max_steps=1",
                        "hydra.sweep.dir=sweep"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.parent for p in (tmp_path / "sweep").glob("*/metrics.csv"))
    assert len(runs) == 6
