"""Per-document reductions over flat token tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """The documents of a flat token tensor, numbered 0..S-1 in order of their ids.

    ``inverse[t]`` is the segment of token t; ``count`` the number of segments S. `of` finds them from
    any ids (``unique``: it reads the ids on the host); a caller that knows them builds one directly,
    e.g. ``Segments(inverse=document_index, count=S)`` for ids that are 0..S-1 already.
    """

    inverse: torch.Tensor  # [N] long
    count: int

    @classmethod
    def of(cls, index: torch.Tensor) -> Segments:
        ids, inverse = torch.unique(index, return_inverse=True)
        return cls(inverse=inverse, count=int(ids.numel()))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[N] -> [S]``: sum of each segment's values (differentiable)."""
        return values.new_zeros(self.count).index_add(0, self.inverse, values)

    def broadcast(self, per_segment: torch.Tensor) -> torch.Tensor:
        """``[S] -> [N]``: each token gets its segment's value."""
        return per_segment[self.inverse]
