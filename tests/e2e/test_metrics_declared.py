"""Every column of the metrics.csv of a real run is declared in a ``METRICS`` of the code (and so on the metrics
reference page, tools/docgen/metrics.py): tiny in-process runs of configs that together turn on every emitter
but the live loop's (tests/e2e/stream/test_stream_metrics_declared.py) and vLLM's ``weight_sync_time``.

Fails naming the columns no declaration matches (a metric added to the code without its declaration), or the
expected columns a run did not write (a run that no longer exercises what it is here for).
"""

from __future__ import annotations

import csv
from pathlib import Path

from factories import make_arithmetic_dataset, make_tiny_qwen2
from rlcli.commands.train import train
from tools.docgen.metrics import declared, matches
from train_helpers import compose_train_config


def columns(run_dir: Path) -> set[str]:
    with (run_dir / "metrics.csv").open() as f:
        return set(next(csv.reader(f))) - {"step"}


def undeclared(found: set[str]) -> list[str]:
    names = [name for name, _ in declared()]
    return sorted(column for column in found if not any(matches(name, column) for name in names))


def run(run_dir: Path, overrides: list[str]) -> set[str]:
    train(compose_train_config([*overrides, "logger=none", "trainer.max_steps=2"]), run_dir)
    found = columns(run_dir)
    assert undeclared(found) == []
    return found


def test_generated_rollouts_with_entropy_gspo_and_eval(tmp_path):
    found = run(tmp_path, ["data=generate", "metrics=with_entropy", "loss=gspo", "rollout.prompts_per_step=2",
                           "rollout.group_size=2", "eval.every=1", "eval.prompts=2", "eval.samples=2"])
    expected = {"loss", "grad_norm", "empty_steps", "bad_steps", "entropy", "num_segments", "ratio_new_old",
                "clipped_ratio_fraction", "reward", "accuracy", "completion_length", "stopped_fraction",
                "eval/reward", "eval/pass@1", "eval/pass@k", "eval/length", "eval/stopped_fraction"}
    assert expected <= found


def test_rollout_files_with_kl_correction_and_exact_steps(tmp_path, small_rollouts):
    found = run(tmp_path / "run", ["data=rollouts", f"data.paths=[{small_rollouts}]", "kl.coef=0.1",
                                   "correction.mode=truncate", "trainer.docs_per_step=3",
                                   "trainer.docs_per_step_mode=exact", "loss.dual_clip=3"])
    expected = {"kl_ref", "mismatch_kl", "is_weight_mean", "is_weight_max", "is_masked_fraction",
                "carried_documents", "max_advantage", "min_advantage", "old_logprobs", "new_logprobs",
                "dual_clipped_fraction"}
    assert expected <= found


def test_generated_rollouts_with_dynamic_sampling(tmp_path):
    found = run(tmp_path, ["data=generate", "rollout.filter=zero_variance"])
    assert {"groups_kept", "groups_filtered", "sampling_rounds"} <= found


def test_a_prompt_task_with_its_reward_terms(tmp_path):
    model = make_tiny_qwen2(tmp_path / "model")
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 8, seed=0)
    found = run(tmp_path / "run", ["model=hf", f"model.path={model}", "task=prompts", f"task.paths=[{data}]",
                                   "rollout.max_new_tokens=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                   "task.rewards=[{name: math_verify}, {name: format}]"])
    assert {"reward/math_verify", "reward/format", "reward_errors", "reward", "accuracy"} <= found


def test_on_policy_distillation(tmp_path):
    student, teacher = make_tiny_qwen2(tmp_path / "student"), make_tiny_qwen2(tmp_path / "teacher", seed=1)
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 8, seed=0)
    found = run(tmp_path / "run", ["model=hf", f"model.path={student}", "task=prompts", f"task.paths=[{data}]",
                                   "rollout.max_new_tokens=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                   "advantage.estimator=distill", f"teacher.path={teacher}"])
    assert "distill/reverse_kl" in found


def test_generated_rollouts_with_reject(tmp_path):
    found = run(tmp_path, ["data=generate", "correction.mode=reject"])
    assert {"is_rejected_fraction", "mismatch_kl"} <= found
