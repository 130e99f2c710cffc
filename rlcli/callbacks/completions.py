"""``completions.jsonl`` in the run directory: a few of each step's rollouts, to read what the model wrote.

One line per rollout, ``{"step": N, ...}`` and the fields of `rlcli.rollout.completions` (text for
rollouts rlcli sampled, token ids for a rollout file's documents), from the first process only (each
process samples its own rollouts; the first one's stand for the step). The same lines go to TensorBoard
as text and to wandb as a table when those loggers are on. A resumed run keeps the lines up to the
step it resumes from.
"""

from __future__ import annotations

import json

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from rlcli.callbacks.step_lines import StepLinesLog


def flat(line: dict) -> dict:
    """A line with one column per value: ``rewards`` as ``reward/<name>``, token ids as text."""
    columns = {}
    for key, value in line.items():
        if key == "rewards":
            columns |= {f"reward/{name}": term for name, term in value.items()}
        else:
            columns[key] = json.dumps(value) if isinstance(value, list) else value
    return columns


def markdown(lines: list[dict]) -> str:
    """The lines as a Markdown table (TensorBoard's text tab renders it)."""
    rows = [flat(line) for line in lines]
    names = list(rows[0])

    def cell(value) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")

    table = ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]
    table += ["| " + " | ".join(cell(row.get(name, "")) for name in names) + " |" for row in rows]
    return "\n".join(table)


class CompletionsLog(StepLinesLog):
    """Appends each step's lines (``outputs["completions"]`` of `rlcli.training.module.PolicyModule.training_step`)
    to ``path`` and to the TensorBoard and wandb loggers of the trainer."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs and outputs["completions"]:
            self.append(trainer, outputs["step"], outputs["completions"])

    @rank_zero_only
    def append(self, trainer: L.Trainer, step: int, lines: list[dict]) -> None:
        lines = [{"step": step, **line} for line in lines]
        self.write(lines)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("completions", markdown(lines), global_step=step)
            elif isinstance(logger, WandbLogger):
                rows = [flat(line) for line in lines]
                logger.log_table("completions", columns=list(rows[0]), data=[list(row.values()) for row in rows])
