"""Recovery that finishes: a trainer resumed from an earlier step than its crash published removes the
later versions and keeps its own, and `rlcli loop` killed at a step with the default settings
(no checkpoint before the end) resumes with ``resume=auto``, finishes, and continues when asked."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import pytest
import redis
from test_loop import start_loop, wait_for_rows

from factories import rollout_record
from rlcli.commands.train import train
from rlcli.stream import StreamWriter
from train_helpers import compose_train_config, descendants


def pushed(url: str, ids: range) -> None:
    with StreamWriter(url) as writer:
        writer.push_many([rollout_record(i, vocab=7, advantage=1.0, id=f"r{i}", policy_version=0) for i in ids])


def test_a_resumed_trainer_removes_the_versions_published_after_its_step_and_keeps_its_own(redis_url, tmp_path):
    """The run ends at step 4 (its checkpoint); v5..v7 stand for what it published before a crash after
    step 7. Before the fix the resumed run announced v4 and its pruning (the newest publish.keep=3) deleted
    v4 at once: a sampler then failed to load it, and v7 was never removed."""
    common = ["data=stream", f"data.url={redis_url}", "data.idle_timeout=1", "data.max_tokens=10",
              "data.max_lag=100", "logger=none", "trainer.accumulate_microbatches=1", "trainer.max_steps=50",
              "publish.keep=3"]
    pushed(redis_url, range(4))
    train(compose_train_config(common), tmp_path)
    weights = tmp_path / "weights"
    for version in (5, 6, 7):
        (weights / f"v{version}").mkdir()
        (weights / f"v{version}" / "before-the-crash").touch()
    pushed(redis_url, range(4, 6))
    train(compose_train_config([*common, "resume=auto"]), tmp_path)

    assert sorted(p.name for p in weights.iterdir()) == ["v4", "v5", "v6"]
    assert not list(weights.glob("*/before-the-crash"))
    announced = json.loads(redis.Redis.from_url(redis_url).get("rlcli:rollouts:weights"))
    assert (announced["version"], announced["final"]) == (6, True)


def steps(run: Path) -> list[int]:
    with (run / "metrics.csv").open() as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def finished(args: list[str], cwd: Path) -> str:
    """The output of ``rlcli loop ARGS``, which must exit 0 with its sampler's exit 0."""
    process = start_loop(args, cwd)
    try:
        output, _ = process.communicate(timeout=400)
    finally:
        process.kill()
    assert process.returncode == 0, output[-3000:]
    assert "sampler 0 exited with code 0" in output, output[-3000:]
    return output


@pytest.mark.slow
def test_a_loop_killed_at_a_step_resumes_finishes_and_continues_when_asked(tmp_path):
    """The trainer killed with SIGKILL after step 3, default settings: no checkpoint, so ``resume=auto``
    starts afresh at v0 beside the crash's last two versions (publish.keep=2). Before the fix of recovery the
    new v0 was pruned at once and the sampler exited 2 ("cannot load the trainer's weights v0"); before
    the fix of continuing, the third loop's sampler obeyed the second's ``final`` and exited before
    loading anything, leaving the trainer to wait (here: until data.idle_timeout, short of step 9)."""
    run = tmp_path / "run"
    process = start_loop(["trainer.max_steps=100000", "hydra.run.dir=run"], tmp_path)
    try:
        wait_for_rows(run / "metrics.csv", 3, process)
        [trainer] = {os.getpgid(pid) for pid in descendants(process.pid)  # the trainer leads a process group
                     if b"\0train\0" in Path(f"/proc/{pid}/cmdline").read_bytes()}
        os.killpg(trainer, signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGKILL, output[-3000:]
    assert not list((run / "checkpoints").glob("step-*.ckpt"))

    idle = "data.idle_timeout=30"  # bounds a hang: the trainer ends 30 s after its last record
    finished(["trainer.max_steps=3", "resume=auto", idle, "hydra.run.dir=run"], tmp_path)
    assert steps(run) == [1, 2, 3]
    output = finished(["trainer.max_steps=9", "resume=auto", idle, "hydra.run.dir=run"], tmp_path)
    assert steps(run) == list(range(1, 10))
    assert "sampler 0: sampling with the weights v" in output  # of the resumed trainer, not gone at its old final
