"""The trainer's own log-probs, computed once at the start of each batch.

The policy's (``proximal_logprobs``, with ``loss.old_logprobs=recompute`` or a teacher), the reference
model's (a record's ``ref_logprobs`` field, for a KL penalty to a reference model) and the teacher's
(``teacher_logprobs``, for on-policy distillation), by the head the loss uses, on the micro-batches of
the batch's first epoch: so the batch's first update starts at ratio 1 and ``kl_ref = 0`` exactly. One
model that is both the reference and the teacher runs one forward for both.
"""

from __future__ import annotations

import itertools

import torch

from rlcli.training.batches import BatchPlan
from rlcli.training.loss import MicroBatchLoss, micro_batch_to_device
from rlcli.training.plan import passes


@torch.no_grad()
def add_trainer_logprobs(batch: BatchPlan, loss: MicroBatchLoss, device: torch.device, *,
                         policy: torch.nn.Module, reference: torch.nn.Module | None,
                         teacher: torch.nn.Module | None = None) -> None:
    """Give the documents of ``batch`` the log-probs the loss and the distillation need from the trainer:
    ``policy``'s when the loss recomputes them or there is a teacher, ``reference``'s when there is a
    reference model, ``teacher``'s when there is a teacher (the scorers, sharded or not)."""
    scorers = {"proximal_logprobs": policy if loss.recompute or teacher is not None else None,
               "ref_logprobs": reference, "teacher_logprobs": teacher}
    scorers = {field: scorer for field, scorer in scorers.items() if scorer is not None}  # by `Rollout` field
    models = {id(scorer): scorer for scorer in scorers.values()}  # one forward for each model
    if not scorers:
        return
    micro_batches = [mb for part in batch.parts(0) for mb in part]
    numbering = batch.numbering
    scored: list[dict[str, torch.Tensor]] = []  # [L] each, on the device until the batch is scored
    for i in range(passes(micro_batches)):  # every rank the same passes (a sharded scorer gathers its weights)
        micro_batch = micro_batch_to_device(micro_batches[i] if i < len(micro_batches) else None, numbering, device)
        by_model = {key: loss.logprobs(scorer, micro_batch) for key, scorer in models.items()}  # [L] each
        scored.append({field: by_model[id(scorer)] for field, scorer in scorers.items()})
    values: dict[int, dict] = {}
    for micro_batch, fields in zip(micro_batches, _to_host(scored)):  # the stand-ins' are dropped
        per_document = {field: micro_batch.completion_values(v) for field, v in fields.items()}
        for d, doc in enumerate(micro_batch.documents):
            values[id(doc)] = {field: v[d] for field, v in per_document.items()}
    batch.fill(values)


def _to_host(scored: list[dict[str, torch.Tensor]]) -> list[dict[str, list[float]]]:
    """The same values (rounded to float32, as rollouts hold them) as host lists, moved in one transfer."""
    flat = [value for fields in scored for value in fields.values()]  # [L] each
    if not flat:
        return []
    host = torch.cat([value.to(torch.float32) for value in flat]).tolist()
    ends = list(itertools.accumulate(value.numel() for value in flat))
    pieces = iter(host[end - value.numel() : end] for value, end in zip(flat, ends))
    return [{field: next(pieces) for field in fields} for fields in scored]
