"""One live run per run directory: ``<run_dir>/.lock``, held by the run's first process while it runs.

The lock is an advisory `fcntl.flock`, so the system releases it when the process ends in any way
(kill -9 included) and a requeued or resumed run takes the directory over. Whoever takes it also
removes the half-written checkpoints (``*.ckpt.tmp``) that a killed save left behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from rlcli.errors import UserError
from rlcli.storage import storage_error


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._handle = None

    def __enter__(self) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = self.path.open("a+", encoding="utf-8")
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
        self._handle.close()  # closing releases the lock
