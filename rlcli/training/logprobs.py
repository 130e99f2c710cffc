"""The trainer's own log-probs, computed once at the start of each batch.

The policy's (``proximal_logprobs``, with ``loss.old_logprobs=recompute``) and the reference model's
(a record's ``ref_logprobs`` field, for a KL penalty to a reference model), by the head the loss uses,
on the micro-batches of the batch's first epoch: so the batch's first update starts at ratio 1 and
``kl_ref = 0`` exactly.
"""

from __future__ import annotations

import torch

from rlcli.training.batches import BatchPlan
from rlcli.training.loss import MicroBatchLoss, micro_batch_tensors
from rlcli.training.plan import passes


@torch.no_grad()
def add_trainer_logprobs(batch: BatchPlan, loss: MicroBatchLoss, device: torch.device, *,
                         policy: torch.nn.Module, reference: torch.nn.Module | None) -> None:
    """Give the documents of ``batch`` the log-probs the loss needs from the trainer: ``policy``'s when
    the loss recomputes them, ``reference``'s when there is a reference model (the scorers, sharded or not)."""
    scorers = {"proximal_logprobs": policy if loss.recompute else None, "ref_logprobs": reference}
    scorers = {field: scorer for field, scorer in scorers.items() if scorer is not None}  # by `Rollout` field
    if not scorers:
        return
    micro_batches = [mb for part in batch.parts(0) for mb in part]
    values: dict[int, dict] = {}
    for i in range(passes(micro_batches, device)):  # every rank the same passes (a sharded scorer gathers its weights)
        micro_batch = micro_batches[i] if i < len(micro_batches) else None
        t = micro_batch_tensors(micro_batch, device)
        scored = {field: loss.logprobs(scorer, t) for field, scorer in scorers.items()}  # [L] each
        if micro_batch is not None:
            per_document = {field: micro_batch.completion_values(v) for field, v in scored.items()}
            for d, doc in enumerate(micro_batch.documents):
                values[id(doc)] = {field: v[d] for field, v in per_document.items()}
    batch.fill(values)
