"""Float64 references for the tests of ``rlcli.modules``, written from SPEC §2–§4 and §6 only.

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
# loss (SPEC §3, §4)
# --------------------------------------------------------------------------------------------


def ref_document_weights(docs: list[Doc], *, aggregation: str, divisor: float | None = None) -> list[float]:
    """``w`` of SPEC §4 shared by the labelled tokens of each document (0 for a document without any)."""
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
# metrics (SPEC §6)
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
    """Every module-level metric of SPEC §6 (level ``basic``, plus ``entropy`` when given)."""
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
# LM head (SPEC §2)
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
