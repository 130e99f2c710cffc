"""A non-finite loss or gradient on any rank skips the update on every rank; too many in a row
stop the run with a clear message."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from fault_injection import FAULTS_ENV, callbacks_override
from safetensors.torch import load_file


def run(args, cwd, **env):
    return subprocess.run([sys.executable, "-m", "rlcli", "train", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", **env), timeout=600)


@pytest.mark.slow
def test_nan_on_one_of_two_ranks_skips_the_update_everywhere(tmp_path):
    common = ["trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp", "trainer.accumulate_microbatches=1"]
    # the run with the fault at step 2 makes no update there, so its step-2 checkpoint equals step 1's
    result = run([*common, "trainer.max_steps=3", "hydra.run.dir=faulty", "trainer.checkpoint_every=1",
                  *callbacks_override("NanLossAt", step=2, rank=1)], tmp_path, **FAULTS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "faulty" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    # max_steps counts updates: the skipped step adds a fourth training step
    assert [r["bad_steps"] for r in rows] == ["0.0", "1.0", "1.0", "1.0"]
    assert rows[1]["loss"] == "nan" and rows[2]["loss"] != "nan"
    assert "step 2: loss nan or gradient norm nan is not finite; no update" in result.stderr

    import torch

    ckpt = {s: torch.load(tmp_path / "faulty" / "checkpoints" / f"step-{s}.ckpt", weights_only=True)["state_dict"]
            for s in (1, 2, 3)}
    assert all(torch.equal(ckpt[1][k], ckpt[2][k]) for k in ckpt[1])  # step 2 changed nothing
    assert not all(torch.equal(ckpt[2][k], ckpt[3][k]) for k in ckpt[2])  # step 3 trained again
    exported = load_file(tmp_path / "faulty" / "export" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in exported.values())


@pytest.mark.slow
def test_consecutive_bad_steps_stop_the_run(tmp_path):
    result = run(["trainer.max_steps=5", "trainer.max_bad_steps=1", *callbacks_override("NanLossAt", step=2, rank=0)],
                 tmp_path, **FAULTS_ENV)
    assert result.returncode == 2
    assert "training stopped at step 2: 1 steps in a row with a non-finite loss or gradient" in result.stderr
    assert "Traceback" not in result.stderr
