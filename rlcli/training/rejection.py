"""``correction.mode=reject`` at the trainer's batch stage (math.md#mismatch-correction).

The proximal log-probs are fixed for the whole batch, so the rejection is known before any update's
totals: `BatchRejection` runs once per collected batch, right after `add_trainer_logprobs`, and takes the
rejected tokens out of the documents' ``completion_mask`` (a document with no kept token is marked
``rejected``). Every update of the batch, its totals, loss and metrics then see the kept tokens only;
a checkpoint stores the documents as they are now, so a resumed batch keeps its rejection.
"""

from __future__ import annotations

import torch

from rlcli.errors import UserError
from rlcli.modules import Correction, LossInputs, reject_tokens
from rlcli.modules.metrics import Metric
from rlcli.training import distributed
from rlcli.training.batches import BatchPlan

METRICS = {
    "is_rejected_fraction": Metric(
        "correction.mode=reject", "the fraction of the batch's labelled tokens (before the rejection, all "
        "processes) that `reject` took out of the mask; the batch's, logged with each of its updates"),
}


class BatchRejection:
    """``correction.mode=reject`` for each collected batch (`__call__`); ``max_empty`` batches in a row whose every
    labelled token it rejects (``trainer.max_bad_steps``) stop the run with a `UserError`: their steps train
    nothing, and on-policy they would never reach ``trainer.max_steps``."""

    def __init__(self, correction: Correction | None, max_empty: int) -> None:
        self.correction = correction if correction is not None and correction.mode == "reject" else None
        self.max_empty = max_empty
        self.empty_in_a_row = 0

    @torch.no_grad()
    def __call__(self, batch: BatchPlan, device: torch.device) -> None:
        """The rejected tokens of ``batch`` out of its documents' masks, and ``is_rejected_fraction`` in its
        statistics (the same on every rank: one all-reduce, so every rank calls it). Needs the documents'
        ``proximal_logprobs`` (`add_trainer_logprobs`); nothing without the reject mode."""
        if self.correction is None:
            return
        values: dict[int, dict] = {}
        counts = torch.zeros(2, dtype=torch.float64)  # rejected, labelled tokens of this rank
        for micro_batch in batch.micro_batches:
            if micro_batch.proximal_logprobs is None:
                raise ValueError("correction mode 'reject' needs the trainer's proximal log-probs "
                                 "(loss.old_logprobs=recompute)")
            inputs = LossInputs(proximal_logprobs=micro_batch.proximal_logprobs, advantages=micro_batch.advantages,
                                mask=micro_batch.mask, document_index=micro_batch.document_index,
                                sampler_logprobs=micro_batch.sampler_logprobs)
            kept, rejected = reject_tokens(self.correction, inputs)
            masks = micro_batch.completion_values(kept.mask.tolist())  # one tuple of 0/1 per document
            for doc, mask, out in zip(micro_batch.documents, masks, rejected.tolist()):
                values[id(doc)] = {"completion_mask": tuple(int(v) for v in mask), "rejected": out}
            labelled = micro_batch.mask.sum(dtype=torch.float64)
            counts += torch.stack([labelled - kept.mask.sum(dtype=torch.float64), labelled])
        batch.fill(values)
        rejected_tokens, labelled = distributed.all_reduce(counts.to(device), "sum").tolist()
        batch.stats["is_rejected_fraction"] = rejected_tokens / max(labelled, 1.0)
        self._count_empty(labelled > 0 and rejected_tokens == labelled)

    def _count_empty(self, empty: bool) -> None:
        self.empty_in_a_row = self.empty_in_a_row + 1 if empty else 0
        if self.empty_in_a_row >= self.max_empty:
            c = self.correction
            raise UserError(
                f"correction.mode=reject: every labelled token of {self.empty_in_a_row} batches in a row had its "
                f"importance ratio (correction.level={c.level}) outside [correction.low, correction.high] = "
                f"[{c.low:g}, {c.high:g}], so no step trained anything (trainer.max_bad_steps bounds such batches); "
                "widen the bounds, use correction.level=geometric, or check that the sampler's log-probs are this "
                "model's at loss.temperature")
