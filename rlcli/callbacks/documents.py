"""``documents.jsonl`` in the run directory: which documents trained each update, for auditing.

One line per optimizer update, ``{"step": N, "ids": [...]}``, with the documents of every process:
a rollout file's ``path:line`` (or ``path:row N``), a generated rollout's stable source name, or a
stream record's ``id``. A resumed run keeps the lines up to the step it resumes from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from rlcli.storage import keep_steps
from rlcli.training import distributed


class DocumentsLog(L.Callback):
    """Appends each step's documents, as `rlcli.training.module.PolicyModule.training_step` returns
    them (``outputs["documents"]``, this rank's), gathered from every rank; it must come before the
    checkpoint callback, so that a checkpoint never holds a step the file lacks."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._continue = False  # append to the file (a resumed run) rather than start it anew

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs:  # none from a step that found every rank out of data
            names = distributed.all_gather_objects(outputs["documents"])
            self.append(outputs["step"], [name for rank in names for name in rank])

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.resume_at(pl_module.steps_done)  # the module has restored its state first

    @rank_zero_only
    def append(self, step: int, ids: Sequence[str]) -> None:
        with self.path.open("a" if self._continue else "w", encoding="utf-8") as handle:
            self._continue = True
            handle.write(json.dumps({"step": step, "ids": list(ids)}) + "\n")

    @rank_zero_only
    def resume_at(self, step: int) -> None:
        """Keep the lines of steps up to ``step`` (rewritten atomically); later steps are trained again."""
        self._continue = True
        keep_steps(self.path, step)
