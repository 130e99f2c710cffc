"""Writing the run's files: a replacement that a kill at any moment leaves whole (the old file or the new
one), fsync, and one clear message when the storage refuses a file (`StorageError`)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from rlcli.errors import UserError

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # the file does not fit
# a file the system would not let the run write or read: full, over quota, read-only, not permitted
REFUSED_BY_STORAGE = DISK_FULL | {errno.EROFS, errno.EACCES, errno.EPERM}


class StorageError(UserError):
    """The run cannot write a file: a full disk, a quota, a read-only or unwritable directory."""


def storage_error(path: str | Path, err: OSError, needed: int | None = None) -> StorageError:
    """One line naming the file and what the system said, e.g. ``cannot write X: No space left on device``;
    with ``needed`` (bytes), a full disk also says how much the file needs and how much is free."""
    reason = err.strerror or str(err)
    if needed is not None and err.errno in DISK_FULL:
        try:
            free = shutil.disk_usage(Path(path).parent).free
            reason += f" (it needs about {_mib(needed)}; {_mib(free)} free there)"
        except OSError:
            reason += f" (it needs about {_mib(needed)})"
    return StorageError(f"cannot write {path}: {reason}")


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory after a rename in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text(path: Path, text: str) -> None:
    """Make ``text`` the content of ``path``: written to a temporary file beside it, fsynced, then renamed
    over it (and the directory fsynced), so the file is never empty or half-written."""
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    with partial.open("w", encoding="utf-8", newline="") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    fsync(path.parent)


def keep_lines(path: Path, count: int) -> None:
    """Cut ``path`` back to its first ``count`` lines, atomically (a resumed run drops what it writes
    again); with none to keep the file goes. A missing file has no lines."""
    path = Path(path)
    if count == 0:
        path.unlink(missing_ok=True)
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.is_file() else []
    replace_text(path, "".join(lines[:count]))


def keep_steps(path: Path, step: int) -> None:
    """Cut a JSON-lines file of ``{"step": N, ...}`` lines back to those of steps up to ``step``, atomically
    (a resumed run trains the later steps again); a torn last line (a killed run) goes too."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except ValueError:  # the torn last line of a killed run
                break
    replace_text(path, "".join(kept))
