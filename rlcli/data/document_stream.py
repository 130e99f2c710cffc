"""One rank's documents in training order, packed into micro-batches on demand.

Every rank computes the same seeded order of the whole dataset for each epoch and keeps every
``world_size``-th document from its ``rank`` on, so ranks never share a document. Documents handed
out in a micro-batch can be given back (``give_back``) and come out first next time, which is how
``docs_per_step`` exact mode carries surplus documents over without losing or repeating any.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch

from rlcli.data.packing import MicroBatch, fill_micro_batch
from rlcli.data.schema import Rollout


def pack_documents(rollouts: Iterable[Rollout], max_tokens: int) -> Iterator[MicroBatch]:
    """Whole documents, in order, in micro-batches of at most ``max_tokens`` tokens (`fill_micro_batch`)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    stream = DocumentStream(list(rollouts), max_tokens=max_tokens, shuffle=False, seed=0, epochs=1)
    return iter(stream.next_micro_batch, None)


class DocumentStream:
    def __init__(
        self,
        rollouts: Sequence[Rollout],
        *,
        max_tokens: int,
        shuffle: bool,
        seed: int,
        epochs: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.rollouts = rollouts
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.offset = 0  # position in this rank's share of the current epoch
        self.carried: deque[Rollout] = deque()  # given back, served before the epoch order
        self._share = self._epoch_share(0)

    def _epoch_share(self, epoch: int) -> list[int]:
        """This rank's document indices for ``epoch``, in training order."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.rollouts), generator=generator).tolist()
        else:
            order = list(range(len(self.rollouts)))
        return order[self.rank :: self.world_size]

    def next_document(self, first: bool) -> Rollout | None:
        """The next document in training order (given-back ones first), or None when the epochs are done
        (``first`` changes nothing: there is nothing to wait for)."""
        if self.carried:
            return self.carried.popleft()
        while self.offset >= len(self._share):
            if self.epoch + 1 >= self.epochs:
                return None
            self.epoch += 1
            self.offset = 0
            self._share = self._epoch_share(self.epoch)
        self.offset += 1
        return self.rollouts[self._share[self.offset - 1]]

    def next_micro_batch(self) -> MicroBatch | None:
        """The next documents that fit in ``max_tokens`` (`fill_micro_batch`), or ``None`` when none is left."""
        return fill_micro_batch(self, self.max_tokens)

    def give_back(self, documents: Sequence[Rollout]) -> None:
        """Put ``documents`` back at the front, in order: they are served next."""
        self.carried.extendleft(reversed(documents))

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "carried": [doc.index for doc in self.carried],
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._share = self._epoch_share(self.epoch)
        by_index = {doc.index: doc for doc in self.rollouts}
        self.carried = deque(by_index[i] for i in state["carried"])
