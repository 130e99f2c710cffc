"""Planning an update on the host, and bringing what it reports back from the device once.

`plan_update` works out what every rank agrees on before its first backward (math.md#step-size) from
the documents themselves, which the packer built on the host: the update's totals (D, T, P, n_d, T_g),
its group numbering, the forward passes every rank makes and the batch's statistics, in one exchange
between ranks (none in a single process) and without reading a tensor back from the device.
`update_values_to_host` reduces the update's loss and metric partials over ranks and moves them, with
the gradient norm, to the host in one transfer: the only place an update waits for the device besides
the check of the updated weights (`rlcli.training.guard`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlcli.data.packing import MicroBatch
from rlcli.modules.aggregation import StepTotals
from rlcli.modules.metrics import MetricPartials, metric_values, without_empty_extremes
from rlcli.training import distributed


@dataclass(frozen=True)
class UpdateTotals:
    """The update's totals and group numbering, the same on every rank.

    Attributes:
        totals: the `StepTotals`, on the device.
        group_numbering: ``group_id -> index`` of the update's groups, rank 0's first.
        documents: ``D`` on the host.
        tokens: ``T`` on the host.
        passes: the most micro-batches any rank has: the forward passes every rank makes (stand-ins
            past its own), so that every rank runs the same collectives.
        stats: the mean over ranks of each rollout statistic of the batch.
    """

    totals: StepTotals
    group_numbering: dict
    documents: int
    tokens: int
    passes: int
    stats: dict[str, float] = field(default_factory=dict)


def passes(micro_batches: list[MicroBatch]) -> int:
    """The most micro-batches any rank has (one exchange between ranks; none in a single process)."""
    if distributed.world_size() == 1:
        return len(micro_batches)
    return max(distributed.all_gather_objects(len(micro_batches)))


def plan_update(micro_batches: list[MicroBatch], device: torch.device, stats: dict[str, float] | None = None
                ) -> UpdateTotals:
    """The update's `UpdateTotals` over all micro-batches of all ranks (a document ``correction.mode=reject``
    rejected counts in neither D nor P), from the documents: one exchange of host values between ranks."""
    groups: dict = {}  # group_id -> [documents counted in D, labelled tokens], in order of first appearance
    for doc in (doc for batch in micro_batches for doc in batch.documents):
        counts = groups.setdefault(doc.group_id, [0, 0])
        counts[0] += not doc.rejected
        counts[1] += doc.num_labelled
    ranks = distributed.all_gather_objects({"groups": groups, "passes": len(micro_batches), "stats": stats or {}})
    numbering = distributed.number_groups(rank["groups"] for rank in ranks)
    group_counts = [[0, 0] for _ in numbering]  # [documents counted in D, labelled tokens] of each group
    for rank in ranks:
        for group, (documents, tokens) in rank["groups"].items():
            group_counts[numbering[group]][0] += documents
            group_counts[numbering[group]][1] += tokens
    documents = sum(c[0] for c in group_counts)
    tokens = sum(c[1] for c in group_counts)
    flat = [documents, tokens, *(c[0] for c in group_counts), *(c[1] for c in group_counts)]  # [2 + 2G]
    totals = StepTotals.unflatten(to_device(torch.tensor(flat, dtype=torch.float64), device))
    mean_stats = {k: sum(rank["stats"][k] for rank in ranks) / len(ranks) for k in sorted(stats or {})}
    return UpdateTotals(totals=totals, group_numbering=numbering, documents=documents, tokens=tokens,
                        passes=max(rank["passes"] for rank in ranks), stats=mean_stats)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for it: a copy to a GPU goes from pinned memory, queued
    behind the work already there (a plain copy would wait for that work to finish)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def update_values_to_host(loss: torch.Tensor, grad_norm: torch.Tensor, partials: MetricPartials,
                          totals: StepTotals) -> tuple[float, float, dict[str, float]]:
    """The update's loss (summed over ranks), gradient norm and metrics (`metric_values` of the partials
    combined over ranks: sums add, maxima and minima reduce) on the host, in one transfer."""
    reduced = MetricPartials()
    for name, op in (("means", "sum"), ("sums", "sum"), ("maxima", "max"), ("minima", "min")):
        values = getattr(partials, name)
        if values:
            keys = sorted(values)
            flat = distributed.all_reduce(torch.stack([values[k] for k in keys]), op)
            setattr(reduced, name, dict(zip(keys, flat)))
    metrics = metric_values(reduced, totals)
    values = torch.stack([distributed.all_reduce(loss, "sum"), grad_norm.to(torch.float64), *metrics.values()])
    loss_value, norm_value, *metric_list = values.tolist()
    return loss_value, norm_value, without_empty_extremes(dict(zip(metrics, metric_list)), reduced)
