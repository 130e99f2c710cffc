"""Planning an update: what every rank agrees on before its first backward (math.md#step-size), and the
reductions of what the update reports.

`plan_update` sums the update's totals over all its micro-batches of all ranks and numbers its groups
the same on every rank; `reduce_partials` and `mean_over_ranks` combine the ranks' metrics once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcli.data.packing import MicroBatch
from rlcli.modules.aggregation import StepTotals
from rlcli.modules.metrics import MetricPartials
from rlcli.modules.segments import Segments
from rlcli.training import distributed


@dataclass(frozen=True)
class UpdateTotals:
    """The update's totals and group numbering, the same on every rank."""

    totals: StepTotals
    group_numbering: dict


def passes(micro_batches: list[MicroBatch], device: torch.device) -> int:
    """The most micro-batches any rank has: the forward passes every rank makes (stand-ins past its own),
    so that every rank runs the same collectives."""
    return int(distributed.all_reduce(torch.tensor(len(micro_batches), device=device), "max"))


def plan_update(micro_batches: list[MicroBatch], device: torch.device) -> UpdateTotals:
    """The update's totals (D, T, P, n_d, T_g) over all micro-batches of all ranks (a document
    ``correction.mode=reject`` rejected in none)."""
    numbering = distributed.step_group_numbering(
        [doc.group_id for batch in micro_batches for doc in batch.documents]
    )
    totals = StepTotals.zeros(len(numbering))
    for batch in micro_batches:
        rejected = torch.tensor([doc.rejected for doc in batch.documents], dtype=torch.bool)  # [S]
        totals = totals + StepTotals.of_tokens(
            batch.mask, Segments.of(batch.document_index), batch.group_index(numbering), len(numbering), rejected
        )
    flat = distributed.all_reduce(totals.flatten().to(device), "sum")
    return UpdateTotals(totals=StepTotals.unflatten(flat), group_numbering=numbering)


def reduce_partials(partials: MetricPartials, device: torch.device) -> MetricPartials:
    """Combine every rank's metric partials (sums add, maxima and minima reduce)."""
    reduced = MetricPartials()
    for name, op in (("means", "sum"), ("sums", "sum"), ("maxima", "max"), ("minima", "min")):
        values = getattr(partials, name)
        if values:
            keys = sorted(values)
            flat = distributed.all_reduce(torch.stack([values[k] for k in keys]).to(device), op)
            setattr(reduced, name, dict(zip(keys, flat)))
    return reduced


def mean_over_ranks(stats: dict[str, float], device: torch.device) -> dict[str, float]:
    """The mean of each statistic over ranks (every rank holds the same number of documents)."""
    if not stats:
        return {}
    keys = sorted(stats)
    values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
    return dict(zip(keys, (distributed.all_reduce(values, "sum") / distributed.world_size()).tolist()))
