"""Advantage estimators: turn per-document rewards into per-token advantages within groups."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence

from rlcli.data.errors import DataError
from rlcli.data.schema import FLOAT32_MAX, FLOAT32_RANGE, Rollout

__all__ = ["ESTIMATORS", "GROUP_ESTIMATORS", "apply_advantage_estimator", "check_in_float32", "group_advantages"]

ESTIMATORS = ("none", "grpo", "dr_grpo")
GROUP_ESTIMATORS = tuple(name for name in ESTIMATORS if name != "none")  # computed from rewards in groups


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[Hashable], estimator: str, *, eps: float
) -> list[float]:
    """One advantage per reward, normalised within the documents that share a group id.

    - ``grpo``: ``(r - mean_g) / (std_g + eps)`` with the population standard deviation
      (``ddof=0``: the group is the whole sample, not an estimate of a larger one); ``eps > 0``
      is ``advantage.eps``.
    - ``dr_grpo``: ``r - mean_g`` (Dr. GRPO drops the division by the std).

    A group of one document has no baseline to compare with and gets advantage 0 in both;
    so does a group whose rewards are all equal. Computed in float64 on the rewards scaled by a
    power of two (see `_group`), so that any finite rewards give the grpo advantages to float64
    precision; a dr_grpo advantage beyond the float64 range is ±inf.
    """
    if estimator not in GROUP_ESTIMATORS:
        expected = ", ".join(GROUP_ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {estimator!r} (expected one of: {expected})")
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, group_id in enumerate(group_ids):
        members[group_id].append(i)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        for i, value in zip(indices, _group([float(rewards[i]) for i in indices], estimator, eps)):
            advantages[i] = value
    return advantages


def _group(rewards: list[float], estimator: str, eps: float) -> list[float]:
    """One group's advantages, for any finite rewards.

    With ``s`` the power of two with ``s <= max |r| < 2s`` and ``u = r / s`` (exact, ``|u| < 2``):
    ``mean = s·mean(u)`` and ``std = s·std(u)``, so grpo's ``(r - mean) / (std + eps)`` is
    ``(u - mean(u)) / (std(u) + eps / s)``, whose terms are all below 4 in size (an ``eps / s``
    beyond float64 is inf and gives 0, its limit), and dr_grpo's ``r - mean`` is ``r - s·mean(u)``.
    Scaling by a power of two is exact: where the plain formulas neither overflow nor underflow,
    these give the same float64 values.
    """
    if min(rewards) == max(rewards):
        return [0.0] * len(rewards)
    scale = math.ldexp(1.0, math.frexp(max(abs(r) for r in rewards))[1] - 1)
    scaled = [r / scale for r in rewards]
    mean = math.fsum(scaled) / len(scaled)
    if estimator == "dr_grpo":
        return [r - mean * scale for r in rewards]
    centred = [u - mean for u in scaled]
    std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
    return [c / (std + eps / scale) for c in centred]


def apply_advantage_estimator(rollouts: Sequence[Rollout], estimator: str, *, eps: float) -> list[Rollout]:
    """Give every rollout per-token advantages, as ``advantage.estimator`` and ``advantage.eps`` say.

    - ``none``: every rollout must already carry ``advantage``/``advantages``.
    - ``grpo``/``dr_grpo``: rollouts without advantages get their group's advantage (see
      ``group_advantages``, which takes ``eps``) from ``reward`` on every completion token; groups
      are formed over the whole dataset and only from these rollouts. Rollouts that already carry
      advantages keep them unchanged. An advantage beyond the float32 range (dr_grpo on rewards that
      far apart) is a ``DataError`` naming the rollout.
    """
    if estimator not in ESTIMATORS:
        expected = ", ".join(ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {estimator!r} (expected one of: {expected})")
    pending = [i for i, r in enumerate(rollouts) if r.advantages is None]
    if estimator == "none":
        if pending:
            raise DataError(
                f"{rollouts[pending[0]].source}: no 'advantage' or 'advantages' and advantage.estimator=none "
                f"({len(pending)} rollouts lack one). Set advantage.estimator=grpo (or dr_grpo) to compute "
                "them from 'reward' within each 'group_id'."
            )
        return list(rollouts)
    for i in pending:
        for field in ("reward", "group_id"):
            if getattr(rollouts[i], field) is None:
                raise DataError(
                    f"{rollouts[i].source}: advantage.estimator={estimator} needs '{field}' on a rollout "
                    "without 'advantage'/'advantages'"
                )
    rewards = [rollouts[i].reward for i in pending]
    groups = [rollouts[i].group_id for i in pending]
    result = list(rollouts)
    advantages = group_advantages(rewards, groups, estimator, eps=eps)
    check_in_float32(advantages, [rollouts[i].source for i in pending], estimator)
    for i, value in zip(pending, advantages):
        result[i] = result[i].with_advantages((value,) * len(result[i].completion_ids))
    return result


def check_in_float32(advantages: Sequence[float], names: Sequence[str], estimator: str) -> None:
    """A ``DataError`` naming the first of ``names`` whose advantage is beyond the float32 range that
    training computes in (grpo's never is; dr_grpo's ``r - mean`` can be)."""
    for name, value in zip(names, advantages):
        if abs(value) > FLOAT32_MAX:
            raise DataError(
                f"{name}: field 'reward': advantage.estimator={estimator} makes it the advantage {value!r} (reward "
                f"minus its group's mean), {FLOAT32_RANGE}. Scale the rewards down, or use advantage.estimator=grpo "
                "(normalised by the group's std)."
            )
