"""Step totals and per-token aggregation weights of math.md#aggregation.

The step loss is ``L = Σ_t w_t ℓ_t`` over every token of the step. The weights of a micro-batch
need only its own tokens and the step totals, so micro-batches (and ranks) can each compute their
part of ``L`` and the parts add up exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlcli.modules.bounds import FLOAT32_MAX, FLOAT32_TINY, check_value
from rlcli.modules.registry import Registry
from rlcli.modules.segments import Segments

AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry("aggregation")
# the weights 1 / (divisor·D) are float32 numbers: past these bounds they flush to 0 or to inf
DIVISOR = {"ge": FLOAT32_TINY, "le": FLOAT32_MAX}


def check_aggregation_options(aggregation: str, divisor: float | None) -> None:
    """Raise ``ValueError`` naming the invalid argument."""
    AGGREGATIONS[aggregation]  # an unknown name: the registry's error
    if aggregation == "constant":
        if divisor is None:
            raise ValueError("divisor is required for aggregation 'constant'")
        check_value("divisor", divisor, DIVISOR)
    elif divisor is not None:
        raise ValueError(f"divisor is only valid for aggregation 'constant', not {aggregation!r}")


@dataclass
class StepTotals:
    """Counts over a whole step (all micro-batches, all ranks); every field adds up.

    ``group_documents[g]`` and ``group_tokens[g]`` (``T_g``) are indexed by the step's group
    indices, so micro-batches must share one group numbering.

    Attributes:
        documents: ``[]`` ``D``, the documents of the step (not those ``correction.mode=reject`` rejected).
        tokens: ``[]`` ``T``, the labelled tokens of the step.
        group_documents: ``[G]`` the documents of each group counted in ``D``.
        group_tokens: ``[G]`` ``T_g``, the labelled tokens of each group.
    """

    documents: torch.Tensor  # [] D
    tokens: torch.Tensor  # [] T
    group_documents: torch.Tensor  # [G]
    group_tokens: torch.Tensor  # [G] T_g

    @property
    def groups(self) -> torch.Tensor:
        """P: groups with at least one document in the step."""
        return (self.group_documents > 0).sum().to(self.tokens.dtype)

    @classmethod
    def of_tokens(
        cls,
        mask: torch.Tensor,
        segments: Segments,
        group_index: torch.Tensor | None = None,
        num_groups: int = 0,
        rejected: torch.Tensor | None = None,
    ) -> StepTotals:
        """Totals of the given tokens; ``group_index`` [N] in ``[0, num_groups)``; ``rejected`` [S] bool: the
        documents ``correction.mode=reject`` rejected, which count in neither ``D`` nor ``P``."""
        mask = mask.detach()
        dtype = torch.float64
        counted = torch.ones(segments.count, dtype=dtype, device=mask.device)  # [S] 1 for a document in D
        if rejected is not None:
            counted = counted.masked_fill(rejected.to(mask.device), 0.0)
        group_documents = torch.zeros(num_groups, dtype=dtype, device=mask.device)
        group_tokens = torch.zeros(num_groups, dtype=dtype, device=mask.device)
        if group_index is not None and num_groups > 0:
            group_tokens.index_add_(0, group_index, mask.to(dtype))
            # [S] the group of each document (all its tokens share one group)
            doc_groups = group_index.new_zeros(segments.count).scatter_(0, segments.inverse, group_index)
            group_documents.index_add_(0, doc_groups, counted)
        return cls(
            documents=counted.sum(),
            tokens=mask.to(dtype).sum(),
            group_documents=group_documents,
            group_tokens=group_tokens,
        )

    @classmethod
    def zeros(cls, num_groups: int = 0) -> StepTotals:
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.float64)

        return cls(zeros(), zeros(), zeros(num_groups), zeros(num_groups))

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(
            documents=self.documents + other.documents,
            tokens=self.tokens + other.tokens,
            group_documents=self.group_documents + other.group_documents,
            group_tokens=self.group_tokens + other.group_tokens,
        )

    def flatten(self) -> torch.Tensor:
        """``[2 + 2G]`` float64, for one all-reduce (sum) of every field."""
        return torch.cat(
            [self.documents[None], self.tokens[None], self.group_documents, self.group_tokens]
        )

    @classmethod
    def unflatten(cls, flat: torch.Tensor) -> StepTotals:
        num_groups = (flat.numel() - 2) // 2
        return cls(
            documents=flat[0],
            tokens=flat[1],
            group_documents=flat[2 : 2 + num_groups],
            group_tokens=flat[2 + num_groups :],
        )


def token_weights(
    mask: torch.Tensor,
    segments: Segments,
    totals: StepTotals,
    *,
    aggregation: str,
    divisor: float | None = None,
    group_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w_t`` of math.md#aggregation for the given tokens ([N], same dtype as ``mask``, 0 where mask is 0).

    Denominators are clamped to at least 1: they only matter where ``m_t = 1``, and there they are
    >= 1 already, so a step with nothing to train on gets weights 0, never NaN.
    """
    return AGGREGATIONS[aggregation](mask, segments, totals, divisor=divisor, group_index=group_index)


@AGGREGATIONS.register("token_mean")
def _token_mean(mask, segments, totals, *, divisor, group_index) -> torch.Tensor:
    """``1 / T``"""
    return mask / totals.tokens.to(mask.dtype).clamp(min=1)


@AGGREGATIONS.register("sample_mean")
def _sample_mean(mask, segments, totals, *, divisor, group_index) -> torch.Tensor:
    """``1 / (n_d · D)``"""
    doc_tokens = segments.sum(mask.detach()).clamp(min=1)  # [S] n_d
    return mask / (segments.broadcast(doc_tokens) * totals.documents.to(mask.dtype).clamp(min=1))


@AGGREGATIONS.register("prompt_mean")
def _prompt_mean(mask, segments, totals, *, divisor, group_index) -> torch.Tensor:
    """``1 / (T_g · P)``"""
    if group_index is None:
        raise ValueError("aggregation 'prompt_mean' needs group_index (the group of each token)")
    group_tokens = totals.group_tokens.to(mask.dtype)[group_index].clamp(min=1)  # [N] T_g
    return mask / (group_tokens * totals.groups.to(mask.dtype).clamp(min=1))


@AGGREGATIONS.register("constant")
def _constant(mask, segments, totals, *, divisor, group_index) -> torch.Tensor:
    """``1 / (divisor · D)``"""
    return mask / (divisor * totals.documents.to(mask.dtype).clamp(min=1))
