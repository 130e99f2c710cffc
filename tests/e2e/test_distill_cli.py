"""On-policy distillation through `rlcli train` (math.md#on-policy-distillation): the default task, rollout
files, a task=prompts run with a reference that is the teacher, exact resume in the middle of a batch, and
the errors a user meets."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from factories import make_arithmetic_dataset, make_tiny_qwen2, tiny_policy
from rlcli.commands.train import train
from rlcli.data.toy import VOCAB_SIZE as TOY_VOCAB_SIZE
from rlcli.rollout.tasks import ReverseTask
from train_helpers import compose_train_config, run_rlcli

REVERSE_VOCAB = ReverseTask(min_len=1, max_len=2, alphabet="abcd").tokenizer.vocab_size  # the default task's


def save_teacher(directory: Path, vocab_size: int, *, sharpen: float = 1.0) -> Path:
    """A tiny Llama saved with save_pretrained; ``sharpen`` scales its head, so that it is far from a random
    policy."""
    model = tiny_policy(vocab_size, hidden_size=32, num_heads=2, seed=7)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(directory)
    return directory


def rows_of(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def kl_of(rows: list[dict]) -> list[float]:
    return [float(row["distill/reverse_kl"]) for row in rows]


@pytest.mark.slow
def test_pure_distillation_on_the_default_task_draws_the_policy_to_the_teacher(tmp_path):
    """The reward part is 0 (distill.rewards=none): only the teacher's term moves the policy, and the reverse
    KL to the teacher falls. Fails if the term has the wrong sign or does not reach the advantages."""
    teacher = save_teacher(tmp_path / "teacher", REVERSE_VOCAB, sharpen=2.5)
    train(compose_train_config(["logger=none", "advantage.estimator=distill", f"teacher.path={teacher}",
                                "trainer.max_steps=12", "optimizer.lr=1e-2"]), tmp_path / "run")
    kl = kl_of(rows_of(tmp_path / "run"))
    assert len(kl) == 12 and kl[0] > 0.3
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl


@pytest.mark.slow
def test_rollout_files_with_grpo_rewards_and_a_teacher(tmp_path):
    teacher = save_teacher(tmp_path / "teacher", TOY_VOCAB_SIZE)
    train(compose_train_config(["logger=none", "data=rollouts", "advantage.estimator=distill",
                                f"teacher.path={teacher}", "distill.rewards=grpo", "distill.coef=0.5",
                                "trainer.max_steps=2"]), tmp_path / "run")
    rows = rows_of(tmp_path / "run")
    assert len(rows) == 2 and all(row["distill/reverse_kl"] != "" for row in rows)


@pytest.mark.slow
def test_a_prompt_task_with_the_teacher_as_its_kl_reference(tmp_path):
    """task=prompts on a Qwen2 checkpoint, the teacher another Qwen2 of the same tokenizer, also the KL
    reference (one model, one forward)."""
    student, teacher = make_tiny_qwen2(tmp_path / "student"), make_tiny_qwen2(tmp_path / "teacher", seed=1)
    data = make_arithmetic_dataset(tmp_path / "train.jsonl", 8, seed=0)
    result = run_rlcli(["train", "model=hf", f"model.path={student}", "task=prompts", f"task.paths=[{data}]",
                        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                        "advantage.estimator=distill", f"teacher.path={teacher}", "distill.rewards=grpo",
                        "kl.coef=0.05", f"kl.reference={teacher}", "trainer.max_steps=2", "logger=none",
                        "hydra.run.dir=run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "run")
    assert len(rows) == 2 and all(float(row["distill/reverse_kl"]) != 0 and float(row["kl_ref"]) > 0
                                  for row in rows)


@pytest.mark.slow
def test_a_run_resumed_in_the_middle_of_a_batch_adds_the_term_once(tmp_path):
    """Two updates per batch; a run stopped after the first update of a batch and resumed trains the second
    exactly as a straight run: its checkpoint holds the distilled advantages, the term is not added again."""
    teacher = save_teacher(tmp_path / "teacher", REVERSE_VOCAB, sharpen=2.5)
    common = ["train", "advantage.estimator=distill", f"teacher.path={teacher}", "trainer.minibatches=2",
              "trainer.checkpoint_every=1", "logger=none", "optimizer.lr=1e-2"]
    straight = run_rlcli([*common, "trainer.max_steps=4", "hydra.run.dir=straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run_rlcli([*common, "trainer.max_steps=3", "hydra.run.dir=resumed"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_rlcli([*common, "trainer.max_steps=4", "hydra.run.dir=resumed", "resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = rows_of(tmp_path / "straight"), rows_of(tmp_path / "resumed")
    assert [row["step"] for row in got] == ["1", "2", "3", "4"]
    for a, b in zip(want, got):
        for name in ("loss", "grad_norm", "advantage", "distill/reverse_kl"):
            assert float(b[name]) == pytest.approx(float(a[name]), rel=1e-6, abs=1e-9), (a["step"], name)


def test_a_teacher_with_another_vocabulary_is_named_with_both_sizes(tmp_path):
    teacher = save_teacher(tmp_path / "teacher", REVERSE_VOCAB + 3)
    result = run_rlcli(["train", "advantage.estimator=distill", f"teacher.path={teacher}", "trainer.max_steps=1",
                        "logger=none", "hydra.run.dir=run"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"teacher.path: {teacher} has {REVERSE_VOCAB + 3} token ids, the policy (model=tiny) {REVERSE_VOCAB}" \
        in result.stderr
