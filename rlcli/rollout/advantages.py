"""Advantage estimators: turn per-document rewards into per-token advantages within groups."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence

from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout

__all__ = ["ESTIMATORS", "GROUP_ESTIMATORS", "apply_advantage_estimator", "group_advantages"]

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
    so does a group whose rewards are all equal. Computed in float64.
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
        values = [float(rewards[i]) for i in indices]
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
        for i, value in zip(indices, values):
            centred = value - mean
            advantages[i] = centred / (std + eps) if estimator == "grpo" else centred
    return advantages


def apply_advantage_estimator(rollouts: Sequence[Rollout], estimator: str, *, eps: float) -> list[Rollout]:
    """Give every rollout per-token advantages, as ``advantage.estimator`` and ``advantage.eps`` say.

    - ``none``: every rollout must already carry ``advantage``/``advantages``.
    - ``grpo``/``dr_grpo``: rollouts without advantages get their group's advantage (see
      ``group_advantages``, which takes ``eps``) from ``reward`` on every completion token; groups
      are formed over the whole dataset and only from these rollouts. Rollouts that already carry
      advantages keep them unchanged.
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
    for i, value in zip(pending, group_advantages(rewards, groups, estimator, eps=eps)):
        result[i] = result[i].with_advantages((value,) * len(result[i].completion_ids))
    return result
