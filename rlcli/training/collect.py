"""Collecting a batch: this rank's micro-batches of what the next update (or updates) will train.

`collect_batch` fetches a fixed number of micro-batches, or, with ``docs_per_step``, rounds of one
micro-batch per rank until the whole job holds N documents (math.md#step-size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlcli.data.packing import MicroBatch, make_micro_batch
from rlcli.data.schema import Rollout
from rlcli.training import distributed


class MicroBatchSource(Protocol):
    """What `collect_batch` reads: a `DocumentStream`, or a stream reader (`rlcli.stream.reader`)."""

    def next_micro_batch(self) -> MicroBatch | None:
        """The next micro-batch, or None when the data is used up."""

    def give_back(self, documents: Sequence[Rollout]) -> None:
        """Put ``documents`` back at the front, in order: they are served next."""


@dataclass
class CollectedBatch:
    """What a step source yields: this rank's micro-batches of one batch."""

    micro_batches: list[MicroBatch]  # this rank's
    carried_over: int | None = None  # documents given back to the streams (docs_per_step exact mode; else None)
    stats: dict[str, float] = field(default_factory=dict)  # this rank's rollout statistics (on-policy)
    completions: list[dict] = field(default_factory=list)  # this rank's lines of completions.jsonl


def _give_back_share(counts: list[int], surplus: int, rank: int) -> int:
    """How many of its last-fetched documents ``rank`` gives back: the surplus is taken from the
    highest rank down, so every rank computes the same split."""
    for r in reversed(range(len(counts))):
        take = min(counts[r], surplus)
        if r == rank:
            return take
        surplus -= take
    return 0


def collect_batch(
    stream: MicroBatchSource,
    *,
    accumulate_microbatches: int,
    docs_per_step: int,
    exact: bool,
    device: torch.device | None = None,
) -> CollectedBatch:
    """This rank's micro-batches of the next batch (empty on every rank when all data is used).

    With ``docs_per_step = N > 0`` each rank fetches one micro-batch per round and the ranks
    stop together once the job holds N documents. A rank out of data fetches nothing while the
    others go on; when every rank is out, the batch ends with what they have. In exact mode the
    surplus of the last round goes back to the front of the streams.
    """
    if docs_per_step == 0:
        batches = []
        while len(batches) < accumulate_microbatches and (batch := stream.next_micro_batch()) is not None:
            batches.append(batch)
        return CollectedBatch(batches, carried_over=0 if exact else None)
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
    return CollectedBatch(batches, carried_over=surplus if exact else None)
