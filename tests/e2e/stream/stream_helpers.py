"""Helpers for the fault tests of ``rlcli train data=stream``: records, trainer processes killed as a
whole, and the audit of ``documents.jsonl`` against what was pushed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import redis
from fault_injection import FAULTS_ENV

from factories import rollout_record
from rlcli.stream import StreamWriter

STREAM, GROUP = "rlcli:rollouts", "rlcli-trainer"
VOCAB = 7  # the reverse task's tokenizer (pad, eos, '>' and 'abcd'): data=stream sizes the tiny model from it

# Small, fast runs that end by themselves once the stream has been empty for IDLE seconds. Records are
# 7 tokens, so a step (one micro-batch of at most 32 tokens per process) trains 4 of them. They all say
# policy_version 0: a large data.max_lag keeps them from being dropped as stale while the trainer's grows.
IDLE = 3
FAST = ["logger=none", "trainer.accumulate_microbatches=1", "data.max_tokens=32", "trainer.max_steps=100000",
        "data.max_lag=1000000", f"data.idle_timeout={IDLE}", "trainer.checkpoint_every=1"]
DDP = ["trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp"]


def subprocess_env(faults: bool = False) -> dict:
    """The environment of a process of a test run; with ``faults``, one that can load `fault_injection`."""
    return dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                **(FAULTS_ENV if faults else {}))


def records(prefix: str, count: int) -> list[dict]:
    """``count`` valid stream records with the distinct ids ``<prefix>-<i>``."""
    return [
        {**rollout_record(i, vocab=VOCAB), "id": f"{prefix}-{i}", "policy_version": 0,
         "advantage": float(i % 3 - 1)}
        for i in range(count)
    ]


def spoil(batch: list[dict], every: int = 10) -> list[str]:
    """Make every ``every``-th record of ``batch`` invalid in place (a token id outside the vocabulary);
    their ids, which the trainer must reject exactly once."""
    for record in batch[every - 1::every]:
        record["completion_ids"] = [VOCAB + 1] * len(record["completion_ids"])
    return [r["id"] for r in batch[every - 1::every]]


def push(url: str, batch: list[dict]) -> list[str]:
    """Push ``batch`` into the stream; the ids pushed."""
    with StreamWriter(url, STREAM) as writer:
        writer.push_many(batch)
    return [r["id"] for r in batch]


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


class Trainer:
    """``rlcli train ARGS`` in ``cwd``, in a session of its own so that a kill reaches every process of
    the run (the other DDP ranks too); its output goes to files, never to a pipe that could fill."""

    def __init__(self, args: list[str], cwd: Path, name: str, faults: bool = False) -> None:
        self.out = cwd / f"{name}.out"
        self.err = cwd / f"{name}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rlcli", "train", *args], cwd=cwd, env=subprocess_env(faults),
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)

    @property
    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        """The end of the run's stdout and of its stderr (for failure messages)."""
        out, err = (path.read_text(errors="replace")[-chars:] for path in (self.out, self.err))
        return f"--- stdout\n{out}\n--- stderr\n{err}"

    def running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL to every process of the run at once, as a crash of the node would."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the trainer did not end within {timeout} s:\n{self.tail()}") from None

    def wait_for(self, condition, what: str, timeout: float = 180, poll: float = 0.05) -> None:
        """Poll ``condition()`` until it holds; fails when the trainer exits or the time is up."""
        deadline = time.monotonic() + timeout
        while not condition():
            if not self.running():
                raise AssertionError(f"the trainer exited ({self.process.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {what} within {timeout} s:\n{self.tail()}")
            time.sleep(poll)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        if self.running():
            self.kill()


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the complete ``step-N.ckpt`` files of the run."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name[len("step-"):-len(".ckpt")]) for p in folder.glob("step-*.ckpt"))


def trained_steps(run_dir: Path) -> list[tuple[int, list[str]]]:
    """``documents.jsonl`` as (step, ids) pairs, in file order."""
    path = run_dir / "documents.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [(row["step"], row["ids"]) for row in map(json.loads, lines)]


def assert_trained_exactly_once(run_dir: Path, pushed: list[str]) -> list[tuple[int, list[str]]]:
    """Steps 1..N in order, each once, and every pushed id in exactly one of them (and nothing else)."""
    steps = trained_steps(run_dir)
    assert [s for s, _ in steps] == list(range(1, len(steps) + 1)), f"steps are not 1..N: {[s for s, _ in steps]}"
    counts = Counter(i for _, ids in steps for i in ids)
    twice = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(set(pushed) - set(counts))
    unknown = sorted(set(counts) - set(pushed))
    assert not twice, f"trained more than once: {twice}"
    assert not missing, f"never trained: {missing}"
    assert not unknown, f"trained but never pushed: {unknown}"
    assert all(ids for _, ids in steps), "a step without documents"
    return steps


def stream_length(url: str) -> int:
    conn = client(url)
    try:
        return conn.xlen(STREAM)
    finally:
        conn.close()


def assert_stream_drained(url: str, rejected: list[str] = ()) -> None:
    """Nothing pending in the trainer's group, every acknowledged entry trimmed from the stream, and the
    ids ``rejected`` in ``<stream>:rejected`` once each (and nothing else)."""
    conn = client(url)
    try:
        assert conn.xpending(STREAM, GROUP)["pending"] == 0, conn.xpending(STREAM, GROUP)
        assert conn.xlen(STREAM) == 0
        in_redis = [json.loads(json.loads(fields["record"])["record"])["id"]
                    for _, fields in conn.xrange(f"{STREAM}:rejected")]
        assert sorted(in_redis) == sorted(rejected), Counter(in_redis)
    finally:
        conn.close()


def assert_rejected_exactly_once(run_dir: Path, rejected: list[str]) -> None:
    """The run's rejection files (``rejected.jsonl``, or one per process) list each id of ``rejected`` once."""
    lines = [json.loads(line) for path in sorted(run_dir.glob("rejected*.jsonl"))
             for line in path.read_text().splitlines()]
    ids = [line["record"]["id"] for line in lines]
    assert sorted(ids) == sorted(rejected), Counter(ids)
