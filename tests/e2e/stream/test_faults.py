"""Faults of the live loop against a real Redis (issue 15, "Faults, tested"): a trainer killed with
SIGKILL at seeded random moments (and at the two moments around a checkpoint that matter most) and
resumed with ``resume=auto`` trains every pushed record exactly once, with 1 and 2 processes; a killed
sampler makes the trainer wait and say so, then go on with a new one; a Redis restart is ridden out
with nothing lost or repeated; an unreachable URL is one clear error and exit 2.

Each run is audited: ``documents.jsonl`` (which records trained each step) against the ids pushed, and
the consumer group in Redis (nothing pending, the stream trimmed).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_injection import callbacks_override
from stream_helpers import (
    DDP,
    FAST,
    STREAM,
    Trainer,
    assert_rejected_exactly_once,
    assert_stream_drained,
    assert_trained_exactly_once,
    checkpoint_steps,
    push,
    records,
    spoil,
    stream_length,
    subprocess_env,
    trained_steps,
)

from rlcli.stream.server import EmbeddedRedis, free_port
from train_helpers import run_rlcli

WAITING = "is a sampler running?"


def stream_args(url: str, *extra: str) -> list[str]:
    return ["data=stream", f"data.url={url}", *FAST, "hydra.run.dir=run", "resume=auto", *extra]


def kill_at_random(trainer: Trainer, run_dir: Path, rng: random.Random) -> None:
    """SIGKILL the whole run at a seeded random moment: 1 to 5 checkpoints after its start, somewhere in
    a step (reading, training, saving, acknowledging or publishing)."""
    before = max(checkpoint_steps(run_dir), default=0)
    target = before + rng.randint(1, 5)
    trainer.wait_for(lambda: max(checkpoint_steps(run_dir), default=0) >= target, f"checkpoint {target}", poll=0.005)
    time.sleep(rng.uniform(0, 0.2))  # about one or two steps of these tiny runs
    assert trainer.running(), f"the run ended before it could be killed:\n{trainer.tail()}"
    trainer.kill()


def resume_until_drained(tmp_path: Path, url: str, extra: list[str]) -> str:
    """``resume=auto`` in the killed run's directory until the stream is drained; the run's output."""
    with Trainer(stream_args(url, *extra), tmp_path, "final") as final:
        assert final.wait() == 0, final.tail()
    assert "resuming from" in final.output
    assert "data.idle_timeout); ending the run" in final.output
    return final.output


def kill_and_resume(tmp_path: Path, url: str, seed: int, kills: int, extra: list[str]) -> tuple[list[str], list[str]]:
    """Push, train, kill -9 ``kills`` times (pushing more after each kill), then let a resumed run drain
    the stream; the ids of the valid records pushed, and of the invalid ones among them."""
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    first = records("first", 60)  # a kill (5 checkpoints of 4 records, 8 on 2 processes, at most) leaves some
    invalid = spoil(first)
    pushed = push(url, first)
    for kill in range(kills):
        with Trainer(stream_args(url, *extra), tmp_path, f"killed-{kill}") as trainer:
            kill_at_random(trainer, run_dir, rng)
        assert stream_length(url) > 0  # killed before the stream was drained
        pushed += push(url, records(f"after-kill-{kill}", 20))
    resume_until_drained(tmp_path, url, extra)
    return [i for i in pushed if i not in invalid], invalid


@pytest.mark.slow
@pytest.mark.parametrize("seed, kills", [(1, 1), (2, 2)])
def test_trainer_killed_at_random_trains_every_record_exactly_once(tmp_path, redis_url, seed, kills):
    pushed, invalid = kill_and_resume(tmp_path, redis_url, seed, kills, [])
    assert_trained_exactly_once(tmp_path / "run", pushed)
    assert_rejected_exactly_once(tmp_path / "run", invalid)
    assert_stream_drained(redis_url, rejected=invalid)


@pytest.mark.slow
@pytest.mark.parametrize("fault, resumed_from", [("KillDuringSave", 2), ("KillBeforeAcknowledge", 3)])
def test_trainer_killed_around_a_checkpoint_trains_every_record_exactly_once(tmp_path, redis_url, fault,
                                                                             resumed_from):
    """The moments a random kill seldom hits: in the middle of a save (written, not yet renamed), and
    between a durable checkpoint and the acknowledgement of the records it trained."""
    first = records("first", 40)
    invalid = spoil(first)  # first-9 is read in step 3: its rejection is made again after a resume from step 2
    pushed = push(redis_url, first)
    args = stream_args(redis_url, *callbacks_override(fault, step=3))
    with Trainer(args, tmp_path, "killed", faults=True) as killed:
        assert killed.wait() == 137, killed.tail()
    pushed += push(redis_url, records("after-kill", 20))
    output = resume_until_drained(tmp_path, redis_url, [])
    assert re.search(rf"resuming from \S*/run/checkpoints/step-{resumed_from}\.ckpt", output), output[-3000:]
    assert_trained_exactly_once(tmp_path / "run", [i for i in pushed if i not in invalid])
    assert_rejected_exactly_once(tmp_path / "run", invalid)
    assert_stream_drained(redis_url, rejected=invalid)


@pytest.mark.slow
def test_two_process_trainer_killed_trains_every_record_exactly_once(tmp_path, redis_url):
    pushed, invalid = kill_and_resume(tmp_path, redis_url, 3, 1, DDP)
    steps = assert_trained_exactly_once(tmp_path / "run", pushed)
    assert max(len(ids) for _, ids in steps) > 4  # both processes trained: more than one micro-batch per step
    assert_rejected_exactly_once(tmp_path / "run", invalid)
    assert_stream_drained(redis_url, rejected=invalid)


# A sampler as its own process: it pushes the records it reads from stdin once asked to, says so, and
# hangs (a sampler stuck or about to die) until it is killed.
SAMPLER = """
import json, sys, time
from rlcli.stream import StreamWriter
url, stream = sys.argv[1:3]
print("ready", flush=True)
batch = json.loads(sys.stdin.readline())
with StreamWriter(url, stream) as writer:
    writer.push_many(batch)
