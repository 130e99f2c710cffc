"""Float64 references for the tests of ``rlcli.modules``, written from math.md only
(log-probabilities, policy losses, aggregation, metrics).

Nothing here imports rlcli. The loss is a plain loop over documents (torch ops only so that
autograd gives the reference gradient); the metrics are plain Python floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# documents of a flat step
# --------------------------------------------------------------------------------------------


@dataclass
class Doc:
    id: int
    group: int | None
    positions: list[int]  # every token of the document
    labelled: list[int]  # the tokens with m_t = 1


def documents(mask: torch.Tensor, doc: torch.Tensor, group: torch.Tensor | None = None) -> list[Doc]:
    """The documents of a step in order of first appearance."""
    out: dict[int, Doc] = {}
    mask_l = mask.tolist()
    group_l = group.tolist() if group is not None else None
    for t, d in enumerate(doc.tolist()):
        if d not in out:
            out[d] = Doc(d, None if group_l is None else group_l[t], [], [])
        entry = out[d]
        assert group_l is None or entry.group == group_l[t], "a document lies in one group"
        entry.positions.append(t)
        if mask_l[t] != 0:
            entry.labelled.append(t)
    return list(out.values())


# --------------------------------------------------------------------------------------------
# loss (math.md#policy-losses, #aggregation)
# --------------------------------------------------------------------------------------------


def ref_document_weights(docs: list[Doc], *, aggregation: str, divisor: float | None = None) -> list[float]:
    """``w`` of math.md#aggregation shared by the labelled tokens of each document (0 for a document without any)."""
    num_docs = len(docs)  # D: every document, also those with no labelled token
    num_tokens = sum(len(d.labelled) for d in docs)  # T
    group_tokens: dict[int, int] = {}  # T_g
    for d in docs:
        if aggregation == "prompt_mean":
            group_tokens[d.group] = group_tokens.get(d.group, 0) + len(d.labelled)
    num_groups = len(group_tokens)  # P: groups with a document in the step

    def weight(d: Doc) -> float:
        n = len(d.labelled)
        if n == 0:
            return 0.0
        if aggregation == "token_mean":
            return 1.0 / num_tokens
        if aggregation == "sample_mean":
            return 1.0 / (n * num_docs)
        if aggregation == "prompt_mean":
            return 1.0 / (group_tokens[d.group] * num_groups)
        if aggregation == "constant":
            return 1.0 / (divisor * num_docs)
        raise AssertionError(aggregation)

    return [weight(d) for d in docs]


