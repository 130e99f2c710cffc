"""`rlcli loop`: config errors stop it before it starts anything, a signal stops every process it
started, and a short run trains with two samplers and ends cleanly."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from train_helpers import alive, descendants

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")


def start_loop(args: list[str], cwd: Path) -> subprocess.Popen:
    """``rlcli loop ARGS`` in its own session, as a terminal runs it in its own foreground group."""
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "rlcli", "loop", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_rows(path: Path, rows: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and len(path.read_text().splitlines()) > rows):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the trainer did not reach the expected step"
        time.sleep(0.2)


@pytest.mark.parametrize("args, message", [
    (["trainer.max_steps=0"], "trainer.max_steps: must be >= 1"),
    (["sample.workers=0"], "sample.workers: must be >= 1"),
    (["data=generate"], "data: rlcli loop runs samplers and a trainer around a stream"),
    (["nosuchgroup=1"], "nosuchgroup"),
])
def test_config_error_exits_2_before_starting_anything(tmp_path, args, message):
    process = start_loop([*args, "hydra.run.dir=run"], tmp_path)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert message in output and "Traceback" not in output
    started = [p.name for p in (tmp_path / "run").glob("*")] if (tmp_path / "run").exists() else []
    assert not {"redis", "sampler-0"} & set(started)


def test_a_sampler_temperature_apart_from_the_loss_temperature_exits_2_at_once(tmp_path):
    """The samplers would push records at 0.7 that the trainer (loss.temperature=1.0) rejects, for ever."""
    started = time.monotonic()
    process = start_loop(["rollout.temperature=0.7", "trainer.max_steps=3", "hydra.run.dir=run"], tmp_path)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert "rollout.temperature: 0.7 differs from loss.temperature=1.0" in output and "Traceback" not in output
    assert time.monotonic() - started < 30
    assert not (tmp_path / "run" / "redis").exists()


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["loop", "terminal"])
def test_ctrl_c_stops_every_process_and_exits_130(tmp_path, to_group):
    """SIGINT to the loop alone, or to its whole process group as a terminal's Ctrl-C does."""
    process = start_loop(["sample.workers=2", "trainer.max_steps=100000", "hydra.run.dir=run"], tmp_path)
    try:
        wait_for_rows(tmp_path / "run" / "metrics.csv", 2, process)
        started = descendants(process.pid)
        assert len(started) >= 4  # Redis, two samplers, the trainer
        if to_group:
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 130, output[-3000:]
    assert not [pid for pid in started if alive(pid)]
    assert "stopped by a signal after step" in output  # the trainer saved a checkpoint and exited itself
    assert "killing" not in output
    for i in range(2):
        assert f"sampler {i} exited with code 0" in output


@pytest.mark.slow
def test_loop_trains_with_two_samplers_and_ends_with_the_trainer(tmp_path):
    process = start_loop(["sample.workers=2", "trainer.max_steps=4", "hydra.run.dir=run"], tmp_path)
    try:
        output, _ = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, output[-3000:]
    run = tmp_path / "run"
    with (run / "metrics.csv").open() as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [1, 2, 3, 4]
    for i in range(2):
        assert f"sampler {i} exited with code 0" in output
        assert "trainer finished" in (run / f"sampler-{i}" / "sample.log").read_text()
    # a sampler that loads its first weights late on a busy machine may find the 4 steps trained by the other
    written = [p for p in (run / f"sampler-{i}" / "completions.jsonl" for i in range(2)) if p.exists()]
    assert written
    for path in written:
        logged = [json.loads(line) for line in path.read_text().splitlines()]
        assert logged and all(line["prompt"].endswith(">") and isinstance(line["policy_version"], int)
                              for line in logged)  # the reverse task's prompts, as text; rollout.log_completions=4
        assert {line["round"] for line in logged} == set(range(len(logged) // 4))
    assert "trainer exited with code 0" in output
    url = re.search(r"Redis at (unix://\S+)", output).group(1)
    with pytest.raises(redis.ConnectionError):  # the loop's server is stopped
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
