"""Exact resume and atomic checkpoints: a run killed in the middle of a save and resumed with
`resume=auto` ends exactly like a run that was never killed."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fault_injection import FAULTS_ENV, callbacks_override
from safetensors.torch import load_file

from rlcli.callbacks.checkpoint import find_resume_checkpoint
from rlcli.errors import UserError

STEPS = 6


def run_cli(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-m", "rlcli", "train", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=600)


def rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_find_resume_checkpoint_takes_the_newest_complete_one(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for name in ("step-2.ckpt", "step-10.ckpt", "step-11.ckpt.tmp", "last.ckpt", "step-x.ckpt"):
        (checkpoints / name).write_text("")
    assert find_resume_checkpoint("auto", tmp_path) == checkpoints / "step-10.ckpt"
    assert find_resume_checkpoint("auto", tmp_path / "fresh") is None
    assert find_resume_checkpoint(None, tmp_path) is None
    with pytest.raises(UserError, match="resume: no checkpoint file"):
        find_resume_checkpoint(str(tmp_path / "missing.ckpt"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_kill_during_a_save_then_resume_equals_an_uninterrupted_run(tmp_path, processes):
    common = ["data=rollouts", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every=1",
              "trainer.accumulate_microbatches=2", "data.max_tokens=128"]
    if processes == 2:
        common += ["trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp"]
    straight = run_cli([*common, "hydra.run.dir=straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]

    killed = run_cli([*common, "hydra.run.dir=killed", *callbacks_override("KillDuringSave", step=3)], tmp_path,
                     **FAULTS_ENV)
    assert killed.returncode != 0
    saved = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert saved == ["step-1.ckpt", "step-2.ckpt", "step-3.ckpt.tmp"]  # the half-written one stays aside

    resumed = run_cli([*common, "hydra.run.dir=killed", "resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr and "step-2.ckpt" in resumed.stdout + resumed.stderr

    expected, actual = rows(tmp_path / "straight"), rows(tmp_path / "killed")
    assert [r["step"] for r in actual] == [str(s) for s in range(1, STEPS + 1)]
    # step 3's line was written before the kill: the resumed run drops it and writes it again, once
    audit = (tmp_path / "killed" / "documents.jsonl").read_text()
    assert audit == (tmp_path / "straight" / "documents.jsonl").read_text()
    assert [json.loads(line)["step"] for line in audit.splitlines()] == list(range(1, STEPS + 1))
    for want, got in zip(expected, actual):
        for name in ("loss", "num_documents", "documents_seen", "num_tokens", "grad_norm", "ratio_new_old"):
            assert float(got[name]) == pytest.approx(float(want[name]), rel=1e-6, abs=1e-9), (want["step"], name)
    want_params = load_file(tmp_path / "straight" / "export" / "model.safetensors")
    got_params = load_file(tmp_path / "killed" / "export" / "model.safetensors")
    for name, value in want_params.items():
        assert (got_params[name] - value).abs().max() <= 1e-6, name
