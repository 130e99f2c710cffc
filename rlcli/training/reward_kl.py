"""KL in the reward (``kl.placement=reward``, math.md#kl-in-the-reward): each document's reward less
``beta x sum_t k1_t``, with ``k1_t = old_lp_t - ref_lp_t`` over its labelled tokens, before the advantages.

``data=generate``: `add_kl_to_rewards` recomputes a collected batch's advantages in the trainer, once the
reference's log-probs (and with ``loss.old_logprobs=recompute`` the trainer's own) are known. Rollout files
with ``kl.reference=rollouts``: `subtract_kl_at_read` shapes the records' rewards before the estimator runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlcli.conf.schema import TrainConfig
from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout
from rlcli.modules.metrics import Metric
from rlcli.rollout.advantages import check_in_float32, group_advantages
from rlcli.training import distributed
from rlcli.training.batches import BatchPlan

log = logging.getLogger("rlcli")

METRICS = {
    "reward/kl": Metric("kl.placement=reward (data=generate)", "the mean KL term `β Σ_t k1_t` subtracted from the "
                        "rewards of the step's batch, over its documents on every process (math.md#kl-in-the-reward)"),
}


def sequence_k1(doc: Rollout, old: Sequence[float]) -> float:
    """``sum_t (old_t - ref_t)`` over the document's labelled tokens (``old``: one log-prob per completion token)."""
    return math.fsum(o - r for o, r, m in zip(old, doc.ref_logprobs, doc.completion_mask) if m)


@dataclass(frozen=True)
class RewardKL:
    """``kl.placement=reward`` with ``data=generate``: ``coef`` is beta; the advantages are recomputed with
    ``estimator``, ``eps`` and ``k`` (``advantage.*``); ``recompute``: the ratio's denominator is the trainer's
    proximal log-probs (``loss.old_logprobs=recompute``), else the sampler's ``old_logprobs``."""

    coef: float
    estimator: str
    eps: float
    k: int | None
    recompute: bool

    @classmethod
    def of(cls, cfg: TrainConfig) -> RewardKL | None:
        """The trainer's batch stage for ``cfg``, or None where the KL stays in the loss (or is off, or the
        rewards are shaped at read)."""
        if cfg.kl.placement != "reward" or cfg.kl.coef == 0 or cfg.data.kind != "generate":
            return None
        a = cfg.advantage
        return cls(cfg.kl.coef, a.estimator, a.eps, a.k, cfg.loss.old_logprobs == "recompute")


def add_kl_to_rewards(batch: BatchPlan, reward_kl: RewardKL | None) -> None:
    """Give ``batch``'s documents the advantages of their rewards less ``beta x sum_t k1_t`` (nothing with
    None), over the batch of every process (its groups are whole on each), and log the mean term as
    ``reward/kl``. Called by every process alike, after the trainer's log-probs."""
    if reward_kl is None:
        return
    docs = batch.documents
    terms = [reward_kl.coef * sequence_k1(d, d.proximal_logprobs if reward_kl.recompute else d.old_logprobs)
             for d in docs]
    names = [d.name for d in docs]
    advantages = group_advantages([d.reward - t for d, t in zip(docs, terms)], [d.group_id for d in docs],
                                  reward_kl.estimator, eps=reward_kl.eps, k=reward_kl.k,
                                  lengths=[d.num_labelled for d in docs], names=names,
                                  gather=distributed.all_gather_objects)
    check_in_float32(advantages, names, reward_kl.estimator)
    batch.fill({id(d): {"advantages": (a,) * len(d.completion_ids)} for d, a in zip(docs, advantages)})
    every = [t for rank in distributed.all_gather_objects(terms) for t in rank]
    batch.stats["reward/kl"] = math.fsum(every) / max(len(every), 1)


def subtract_kl_at_read(rollouts: list[Rollout], cfg: TrainConfig) -> list[Rollout]:
    """Rollout files with ``kl.placement=reward`` (``kl.reference=rollouts``): every record that lacks
    advantages gets ``reward - beta x sum_t (old_logprobs_t - ref_logprobs_t)``; one that carries advantages
    is a `DataError` (its rewards no longer make them). Unchanged otherwise."""
    if cfg.kl.placement != "reward" or cfg.kl.coef == 0:
        return rollouts
    carrying = [r for r in rollouts if r.advantages is not None]
    if carrying:
        raise DataError(f"{carrying[0].source}: carries advantages, and kl.placement=reward subtracts the KL from "
                        f"the rewards before the advantages are computed ({len(carrying)} records carry them); "
                        "give rewards, or set kl.placement=loss")
    terms = [cfg.kl.coef * sequence_k1(r, r.old_logprobs) for r in rollouts]
    log.info("data: kl.placement=reward: the mean KL term beta x sum k1 is %g over %d records",
             math.fsum(terms) / max(len(terms), 1), len(terms))
    return [r if r.reward is None else dataclasses.replace(r, reward=r.reward - t) for r, t in zip(rollouts, terms)]
