"""SIGTERM and SIGUSR1 (Slurm's preemption and time-limit warnings) end training cleanly: every rank
stops after the same step, a checkpoint is saved, and `rlcli train` exits with PREEMPTED_EXIT_CODE.
`resume=auto` then continues from that checkpoint."""

from __future__ import annotations

import signal

import lightning as L
import torch

from rlcli.callbacks.checkpoint import StepCheckpoint
from rlcli.training import distributed

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what schedulers expect of a job that was asked to stop
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopOnSignal(L.Callback):
    def __init__(self, checkpoint: StepCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.received: int | None = None  # the signal this process got
        self.preempted = False  # training stopped because some rank got a signal
        self._previous: dict = {}
        self._module = None

    def _handle(self, signum, frame) -> None:
        self.received = signum
        self._module.source.interrupt()  # a source waiting for data ends the step now

    def on_train_start(self, trainer, pl_module) -> None:
        self._module = pl_module
        # installed after Lightning's own handlers, which would stop without a checkpoint
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        flag = torch.tensor(float(self.received is not None), device=pl_module.device)
        if distributed.all_reduce(flag, "max").item() > 0:
            self.preempted = True
            self.checkpoint.save_now(trainer)
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
