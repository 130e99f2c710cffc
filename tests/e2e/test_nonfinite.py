"""A non-finite loss or gradient on any rank skips the update on every rank; too many in a row
stop the run with a clear message. An update that leaves a parameter non-finite on any rank stops the
run on every rank, and non-finite weights are never exported or published."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from fault_injection import FAULTS_ENV, callbacks_override
from safetensors.torch import load_file

from factories import rollout_record, write_jsonl


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
    # rlcli's warnings reach the console through its log (stdout), with the lines of the run
    assert "step 2: loss nan or gradient norm nan is not finite; no update" in result.stdout + result.stderr

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


PARAMETERS_NOT_FINITE = "after the optimizer update, parameters are NaN or infinite"


@pytest.mark.slow
def test_parameters_an_update_makes_nan_stop_the_run_and_nothing_is_exported(tmp_path):
    """An update that writes NaN into the weights (the issue's repro was float16 parameters, where the
    unfused AdamW's eps underflowed to 0): before, the skipped steps that followed ended with exit 0 and
    NaN weights exported, however large trainer.max_bad_steps."""
    result = run(["data=rollouts", "trainer.max_steps=3", "trainer.max_bad_steps=100", "trainer.checkpoint_every=1",
                  "hydra.run.dir=run", *callbacks_override("NanParametersAt", step=1, rank=0)], tmp_path, **FAULTS_ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"rlcli train: error: training stopped at step 1: {PARAMETERS_NOT_FINITE}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "export").exists()
    assert not list((tmp_path / "run").glob("checkpoints/*.ckpt"))  # the NaN weights are nowhere


@pytest.mark.slow
def test_parameters_made_nan_in_the_shards_of_one_fsdp2_rank_stop_every_rank_after_that_step(tmp_path):
    common = ["data=rollouts", "trainer.devices=2", "trainer.accelerator=cpu", "strategy=fsdp2",
              "trainer.max_steps=3", "trainer.checkpoint_every=1", "hydra.run.dir=run"]
    result = run([*common, *callbacks_override("NanParametersAt", step=2, rank=1)], tmp_path, **FAULTS_ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    # both ranks stop at step 2 (neither trains on, nor hangs in a collective the other never reaches)
    assert result.stderr.count(f"rlcli train: error: training stopped at step 2: {PARAMETERS_NOT_FINITE}") == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt")) == ["step-1.ckpt"]
    assert not (tmp_path / "run" / "export").exists()


@pytest.mark.slow
def test_weights_that_are_not_finite_are_never_exported(tmp_path):
    # NaN before the first step: every loss is NaN, every update skipped (2 steps of 2 documents); the run
    # gets to its export
    data = write_jsonl(tmp_path / "four.jsonl", [rollout_record(g) for g in range(4)])
    result = run(["data=rollouts", f"data.paths=[{data}]", "trainer.accumulate_microbatches=1", "data.max_tokens=14",
                  "trainer.max_bad_steps=100", "hydra.run.dir=run",
                  *callbacks_override("NanParametersAt", step=0, rank=0)], tmp_path, **FAULTS_ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    export = tmp_path / "run" / "export"
    assert f"rlcli train: error: not writing the policy to {export}: after step 2 its parameters hold NaN or " \
           "infinite values" in result.stderr
    assert "Traceback" not in result.stderr and not export.exists()


def test_weights_that_are_not_finite_are_never_published(tmp_path):
    import torch

    from rlcli.callbacks.publish import WeightPublisher
    from rlcli.errors import UserError

    scorer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        scorer.bias[1] = math.inf
    module = SimpleNamespace(scorer=scorer, device=torch.device("cpu"), steps_done=4, trainer=SimpleNamespace())
    publisher = WeightPublisher(tmp_path, url="redis://127.0.0.1:1/0", stream="s", every=1, keep=2, model_cfg=None)
    with pytest.raises(UserError, match=f"not writing the policy to {tmp_path / '.v4.partial'}: after step 4 its "
                                        "parameters hold NaN or infinite values"):
        publisher.publish(module, 4)
    assert list(tmp_path.iterdir()) == [] and publisher.published is None
