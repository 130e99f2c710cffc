"""Advantage estimators: turn per-document rewards into per-token advantages within groups.

An estimator is one function registered in `ADVANTAGE_ESTIMATORS` under its ``advantage.estimator``
name; the config's choices and the errors that list them come from there::

    @ADVANTAGE_ESTIMATORS.register("spread")
    def spread(rewards: list[float]) -> list[float]:
        return [r - min(rewards) for r in rewards]

It gets the rewards of one group (the documents that share a ``group_id``: one or more finite
floats) and returns one advantage per reward, in order. It also gets those of these keywords that
it declares: ``eps`` (``advantage.eps``), ``k`` (``advantage.k``) and ``lengths`` (each document's
number of labelled tokens). A ``ValueError`` it raises is a `DataError` naming the group. A group
of one document, or of equal rewards, has no signal: the built-in estimators give it 0.
``none`` is the estimator that computes nothing: the documents carry their advantages.

An estimator may also normalise over the whole batch (all the groups of one call, and of every
process where the call site gathers them): `batch_stage` gives it a function of the batch's group
advantages (and ``rewards``, ``lengths`` and ``eps`` where it declares them) that returns the map
from a document's group advantage to its advantage; ``reinforce_pp_baseline`` and ``grpo_batch_std``
are built so (math.md#batch-level-estimators).
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from fractions import Fraction

from rlcli.data.errors import DataError
from rlcli.data.schema import FLOAT32_MAX, FLOAT32_RANGE, Rollout
from rlcli.modules.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "apply_advantage_estimator",
    "batch_stage",
    "check_in_float32",
    "computes_advantages",
    "estimator_keywords",
    "group_advantages",
    "group_estimators",
]

GroupEstimator = Callable[..., list[float]]  # (rewards: list[float], *, [eps], [k], [lengths]) -> list[float]
# (group advantages of the whole batch, *, [rewards], [lengths], [eps]) -> group advantage -> advantage
BatchStage = Callable[..., Callable[[float], float]]
Gather = Callable[[object], list]  # one process's object -> every process's, in rank order

ADVANTAGE_ESTIMATORS: Registry[GroupEstimator] = Registry("advantage estimator")

KEYWORDS = ("eps", "k", "lengths")  # what an estimator may declare, beside the rewards


def batch_stage(stage: BatchStage) -> Callable[[GroupEstimator], GroupEstimator]:
    """Decorator (under ``register``): the estimator's advantages go through ``stage`` over the batch."""

    def mark(estimator: GroupEstimator) -> GroupEstimator:
        estimator.batch_stage = stage
        return estimator

    return mark


def whiten_over_tokens(parts: list[float], *, lengths: list[int], eps: float) -> Callable[[float], float]:
    """``(a - mean) / (std + eps)`` with the mean and the population std of the batch's group advantages
    ``a`` over its labelled tokens (a document's counts ``|y|`` times); 0 in a batch with none."""
    if sum(lengths) == 0:
        return lambda a: 0.0
    scale, mean, std = _batch_moments(parts, lengths)
    return lambda a: (a / scale - mean) / (std + eps / scale)


def by_reward_std(parts: list[float], *, rewards: list[float], eps: float) -> Callable[[float], float]:
    """``a / (std + eps)`` with the population std of the batch's rewards (one per document)."""
    scale, _, std = _batch_moments(rewards, [1] * len(rewards))
    return lambda a: a / scale / (std + eps / scale)


def _batch_moments(values: list[float], weights: list[int]) -> tuple[float, float, float]:
    """``(s, mean, std)``: the ``weights``-weighted mean and population std of ``values / s``, ``s`` the power
    of two with ``s <= max |v| < 2s`` (1 when all are 0 or none weighs); exact sums (`math.fsum`)."""
    if not all(math.isfinite(v) for v in values):
        raise ValueError("an advantage beyond the float64 range: scale the rewards down")
    total = sum(weights)
    peak = max((abs(v) for v, w in zip(values, weights) if w), default=0.0)
    if total == 0 or peak == 0:
        return 1.0, 0.0, 0.0
    scale = math.ldexp(1.0, math.frexp(peak)[1] - 1)
    scaled = [v / scale for v in values]
    mean = math.fsum(w * u for w, u in zip(weights, scaled)) / total
    return scale, mean, math.sqrt(math.fsum(w * (u - mean) ** 2 for w, u in zip(weights, scaled)) / total)


