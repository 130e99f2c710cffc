"""The metrics row of each step: callbacks that add to it, and the callback that logs it.

`rlcli.training.module.PolicyModule.training_step` returns ``{"step": N, "metrics": row, "documents":
ids}`` (nothing on a step that found every rank out of data); Lightning hands it to every callback's
``on_train_batch_end`` as ``outputs``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import lightning as L

from rlcli.loggers.metrics_csv import MetricsCSVLogger


@runtime_checkable
class StepMetricsCallback(Protocol):
    """A callback that adds metrics to a step's row (e.g. ``eval.every``'s `rlcli.callbacks.evaluate.PeriodicEval`,
    the published weights' `rlcli.callbacks.publish.WeightPublisher`): the module asks it on every rank,
    after the step's update and before the row is returned, so that a step keeps one row."""

    def step_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """This step's metrics by column name (``{}`` on a step it adds nothing to)."""


def step_row(outputs) -> dict[str, float] | None:
    """The metrics row of a step's ``outputs``; None for a step that trained nothing."""
    return outputs["metrics"] if outputs else None


class LogMetrics(L.Callback):
    """Logs each step's row to the run's loggers (``metrics.csv`` and those ``logger`` turns on); a
    resumed run's ``metrics.csv`` keeps the rows up to the step it resumes from. It must come before
    the checkpoint callback, so that a checkpoint never holds a step the file lacks."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = step_row(outputs)
        if row is not None:
            for logger in trainer.loggers:
                logger.log_metrics(row, step=outputs["step"])

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, MetricsCSVLogger):
                logger.resume_at(pl_module.steps_done)  # the module has restored its state first
