"""Advantage estimators: turn per-document rewards into per-token advantages within groups.

An estimator is one function registered in `ADVANTAGE_ESTIMATORS` under its ``advantage.estimator``
name; the config's choices and the errors that list them come from there::

    @ADVANTAGE_ESTIMATORS.register("rloo")
    def rloo(rewards: list[float], *, eps: float) -> list[float]:
        ...

It gets the rewards of one group (the documents that share a ``group_id``: finite floats, at least
two of them different) and ``eps`` (``advantage.eps``), and returns one advantage per reward, in
order. A group of one document, or of equal rewards, has no signal: it gets advantage 0 without a
call. ``none`` is the estimator that computes nothing: the documents carry their advantages.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

from rlcli.data.errors import DataError
from rlcli.data.schema import FLOAT32_MAX, FLOAT32_RANGE, Rollout
from rlcli.modules.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "apply_advantage_estimator",
    "check_in_float32",
    "computes_advantages",
    "group_advantages",
    "group_estimators",
]

GroupEstimator = Callable[..., list[float]]  # (rewards: list[float], *, eps: float) -> list[float]

ADVANTAGE_ESTIMATORS: Registry[GroupEstimator] = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("none")
def no_estimator(rewards: list[float], *, eps: float) -> list[float]:
    """``none``: every document must carry ``advantage``/``advantages``; there are none to compute."""
    raise ValueError("advantage.estimator=none computes no advantages: the documents must carry them")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: list[float], *, eps: float) -> list[float]:
    """``(r - mean) / (std + eps)`` with the population standard deviation (``ddof=0``: the group is
    the whole sample, not an estimate of a larger one); ``eps > 0``.

    Computed on the rewards divided by a power of two ``s`` (see `_scaled`): ``(u - mean(u)) /
    (std(u) + eps / s)``, whose terms are all below 4 in size (an ``eps / s`` beyond float64 is inf and
    gives 0, its limit), so any finite rewards give the advantages to float64 precision.
    """
    scale, scaled, mean = _scaled(rewards)
    centred = [u - mean for u in scaled]
    std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
    return [c / (std + eps / scale) for c in centred]


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: list[float], *, eps: float) -> list[float]:
    """``r - mean`` (Dr. GRPO drops the division by the std; ``eps`` is unused), computed as
    ``r - s·mean(u)`` (see `_scaled`); an advantage beyond the float64 range is ±inf."""
    scale, _, mean = _scaled(rewards)
    return [r - mean * scale for r in rewards]


def _scaled(rewards: list[float]) -> tuple[float, list[float], float]:
    """``(s, u, mean(u))`` with ``s`` the power of two with ``s <= max |r| < 2s`` and ``u = r / s``
    (exact, ``|u| < 2``; some reward is not 0). Scaling by a power of two is exact: where the plain
    formulas neither overflow nor underflow, the scaled ones give the same float64 values."""
    scale = math.ldexp(1.0, math.frexp(max(abs(r) for r in rewards))[1] - 1)
    scaled = [r / scale for r in rewards]
    return scale, scaled, math.fsum(scaled) / len(scaled)


def computes_advantages(estimator: str) -> bool:
    """Whether ``estimator`` computes advantages from rewards (every one but ``none``); an unknown name
    is a ``ValueError`` listing the estimators."""
    return ADVANTAGE_ESTIMATORS[estimator] is not no_estimator


def group_estimators() -> tuple[str, ...]:
    """The estimators that compute advantages from rewards in groups, in registration order."""
    return tuple(name for name in ADVANTAGE_ESTIMATORS if computes_advantages(name))


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[Hashable], estimator: str, *, eps: float
) -> list[float]:
    """One advantage per reward, by ``estimator`` (one of `group_estimators`) within the documents that
    share a group id; ``eps`` is ``advantage.eps``. A group of one document, or of equal rewards, gets 0."""
    if not computes_advantages(estimator):
        raise ValueError(f"advantage estimator {estimator!r} computes no advantages; expected one of: "
                         f"{', '.join(group_estimators())}")
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    estimate = ADVANTAGE_ESTIMATORS[estimator]
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, group_id in enumerate(group_ids):
        members[group_id].append(i)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        group = [float(rewards[i]) for i in indices]
        if min(group) != max(group):
            for i, value in zip(indices, estimate(group, eps=eps)):
                advantages[i] = value
    return advantages


def apply_advantage_estimator(rollouts: Sequence[Rollout], estimator: str, *, eps: float) -> list[Rollout]:
    """Give every rollout per-token advantages, as ``advantage.estimator`` and ``advantage.eps`` say.

    - ``none``: every rollout must already carry ``advantage``/``advantages``.
    - any other estimator: rollouts without advantages get their group's advantage (see
      ``group_advantages``) from ``reward`` on every completion token; groups are formed over the
      whole dataset and only from these rollouts. Rollouts that already carry advantages keep them
      unchanged. An advantage beyond the float32 range (dr_grpo on rewards that far apart) is a
      ``DataError`` naming the rollout.
    """
    pending = [i for i, r in enumerate(rollouts) if r.advantages is None]
    if not computes_advantages(estimator):
        if pending:
            raise DataError(
                f"{rollouts[pending[0]].source}: no 'advantage' or 'advantages' and advantage.estimator={estimator} "
                f"({len(pending)} rollouts lack one). Set advantage.estimator={' or '.join(group_estimators())} to "
                "compute them from 'reward' within each 'group_id'."
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