@ADVANTAGE_ESTIMATORS.register("none")
def no_estimator(rewards: list[float]) -> list[float]:
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
    if _no_signal(rewards):
        return [0.0] * len(rewards)
    scale, scaled, mean = _scaled(rewards)
    centred = [u - mean for u in scaled]
    std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
    return [c / (std + eps / scale) for c in centred]


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: list[float]) -> list[float]:
    """``r - mean`` (Dr. GRPO drops the division by the std), computed as ``r - s·mean(u)`` (see
    `_scaled`); an advantage beyond the float64 range is ±inf."""
    if _no_signal(rewards):
        return [0.0] * len(rewards)
    scale, _, mean = _scaled(rewards)
    return [r - mean * scale for r in rewards]


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: list[float]) -> list[float]:
    """``r_i - (sum of the others) / (G - 1)``, the leave-one-out baseline, computed as
    ``s·(u_i - (sum(u) - u_i) / (G - 1))`` (see `_scaled`); an advantage beyond float64 is ±inf."""
    if _no_signal(rewards):
        return [0.0] * len(rewards)
    scale, scaled, _ = _scaled(rewards)
    total, others = math.fsum(scaled), len(scaled) - 1
    return [(u - (total - u) / others) * scale for u in scaled]


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
@batch_stage(whiten_over_tokens)
def reinforce_pp_baseline(rewards: list[float]) -> list[float]:
    """REINFORCE++-baseline: ``r - mean`` in the group (as ``dr_grpo``), then whitened over every labelled
    token of the batch (`whiten_over_tokens`)."""
    return dr_grpo(rewards)


@ADVANTAGE_ESTIMATORS.register("grpo_batch_std")
@batch_stage(by_reward_std)
def grpo_batch_std(rewards: list[float]) -> list[float]:
    """``(r - mean) / (std + eps)`` with the group's mean and the std of the whole batch's rewards
    (`by_reward_std`; TRL's ``scale_rewards="batch"``)."""
    return dr_grpo(rewards)


@ADVANTAGE_ESTIMATORS.register("opo")
def opo(rewards: list[float], *, lengths: list[int]) -> list[float]:
    """``r_i - b`` with OPO's length-weighted baseline ``b = sum(|y_j| r_j) / sum(|y_j|)``
    (``lengths`` are the ``|y_j|``), computed as ``s·(u_i - b(u))`` (see `_scaled`); 0 when the group
    has no labelled token (``sum(|y_j|) = 0``). An advantage beyond float64 is ±inf."""
    total_length = sum(lengths)
    if _no_signal(rewards) or total_length == 0:
        return [0.0] * len(rewards)
    scale, scaled, _ = _scaled(rewards)
    baseline = math.fsum(n * u for n, u in zip(lengths, scaled)) / total_length
    return [(u - baseline) * scale for u in scaled]


@ADVANTAGE_ESTIMATORS.register("passk")
def passk(rewards: list[float], *, k: int) -> list[float]:
    """The analytic pass@k advantage of Chen et al. (2025) for rewards 0 or 1 (math.md#advantages):
    with ``N`` samples, ``c`` correct, ``rho = 1 - C(N-c, k)/C(N, k)`` and ``sigma = sqrt(rho (1 - rho))``, a
    correct sample gets ``(1 - rho) / sigma`` and an incorrect one ``(1 - rho - C(N-c-1, k-1)/C(N-1, k-1)) /
    sigma``; all get 0 when ``sigma = 0``. Each is ``(m - rho) / sigma`` with ``m`` the mean pass@k of the
    k-subsets holding the sample, computed as ``±sqrt((m - rho)^2 / (rho (1 - rho)))`` from exact rationals."""
    wrong = next((r for r in rewards if r not in (0.0, 1.0)), None)
    if wrong is not None:
        raise ValueError(f"advantage.estimator=passk needs rewards of 0 or 1, got {wrong!r}")
    n, c = len(rewards), int(sum(rewards))
    if k > n:
        raise ValueError(f"{n} documents, fewer than advantage.k={k} (pass@k needs k <= the group's size)")
    rho = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    if rho in (0, 1):
        return [0.0] * n
    variance = rho * (1 - rho)
    positive = math.sqrt((1 - rho) ** 2 / variance)  # m = 1: every subset with a correct sample passes
    fails = Fraction(math.comb(n - c - 1, k - 1), math.comb(n - 1, k - 1))  # an incorrect one's subsets that fail
    negative = -math.sqrt((1 - fails - rho) ** 2 / variance)  # m = 1 - fails < rho
    return [positive if r == 1.0 else negative for r in rewards]


@ADVANTAGE_ESTIMATORS.register("distill")
def distill(rewards: list[float]) -> list[float]:
    """``distill`` with ``distill.rewards=none``: the rewards add nothing (0 for every document); the trainer
    adds ``distill.coef`` times the teacher's per-token term at the start of each batch (`rlcli.training.distill`,
    math.md#on-policy-distillation)."""
    return [0.0] * len(rewards)


def _no_signal(rewards: list[float]) -> bool:
    """A group of one document, or of equal rewards: nothing to prefer, advantage 0."""
    return min(rewards) == max(rewards)


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


def estimator_keywords(estimator: str) -> tuple[str, ...]:
    """The keywords of `KEYWORDS` that the estimator ``estimator`` declares, or its batch stage (all of
    them with ``**kwargs``)."""
    estimate = ADVANTAGE_ESTIMATORS[estimator]
    stage = getattr(estimate, "batch_stage", None)
    declared = {*_declared(estimate), *(_declared(stage) if stage is not None else ())}
    return tuple(key for key in KEYWORDS if key in declared)


