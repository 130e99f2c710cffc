"""Per-token policy losses of SPEC §3: GRPO (token ratios) and GSPO (sequence ratios)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlcli.modules.segments import Segments

LOSSES = ("grpo", "gspo")


def check_loss_options(loss: str, eps_low: float, eps_high: float) -> None:
    """Raise ``ValueError`` naming the first invalid argument."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r}")
    if not (isinstance(eps_low, (int, float)) and 0 <= eps_low < 1):
        raise ValueError(f"eps_low must be a number in [0, 1); got {eps_low!r}")
    if not (isinstance(eps_high, (int, float)) and 0 <= eps_high < math.inf):
        raise ValueError(f"eps_high must be a finite number >= 0; got {eps_high!r}")


@dataclass(frozen=True)
class RatioUnits:
    """The importance ratios the metrics are taken over: tokens (grpo) or documents (gspo).

    ``mean_weight`` turns a sum over units into the document mean's numerator (SPEC §6, before the
    division by D); ``count_weight`` marks the units that enter the plain sums. All detached.
    """

    ratio: torch.Tensor  # [U]
    log_ratio: torch.Tensor  # [U]
    mean_weight: torch.Tensor  # [U]
    count_weight: torch.Tensor  # [U]


def _clipped_objective(ratio, advantage, eps_low, eps_high):
    """``min(r A, clip(r) A)`` elementwise."""
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.minimum(ratio * advantage, clipped * advantage)


def per_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segments: Segments,
    *,
    loss: str,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, RatioUnits]:
    """Per-token losses ``ℓ_t`` ([N], 0 where ``mask`` is 0) and the ratios for the metrics.

    Documents must be whole in the given tokens (GSPO takes each document's mean).
    """
    labelled = mask > 0
    # values under the mask (prompt, padding) may be anything, -inf and NaN included: never read them
    log_ratio = torch.where(labelled, logprobs - old_logprobs, 0.0)  # [N]
    advantages = torch.where(labelled, advantages, 0.0)  # [N]
    doc_tokens = segments.sum(mask)  # [S] n_d
    doc_norm = doc_tokens.clamp(min=1)  # [S]
    if loss == "grpo":
        ratio = torch.exp(log_ratio)  # [N]
        losses = torch.where(labelled, -_clipped_objective(ratio, advantages, eps_low, eps_high), 0.0)  # [N]
        units = RatioUnits(
            ratio=ratio.detach(),
            log_ratio=log_ratio.detach(),
            mean_weight=mask / segments.broadcast(doc_norm),
            count_weight=mask,
        )
        return losses, units
    # gspo: one sequence ratio per document; gradient flows through rho_d only.
    rho = segments.sum(log_ratio) / doc_norm  # [S]
    seq_ratio = torch.exp(rho)  # [S]
    seq_advantage = (segments.sum(advantages.detach()) / doc_norm).detach()  # [S]
    doc_loss = -_clipped_objective(seq_ratio, seq_advantage, eps_low, eps_high)  # [S]
    losses = segments.broadcast(doc_loss) * mask  # [N]
    has_tokens = (doc_tokens > 0).to(mask.dtype)  # [S]
    units = RatioUnits(
        ratio=seq_ratio.detach(),
        log_ratio=rho.detach(),
        mean_weight=has_tokens,
        count_weight=has_tokens,
    )
    return losses, units
