"""SIGTERM (preemption), SIGUSR1 and SIGUSR2 (time-limit warnings) and SIGINT (Ctrl-C) in `rlcli train`.

One mechanism in every process of a run: a signal never interrupts the code where it is, except a
step's rewards (no KeyboardInterrupt inside a collective, no handler of Lightning's). The command holds the signals
(`hold`) until `RunSignals` takes them for the run; its thread then learns of each at once, even
while the main thread is blocked in C waiting for the other processes, and acts by the run's phase:

- starting (model build, starting and connecting the processes): there is nothing to save, so the
  process exits at once with the signal's code. A process that rank 0 started passes the signal on to
  rank 0 instead, and ends with it (`rlcli.processes`).
- training: the step in progress finishes (one waiting for data ends with what it has), then every
  process saves and stops (`rlcli.callbacks.preemption.StopOnSignal`). A step whose rewards
  (`interruptible` code: the rewards in this process, or the wait for the reward pool) are still
  running `REWARDS_GRACE` seconds after the signal (or after they started, if later), or when a
  second signal comes, is abandoned instead: `StepInterrupted` is raised there, in the main thread,
  and the run ends without a checkpoint of that step (a reward that hangs cannot stop the run).
- finishing (the final checkpoint, the export): the run finishes as it would have.

A second signal changes nothing but that (it says that the first is being acted on).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar

from rlcli.processes import launcher

log = logging.getLogger("rlcli")

TIME_LIMIT = signal.SIGUSR2  # the warning before a job's time limit, as submitit asks Slurm for it
# the exit code of a run a signal stopped: 128 + the signal's number, what shells and schedulers expect;
# SIGUSR1 (Lightning's choice for Slurm's warning before a time limit) stops a run as SIGTERM does, and
# TIME_LIMIT too, after which `rlcli train` hands a Slurm job over to its requeue (`rlcli.slurm.requeue`)
EXIT_CODES = {signal.SIGTERM: 143, signal.SIGUSR1: 143, TIME_LIMIT: 140, signal.SIGINT: 130}
STARTING, TRAINING, FINISHING = "starting", "training", "finishing"
REWARDS_GRACE = 5.0  # seconds a step's rewards may go on after a signal before the step is abandoned


def hold() -> None:
    """Block the signals of `EXIT_CODES` from here to the process's exit: one that comes before `RunSignals`
    takes them waits for it, and one after it lets go finds the process ending (no KeyboardInterrupt)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(EXIT_CODES))


