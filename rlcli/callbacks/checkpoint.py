"""Save Lightning checkpoints every N optimizer steps and at the end of training."""

from __future__ import annotations

from pathlib import Path

import lightning as L


class StepCheckpoint(L.Callback):
    """``checkpoints/step-<N>.ckpt`` every ``every`` steps (0: never) and ``checkpoints/last.ckpt``
    when training ends."""

    def __init__(self, dirpath: Path, every: int) -> None:
        self.dirpath = Path(dirpath)
        self.every = every
        self._saved_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every and step and step % self.every == 0 and step != self._saved_step:
            trainer.save_checkpoint(self.dirpath / f"step-{step}.ckpt")
            self._saved_step = step

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.dirpath / "last.ckpt")