def _declared(function: Callable) -> tuple[str, ...]:
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return (*KEYWORDS, "rewards")
    return tuple(p.name for p in parameters if p.name in (*KEYWORDS, "rewards"))


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    estimator: str,
    *,
    eps: float,
    k: int | None = None,
    lengths: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    gather: Gather | None = None,
) -> list[float]:
    """One advantage per reward, by ``estimator`` (one of `group_estimators`) within the documents that
    share a group id. ``eps`` and ``k`` are ``advantage.eps`` and ``advantage.k``, ``lengths`` the
    documents' labelled tokens (needed by an estimator that declares it, ``opo``, or whose batch stage
    does, ``reinforce_pp_baseline``). A ``ValueError`` of the estimator is a `DataError` naming the
    group and its first document, ``names[i]`` (default ``document i``).

    An estimator with a `batch_stage` normalises over the batch: these documents, and with ``gather``
    (e.g. `rlcli.training.distributed.all_gather_objects`, called on every process alike) those of
    every process too; the statistics are then the same on every process, whatever the split."""
    if not computes_advantages(estimator):
        raise ValueError(f"advantage estimator {estimator!r} computes no advantages; expected one of: "
                         f"{', '.join(group_estimators())}")
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    if "lengths" in estimator_keywords(estimator) and (lengths is None or len(lengths) != len(rewards)):
        raise ValueError(f"advantage.estimator={estimator} needs one length per reward")
    estimate = ADVANTAGE_ESTIMATORS[estimator]
    keywords = [key for key in _declared(estimate) if key in KEYWORDS]
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, group_id in enumerate(group_ids):
        members[group_id].append(i)
    advantages = [0.0] * len(rewards)
    for group_id, indices in members.items():
        options = {"eps": eps, "k": k, "lengths": [lengths[i] for i in indices] if lengths is not None else None}
        try:
            values = estimate([float(rewards[i]) for i in indices], **{key: options[key] for key in keywords})
        except ValueError as err:
            first = names[indices[0]] if names is not None else f"document {indices[0]}"
            raise DataError(f"group {group_id!r} (first document {first}, {len(indices)} in all): {err}") from None
        for i, value in zip(indices, values):
            advantages[i] = value
    stage = getattr(estimate, "batch_stage", None)
    if stage is None:
        return advantages
    local = (advantages, [float(r) for r in rewards], list(lengths) if lengths is not None else None)
    ranks = gather(local) if gather is not None else [local]
    batch = {"rewards": [r for rank in ranks for r in rank[1]], "eps": eps,
             "lengths": None if lengths is None else [n for rank in ranks for n in rank[2]]}
    try:
        normalise = stage([a for rank in ranks for a in rank[0]],
                          **{key: batch[key] for key in _declared(stage) if key in batch})
    except ValueError as err:
        raise DataError(f"advantage.estimator={estimator} over the batch of {len(batch['rewards'])} documents: "
                        f"{err}") from None
    return [normalise(a) for a in advantages]


def apply_advantage_estimator(
    rollouts: Sequence[Rollout], estimator: str, *, eps: float, k: int | None = None
) -> list[Rollout]:
    """Give every rollout per-token advantages, as ``advantage.estimator``, ``advantage.eps`` and
    ``advantage.k`` say.

    - ``none``: every rollout must already carry ``advantage``/``advantages``.
    - any other estimator: rollouts without advantages get their group's advantage (see
      ``group_advantages``; a document's length is its labelled tokens) from ``reward`` on every
      completion token; groups are formed over the whole dataset and only from these rollouts.
      Rollouts that already carry advantages keep them unchanged. An advantage beyond the float32
      range (dr_grpo on rewards that far apart) is a ``DataError`` naming the rollout.
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
    docs = [rollouts[i] for i in pending]
    sources = [d.source for d in docs]
    advantages = group_advantages([d.reward for d in docs], [d.group_id for d in docs], estimator, eps=eps, k=k,
                                  lengths=[d.num_labelled for d in docs], names=sources)
    check_in_float32(advantages, sources, estimator)
    result = list(rollouts)
    for i, value in zip(pending, advantages):
        result[i] = result[i].with_advantages((value,) * len(result[i].completion_ids))
    return result


def check_in_float32(advantages: Sequence[float], names: Sequence[str], estimator: str) -> None:
    """A ``DataError`` naming the first of ``names`` whose advantage is beyond the float32 range that
    training computes in (grpo's and passk's never is; dr_grpo's ``r - mean`` can be)."""
    for name, value in zip(names, advantages):
        if abs(value) > FLOAT32_MAX:
            raise DataError(
                f"{name}: field 'reward': advantage.estimator={estimator} makes it the advantage {value!r} (reward "
                f"minus its group's baseline), {FLOAT32_RANGE}. Scale the rewards down, or use "
                "advantage.estimator=grpo (normalised by the group's std)."
            )
