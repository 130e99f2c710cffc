"""Every collective of the training step, in one place. All are no-ops in a single process.

Gradient reduction policy: data-parallel strategies (DDP, FSDP) average gradients over ranks,
while each rank's loss is its exact share of the step loss L (math.md#aggregation). The loss is therefore
multiplied by the world size before backward (`gradient_scale`), so that after the averaging the
gradient in the parameters is exactly ∇L.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def gradient_scale() -> float:
    """Factor on each rank's loss that turns the strategy's gradient average into a sum."""
    return float(world_size())


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` with ``op`` in {"sum", "max", "min"}; returns it."""
    if world_size() > 1:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(tensor, op=reduce_op)
    return tensor


def gather_counts(count: int, device: torch.device | None = None) -> list[int]:
    """``[count of rank 0, count of rank 1, ...]`` on every rank (one all-reduce)."""
    counts = torch.zeros(world_size(), dtype=torch.int64, device=device)
    counts[rank()] = count
    return all_reduce(counts, "sum").tolist()


def all_gather_objects(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]``."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def step_group_numbering(local_groups: Sequence[Hashable]) -> dict[Hashable, int]:
    """The same ``group_id -> index`` map on every rank (`number_groups` of every rank's groups)."""
    return number_groups(all_gather_objects(list(dict.fromkeys(local_groups))))


def number_groups(ranks_groups: Iterable[Iterable[Hashable]]) -> dict[Hashable, int]:
    """``group_id -> index`` of the groups of every rank (rank 0's first), numbered in order of first
    appearance."""
    numbering: dict[Hashable, int] = {}
    for groups in ranks_groups:
        for group in groups:
            numbering.setdefault(group, len(numbering))
    return numbering


def clip_grad_norm(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradient of ``module`` to ``max_norm`` (0: no clipping); returns the norm before, ``[]`` on the
    device (clipping scales by a clamped factor on the device: nothing waits for it).

    The norm is over the whole model on every strategy: an FSDP1 root unit (``strategy=fsdp``) computes
    it over its shards, and DTensor (FSDP2) gradients reduce their norm over the shards.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    limit = max_norm if max_norm > 0 else math.inf
    if isinstance(module, FullyShardedDataParallel):
        norm = module.clip_grad_norm_(limit)
    else:
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), limit)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def all_finite(tensors: Iterable[torch.Tensor], device: torch.device) -> bool:
    """Whether every element of ``tensors`` is finite on every rank (one all-reduce).

    Each rank checks what it holds (a DTensor's local shard under FSDP2, FSDP1's flat shards): one
    fused max-abs over all the tensors (an infinity norm is the largest value itself, so it never
    overflows) and a look at that one number.
    """
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    local = [t.detach() for t in local if t.numel()]  # an empty shard has no infinity norm
    finite = torch.ones((), dtype=torch.int64, device=device)
    if local:
        finite = torch.nn.utils.get_total_norm(local, math.inf).isfinite().to(device, torch.int64)
    return bool(all_reduce(finite, "min"))
