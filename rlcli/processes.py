"""The processes of a run and how they hold together.

`rlcli train` on several devices is one process per device: rank 0 starts the others of its node
(Lightning re-runs the program in them, with `LAUNCHER_PID` in their environment), they die with it
(`die_with_parent`), and it exits only after they have (`wait_for_launched`). While the processes of
a run connect, each says what it waits for (`saying_what_it_waits_for`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("rlcli")

LAUNCHER_PID = "RLCLI_LAUNCHER_PID"  # rank 0's process id, in the environment of every process of its run
WAIT_REPORT_EVERY = 20.0  # seconds between the messages of a process waiting for the others at start-up
_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int) -> None:
    """Ask Linux to send ``signum`` to this process when its parent dies, even by SIGKILL (elsewhere: nothing)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signum)  # libc's, already loaded


def launcher() -> int | None:
    """Rank 0's process id in a process that rank 0 started and that still runs under it; None in rank 0
    and in a process started otherwise (another node's, or one whose launcher is gone)."""
    pid = int(os.environ.get(LAUNCHER_PID, "0"))
    return pid if pid not in (0, os.getpid()) and os.getppid() == pid else None


def wait_for_launched(trainer) -> None:
    """Wait until the processes that this one started for ``trainer``'s run have exited (none: return)."""
    procs: list[subprocess.Popen] = getattr(trainer.strategy.launcher, "procs", [])
    for proc in procs:
        proc.wait()


@contextmanager
def saying_what_it_waits_for(trainer) -> Iterator[None]:
    """Inside: while the processes of ``trainer``'s run have not all connected, log every `WAIT_REPORT_EVERY`
    seconds what this one waits for (a run of one process waits for nothing)."""
    if trainer.world_size == 1:
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=_report_waiting, args=(trainer, done), name="rlcli-rendezvous", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _report_waiting(trainer, done: threading.Event) -> None:
    import torch.distributed as dist

    started = time.monotonic()
    while not done.wait(WAIT_REPORT_EVERY) and not dist.is_initialized():
        log.warning("waiting for the %d other process(es) of this run to connect at %s:%s (trainer.num_nodes=%d x "
                    "trainer.devices=%d; this is process %d), %.0f s so far", trainer.world_size - 1,
                    os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?"), trainer.num_nodes,
                    trainer.num_devices, trainer.global_rank, time.monotonic() - started)
