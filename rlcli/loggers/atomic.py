"""Replacing a run's file so that a kill at any moment leaves either the old file or the new one."""

from __future__ import annotations

import os
from pathlib import Path


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
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
