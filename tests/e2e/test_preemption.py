"""Signals to `rlcli train` on 1 and 2 processes: in training every process stops after the same step,
a checkpoint is saved and resume=auto continues from it; in start-up every process ends at once. Either
way the run exits with the signal's code, no process of it is left, and nothing prints a traceback."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_injection import FAULTS_ENV, callbacks_override

from rlcli.signals import EXIT_CODES, TRAINING, RunSignals
from train_helpers import alive, descendants

TWO_PROCESSES = ["trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp"]
RUN = ["data=rollouts", "hydra.run.dir=run", "data.epochs=50", "trainer.accumulate_microbatches=1"]
LEFTOVER_GRACE = 10.0  # seconds a process of an ended run may take to exit (see Run.finish)


class Run:
    """``rlcli train ARGS`` in its own session (as a terminal runs a command), its output in a file."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.output = cwd / f"output-{len(list(cwd.glob('output-*')))}.txt"
        env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **FAULTS_ENV)
        with self.output.open("w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "rlcli", "train", *args], cwd=cwd, env=env,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.seen: set[int] = set()  # the processes of the run seen (rank 0's descendants)

    def text(self) -> str:
        return self.output.read_text()

    def wait_until(self, condition, timeout: float = 300, poll: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, "the run did not get there in time"
            time.sleep(poll)
        self.seen |= descendants(self.process.pid)

    def rank_one(self, holding: bool) -> int:
        """Rank 1's process id, once it blocks exactly the run's signals (``holding``: `rlcli.signals.hold`,
        not the moment glibc blocks every signal to start a thread) or catches them: from then on it
        handles them instead of dying of them."""
        self.wait_until(lambda: self._rank_one() is not None)
        pid = self._rank_one()
        mask = sum(1 << (s - 1) for s in EXIT_CODES)
        if holding:
            self.wait_until(lambda: int(_status(pid).get("SigBlk", "0"), 16) == mask, poll=0.005)
        else:
            self.wait_until(lambda: int(_status(pid).get("SigCgt", "0"), 16) & mask == mask)
        return pid

    def _rank_one(self) -> int | None:
        """The run's second process: Lightning starts it with ``LOCAL_RANK=1``. Rank 0 also runs short-lived
        helpers (``git``, for the run's manifest), which are no rank."""
        for pid in descendants(self.process.pid):
            try:
                environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue  # exited meanwhile
            if b"\0LOCAL_RANK=1\0" in environ:
                return pid
        return None

    def finish(self) -> str:
        """Wait for the end (a hang fails); the run's output, checked for tracebacks and leftover processes."""
        self.seen |= descendants(self.process.pid)
        self.process.wait(timeout=120)
        text = self.text()
        assert "Traceback" not in text, text[-3000:]
        # a short-lived helper (git, for a manifest) started just before the signal may outlive its parent by
        # moments; a process of the run that is still there after LEFTOVER_GRACE seconds is a leak
        deadline = time.monotonic() + LEFTOVER_GRACE
        while (left := [pid for pid in self.seen if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, [_command_line(pid) for pid in left]
        return text


@pytest.fixture
def start(tmp_path):
    """``start(ARGS)``: a `Run` in ``tmp_path``; whatever is left of its process group is killed at the end."""
    runs: list[Run] = []

    def run(args: list[str]) -> Run:
        runs.append(Run(args, tmp_path))
        return runs[-1]

    yield run
    for started in runs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(started.process.pid, signal.SIGKILL)


def _command_line(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: exited"


def _status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def steps(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open() as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def trained_steps(run_dir: Path, count: int):
    """Whether ``count`` steps are done (metrics.csv has a header and a row per step)."""
    metrics = run_dir / "metrics.csv"
    return lambda: metrics.is_file() and len(metrics.read_text().splitlines()) > count


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")
@pytest.mark.parametrize("signum, to", [  # (SIGTERM to one process in training: tests/e2e/launcher/test_slurm.py)
    (signal.SIGUSR1, "rank 1"),  # the rank that did not get it learns it at the step's end
    (signal.SIGINT, "terminal, twice"),  # Ctrl-C twice: to the whole process group, the second mid-stop
])
def test_a_signal_in_training_stops_every_process_of_two_saves_and_resumes(start, tmp_path, signum, to):
    late = callbacks_override("EndsLate", rank=1, seconds=5)
    run = start([*RUN, "trainer.max_steps=1000", *TWO_PROCESSES, *late])  # rank 0 exits after rank 1, however late
    run.wait_until(trained_steps(tmp_path / "run", 2))
    if to == "rank 1":
        os.kill(run.rank_one(holding=False), signum)
    else:
        os.killpg(run.process.pid, signum)
        time.sleep(0.2)
        os.killpg(run.process.pid, signum)
    output = run.finish()
    assert run.process.returncode == (130 if signum == signal.SIGINT else 143)
    stopped_at = steps(tmp_path / "run")[-1]
    assert f"stopped by a signal after step {stopped_at}; checkpoint saved" in output
    assert (tmp_path / "run" / "checkpoints" / f"step-{stopped_at}.ckpt").is_file()
    assert not (tmp_path / "run" / "export").exists() and "export (Hugging Face)" not in output  # not exported
    assert (tmp_path / "run" / "ended-1").exists()

    resumed = start([*RUN, f"trainer.max_steps={stopped_at + 2}", "resume=auto", *TWO_PROCESSES])
    resumed.finish()
    assert resumed.process.returncode == 0
    assert steps(tmp_path / "run") == list(range(1, stopped_at + 3))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")
@pytest.mark.parametrize("signum, to", [(signal.SIGTERM, "rank 0"), (signal.SIGINT, "rank 1")])
def test_a_signal_during_start_up_ends_every_process_at_once(start, tmp_path, signum, to):
    """Rank 0 waits for rank 1 to connect (blocked in C); rank 1 has just started and holds the signal
    until it can pass it on to rank 0. Nothing to save."""
    run = start([*RUN, "trainer.max_steps=1000", *TWO_PROCESSES])
    rank_one = run.rank_one(holding=True)
    os.kill(run.process.pid if to == "rank 0" else rank_one, signum)
    output = run.finish()
    assert run.process.returncode == (130 if signum == signal.SIGINT else 143)
    assert f"{signal.Signals(signum).name} during start-up: nothing to save yet" in output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")
def test_waiting_for_another_node_says_so_and_ctrl_c_ends_it(start):
    run = start([*RUN, "trainer.num_nodes=2", "trainer.accelerator=cpu", "strategy=ddp"])
    waiting = re.compile(r"waiting for the 1 other process\(es\) of this run to connect at 127\.0\.0\.1:\d+ "
                         r"\(trainer\.num_nodes=2 x trainer\.devices=1; this is process 0\), \d+ s so far")
    run.wait_until(lambda: waiting.search(run.text()), timeout=120)
    os.killpg(run.process.pid, signal.SIGINT)
    run.finish()
    assert run.process.returncode == 130


def test_run_signals_record_the_first_signal_and_never_raise():
    """In training a signal interrupts the step's wait for data and sets the exit code, the first one
    counts; SIGINT raises no KeyboardInterrupt; on exit the previous handlers are back."""
    previous = {s: signal.getsignal(s) for s in EXIT_CODES}
    interrupted = []
    with RunSignals() as signals:
        signals.phase = TRAINING
        signals.interrupt = lambda: interrupted.append(True)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while len(interrupted) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert signals.exit_code == 130
    assert {s: signal.getsignal(s) for s in EXIT_CODES} == previous
