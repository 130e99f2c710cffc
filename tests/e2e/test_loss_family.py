"""The loss family of a real RL run through `rlcli train`: several updates per batch, the trainer's own
log-probs for the ratio, a KL penalty to a reference, the mismatch correction, and exact resume."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from fault_injection import FAULTS_ENV, callbacks_override
from safetensors.torch import load_file

from rlcli.commands.train import train
from train_helpers import compose_train_config, run_rlcli


def rows_of(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def train_rows(tmp_path: Path, *overrides: str) -> list[dict]:
    train(compose_train_config(["logger=none", *overrides]), tmp_path / "run")
    return rows_of(tmp_path / "run")


@pytest.mark.slow
def test_on_policy_minibatches_start_each_batch_on_policy_then_move_and_clip(tmp_path):
    rows = train_rows(tmp_path, "trainer.minibatches=4", "trainer.max_steps=12", "optimizer.lr=2e-2")
    assert len(rows) == 12  # one row per update
    firsts, later = rows[::4], [row for i, row in enumerate(rows) if i % 4]
    for row in firsts:  # each batch was just sampled from the current weights
        assert float(row["ratio_new_old"]) == pytest.approx(1.0, abs=1e-5)
        assert abs(float(row["kl_new_old"])) < 1e-6 and float(row["clipped_ratio_fraction"]) == 0
    assert all(abs(float(row["ratio_new_old"]) - 1) > 1e-4 for row in later)
    assert max(float(row["clipped_ratio_fraction"]) for row in later) > 0  # the clip acts
    assert sum(int(float(row["num_documents"])) for row in rows[:4]) == 64  # 8 prompts x 8, split in four


@pytest.mark.slow
def test_recomputed_old_logprobs_and_an_initial_reference_are_exact_at_the_start(tmp_path):
    rows = train_rows(tmp_path, "data=rollouts", "trainer.max_steps=4", "trainer.minibatches=2",
                      "loss.old_logprobs=recompute", "kl.coef=0.1", "correction.mode=truncate")
    def on_policy_exactly(row):  # every r_t = 1: their sum is the token count, and kl 0, bit for bit
        return float(row["ratio_new_old_sum"]) == float(row["num_tokens"]) and float(row["kl_new_old"]) == 0.0

    first = rows[0]
    assert on_policy_exactly(first)  # the same head as the loss's
    assert float(first["kl_ref"]) == 0.0  # the reference is the starting policy
    assert on_policy_exactly(rows[2])  # a new batch: recomputed with the weights of that moment
    assert not on_policy_exactly(rows[1]) and float(rows[1]["kl_ref"]) > 0
    # the toy rollouts were written by a uniform sampler: the correction sees the mismatch
    assert float(first["mismatch_kl"]) > 0 and float(first["is_weight_mean"]) < 2.0


@pytest.mark.slow
def test_a_run_of_the_whole_family_killed_and_resumed_equals_the_straight_run(tmp_path):
    common = ["train", "data=rollouts", "trainer.max_steps=6", "trainer.checkpoint_every=1", "loss=gspo",
              "trainer.minibatches=2", "trainer.batch_epochs=2", "kl.coef=0.05", "correction.mode=truncate",
              "correction.high=2", "loss.entropy_coef=0.01", "trainer.accumulate_microbatches=2",
              "data.max_tokens=128", "optimizer.lr=1e-2"]
    straight = run_rlcli([*common, "hydra.run.dir=straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run_rlcli([*common, "hydra.run.dir=killed", *callbacks_override("KillDuringSave", step=3)], tmp_path,
                       extra_env=FAULTS_ENV)
    assert killed.returncode != 0
    resumed = run_rlcli([*common, "hydra.run.dir=killed", "resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = rows_of(tmp_path / "straight"), rows_of(tmp_path / "killed")
    assert [r["step"] for r in got] == [str(s) for s in range(1, 7)]
    for a, b in zip(want, got):
        for name in ("loss", "num_documents", "grad_norm", "ratio_new_old", "kl_ref", "is_weight_mean", "entropy"):
            if name in a:
                assert float(b[name]) == pytest.approx(float(a[name]), rel=1e-6, abs=1e-9), (a["step"], name)
    want_params = load_file(tmp_path / "straight" / "export" / "model.safetensors")
    got_params = load_file(tmp_path / "killed" / "export" / "model.safetensors")
    assert all((got_params[k] - v).abs().max() <= 1e-6 for k, v in want_params.items())


@pytest.mark.slow
def test_two_processes_split_each_batch_by_whole_groups_and_start_exactly_on_policy(tmp_path):
    result = run_rlcli(["train", "data=rollouts", "trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp",
                        "trainer.max_steps=4", "trainer.minibatches=2", "kl.coef=0.05", "correction.mode=truncate",
                        "logger=none", "hydra.run.dir=run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = rows_of(tmp_path / "run")
    assert len(rows) == 4
    for first in (rows[0], rows[2]):  # every batch starts from the trainer's own log-probs
        assert float(first["ratio_new_old_sum"]) == float(first["num_tokens"]) and float(first["kl_new_old"]) == 0
    assert float(rows[0]["kl_ref"]) == 0.0 and float(rows[1]["kl_ref"]) > 0


@pytest.mark.slow
def test_a_reference_model_from_a_checkpoint(tmp_path):
    train(compose_train_config(["logger=none", "trainer.max_steps=3"]), tmp_path / "ref")  # a trained export
    rows = train_rows(tmp_path, "trainer.max_steps=1", "kl.coef=0.1", f"kl.reference={tmp_path / 'ref' / 'export'}")
    assert float(rows[0]["kl_ref"]) > 0  # the starting policy is not the trained reference
    other = run_rlcli(["train", "kl.coef=0.1", f"kl.reference={tmp_path / 'ref' / 'export'}", "model.vocab_size=40"],
                      cwd=tmp_path)
    assert other.returncode == 2 and "kl.reference:" in other.stderr and "token ids" in other.stderr
    assert "Traceback" not in other.stderr


def test_a_record_without_ref_logprobs_under_kl_reference_rollouts_is_named(tmp_path):
    from factories import rollout_record, write_jsonl

    records = [rollout_record(g, ref_logprobs=[-4.5] * 4) for g in range(4)] + [rollout_record(4)]
    data = write_jsonl(tmp_path / "ref.jsonl", records)
    result = run_rlcli(["train", "data=rollouts", f"data.paths=[{data}]", "kl.coef=0.1", "kl.reference=rollouts",
                        "trainer.max_steps=1"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "ref.jsonl:5: no 'ref_logprobs', and kl.reference=rollouts" in result.stderr
    assert "(1 records lack them)" in result.stderr and "Traceback" not in result.stderr
