"""The reward worker pool: reward functions run in worker processes with a timeout per call, so that one
that hangs, crashes its process or raises anything scores 0 and the step goes on (``task.reward_workers``,
``task.reward_timeout``).

Built on pebble's `ProcessPool`, which stops a worker whose call runs past its timeout and replaces any
worker that ended. A term that is not ``batched`` is one call per completion, a ``batched`` one a call
per batch. Each worker rebuilds the terms from their specs (`build_rewards`; functions made by factories
do not pickle) with the training process's ``sys.path``, so a user's ``_target_`` module imports there too.

Workers start with ``forkserver``: forking the training process itself is unsafe once torch has started
threads or CUDA, and ``spawn`` would import rlcli again for every replacement of a worker (about 1 s);
the fork server, started clean, imports `rlcli.rollout.rewards` and math-verify once and forks each worker
from it. As with any start method but fork, the training process's main script is imported (once, by
the fork server): a script that trains must do so under ``if __name__ == "__main__":``. A worker exits
when the training process ends, even killed and in the middle of a call: a thread of the worker waits on
a pipe that only the training process holds open (the fork server, in turn, ends with its last worker).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import TimeoutError as CallTimeout
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from typing import Any

from pebble import ProcessExpired, ProcessPool

from rlcli.rollout.rewards import RewardTerm, build_rewards, term_values

__all__ = ["RewardPool", "default_workers"]

Values = list[tuple[float, str | None]]  # each completion's value and the reason where it failed

_terms: tuple[RewardTerm, ...] = ()  # a worker's terms, built by `_start_worker`


def default_workers() -> int:
    """The cores this process may use, shared among the training processes of this node: ``LOCAL_WORLD_SIZE``
    (torchrun), else ``WORLD_SIZE`` (Lightning's launch of ``trainer.devices`` processes, set before the first
    batch; on several nodes it counts them all, so each process gets fewer workers than its share); at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
    return max(1, cores // max(1, int(processes)))


def _start_worker(path: list[str], specs: list[dict], trainer: Connection) -> None:
    """A worker's initializer: the parent's ``sys.path``, the terms of ``specs``, and a thread that ends
    the worker when ``trainer`` (the reading end of a pipe only the training process writes to) closes."""
    global _terms
    sys.path[:] = path
    _terms = build_rewards(specs).terms
    threading.Thread(target=_exit_at_end_of, args=(trainer,), daemon=True).start()


def _exit_at_end_of(trainer: Connection) -> None:
    try:
        trainer.recv()  # nothing is ever sent: returns at the end of the training process
    finally:
        os._exit(1)


def _values(index: int, completions: list[str], contexts: list[dict]) -> Values:
    """Term ``index``'s values in a worker; anything it raises, SystemExit included, fails them all."""
    try:
        return term_values(_terms[index], completions, contexts)
    except BaseException as err:  # a reward's sys.exit() or KeyboardInterrupt is its failure
        return [(0.0, f"{type(err).__name__}: {err}")] * len(completions)


def _stop(pool: ProcessPool, trainer: Connection) -> None:
    pool.stop()
    pool.join()
    trainer.close()


class RewardPool:
    """Runs the terms of ``specs`` (plain mappings; ``batched[i]`` says whether term i takes the whole batch)
    in ``workers`` processes (None: `default_workers` when the pool starts), each call limited to ``timeout``
    seconds. The pool starts at the first `submit` and stops at `close`, when the pool is collected, or at
    exit."""

    def __init__(self, specs: Sequence[Mapping[str, Any]], batched: Sequence[bool], *, workers: int | None,
                 timeout: float) -> None:
        self.specs = [dict(spec) for spec in specs]
        self.batched = list(batched)
        self.workers = workers
        self.timeout = timeout
        self._pool: ProcessPool | None = None
        self._finalizer: weakref.finalize | None = None

    def _started(self) -> ProcessPool:
        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["rlcli.rollout.rewards", "math_verify"])  # imported once, not per worker
            watched, trainer = context.Pipe(duplex=False)  # this process holds the only writing end
            workers = default_workers() if self.workers is None else self.workers
            self._pool = ProcessPool(workers, initializer=_start_worker,
                                     initargs=(list(sys.path), self.specs, watched), context=context)
            self._finalizer = weakref.finalize(self, _stop, self._pool, trainer)
            atexit.register(self._finalizer)  # before multiprocessing's exit handler, which joins workers
        return self._pool

    def submit(self, completions: Sequence[str], contexts: Sequence[Mapping[str, Any]]) -> Callable[[], list[Values]]:
        """Schedules every term on the batch; returns the function that waits for the columns of values
        (``[term][completion]``, as `term_values` gives them)."""
        pool, completions, contexts = self._started(), list(completions), [dict(c) for c in contexts]
        calls = [[(pool.schedule(_values, (i, completions, contexts), timeout=self.timeout), len(completions))]
                 if batched else [(pool.schedule(_values, (i, [c], [x]), timeout=self.timeout), 1)
                                  for c, x in zip(completions, contexts)]
                 for i, batched in enumerate(self.batched)]

        def collect() -> list[Values]:
            columns = [[value for future, count in futures for value in self._result(future, count)]
                       for futures in calls]
            if not pool.active:  # broken (every worker failed to start): a new one for the next batch
                self.close()
            return columns

        return collect

    def _result(self, future: Any, count: int) -> Values:
        try:
            return future.result()
        except CallTimeout:
            reason = f"timed out after {self.timeout:g} s (its worker was replaced)"
        except ProcessExpired as err:
            code = err.exitcode
            how = f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
            reason = f"its worker process died ({how}; replaced)"
        except BrokenProcessPool as err:  # e.g. every worker failed to build the terms
            reason = (f"no reward worker could run it ({err}; a worker's own error is on stderr); "
                      "a new pool starts at the next batch")
        except Exception as err:  # a context that does not pickle, a broken pool
            reason = f"{type(err).__name__}: {err}"
        return [(0.0, reason)] * count

    def close(self) -> None:
        """Stops the workers (a new pool starts at the next `submit`)."""
        if self._finalizer is not None:
            self._finalizer()
            atexit.unregister(self._finalizer)
        self._pool = self._finalizer = None
