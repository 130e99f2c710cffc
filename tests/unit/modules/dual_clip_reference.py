"""Float64 references of the dual clip (math.md#dual-clip), written from the formulas only:

    grpo:        x_t = r_t = exp(lp_t − old_t)
    gspo_token:  x_t = s_t = sg(R_d)·exp(lp_t − sg(lp_t)),  R_d = exp(mean_d(lp − old))
    both:        ℓ_t = −min(x_t A_t, clip(x_t) A_t)
    dual clip:   ℓ^dc_t = min(ℓ_t, −c·A_t) if A_t < 0, else ℓ_t
    metric:      dual_clipped_fraction = μ(1[A_t < 0 and ℓ_t > −c·A_t])  (the cap acts)

Nothing here imports rlcli; the documents, aggregation weights and the other metrics are the references
of ``rl_reference.py``.
"""

from __future__ import annotations

import torch
from rl_reference import F64, documents, ref_document_weights, ref_metrics, ref_new_metrics


def ref_dual_clip_token_losses(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor, *,
    loss: str, dual_clip: float | None, eps_low: float = 0.2, eps_high: float = 0.2,
) -> dict[int, tuple[torch.Tensor, bool]]:
    """``(ℓ^dc_t, whether the cap acts)`` of every labelled token, differentiable w.r.t. ``lp``."""
    lp, old, adv = lp.to(F64), old.to(F64), adv.to(F64)
    out = {}
    for d in documents(mask, doc):
        if not d.labelled:
            continue
        if loss == "gspo_token":
            big_r = torch.exp(sum(lp[t] - old[t] for t in d.labelled) / len(d.labelled)).detach()  # sg(R_d)
        for t in d.labelled:
            a = float(adv[t])
            if loss == "grpo":
                x = torch.exp(lp[t] - old[t])
            elif loss == "gspo_token":
                x = big_r * torch.exp(lp[t] - lp[t].detach())
            else:
                raise AssertionError(loss)
            ell = -torch.minimum(x * a, torch.clamp(x, 1.0 - eps_low, 1.0 + eps_high) * a)
            acts = dual_clip is not None and a < 0 and float(ell.detach()) > -dual_clip * a
            out[t] = (torch.minimum(ell, torch.tensor(-dual_clip * a, dtype=F64)) if acts else ell, acts)
    return out


def ref_dual_clip_loss(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor,
    group: torch.Tensor | None = None, *, loss: str, aggregation: str, divisor: float | None = None,
    dual_clip: float | None, eps_low: float = 0.2, eps_high: float = 0.2,
) -> torch.Tensor:
    """``L = Σ_t w_t ℓ^dc_t`` in float64, differentiable w.r.t. ``lp``."""
    docs = documents(mask, doc, group)
    weights = ref_document_weights(docs, aggregation=aggregation, divisor=divisor)
    ell = ref_dual_clip_token_losses(lp, old, adv, mask, doc, loss=loss, dual_clip=dual_clip, eps_low=eps_low,
                                     eps_high=eps_high)
    total = lp.to(F64).sum() * 0.0
    for d, w in zip(docs, weights):
        for t in d.labelled:
            total = total + w * ell[t][0]
    return total


def ref_dual_clip_metrics(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor, *,
    loss: str, dual_clip: float | None, eps_low: float = 0.2, eps_high: float = 0.2,
    entropy: torch.Tensor | None = None,
) -> dict[str, float]:
    """Every metric at level ``basic`` (with ``entropy`` when given): the loss's own, and
    ``dual_clipped_fraction`` when the dual clip is on."""
    eps = dict(eps_low=eps_low, eps_high=eps_high)
    if loss == "grpo":
        out = ref_metrics(lp, old, adv, mask, doc, loss="grpo", entropy=entropy, **eps)
    else:
        out = ref_new_metrics(lp, old, adv, mask, doc, loss=loss, entropy=entropy, **eps)
    if dual_clip is not None:
        ell = ref_dual_clip_token_losses(lp, old, adv, mask, doc, loss=loss, dual_clip=dual_clip, **eps)
        docs = documents(mask, doc)
        acc = sum(sum(float(ell[t][1]) for t in d.labelled) / max(len(d.labelled), 1) for d in docs)
        out["dual_clipped_fraction"] = acc / len(docs)
    return out
