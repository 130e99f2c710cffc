"""SIGTERM / SIGUSR1: every rank stops after the same step, saves a checkpoint, and the run exits
with the documented code; resume=auto continues from there."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from rlcli.callbacks.preemption import PREEMPTED_EXIT_CODE


def start(args, cwd):
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "rlcli", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(path, count, process, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) > count:
            return
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("the run did not reach the expected step")


@pytest.mark.slow
@pytest.mark.parametrize("signum, processes", [(signal.SIGTERM, 1), (signal.SIGUSR1, 2)])
def test_signal_stops_saves_and_resumes(tmp_path, signum, processes):
    args = ["data=rollouts", "hydra.run.dir=run", "trainer.max_steps=1000", "data.epochs=50",
            "trainer.accumulate_microbatches=1"]
    if processes == 2:
        args += ["trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp"]
    process = start(args, tmp_path)
    wait_for_rows(tmp_path / "run" / "metrics.csv", 2, process)
    process.send_signal(signum)  # to rank 0 only: the other rank learns it at the step boundary
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "stopped by a signal after step" in stdout + stderr

    with (tmp_path / "run" / "metrics.csv").open() as f:
        stopped_at = int(list(csv.DictReader(f))[-1]["step"])
    assert (tmp_path / "run" / "checkpoints" / f"step-{stopped_at}.ckpt").is_file()
    assert not (tmp_path / "run" / "export").exists()  # an unfinished run is not exported

    resumed = start([*[a for a in args if not a.startswith("trainer.max_steps")],
                     f"trainer.max_steps={stopped_at + 2}", "resume=auto"], tmp_path)
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr[-3000:]
    with (tmp_path / "run" / "metrics.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(1, stopped_at + 3))
