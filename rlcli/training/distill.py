"""On-policy distillation (``advantage.estimator=distill``, math.md#on-policy-distillation).

Each labelled token's advantage is the rewards' part (``distill.rewards``: 0, or a group estimator's,
computed where ``advantage.estimator``'s would be: `reward_advantage`) plus
``distill.coef`` x (the teacher's log-prob − the trainer's own at the start of the batch), both by the
loss's head at ``loss.temperature`` (`rlcli.training.logprobs` fills them in). `add_distill_advantages`
adds the teacher's term once per batch, at the batch stage: a batch resumed from a checkpoint already
holds it in its documents' advantages.
"""

from __future__ import annotations

import dataclasses

import torch

from rlcli.conf.schema import AdvantageConfig, DistillConfig
from rlcli.modules.metrics import Metric
from rlcli.training import distributed
from rlcli.training.batches import BatchPlan

METRICS = {
    "distill/reverse_kl": Metric(
        "advantage.estimator=distill", "`Σ_t m_t (prox_t − tlp_t) / T` over the batch (every process): the "
        "trainer's minus the teacher's log-prob of the sampled tokens at the start of the batch, the per-token "
        "reverse KL estimate; logged with each update of the batch"),
}


def reward_advantage(advantage: AdvantageConfig, distill: DistillConfig) -> AdvantageConfig:
    """The ``advantage`` config that turns rewards into advantages: ``advantage`` itself, or with
    ``advantage.estimator=distill`` and ``distill.rewards`` a group estimator, that estimator (with
    ``distill.rewards=none`` it stays ``distill``, whose rewards' part is 0)."""
    if advantage.estimator != "distill" or distill.rewards == "none":
        return advantage
    return dataclasses.replace(advantage, estimator=distill.rewards)


def add_distill_advantages(batch: BatchPlan, coef: float | None, device: torch.device) -> None:
    """Add ``coef`` x (``teacher_logprobs`` − ``proximal_logprobs``) to the advantages of every document of
    ``batch`` and put the batch's ``distill/reverse_kl`` (summed over processes: a collective, every rank
    calls it) in its statistics; nothing without distillation (``coef`` None)."""
    if coef is None:
        return
    values, kl_sum = {}, 0.0
    for doc in batch.documents:
        term = [teacher - student for teacher, student in zip(doc.teacher_logprobs, doc.proximal_logprobs)]
        # both are 0 where completion_mask is 0: the term leaves those advantages as they were
        values[id(doc)] = {"advantages": tuple(a + coef * t for a, t in zip(doc.advantages, term))}
        kl_sum -= sum(t for t, m in zip(term, doc.completion_mask) if m)
    totals = torch.tensor([kl_sum, sum(doc.num_labelled for doc in batch.documents)], dtype=torch.float64,
                          device=device)
    kl_sum, tokens = distributed.all_reduce(totals, "sum").tolist()
    batch.fill(values)
    batch.stats["distill/reverse_kl"] = kl_sum / max(tokens, 1)
