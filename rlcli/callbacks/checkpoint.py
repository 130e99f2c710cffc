"""Atomic checkpoints every N steps and at the end of training, and finding one to resume from.

A checkpoint is written as ``step-<N>.ckpt.tmp`` and renamed to ``step-<N>.ckpt`` only once it is
complete (``N`` counts training steps), so a process killed during a save leaves the previous
checkpoints usable and a half-written file is never picked up. ``last.ckpt`` is the final one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import lightning as L

from rlcli.errors import UserError

STEP_CHECKPOINT = re.compile(r"step-(\d+)\.ckpt")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(trainer: L.Trainer, path: Path) -> None:
    """Write a checkpoint to ``path`` so that it either exists complete or not at all, and tell the
    module once it is durable (on disk, renamed, on every rank)."""
    partial = path.with_name(path.name + ".tmp")
    trainer.save_checkpoint(partial)  # every rank takes part; rank 0 writes
    if trainer.is_global_zero:
        _fsync(partial)
        os.replace(partial, path)
        _fsync(path.parent)
    trainer.strategy.barrier("rlcli-checkpoint-durable")
    trainer.lightning_module.checkpoint_durable()


class StepCheckpoint(L.Callback):
    """``step-<N>.ckpt`` every ``every`` steps (0: never) and ``step-<N>.ckpt`` + ``last.ckpt``
    at the end of training."""

    def __init__(self, dirpath: Path, every: int) -> None:
        self.dirpath = Path(dirpath)
        self.every = every
        self._saved_step = -1

    def save_now(self, trainer) -> None:
        """Save the current step's checkpoint (once)."""
        self._save_step(trainer)

    def _save_step(self, trainer) -> None:
        step = trainer.lightning_module.steps_done
        if step != self._saved_step:
            save_atomically(trainer, self.dirpath / f"step-{step}.ckpt")
            self._saved_step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every and pl_module.steps_done and pl_module.steps_done % self.every == 0:
            self._save_step(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._save_step(trainer)
        save_atomically(trainer, self.dirpath / "last.ckpt")


def find_resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """``resume=auto``: the newest complete ``step-<N>.ckpt`` of the run directory (None if there
    is none yet); ``resume=PATH``: that file; ``null``: no resume."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        if not path.is_file():
            raise UserError(f"resume: no checkpoint file at {path}")
        return path
    steps = [
        (int(match.group(1)), path)
        for path in (run_dir / "checkpoints").glob("step-*.ckpt")
        if (match := STEP_CHECKPOINT.fullmatch(path.name))
    ]
    return max(steps)[1] if steps else None
