"""``documents.jsonl`` in the run directory: which documents trained each update, for auditing.

One line per optimizer update, ``{"step": N, "ids": [...]}``, with the documents of every process:
a rollout file's ``path:line`` (or ``path:row N``), a generated rollout's stable source name, or a
stream record's ``id``. A resumed run keeps the lines up to the step it resumes from.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlcli.callbacks.step_lines import StepLinesLog
from rlcli.training import distributed


class DocumentsLog(StepLinesLog):
    """Appends each step's documents, as `rlcli.training.module.PolicyModule.training_step` returns
    them (``outputs["documents"]``, this rank's), gathered from every rank."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs:  # none from a step that found every rank out of data
            names = distributed.all_gather_objects(outputs["documents"])
            self.append(outputs["step"], [name for rank in names for name in rank])

    def append(self, step: int, ids: Sequence[str]) -> None:
        self.write([{"step": step, "ids": list(ids)}])