print("pushed", len(batch), flush=True)
time.sleep(3600)
"""


class Sampler:
    """A writer process, started ahead so that its push comes the moment it is asked for."""

    def __init__(self, url: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SAMPLER, url, STREAM], env=subprocess_env(),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline() == "ready\n"

    def push(self, batch: list[dict]) -> list[str]:
        self.process.stdin.write(json.dumps(batch) + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == f"pushed {len(batch)}\n"
        return [r["id"] for r in batch]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


@pytest.mark.slow
def test_killed_sampler_the_trainer_waits_says_so_and_continues_with_a_new_one(tmp_path, redis_url):
    run_dir = tmp_path / "run"
    first, second = Sampler(redis_url), Sampler(redis_url)
    try:
        args = stream_args(redis_url, "data.wait_warning=1", "data.idle_timeout=6")
        with Trainer(args, tmp_path, "trainer") as trainer:
            trainer.wait_for(lambda: WAITING in trainer.output, "a word that the trainer waits for a sampler")
            pushed = first.push(records("first-sampler", 12))
            first.kill()  # SIGKILL: the sampler dies after its push
            trained = lambda: {i for _, ids in trained_steps(run_dir) for i in ids}
            trainer.wait_for(lambda: trained() >= set(pushed), "the first sampler's records trained")
            waits = trainer.output.count(WAITING)
            trainer.wait_for(lambda: trainer.output.count(WAITING) > waits, "a word that it waits again")
            pushed += second.push(records("second-sampler", 12))
            assert trainer.wait() == 0, trainer.tail()
            output = trainer.output
    finally:
        first.kill()
        second.kill()
    assert f"stream: no rollouts for 1 s on {STREAM}; {WAITING}" in output
    assert "data.idle_timeout); ending the run" in output
    steps = assert_trained_exactly_once(run_dir, pushed)
    last_of_first = max(s for s, ids in steps if any(i.startswith("first-") for i in ids))
    assert all(s > last_of_first for s, ids in steps if any(i.startswith("second-") for i in ids))
    assert_stream_drained(redis_url)


@pytest.mark.slow
def test_redis_restart_mid_run_loses_nothing_and_repeats_nothing(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        url = server.url
        pushed = push(url, records("burst-1", 40))
        with Trainer(stream_args(url, "data.idle_timeout=5"), tmp_path, "trainer") as trainer:
            trainer.wait_for(lambda: len(checkpoint_steps(tmp_path / "run")) >= 2, "two checkpoints")
            pushed += push(url, records("burst-2", 20))
            server.stop()  # graceful: the append-only file holds every entry and acknowledgement
            time.sleep(2)  # away long enough that the trainer's commands fail (a bare restart() may go unnoticed)
            server.start()
            trainer.wait_for(lambda: "is back" in trainer.output, "a word that Redis is back")
            pushed += push(url, records("burst-3", 20))
            assert trainer.wait() == 0, trainer.tail()
            output = trainer.output
        assert f"stream: Redis at {url} is unreachable" in output
        assert f"stream: Redis at {url} is back" in output
        assert "Traceback" not in output
        assert_trained_exactly_once(tmp_path / "run", pushed)
        assert_stream_drained(url)


@pytest.mark.slow
def test_unreachable_url_is_one_clear_error_and_exit_2(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    result = run_rlcli(["train", "data=stream", f"data.url={url}", "hydra.run.dir=run"], tmp_path, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    naming = [line for line in result.stderr.splitlines() if url in line]
    assert len(naming) == 1 and naming[0].startswith("rlcli train: error: data.url: no Redis server answers at"), \
        result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s to give up"  # a few seconds of retries, not the 120 s of a running one