def ref_loss(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    doc: torch.Tensor,
    group: torch.Tensor | None = None,
    *,
    loss: str,
    aggregation: str,
    divisor: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> torch.Tensor:
    """``L = Σ_t w_t ℓ_t`` in float64, differentiable w.r.t. ``lp``."""
    lp, old, adv = lp.to(F64), old.to(F64), adv.to(F64)
    docs = documents(mask, doc, group)
    weights = ref_document_weights(docs, aggregation=aggregation, divisor=divisor)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high

    total = lp.sum() * 0.0  # float64 zero that carries the graph
    for d, w in zip(docs, weights):
        n = len(d.labelled)
        if n == 0:
            continue
        sel = torch.tensor(d.labelled)
        if loss == "grpo":
            r = torch.exp(lp[sel] - old[sel])
            a = adv[sel]
            clipped = torch.minimum(torch.maximum(r, torch.full_like(r, lo)), torch.full_like(r, hi))
            ell = -torch.minimum(r * a, clipped * a)  # [n]
            total = total + w * ell.sum()
        elif loss == "gspo":
            rho = (lp[sel] - old[sel]).sum() / n
            big_r = torch.exp(rho)
            a_bar = float(adv[sel].sum()) / n  # no gradient
            clipped = min(max(big_r, torch.tensor(lo, dtype=F64)), torch.tensor(hi, dtype=F64))
            lam = -torch.minimum(big_r * a_bar, clipped * a_bar)
            total = total + w * n * lam  # every labelled token of d carries λ_d
        else:
            raise AssertionError(loss)
    return total


# --------------------------------------------------------------------------------------------
# metrics (math.md#metrics)
# --------------------------------------------------------------------------------------------


def ref_metrics(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    doc: torch.Tensor,
    *,
    loss: str,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    entropy: torch.Tensor | None = None,
) -> dict[str, float]:
    """Every module-level metric of math.md#metrics (level ``basic``, plus ``entropy`` when given)."""
    lp_l = lp.detach().to(F64).tolist()
    old_l = old.detach().to(F64).tolist()
    adv_l = adv.detach().to(F64).tolist()
    ent_l = None if entropy is None else entropy.detach().to(F64).tolist()
    docs = documents(mask, doc)
    num_docs = len(docs)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high

    def mu(value_of_token) -> float:
        acc = 0.0
        for d in docs:
            acc += sum(value_of_token(t) for t in d.labelled) / max(len(d.labelled), 1)
        return acc / num_docs

    def outside(r: float) -> float:
        return 1.0 if (r < lo or r > hi) else 0.0

    out = {
        "num_documents": float(num_docs),
        "num_tokens": float(sum(len(d.labelled) for d in docs)),
        "old_logprobs": mu(lambda t: old_l[t]),
        "new_logprobs": mu(lambda t: lp_l[t]),
        "advantage": mu(lambda t: adv_l[t]),
    }
    labelled_adv = [adv_l[t] for d in docs for t in d.labelled]
    if labelled_adv:
        out["max_advantage"] = max(labelled_adv)
        out["min_advantage"] = min(labelled_adv)
    if ent_l is not None:
        out["entropy"] = mu(lambda t: ent_l[t])

    if loss == "grpo":
        def log_r(t):
            return lp_l[t] - old_l[t]

        out["ratio_new_old"] = mu(lambda t: math.exp(log_r(t)))
        out["ratio_new_old_sum"] = sum(math.exp(log_r(t)) for d in docs for t in d.labelled)
        out["ratio_new_old_squared_sum"] = sum(math.exp(2 * log_r(t)) for d in docs for t in d.labelled)
        out["kl_new_old"] = mu(lambda t: math.exp(log_r(t)) - 1 - log_r(t))
        out["clipped_ratio_fraction"] = mu(lambda t: outside(math.exp(log_r(t))))
    else:
        rhos = [sum(lp_l[t] - old_l[t] for t in d.labelled) / len(d.labelled) for d in docs if d.labelled]
        ratios = [math.exp(rho) for rho in rhos]
        out["ratio_new_old"] = sum(ratios) / num_docs
        out["ratio_new_old_sum"] = sum(ratios)
        out["ratio_new_old_squared_sum"] = sum(r * r for r in ratios)
        out["kl_new_old"] = sum(r - 1 - rho for r, rho in zip(ratios, rhos)) / num_docs
        out["clipped_ratio_fraction"] = sum(outside(r) for r in ratios) / num_docs
        out["num_segments"] = float(len(ratios))
    return out


# --------------------------------------------------------------------------------------------
# LM head (math.md#log-probabilities)
# --------------------------------------------------------------------------------------------


def ref_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """Full float64 logits -> (log-prob of each label, entropy); both 0 where ``labels < 0``.

    Differentiable w.r.t. float64 leaves ``hidden`` and ``weight``.
    """
    logits = hidden.to(F64) @ weight.to(F64).T / temperature  # [N, V]
    log_p = torch.log_softmax(logits, dim=-1)
    valid = labels >= 0
    picked = log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    zero = torch.zeros((), dtype=F64)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


# --------------------------------------------------------------------------------------------
# random steps
# --------------------------------------------------------------------------------------------


def make_step(
    seed: int,
    *,
    num_docs: int = 12,
    max_len: int = 9,
    num_groups: int = 4,
    empty_docs: int = 2,
    log_ratio_std: float = 0.25,
) -> dict[str, torch.Tensor]:
    """A packed step of whole documents (tokens of a document are contiguous).

    Document and group ids are arbitrary non-contiguous integers. Each document starts with 0–2
    masked "prompt" tokens; ``empty_docs`` documents have no labelled token at all. Masked tokens
    carry garbage log-probs/advantages (they must not matter). Everything float64.
    """
    g = torch.Generator().manual_seed(seed)
    doc_ids = (torch.randperm(10_000, generator=g)[:num_docs] * 7 - 5000).tolist()
    group_ids = (torch.randperm(1000, generator=g)[:num_groups] + 3).tolist()
    empty = set(torch.randperm(num_docs, generator=g)[:empty_docs].tolist())
    mask, doc, group, adv = [], [], [], []
    for k, d in enumerate(doc_ids):
        length = int(torch.randint(1, max_len + 1, (1,), generator=g))
        prompt = int(torch.randint(0, 3, (1,), generator=g))
        m = [0.0 if (t < prompt or k in empty) else float(torch.rand((), generator=g) < 0.8) for t in range(length)]
        if k not in empty and sum(m) == 0:
            m[-1] = 1.0
        gid = group_ids[int(torch.randint(0, num_groups, (1,), generator=g))]
        doc_adv = float(torch.randn((), generator=g))
        mask += m
        doc += [d] * length
        group += [gid] * length
        adv += [doc_adv + 0.3 * float(torch.randn((), generator=g)) for _ in range(length)]
    n = len(mask)
    mask_t = torch.tensor(mask, dtype=F64)
    lp = -3.0 * torch.rand(n, generator=g, dtype=F64) - 0.05
    old = lp - log_ratio_std * torch.randn(n, generator=g, dtype=F64)
    labelled = mask_t > 0
    # garbage where m_t = 0: these values must not change anything
    old = torch.where(labelled, old, -50.0 * torch.rand(n, generator=g, dtype=F64))
    adv_t = torch.where(labelled, torch.tensor(adv, dtype=F64), 100.0 * torch.randn(n, generator=g, dtype=F64))
    return dict(
        lp=lp,
        old=old,
        adv=adv_t,
        mask=mask_t,
        doc=torch.tensor(doc, dtype=torch.long),
        group=torch.tensor(group, dtype=torch.long),
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual − expected| / |expected|`` (Frobenius), in float64; absolute if expected is 0."""
    actual, expected = actual.detach().to(F64), expected.detach().to(F64)
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / scale if scale > 0 else diff


LOSSES = ("grpo", "gspo")
AGGREGATIONS = (
    ("token_mean", None),
    ("sample_mean", None),
    ("prompt_mean", None),
    ("constant", 1.0),
    ("constant", 37.5),
)


# --------------------------------------------------------------------------------------------
# cispo, sapo, gspo_token: loss and metrics, written from their formulas
#   cispo:      ℓ_t = −sg(min(r_t, 1 + eps_high))·A_t·lp_t
#   sapo:       ℓ_t = −σ(τ_t (r_t − 1))·(4/τ_t)·A_t,  τ_t = tau_pos if A_t > 0 else tau_neg
#   gspo_token: s_t = sg(R_d)·exp(lp_t − sg(lp_t)), R_d = exp(mean_d(lp − old)),
#               ℓ_t = −min(s_t A_t, clip(s_t) A_t)
# --------------------------------------------------------------------------------------------

NEW_LOSSES = ("cispo", "sapo", "gspo_token")


def ref_new_loss(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    doc: torch.Tensor,
    group: torch.Tensor | None = None,
    *,
    loss: str,
    aggregation: str,
    divisor: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> torch.Tensor:
    """``L = Σ_t w_t ℓ_t`` of a new loss in float64, differentiable w.r.t. ``lp``; token by token."""
    lp, old, adv = lp.to(F64), old.to(F64), adv.to(F64)
    docs = documents(mask, doc, group)
    weights = ref_document_weights(docs, aggregation=aggregation, divisor=divisor)
    total = lp.sum() * 0.0
    for d, w in zip(docs, weights):
        if not d.labelled:
            continue
        if loss == "gspo_token":
            log_ratios = [lp[t] - old[t] for t in d.labelled]
            big_r = torch.exp(sum(log_ratios) / len(d.labelled)).detach()  # sg(R_d)
        for t in d.labelled:
            a = float(adv[t])
            if loss == "cispo":
                r = torch.exp(lp[t] - old[t])
                is_weight = torch.clamp(r, max=1.0 + eps_high).detach()
                ell = -is_weight * a * lp[t]
            elif loss == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                r = torch.exp(lp[t] - old[t])
                ell = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * a
            elif loss == "gspo_token":
                s = big_r * torch.exp(lp[t] - lp[t].detach())
                clipped = torch.clamp(s, 1.0 - eps_low, 1.0 + eps_high)
                ell = -torch.minimum(s * a, clipped * a)
            else:
                raise AssertionError(loss)
            total = total + w * ell
    return total


def ref_new_metrics(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    doc: torch.Tensor,
    *,
    loss: str,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    entropy: torch.Tensor | None = None,
) -> dict[str, float]:
    """The metrics of a new loss: the shared ones over tokens (cispo, sapo) or documents (gspo_token,
    exactly gspo's); cispo's ``clipped_ratio_fraction`` is ``μ(1[r > 1 + eps_high])``, sapo has none."""
    if loss == "gspo_token":
        return ref_metrics(lp, old, adv, mask, doc, loss="gspo", eps_low=eps_low, eps_high=eps_high,
                           entropy=entropy)
    out = ref_metrics(lp, old, adv, mask, doc, loss="grpo", eps_low=eps_low, eps_high=eps_high, entropy=entropy)
    del out["clipped_ratio_fraction"]
    if loss == "cispo":
        lp_l, old_l = lp.detach().to(F64).tolist(), old.detach().to(F64).tolist()
        docs = documents(mask, doc)
        acc = 0.0
        for d in docs:
            truncated = sum(1.0 for t in d.labelled if math.exp(lp_l[t] - old_l[t]) > 1.0 + eps_high)
            acc += truncated / max(len(d.labelled), 1)
        out["clipped_ratio_fraction"] = acc / len(docs)
    return out


# --------------------------------------------------------------------------------------------
# terms added to any policy loss, written from their formulas:
#   ℓ'_t = w_t·ℓ_t + β·k(ref_t − lp_t) − c·H_t   (β·r_t·k with ratio_weighted, r_t = exp(lp_t − old_t))
#   k1 = −δ, k2 = δ²/2, k3 = exp(δ) − δ − 1
#   log ρ: token prox_t − behav_t; sequence Σ_{t∈d} (prox − behav); geometric that sum / n_d
#   truncate: w = min(ρ, high); mask (IcePop): w = ρ·1[low ≤ ρ ≤ high]  (rejected: not low ≤ ρ ≤ high)
#   metrics: kl_ref = μ(k3(ref − lp)), mismatch_kl = μ(k3(prox − behav)), is_weight_mean = μ(w),
#            is_weight_max = max_t w_t, is_masked_fraction = μ(1[rejected])
# --------------------------------------------------------------------------------------------

# the metrics' k3 saturates at this log-ratio (a documented choice: finite metrics for broken log-probs)
METRIC_LOG_RATIO_MAX = 600.0


def ref_kl_term(delta: torch.Tensor, estimator: str) -> torch.Tensor:
    """The KL estimator at ``δ = ref − lp`` (differentiable)."""
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return delta * delta / 2
    if estimator == "k3":
        return torch.exp(delta) - delta - 1
    raise AssertionError(estimator)


def ref_importance_weights(
    old: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor, *,
    mode: str, level: str, low: float, high: float,
) -> tuple[list[float], list[bool]]:
    """``w_t`` and ``rejected_t`` of every token (0.0 and False where m_t = 0), in log space."""
    old_l, behav_l = old.detach().to(F64).tolist(), behav.detach().to(F64).tolist()
    n = len(old_l)
    weight, rejected = [0.0] * n, [False] * n
    for d in documents(mask, doc):
        if not d.labelled:
            continue
        token_log_ratio = {t: old_l[t] - behav_l[t] for t in d.labelled}
        total = sum(token_log_ratio.values())
        for t in d.labelled:
            if level == "token":
                log_rho = token_log_ratio[t]
            elif level == "sequence":
                log_rho = total
            elif level == "geometric":
                log_rho = total / len(d.labelled)
            else:
                raise AssertionError(level)
            if mode == "truncate":
                weight[t] = math.exp(min(log_rho, math.log(high)))
            elif mode == "mask":
                rejected[t] = not (math.log(low) <= log_rho <= math.log(high))
                weight[t] = 0.0 if rejected[t] else math.exp(log_rho)
            else:
                raise AssertionError(mode)
    return weight, rejected


def ref_token_policy_losses(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor, *,
    loss: str, eps_low: float = 0.2, eps_high: float = 0.2,
) -> dict[int, torch.Tensor]:
    """``ℓ_t`` of every labelled token (math.md#policy-losses), differentiable w.r.t. ``lp`` and ``old``."""
    lp, old, adv = lp.to(F64), old.to(F64), adv.to(F64)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    out = {}
    for d in documents(mask, doc):
        if not d.labelled:
            continue
        if loss == "grpo":
            for t in d.labelled:
                r = torch.exp(lp[t] - old[t])
                a = float(adv[t])
                out[t] = -torch.minimum(r * a, torch.clamp(r, lo, hi) * a)
        elif loss == "gspo":
            big_r = torch.exp(sum(lp[t] - old[t] for t in d.labelled) / len(d.labelled))
            a_bar = sum(float(adv[t]) for t in d.labelled) / len(d.labelled)
            lam = -torch.minimum(big_r * a_bar, torch.clamp(big_r, lo, hi) * a_bar)
            for t in d.labelled:
                out[t] = lam
        else:
            raise AssertionError(loss)
    return out


def ref_loss_with_terms(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    doc: torch.Tensor,
    group: torch.Tensor | None = None,
    *,
    loss: str,
    aggregation: str,
    divisor: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    estimator: str = "k3",
    ratio_weighted: bool = False,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    behav: torch.Tensor | None = None,
    mode: str = "none",
    level: str = "token",
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """``L = Σ_t w^agg_t (w_t ℓ_t + β k_t − c H_t)`` in float64 (``β r_t k_t`` with ``ratio_weighted``),
    differentiable w.r.t. ``lp``, ``old`` and ``entropy``; the correction weights ``w_t`` are plain
    numbers (no gradient)."""
    docs = documents(mask, doc, group)
    agg = ref_document_weights(docs, aggregation=aggregation, divisor=divisor)
    ell = ref_token_policy_losses(lp, old, adv, mask, doc, loss=loss, eps_low=eps_low, eps_high=eps_high)
    if mode != "none":
        is_weight, _ = ref_importance_weights(old, behav, mask, doc, mode=mode, level=level, low=low, high=high)
    total = torch.where(mask > 0, lp.to(F64), 0.0).sum() * 0.0  # a zero with the graph; never reads the mask's NaN
    for d, w_agg in zip(docs, agg):
        for t in d.labelled:
            term = ell[t] * (is_weight[t] if mode != "none" else 1.0)
            if kl_coef > 0:
                kl = ref_kl_term(ref.to(F64)[t] - lp.to(F64)[t], estimator)
                if ratio_weighted:
                    kl = kl * torch.exp(lp.to(F64)[t] - old.to(F64)[t])
                term = term + kl_coef * kl
            if entropy_coef > 0:
                term = term - entropy_coef * entropy.to(F64)[t]
            total = total + w_agg * term
    return total


def ref_term_metrics(
    lp: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    doc: torch.Tensor,
    *,
    ref: torch.Tensor | None = None,
    behav: torch.Tensor | None = None,
    mode: str = "none",
    level: str = "token",
    low: float = 0.5,
    high: float = 2.0,
) -> dict[str, float]:
    """The terms' metrics (plain floats): ``kl_ref`` with ``ref``, ``mismatch_kl`` with ``behav``, the
    ``is_*`` metrics with a correction."""
    docs = documents(mask, doc)
    lp_l, old_l = lp.detach().to(F64).tolist(), old.detach().to(F64).tolist()

    def mu(value_of_token) -> float:
        return sum(sum(value_of_token(t) for t in d.labelled) / max(len(d.labelled), 1) for d in docs) / len(docs)

    def k3(delta: float) -> float:
        delta = min(delta, METRIC_LOG_RATIO_MAX)
        return math.exp(delta) - delta - 1

    out = {}
    if ref is not None:
        ref_l = ref.detach().to(F64).tolist()
        out["kl_ref"] = mu(lambda t: k3(ref_l[t] - lp_l[t]))
    if behav is not None:
        behav_l = behav.detach().to(F64).tolist()
        out["mismatch_kl"] = mu(lambda t: k3(old_l[t] - behav_l[t]))
    if mode != "none":
        weight, rejected = ref_importance_weights(old, behav, mask, doc, mode=mode, level=level, low=low, high=high)
        out["is_weight_mean"] = mu(lambda t: weight[t])
        out["is_masked_fraction"] = mu(lambda t: float(rejected[t]))
        labelled = [weight[t] for d in docs for t in d.labelled]
        if labelled:
            out["is_weight_max"] = max(labelled)
    return out
