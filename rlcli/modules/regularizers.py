"""The terms a real RL loss adds to any registered policy loss, in one place for every entry point.

Per labelled token, with the loss's own ``ℓ_t`` (`PolicyLoss.per_token`), the total is

    ℓ'_t = w_t · ℓ_t + β · k(ref_t − lp_t) − c · H_t

- **KL to a reference** (`KLPenalty`: ``β = coef``, estimator ``k`` with ``δ = ref − lp``:
  k1 = −δ, k2 = δ²/2, k3 = exp(δ) − δ − 1, computed as ``expm1(δ) − δ``); gradient through ``lp``.
  With ``ratio_weighted`` the term is ``β · r_t · k`` with the loss's ratio ``r_t = exp(lp − old_lp)``,
  differentiable (for k3 its expected gradient is the reverse KL's, math.md#kl-to-a-reference).
- **Entropy bonus** (``c = entropy_coef``): ``H_t`` is the entropy of the temperature-scaled
  distribution at the position, with its gradient (the fused head adds it to the head's gradients).
- **Mismatch correction** (`Correction`): ``w_t`` is the detached importance weight of the
  trainer's log-probs at the start of the batch (``proximal_logprobs``, "prox") over the sampler's
  (``sampler_logprobs``, "behav"): ``log ρ = prox − behav`` per token, summed (``sequence``) or averaged
  (``geometric``) over the labelled tokens of the document; ``truncate``: ``w = min(ρ, high)``,
  ``mask`` (IcePop): ``w = ρ · 1[low ≤ ρ ≤ high]``; computed in log space, so ρ never overflows. Only the
  policy term is weighted (as verl's rollout correction); the KL and entropy terms are not.
  ``reject`` (rejection sampling) weighs by 1: `reject_tokens` takes the tokens out of bounds out of the
  mask before any total is counted (the trainer once per batch, `policy_loss` for its whole step).

The aggregation weights of math.md#aggregation then apply to ``ℓ'_t`` unchanged. Every term is off by default
and then the total is the loss's ``ℓ_t`` itself, bit for bit. `token_losses` is the one function
that computes ``ℓ'_t``: `micro_batch_loss` calls it on the micro-batch, the fused head on each
chunk (it takes ``dL/dlp`` and ``dL/dH`` by autograd through it). The correction weights depend on
the inputs only, so they are computed once per micro-batch (whole documents) and selected per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from rlcli.modules.bounds import FLOAT32_MAX, check_bounds
from rlcli.modules.losses import LossInputs, RatioUnits
from rlcli.modules.metrics import Metric, MetricPartials, document_mean_numerators, labelled_extreme
from rlcli.modules.registry import Registry
from rlcli.modules.segments import Segments

if TYPE_CHECKING:
    from rlcli.modules.policy_loss import LossSpec

F64 = torch.float64

# δ = ref − lp [N] -> the KL estimate [N], differentiable
KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")
# (correction, inputs) -> the importance weights of a micro-batch, or None
CORRECTION_MODES: Registry[Callable[..., ImportanceWeights | None]] = Registry("correction mode")
# (log ρ_t [N], labelled [N], segments) -> the log-ratio each token is weighted by [N]
CORRECTION_LEVELS: Registry[Callable[..., torch.Tensor]] = Registry("correction level")

# The k3 of the metrics (kl_ref, mismatch_kl) saturates at this log-ratio: exp(600) ~ 4e260, so a
# broken log-prob (a sampler's -9999 placeholder) gives a huge but finite metric, whose document
# mean cannot overflow float64. Every log-ratio below it is exact.
METRIC_LOG_RATIO_MAX = 600.0
# the coefficients of the KL and entropy terms: a float32 number, else coef x 0 is already NaN
TERM_COEF = {"ge": 0, "le": FLOAT32_MAX}

# the metrics of the terms (`add_term_partials`), none with metrics=none
METRICS = {
    "kl_ref": Metric("kl.coef > 0", "`μ(k3(ref − lp))`: the document mean of the k3 estimate of the KL to the "
                     "reference, whatever `kl.estimator`; 0 at the first step with `kl.reference=initial`"),
    "mismatch_kl": Metric("correction.mode is not none", "`μ(k3(prox − behav))`: the k3 estimate of the KL "
                          "between the trainer's log-probs at the start of the batch and the sampler's (with "
                          "`reject`: over the kept tokens)"),
    "is_weight_mean": Metric("correction.mode=truncate or mask", "`μ(u)`: the document mean of the importance "
                             "weight `u` (`truncate`: `min(ρ, high)`, `mask`: `ρ·1[low ≤ ρ ≤ high]`)"),
    "is_weight_max": Metric("correction.mode=truncate or mask", "the largest `u_t` over labelled tokens; empty in "
                            "a step with none"),
    "is_masked_fraction": Metric("correction.mode=truncate or mask", "`μ(1[u = 0])`: the document mean of the "
                                 "tokens `mask` rejects (0 with `truncate`)"),
}


@dataclass(frozen=True)
class KLPenalty:
    """``β · k(ref − lp)`` added to every labelled token's loss; ``coef = 0`` is off.

    The metric ``kl_ref`` (k3, whatever the estimator) is reported whenever reference log-probs
    are given, also with ``coef = 0``.

    Attributes:
        coef: ``β`` (``kl.coef``), ``>= 0``; 0 is off.
        estimator: ``k1``, ``k2`` or ``k3`` (``kl.estimator``), a name of ``KL_ESTIMATORS``.
        ratio_weighted: the term times the differentiable ratio ``r_t = exp(lp − old_lp)``
            (``kl.ratio_weighted``; TRL's ``use_bias_correction_kl``).
    """

    coef: float = field(default=0.0, metadata=TERM_COEF)
    estimator: str = "k3"
    ratio_weighted: bool = False

    def __post_init__(self):
        check_bounds(self)
        KL_ESTIMATORS[self.estimator]  # an unknown name: the registry's error
        if not isinstance(self.ratio_weighted, bool):
            raise ValueError(f"ratio_weighted must be a bool; got {self.ratio_weighted!r}")


@dataclass(frozen=True)
class Correction:
    """Training-inference mismatch correction: the policy term times the detached ``w``.

    Attributes:
        mode: ``none`` (off), ``truncate`` (``w = min(ρ, high)``), ``mask`` (IcePop: ``w = ρ · 1[low ≤ ρ ≤ high]``)
            or ``reject`` (``w = 1``; the tokens out of bounds leave the mask: `reject_tokens`).
        level: ``token`` (``ρ_t``), ``sequence`` (``Π_t ρ_t`` over the document's labelled tokens) or
            ``geometric`` (their geometric mean).
        low: the lower bound, read by ``mask`` and ``reject``; ``0 < low ≤ high``.
        high: the upper bound.
    """

    mode: str = "none"
    level: str = "token"
    low: float = field(default=0.5, metadata={"gt": 0})
    high: float = field(default=2.0, metadata={"gt": 0})

    def __post_init__(self):
        CORRECTION_MODES[self.mode]  # an unknown name: the registry's error
        CORRECTION_LEVELS[self.level]
        check_bounds(self)
        if self.low > self.high:
            raise ValueError(f"low must be <= high; got low={self.low!r}, high={self.high!r}")


@KL_ESTIMATORS.register("k1")
def _k1(delta: torch.Tensor) -> torch.Tensor:
    return -delta


@KL_ESTIMATORS.register("k2")
def _k2(delta: torch.Tensor) -> torch.Tensor:
    return 0.5 * delta.square()


@KL_ESTIMATORS.register("k3")
def _k3(delta: torch.Tensor) -> torch.Tensor:
    return torch.expm1(delta) - delta  # exp(δ) − δ − 1 without the cancellation of the − 1


@dataclass(frozen=True)
class ImportanceWeights:
    """The correction of one micro-batch, detached, float64, 0 / False where the mask is 0."""

    weight: torch.Tensor  # [N] w_t (w_d broadcast to the tokens of d at the sequence levels)
    rejected: torch.Tensor  # [N] bool: weight 0 by ``mode="mask"`` (never in ``truncate``)

    def select(self, rows: torch.Tensor) -> ImportanceWeights:
        return ImportanceWeights(self.weight[rows], self.rejected[rows])


def importance_weights(correction: Correction | None, inputs: LossInputs) -> ImportanceWeights | None:
    """The weights ``w`` of ``correction`` for ``inputs`` (whole documents); None when it is off."""
    return None if correction is None else CORRECTION_MODES[correction.mode](correction, inputs)


@CORRECTION_MODES.register("none")
def _no_correction(correction: Correction, inputs: LossInputs) -> None:
    return None


def _log_ratio(correction: Correction, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``log ρ = prox − behav`` [N] float64 at the correction's level, 0 where the mask is 0, and the
    mask as bool [N]."""
    labelled = inputs.labelled
    log_ratio = torch.where(
        labelled, inputs.proximal_logprobs.detach().to(F64) - inputs.sampler_logprobs.detach().to(F64), 0.0
    )  # [N]
    return CORRECTION_LEVELS[correction.level](log_ratio, labelled, inputs.segments), labelled


@CORRECTION_LEVELS.register("token")
def _token_level(log_ratio: torch.Tensor, labelled: torch.Tensor, segments: Segments) -> torch.Tensor:
    return log_ratio


@CORRECTION_LEVELS.register("sequence")
def _sequence_level(log_ratio: torch.Tensor, labelled: torch.Tensor, segments: Segments) -> torch.Tensor:
    return segments.broadcast(segments.sum(log_ratio))  # [N] Σ_{t∈d} log ρ_t


@CORRECTION_LEVELS.register("geometric")
def _geometric_level(log_ratio: torch.Tensor, labelled: torch.Tensor, segments: Segments) -> torch.Tensor:
    return segments.broadcast(segments.sum(log_ratio) / segments.sum(labelled.to(F64)).clamp(min=1))  # [N]


# both modes compute in log space and float64: ``log w = min(log ρ, log high)``, ``low ≤ ρ ≤ high`` as logs
@CORRECTION_MODES.register("truncate")
def _truncate(correction: Correction, inputs: LossInputs) -> ImportanceWeights:
    log_ratio, labelled = _log_ratio(correction, inputs)
    weight = torch.exp(log_ratio.clamp(max=math.log(correction.high)))
    return ImportanceWeights(torch.where(labelled, weight, 0.0), torch.zeros_like(labelled))


def _kept(correction: Correction, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log ρ`` [N] at the correction's level, the labelled tokens and those with ``low ≤ ρ ≤ high`` among
    them ([N] bool each)."""
    log_ratio, labelled = _log_ratio(correction, inputs)
    out_of_bounds = (log_ratio < math.log(correction.low)) | (log_ratio > math.log(correction.high))
    return log_ratio, labelled, labelled & ~out_of_bounds


@CORRECTION_MODES.register("mask")
def _mask(correction: Correction, inputs: LossInputs) -> ImportanceWeights:
    log_ratio, labelled, kept = _kept(correction, inputs)
    return ImportanceWeights(torch.exp(torch.where(kept, log_ratio, -math.inf)), labelled & ~kept)  # ρ ≤ high


@CORRECTION_MODES.register("reject")
def _reject(correction: Correction, inputs: LossInputs) -> None:
    return None  # weight 1: the rejected tokens are out of the mask already (`reject_tokens`)


def reject_tokens(correction: Correction | None, inputs: LossInputs) -> tuple[LossInputs, torch.Tensor | None]:
    """With ``mode="reject"``: ``inputs`` (whole documents) with the rejected tokens out of the mask, and
    ``[S]`` bool the rejected documents (by `Segments.of(inputs.document_index)`): those with a labelled
    token and no kept one, which are in no count (math.md#mismatch-correction). Else ``(inputs, None)``.
    Applying it again changes nothing."""
    if correction is None or correction.mode != "reject":
        return inputs, None
    _, labelled, kept = _kept(correction, inputs)
    segments = inputs.segments
    rejected = (segments.sum(labelled.to(F64)) > 0) & (segments.sum(kept.to(F64)) == 0)  # [S]
    return replace(inputs, mask=torch.where(kept, inputs.mask, torch.zeros_like(inputs.mask))), rejected


def token_losses(
    logprobs: torch.Tensor,
    inputs: LossInputs,
    spec: LossSpec,
    *,
    entropy: torch.Tensor | None = None,
    importance: ImportanceWeights | None = None,
) -> tuple[torch.Tensor, RatioUnits]:
    """``ℓ'_t = w_t ℓ_t + β k_t − c H_t`` [N] (0 where the mask is 0) and the loss's ratio units.

    ``ℓ_t`` is ``spec.loss.per_token(logprobs, inputs)``; ``importance`` the weights of `importance_weights`
    for the same rows (None: no correction). Differentiable w.r.t. ``logprobs`` and ``entropy``.
    """
    losses, units = spec.loss.per_token(logprobs, inputs)  # [N]
    labelled = inputs.labelled
    if importance is not None:
        losses = losses * importance.weight.detach().to(losses.dtype)
    if spec.kl_on:
        # values under the mask may be anything, -inf and NaN included: never read them
        delta = torch.where(labelled, inputs.reference_logprobs.detach().to(logprobs.dtype) - logprobs, 0.0)
        kl = KL_ESTIMATORS[spec.kl.estimator](delta)
        if spec.kl.ratio_weighted:
            kl = kl * torch.exp(inputs.log_ratio(logprobs))  # r_t, 1 where the mask is 0
        losses = losses + spec.kl.coef * kl
    if spec.entropy_on:
        losses = losses - spec.entropy_coef * torch.where(labelled, entropy, 0.0)
    return losses, units


def _metric_k3(delta: torch.Tensor) -> torch.Tensor:
    """k3 for the metrics, float64, saturating at ``METRIC_LOG_RATIO_MAX``."""
    delta = delta.clamp(max=METRIC_LOG_RATIO_MAX)
    return torch.expm1(delta) - delta


def add_term_partials(
    partials: MetricPartials,
    logprobs: torch.Tensor,
    inputs: LossInputs,
    importance: ImportanceWeights | None,
    *,
    metrics: str,
) -> None:
    """Add the terms' metrics of one micro-batch (whole documents) to ``partials``, float64.

    ``kl_ref = μ(k3(ref − lp))`` when reference log-probs are given, ``mismatch_kl = μ(k3(prox − behav))``
    when sampler log-probs are, and with a correction ``is_weight_mean = μ(w)``, ``is_weight_max``
    (max over labelled tokens) and ``is_masked_fraction = μ(1[rejected])``."""
    if metrics == "none":
        return
    labelled = inputs.labelled

    def log_ratio(numerator, denominator):
        return torch.where(labelled, numerator.detach().to(F64) - denominator.detach().to(F64), 0.0)

    means = {}
    if inputs.reference_logprobs is not None:
        means["kl_ref"] = _metric_k3(log_ratio(inputs.reference_logprobs, logprobs))
    if inputs.sampler_logprobs is not None:
        means["mismatch_kl"] = _metric_k3(log_ratio(inputs.proximal_logprobs, inputs.sampler_logprobs))
    if importance is not None:
        means["is_weight_mean"] = importance.weight
        means["is_masked_fraction"] = importance.rejected
        partials.maxima["is_weight_max"] = labelled_extreme(importance.weight, inputs, -math.inf, torch.max)
    if means:
        partials.means |= document_mean_numerators(means, inputs)
