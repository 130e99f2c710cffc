"""A run directory's JSON-lines log of ``{"step": N, ...}`` lines (``documents.jsonl``, ``completions.jsonl``):
written by the first process, started anew by a fresh run, cut back to the checkpoint by a resumed one."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from rlcli.storage import keep_steps


class StepLinesLog(L.Callback):
    """Appends a step's lines to ``path``; it must come before the checkpoint callback, so that a checkpoint
    never holds a step the file lacks. A resumed run keeps the lines up to the step it resumes from."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._continue = False  # append to the file (a resumed run) rather than start it anew

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.resume_at(pl_module.steps_done)  # the module has restored its state first

    @rank_zero_only
    def write(self, lines: list[dict]) -> None:
        """Append ``lines``, each ``{"step": N, ...}``, one JSON object a line."""
        with self.path.open("a" if self._continue else "w", encoding="utf-8") as handle:
            self._continue = True
            handle.writelines(json.dumps(line) + "\n" for line in lines)

    @rank_zero_only
    def resume_at(self, step: int) -> None:
        """Keep the lines of steps up to ``step`` (rewritten atomically); later steps are trained again."""
        self._continue = True
        keep_steps(self.path, step)
