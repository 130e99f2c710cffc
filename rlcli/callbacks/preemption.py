"""A signal ends training cleanly (`rlcli.signals`): every rank stops after the same step, a checkpoint
is saved, and `rlcli train` exits with the signal's code (`rlcli.signals.EXIT_CODES`). `resume=auto`
then continues from that checkpoint."""

from __future__ import annotations

import lightning as L
import torch

from rlcli.callbacks.checkpoint import StepCheckpoint
from rlcli.signals import FINISHING, TRAINING, RunSignals
from rlcli.training import distributed


class StopOnSignal(L.Callback):
    """After each step, the ranks agree on whether any received a signal and on the exit code (the highest
    of theirs); if so each saves and stops."""

    def __init__(self, checkpoint: StepCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.exit_code: int | None = None  # the ranks' agreed code once a signal stopped training

    def setup(self, trainer, pl_module, stage) -> None:
        # Lightning's own SIGTERM handler would stop without a checkpoint, and it runs a collective inside
        # the handler; its SLURM auto-requeue would be a second requeue beside submitit's: neither is ever
        # installed, `rlcli.signals` handles every signal
        trainer._signal_connector.register_signal_handlers = lambda: None

    def on_train_start(self, trainer, pl_module) -> None:
        if RunSignals.active is not None:
            RunSignals.active.interrupt = pl_module.source.interrupt
            RunSignals.active.phase = TRAINING

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        received = RunSignals.active.exit_code if RunSignals.active is not None else None
        code = distributed.all_reduce(torch.tensor(received or 0, device=pl_module.device), "max").item()
        if code:
            self.exit_code = int(code)
            self.checkpoint.save_now(trainer)
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if RunSignals.active is not None:
            RunSignals.active.phase = FINISHING


def stop_code(trainer) -> int | None:
    """The exit code of a run that a signal stopped (the same on every rank); None if none did: the one
    answer to "was the run stopped by a signal"."""
    return next((c.exit_code for c in trainer.callbacks if isinstance(c, StopOnSignal)), None)
