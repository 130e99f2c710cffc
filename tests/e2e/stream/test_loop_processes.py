"""`rlcli loop` and the processes of a machine (issue 32, items 10, 12 and 13): a second loop in a run directory
in use starts nothing, kill -9 of the loop leaves none of its processes behind, and more samplers than the
machine's cores are a config error."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_helpers import alive, descendants

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")


def start_loop(args: list[str], cwd: Path) -> subprocess.Popen:
    """``rlcli loop ARGS`` in its own session."""
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "rlcli", "loop", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_loop_in_a_run_directory_in_use_starts_nothing(tmp_path):
    """The directory's lock is held (here by this test, as a running loop or trainer holds it: an flock of
    ``<run dir>/.lock``). Before the fix the loop started its Redis (writing into ``redis/``) and its samplers
    before its trainer was refused."""
    run = tmp_path / "run"
    run.mkdir()
    with (run / ".lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        process = start_loop(["trainer.max_steps=3", "hydra.run.dir=run"], tmp_path)
        try:
            output, _ = process.communicate(timeout=120)
        finally:
            process.kill()
    assert process.returncode == 2, output[-3000:]
    assert f"run directory {run} is in use by another run (process 4242)" in output
    assert "Traceback" not in output
    assert not {"redis", "sampler-0"} & {p.name for p in run.iterdir()}  # no Redis, no sampler started


def test_more_samplers_than_cores_is_a_config_error_before_anything_starts(tmp_path):
    cores = len(os.sched_getaffinity(0))
    process = start_loop([f"sample.workers={cores + 1}", "hydra.run.dir=run"], tmp_path)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output[-3000:]
    assert f"sample.workers: {cores + 1} sampler processes, more than the {cores} cores" in output
    assert "Traceback" not in output
    assert not (tmp_path / "run" / "redis").exists()


def command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""  # exited meanwhile


@pytest.mark.slow
def test_kill_9_of_the_loop_leaves_none_of_its_processes(tmp_path):
    """Before the fix Redis ran on (nothing asked it to end with the loop) and the trainer, sent a SIGTERM,
    tried to finish its step against a Redis that was gone."""
    process = start_loop(["trainer.max_steps=100000", "hydra.run.dir=run"], tmp_path)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        metrics = tmp_path / "run" / "metrics.csv"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) > 1):  # a step trained
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the trainer did not train a step"
            time.sleep(0.2)
        started = descendants(process.pid)
        assert len(started) >= 3 and any(b"redis-server" in command_line(pid) for pid in started)  # and 2 rlcli
        process.send_signal(signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 10
        while (left := [pid for pid in started if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running 10 s after the loop was killed: {left}"
    finally:
        if process.poll() is None:
            process.kill()
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