class StepInterrupted(BaseException):  # not an Exception: no reward's ``except Exception`` takes it
    """A signal in training ended the step in progress where it was `interruptible`; ``code`` is the signal's
    exit code."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(signum.name)
        self.signum, self.code = signum, EXIT_CODES[signum]


@contextmanager
def interruptible() -> Iterator[None]:
    """A step's code that a signal in training may end (`StepInterrupted`): its rewards. Only in the main
    thread of a run; elsewhere nothing changes."""
    run = RunSignals.active
    if run is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    run.rewards_since = time.monotonic()
    try:
        yield
    finally:
        run.rewards_since = None


class RunSignals:
    """The signals of one run (a context manager); ``active`` is the one in force. ``at_time_limit``, when
    `TIME_LIMIT` ends the run during start-up, gets the handler of `TIME_LIMIT` that the run's replaced
    (`rlcli.slurm.requeue.requeue` hands the job over to it)."""

    active: ClassVar[RunSignals | None] = None

    def __init__(self, at_time_limit: Callable[[object], None] | None = None) -> None:
        self.at_time_limit = at_time_limit
        self.phase = STARTING
        self.exit_code: int | None = None  # that of the first signal this process received
        self.first_signal: signal.Signals | None = None
        self.rewards_since: float | None = None  # when the main thread entered `interruptible` code; None: out
        self.abandoning = False  # the step in progress ends at once where it is interruptible
        self.interrupt: Callable[[], None] = lambda: None  # ends a wait for data (the step source's)

    def __enter__(self) -> RunSignals:
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = {s: signal.signal(s, self._in_main_thread) for s in EXIT_CODES}
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(read,), name="rlcli-signals", daemon=True)
        self._thread.start()
        self._previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, set(EXIT_CODES))  # held ones arrive now
        RunSignals.active = self
        return self

    def __exit__(self, *exc) -> None:
        RunSignals.active = None
        signal.pthread_sigmask(signal.SIG_SETMASK, self._previous_mask)
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        os.close(self._write)  # the thread reads the end of the pipe and returns
        self._thread.join()

    def _in_main_thread(self, signum: int, frame) -> None:
        """The Python-level handler: `RunSignals`'s thread acts on the signal; here, `interruptible` code ends
        once the step is being abandoned."""
        if self.abandoning and self.rewards_since is not None:
            raise StepInterrupted(self.first_signal)

    def _watch(self, read: int) -> None:
        """The thread: Python writes the number of every signal it catches into the pipe."""
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while numbers := pipe.read(64):
                for number in numbers:
                    if number in EXIT_CODES:
                        self._act(signal.Signals(number))

    def _act(self, signum: signal.Signals) -> None:
        if self.abandoning:
            return  # the signal `_abandon` sent, or one more while the step is abandoned
        first = self.exit_code is None
        self.exit_code = self.exit_code or EXIT_CODES[signum]
        self.first_signal = self.first_signal or signum
        if self.phase == STARTING:
            self._end_start_up(signum)
            return
        if self.phase == TRAINING:
            self.interrupt()
            message = "stopping after this step, with a checkpoint" if first else "already stopping after this step"
            if first:
                threading.Thread(target=self._abandon_rewards_that_hang, args=(time.monotonic(),),
                                 name="rlcli-rewards-grace", daemon=True).start()
            elif self.rewards_since is not None:
                self._abandon()
        else:
            message = "training is over; the run ends once its files are written"
        if launcher() is None:  # rank 0 speaks for the run
            log.warning("%s: %s", signum.name, message)

    def _abandon_rewards_that_hang(self, signalled: float) -> None:
        """A thread: abandons the step if its rewards run `REWARDS_GRACE` seconds past the signal or their start,
        and signals the main thread again every 0.1 s while it is still in them (see `_abandon`)."""
        while RunSignals.active is self and self.phase == TRAINING:
            since = self.rewards_since
            if since is not None and (self.abandoning or time.monotonic() - max(signalled, since) >= REWARDS_GRACE):
                self._abandon()
            time.sleep(0.1)

    def _abandon(self) -> None:
        """Make the main thread raise `StepInterrupted` in its `interruptible` code: a signal sent to that thread
        wakes it from a wait (a sleep, a lock) and runs `_in_main_thread` there. One that lands just before the
        thread enters a wait is only seen when the wait ends, so the grace thread sends it again until the main
        thread has left that code."""
        self.abandoning = True
        signal.pthread_kill(threading.main_thread().ident, self.first_signal)

    def _end_start_up(self, signum: signal.Signals) -> None:
        """Nothing to save yet: pass the signal on to rank 0, whose end ends this process, or exit now (a job at
        its time limit handed over by ``at_time_limit`` first)."""
        rank_zero = launcher()
        if rank_zero is not None:
            try:
                os.kill(rank_zero, signum)
                return
            except ProcessLookupError:
                pass  # rank 0 is gone already
        log.warning("%s during start-up: nothing to save yet; exiting with code %d", signum.name, self.exit_code)
        if signum == TIME_LIMIT and self.at_time_limit is not None:
            try:
                self.at_time_limit(self._previous[signum])
            except BaseException as err:  # submitit exits once it requeued, or raises why it did not
                if not isinstance(err, SystemExit):
                    log.error("%s", err)
        _flush_output()
        os._exit(self.exit_code)


def _flush_output() -> None:
    """Before `os._exit`: what this process logged and printed so far reaches its files and the console."""
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
