"""One live run per run directory: ``<run_dir>/.lock``, held by the run's first process while it runs.

The lock is an advisory `fcntl.flock`, so the system releases it when the process ends in any way
(kill -9 included) and a requeued or resumed run takes the directory over. Whoever takes it also
removes the half-written checkpoints (``*.ckpt.tmp``) that a killed save left behind.

`rlcli loop` takes the lock before it starts anything and hands it to its trainer: the trainer inherits the
locked file (its descriptor in `HANDED_OVER`) and locks that, which it may, where a second loop is refused.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from rlcli.errors import UserError
from rlcli.storage import storage_error

HANDED_OVER = "RLCLI_RUN_LOCK_FD"  # the descriptor of the lock file that a process inherited with its lock


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._handle = None

    def __enter__(self) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = self._handed_over() or self.path.open("a+", encoding="utf-8")
        except OSError as err:
            raise storage_error(self.path, err) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise UserError(f"run directory {self.path.parent} is in use by another run (process {holder}); "
                            "wait for it to end, or give this run its own hydra.run.dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._handle = handle
        for partial in (self.path.parent / "checkpoints").glob("*.ckpt.tmp"):
            partial.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.close()  # closing releases the lock (a handed-over one: once the giver's copy is closed too)

    def fileno(self) -> int:
        """The locked file's descriptor, to pass to a process that takes the lock over (`HANDED_OVER`)."""
        return self._handle.fileno()

    def _handed_over(self):
        """The lock file inherited from the process that locked it (`HANDED_OVER`), or None."""
        fd = os.environ.get(HANDED_OVER)
        if fd is None:
            return None
        try:
            inherited, here = os.fstat(int(fd)), self.path.stat()
        except (OSError, ValueError):
            return None
        if (inherited.st_dev, inherited.st_ino) != (here.st_dev, here.st_ino):
            return None  # another directory's lock
        return os.fdopen(int(fd), "a+", encoding="utf-8")
