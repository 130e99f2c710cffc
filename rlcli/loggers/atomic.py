"""Replacing a run's file so that a kill at any moment leaves either the old file or the new one."""

from __future__ import annotations

import os
from pathlib import Path


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
