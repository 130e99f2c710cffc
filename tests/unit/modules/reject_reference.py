"""Float64 reference of ``correction.mode=reject`` (math.md#mismatch-correction), written from the math page
only: the kept mask, the rejected documents, the counts T, n_d, T_g, D, P of the kept ones, the loss with its
KL and entropy terms, and ``is_rejected_fraction``.

    ρ_t = exp(prox_t − behav_t)                       (token)
    ρ_d = exp(Σ_{t∈d} m_t (prox_t − behav_t))          (sequence)
    ρ_d = exp(Σ_{t∈d} m_t (prox_t − behav_t) / n_d)    (geometric)
    m̃_t = m_t · 1[low ≤ ρ ≤ high]
    a rejected document: n_d > 0 and ñ_d = 0; it is in neither D nor P.

Nothing here imports rlcli.
"""

from __future__ import annotations

import math

import torch
from rl_reference import F64, documents, ref_kl_term, ref_token_policy_losses


def ref_kept(old: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor, *, level: str,
             low: float, high: float) -> tuple[torch.Tensor, set[int]]:
    """``m̃`` [N] float64 and the ids of the rejected documents."""
    old_l, behav_l = old.detach().to(F64).tolist(), behav.detach().to(F64).tolist()
    kept = [0.0] * len(old_l)
    rejected = set()
    for d in documents(mask, doc):
        if not d.labelled:
            continue
        log_ratio = {t: old_l[t] - behav_l[t] for t in d.labelled}
        for t in d.labelled:
            log_rho = {"token": log_ratio[t], "sequence": sum(log_ratio.values()),
                       "geometric": sum(log_ratio.values()) / len(d.labelled)}[level]
            kept[t] = 1.0 if math.log(low) <= log_rho <= math.log(high) else 0.0
        if not any(kept[t] for t in d.labelled):
            rejected.add(d.id)
    return torch.tensor(kept, dtype=F64), rejected


def ref_counts(kept: torch.Tensor, rejected: set[int], doc: torch.Tensor, group: torch.Tensor) -> dict:
    """T, D, P, n_d (by document id) and T_g (by group id) of the kept tokens."""
    docs = [d for d in documents(kept, doc, group) if d.id not in rejected]
    group_tokens: dict[int, int] = {}
    for d in docs:
        group_tokens[d.group] = group_tokens.get(d.group, 0) + len(d.labelled)
    return dict(T=sum(len(d.labelled) for d in docs), D=len(docs), P=len(group_tokens),
                n={d.id: len(d.labelled) for d in docs}, T_g=group_tokens)


def ref_reject_loss(lp, old, behav, adv, mask, doc, group, *, loss: str, aggregation: str, divisor: float | None,
                    level: str, low: float, high: float, eps_low: float = 0.2, eps_high: float = 0.2,
                    ref=None, kl_coef: float = 0.0, estimator: str = "k3", entropy=None,
                    entropy_coef: float = 0.0) -> torch.Tensor:
    """``L = Σ_t w̃_t (ℓ_t + β k_t − c H_t)`` over the kept tokens (weight 1), the aggregation weights ``w̃`` with
    the kept counts; differentiable w.r.t. ``lp``, ``old`` and ``entropy``."""
    kept, rejected = ref_kept(old, behav, mask, doc, level=level, low=low, high=high)
    c = ref_counts(kept, rejected, doc, group)
    ell = ref_token_policy_losses(lp, old, adv, kept, doc, loss=loss, eps_low=eps_low, eps_high=eps_high)
    total = torch.where(mask > 0, lp.to(F64), 0.0).sum() * 0.0  # a zero with the graph
    for d in documents(kept, doc, group):
        if d.id in rejected or not d.labelled:
            continue
        if aggregation == "token_mean":
            w = 1 / c["T"]
        elif aggregation == "sample_mean":
            w = 1 / (c["n"][d.id] * c["D"])
        elif aggregation == "prompt_mean":
            w = 1 / (c["T_g"][d.group] * c["P"])
        else:
            w = 1 / (divisor * c["D"])
        for t in d.labelled:
            term = ell[t]
            if kl_coef > 0:
                term = term + kl_coef * ref_kl_term(ref.to(F64)[t] - lp.to(F64)[t], estimator)
            if entropy_coef > 0:
                term = term - entropy_coef * entropy.to(F64)[t]
            total = total + w * term
    return total


def ref_rejected_fraction(old, behav, mask, doc, *, level: str, low: float, high: float) -> float:
    """``Σ_t (m_t − m̃_t) / max(Σ_t m_t, 1)``."""
    kept, _ = ref_kept(old, behav, mask, doc, level=level, low=low, high=high)
    labelled = float((mask > 0).sum())
    return (labelled - float(kept.sum())) / max(labelled, 1.0)


def ref_kept_mismatch_kl(old, behav, mask, doc, *, level: str, low: float, high: float) -> float:
    """``mismatch_kl = μ(k3(prox − behav))`` over the kept tokens, D of the kept documents."""
    kept, rejected = ref_kept(old, behav, mask, doc, level=level, low=low, high=high)
    docs = [d for d in documents(kept, doc) if d.id not in rejected]
    old_l, behav_l = old.detach().to(F64).tolist(), behav.detach().to(F64).tolist()

    def k3(delta):
        return math.exp(delta) - delta - 1

    return sum(sum(k3(old_l[t] - behav_l[t]) for t in d.labelled) / max(len(d.labelled), 1) for d in docs) / len(docs)
