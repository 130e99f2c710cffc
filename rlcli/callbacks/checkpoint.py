"""Atomic checkpoints every N steps and at the end of training, each stamped with the run's identity.

A checkpoint is written as ``step-<N>.ckpt.tmp`` beside its final name and renamed to
``step-<N>.ckpt`` only once it is complete and fsynced (``N`` counts training steps), so a process
killed during a save leaves the previous checkpoints usable and a half-written file is never picked
up. ``last.ckpt`` is the final one. `rlcli.callbacks.resume` chooses the one to continue from.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L

from rlcli.callbacks.resume import RunIdentity
from rlcli.storage import StorageError, fsync, storage_error
from rlcli.training import distributed


def save_atomically(trainer: L.Trainer, path: Path) -> None:
    """Write a checkpoint to ``path`` so that it either exists complete or not at all, and tell the
    module once it is durable (on disk, renamed, on every rank). A storage failure raises
    `StorageError` on every rank and leaves the previous checkpoints as they were."""
    partial = path.with_name(path.name + ".tmp")
    # every rank takes part; rank 0 writes (RunDirCheckpointIO); the full state (optimizer, loops, callbacks),
    # said outright: Lightning logs that it defaults to it at every save otherwise
    trainer.save_checkpoint(partial, weights_only=False)
    failure = None
    if trainer.is_global_zero:
        failure = trainer.strategy.checkpoint_io.take_failure()
        if failure is None:
            try:
                fsync(partial)
                os.replace(partial, path)
                fsync(path.parent)
            except OSError as err:
                partial.unlink(missing_ok=True)
                failure = storage_error(path, err)
    message = distributed.all_gather_objects(None if failure is None else str(failure))[0]  # also the barrier
    if message is not None:
        raise StorageError(message)
    trainer.lightning_module.checkpoint_durable()


class StepCheckpoint(L.Callback):
    """``step-<N>.ckpt`` every ``every`` steps (0: never) and ``step-<N>.ckpt`` + ``last.ckpt``
    at the end of training; each holds ``run``, the identity `resume` checks."""

    def __init__(self, dirpath: Path, every: int, run: RunIdentity) -> None:
        self.dirpath = Path(dirpath)
        self.every = every
        self.run = run
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

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["run"] = self.run.state_dict()
