"""What a training step is made of, agreed on by every rank before the first backward (SPEC §5).

`collect_step` fetches this rank's micro-batches (a fixed number, or until the whole job has N
documents), and `plan_step` sums the step totals over all of them and all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlcli.data.packing import MicroBatch, make_micro_batch
from rlcli.data.schema import Rollout
from rlcli.modules.aggregation import StepTotals
from rlcli.modules.metrics import MetricPartials
from rlcli.modules.segments import Segments
from rlcli.training import distributed


class MicroBatchSource(Protocol):
    """What `collect_step` reads: a `DocumentStream`, or a stream reader (`rlcli.stream.reader`)."""

    def next_micro_batch(self) -> MicroBatch | None:
        """The next micro-batch, or None when the data is used up."""

    def give_back(self, documents: Sequence[Rollout]) -> None:
        """Put ``documents`` back at the front, in order: they are served next."""


@dataclass
class CollectedStep:
    micro_batches: list[MicroBatch]  # this rank's
    carried_over: int = 0  # documents given back to the streams (docs_per_step exact mode)
    stats: dict[str, float] = field(default_factory=dict)  # this rank's rollout statistics (on-policy)


def _give_back_share(counts: list[int], surplus: int, rank: int) -> int:
    """How many of its last-fetched documents ``rank`` gives back: the surplus is taken from the
    highest rank down, so every rank computes the same split."""
    for r in reversed(range(len(counts))):
        take = min(counts[r], surplus)
        if r == rank:
            return take
        surplus -= take
    return 0


def collect_step(
    stream: MicroBatchSource,
    *,
    accumulate_microbatches: int,
    docs_per_step: int,
    exact: bool,
    device: torch.device | None = None,
) -> CollectedStep:
    """This rank's micro-batches of the next step (empty on every rank when all data is used).

    With ``docs_per_step = N > 0`` each rank fetches one micro-batch per round and the ranks
    stop together once the job holds N documents. A rank out of data fetches nothing while the
    others go on; when every rank is out, the step ends with what they have. In exact mode the
    surplus of the last round goes back to the front of the streams.
    """
    if docs_per_step == 0:
        batches = []
        while len(batches) < accumulate_microbatches and (batch := stream.next_micro_batch()) is not None:
            batches.append(batch)
        return CollectedStep(batches)
    batches: list[MicroBatch] = []
    total = 0
    counts: list[int] = []
    while total < docs_per_step:
        batch = stream.next_micro_batch()
        counts = distributed.gather_counts(batch.num_documents if batch else 0, device)
        if sum(counts) == 0:
            break
        if batch is not None:
            batches.append(batch)
        total += sum(counts)
    surplus = total - docs_per_step if exact and total > docs_per_step else 0
    mine = _give_back_share(counts, surplus, distributed.rank()) if surplus else 0
    if mine:
        last = batches.pop().documents
        stream.give_back(last[-mine:])
        if len(last) > mine:
            batches.append(make_micro_batch(last[:-mine]))
    return CollectedStep(batches, carried_over=surplus)


@dataclass(frozen=True)
class StepPlan:
    """The step's totals and group numbering, the same on every rank."""

    totals: StepTotals
    group_numbering: dict


def plan_step(micro_batches: list[MicroBatch], device: torch.device) -> StepPlan:
    """Step totals (D, T, P, n_d, T_g) over all micro-batches of all ranks."""
    numbering = distributed.step_group_numbering(
        [doc.group_id for batch in micro_batches for doc in batch.documents]
    )
    totals = StepTotals.zeros(len(numbering))
    for batch in micro_batches:
        totals = totals + StepTotals.of_tokens(
            batch.mask, Segments.of(batch.document_index), batch.group_index(numbering), len(numbering)
        )
    flat = distributed.all_reduce(totals.flatten().to(device), "sum")
    return StepPlan(totals=StepTotals.unflatten(flat), group_numbering=numbering)


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
