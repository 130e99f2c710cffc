"""Several optimizer updates per collected batch: ``trainer.minibatches`` × ``trainer.batch_epochs``.

A batch (what a step source yields: generated rollouts, ``docs_per_step`` documents or a number of
micro-batches) is split into ``minibatches`` parts of whole groups, so that a group never spans two
updates and ``prompt_mean`` stays exact on every rank: groups are numbered the same on every rank, a
seeded permutation of them (new for every epoch) is cut into ``minibatches`` runs of nearly equal
size, and each rank packs its documents of a run into micro-batches. One part is one update. With
one mini-batch the batch's own micro-batches are the update, in every epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import torch

from rlcli.data.document_stream import pack_documents
from rlcli.data.packing import MicroBatch, make_micro_batch
from rlcli.data.schema import Rollout
from rlcli.errors import UserError
from rlcli.training import distributed


@dataclass
class UpdatePlan:
    """What one optimizer update trains: this rank's micro-batches, and what the metrics row reports of
    its batch."""

    micro_batches: list[MicroBatch]
    stats: dict[str, float] = field(default_factory=dict)  # this rank's rollout statistics
    carried_over: int | None = None  # documents given back by the batch's collection (docs_per_step exact mode)


def _epoch_seed(seed: int, batch: int, epoch: int) -> int:
    digest = hashlib.sha256(f"rlcli-minibatches/{seed}/{batch}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def minibatch_of_groups(num_groups: int, minibatches: int, seed: int) -> torch.Tensor:
    """``[G]`` long: the mini-batch of each group, a seeded permutation cut into ``minibatches`` runs
    whose sizes differ by at most one."""
    order = torch.randperm(num_groups, generator=torch.Generator().manual_seed(seed))  # [G] groups in run order
    runs = torch.arange(num_groups) * minibatches // num_groups  # [G] run of each position
    return torch.empty_like(order).scatter_(0, order, runs)


class BatchPlan:
    """The updates of one batch, in order: ``epochs`` passes over ``minibatches`` parts of it."""

    def __init__(self, micro_batches: list[MicroBatch], *, minibatches: int, epochs: int, seed: int, batch: int,
                 max_tokens: int, stats: dict | None = None, carried_over: int | None = None, done: int = 0) -> None:
        self.micro_batches = micro_batches
        self.minibatches = minibatches
        self.epochs = epochs
        self.seed = seed
        self.batch = batch
        self.max_tokens = max_tokens
        self.stats = stats or {}
        self.carried_over = carried_over
        self.done = done  # updates already handed out
        self.runs: dict[int, list[int]] = {}  # epoch -> the mini-batch of each group
        documents = [doc for micro_batch in micro_batches for doc in micro_batch.documents]
        self.documents = documents
        self.numbering = distributed.step_group_numbering([doc.group_id for doc in documents])
        if minibatches > 1 and minibatches > len(self.numbering):
            raise UserError(
                f"trainer.minibatches={minibatches} is more than the {len(self.numbering)} groups of batch {batch}; "
                "a group is never split between updates: lower trainer.minibatches or collect larger batches"
            )

    @property
    def remaining(self) -> int:
        return self.minibatches * self.epochs - self.done

    def parts(self, epoch: int) -> list[list[MicroBatch]]:
        """This rank's micro-batches of each update of ``epoch``, in order (possibly none in one)."""
        if self.minibatches == 1:
            return [self.micro_batches]
        if epoch not in self.runs:  # the mini-batch of each group, drawn once per epoch
            self.runs[epoch] = minibatch_of_groups(len(self.numbering), self.minibatches,
                                                   _epoch_seed(self.seed, self.batch, epoch)).tolist()
        runs = self.runs[epoch]
        return [list(pack_documents([doc for doc in self.documents if runs[self.numbering[doc.group_id]] == part],
                                    self.max_tokens)) for part in range(self.minibatches)]

    def next_update(self) -> UpdatePlan:
        """The next update's micro-batches (on this rank: possibly none)."""
        epoch, part = divmod(self.done, self.minibatches)
        self.done += 1
        # reported once, with the batch's first update
        carried = self.carried_over if self.done == 1 or self.carried_over is None else 0
        return UpdatePlan(self.parts(epoch)[part], self.stats, carried)

    def fill(self, values: dict[int, dict[str, tuple[float, ...]]]) -> None:
        """Give documents more per-token values: ``values[id(doc)]`` holds ``{field: values}`` for the
        documents of this plan (as they appear in its micro-batches or `parts`)."""
        filled = {id(doc): dataclasses.replace(doc, **values[id(doc)]) for doc in self.documents}
        self.documents = [filled[id(doc)] for doc in self.documents]
        self.micro_batches = [make_micro_batch([filled[id(doc)] for doc in mb.documents]) for mb in self.micro_batches]

    def state_dict(self) -> dict:
        """What a checkpoint needs to hand out the rest of this batch: its documents (with the trainer's
        log-probs), in their micro-batches, as plain values."""
        return {
            "micro_batches": [[_document_state(doc) for doc in mb.documents] for mb in self.micro_batches],
            "batch": self.batch, "done": self.done, "stats": dict(self.stats), "carried_over": self.carried_over,
        }

    @classmethod
    def from_state(cls, state: dict, *, minibatches: int, epochs: int, seed: int, max_tokens: int) -> BatchPlan:
        micro_batches = [make_micro_batch([_document(doc) for doc in docs]) for docs in state["micro_batches"]]
        return cls(micro_batches, minibatches=minibatches, epochs=epochs, seed=seed, batch=state["batch"],
                   max_tokens=max_tokens, stats=state["stats"], carried_over=state["carried_over"],
                   done=state["done"])


def _document_state(doc: Rollout) -> dict:
    return {name: list(value) if isinstance(value, tuple) else value for name, value in vars(doc).items()}


def _document(state: dict) -> Rollout:
    return Rollout(**{name: tuple(value) if isinstance(value, list) else value for name, value in state.items()})
