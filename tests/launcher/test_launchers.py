"""Sweeps through hydra-submitit-launcher: submitit's local executor, and Slurm against fake
sbatch/srun/sacct/squeue/scancel programs on PATH."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from train_helpers import run_rlcli

pytestmark = pytest.mark.slow
FAKE_SLURM = Path(__file__).parent / "fake_slurm.py"


def test_two_member_sweep_through_the_local_launcher(tmp_path):
    result = run_rlcli(["train", "-m", "launcher=local", "loss=grpo,gspo", "trainer.max_steps=2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    members = sorted((tmp_path / "multirun").glob("*/*/[0-9]"))
    assert [m.name for m in members] == ["0", "1"]
    for member, loss in zip(members, ["grpo", "gspo"]):
        assert len((member / "metrics.csv").read_text().splitlines()) == 3
        assert f"loss={loss}" in (member / ".hydra" / "overrides.yaml").read_text()
    assert list((members[0].parent / ".submitit").glob("*/*_result.pkl"))  # submitit ran them


def fake_slurm_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "srun", "sacct", "squeue", "scancel"):
        program = bin_dir / name
        program.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SLURM}" {name} "$@"\n')
        program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_slurm_submission_script_and_jobs(tmp_path):
    state = tmp_path / "slurm"
    state.mkdir()
    env = dict(os.environ, PATH=f"{fake_slurm_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}",
               FAKE_SLURM_DIR=str(state), WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    args = ["train", "-m", "launcher=slurm", "loss=grpo,gspo", "trainer.max_steps=2", "trainer.accelerator=cpu",
            "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=30", "hydra.launcher.cpus_per_task=2",
            "hydra.launcher.array_parallelism=1", "hydra.launcher.signal_delay_s=90"]
    result = subprocess.run([sys.executable, "-m", "rlcli", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [script] = list(state.glob("sbatch_*.sh"))
    text = script.read_text()
    for line in ("#SBATCH --partition=debug", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=1", "#SBATCH --cpus-per-task=2", "#SBATCH --time=30",
                 "#SBATCH --signal=USR2@90", "#SBATCH --array=0-1%1"):
        assert line in text, (line, text)
    assert re.search(r"srun .*-m submitit.core._submit", text)
    members = sorted((tmp_path / "multirun").glob("*/*/[0-9]"))
    assert [m.name for m in members] == ["0", "1"]
    assert all(len((m / "metrics.csv").read_text().splitlines()) == 3 for m in members)
