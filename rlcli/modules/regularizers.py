"""The terms a real RL loss adds to any registered policy loss, in one place for every entry point.

Per labelled token, with the loss's own ``ℓ_t`` (`PolicyLoss.per_token`), the total is

    ℓ'_t = w_t · ℓ_t + β · k(ref_t − lp_t) − c · H_t

- **KL to a reference** (`KLPenalty`: ``β = coef``, estimator ``k`` with ``δ = ref − lp``:
  k1 = −δ, k2 = δ²/2, k3 = exp(δ) − δ − 1, computed as ``expm1(δ) − δ``); gradient through ``lp``.
- **Entropy bonus** (``c = entropy_coef``): ``H_t`` is the entropy of the temperature-scaled
  distribution at the position, with its gradient (the fused head adds it to the head's gradients).
- **Mismatch correction** (`Correction`): ``w_t`` is the detached importance weight of the
  trainer's log-probs at the start of the batch (``old_logprobs``, "prox") over the sampler's
  (``behaviour_logprobs``): ``log ρ = prox − behav`` per token, summed (``sequence``) or averaged
  (``geometric``) over the labelled tokens of the document; ``truncate``: ``w = min(ρ, high)``,
  ``mask``: ``w = 1[low ≤ ρ ≤ high]``; computed in log space, so ρ never overflows. Only the
  policy term is weighted (as verl's rollout correction); the KL and entropy terms are not.

The aggregation weights of SPEC §4 then apply to ``ℓ'_t`` unchanged. Every term is off by default
and then the total is the loss's ``ℓ_t`` itself, bit for bit. `token_losses` is the one function
that computes ``ℓ'_t``: `micro_batch_loss` calls it on the micro-batch, the fused head on each
chunk (it takes ``dL/dlp`` and ``dL/dH`` by autograd through it). The correction weights depend on
the inputs only, so they are computed once per micro-batch (whole documents) and selected per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rlcli.modules.bounds import FLOAT32_MAX, check_bounds
from rlcli.modules.losses import LossInputs, PolicyLoss, RatioUnits
from rlcli.modules.metrics import MetricPartials, document_mean_numerator, labelled_extreme

KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTION_MODES = ("none", "truncate", "mask")
CORRECTION_LEVELS = ("token", "sequence", "geometric")

# The k3 of the metrics (kl_ref, mismatch_kl) saturates at this log-ratio: exp(600) ~ 4e260, so a
# broken log-prob (a sampler's -9999 placeholder) gives a huge but finite metric, whose document
# mean cannot overflow float64. Every log-ratio below it is exact.
METRIC_LOG_RATIO_MAX = 600.0
# the coefficients of the KL and entropy terms: a float32 number, else coef x 0 is already NaN
TERM_COEF = {"ge": 0, "le": FLOAT32_MAX}


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if not (isinstance(value, str) and value in choices):
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class KLPenalty:
    """``β · k(ref − lp)`` added to every labelled token's loss; ``coef = 0`` is off.

    The metric ``kl_ref`` (k3, whatever the estimator) is reported whenever reference log-probs
    are given, also with ``coef = 0``."""

    coef: float = field(default=0.0, metadata=TERM_COEF)
    estimator: str = "k3"

    def __post_init__(self):
        check_bounds(self)
        _check_choice("estimator", self.estimator, KL_ESTIMATORS)


@dataclass(frozen=True)
class Correction:
    """Training-inference mismatch correction: the policy term times the detached ``w``.

    ``mode``: ``none`` (off) | ``truncate`` (``w = min(ρ, high)``) | ``mask`` (``w = 1[low ≤ ρ ≤ high]``);
    ``level``: ``token`` (``ρ_t``) | ``sequence`` (``Π_t ρ_t`` over the document's labelled tokens) |
    ``geometric`` (their geometric mean). ``0 < low ≤ high``; ``low`` is read by ``mask`` only."""

    mode: str = "none"
    level: str = "token"
    low: float = field(default=0.5, metadata={"gt": 0})
    high: float = field(default=2.0, metadata={"gt": 0})

    def __post_init__(self):
        _check_choice("mode", self.mode, CORRECTION_MODES)
        _check_choice("level", self.level, CORRECTION_LEVELS)
        check_bounds(self)
        if self.low > self.high:
            raise ValueError(f"low must be <= high; got low={self.low!r}, high={self.high!r}")


@dataclass(frozen=True)
class _EntropyCoef:
    """Only to check ``entropy_coef`` with the bounds and messages of every other option."""

    entropy_coef: float = field(default=0.0, metadata=TERM_COEF)

    def __post_init__(self):
        check_bounds(self)


@dataclass(frozen=True)
class Terms:
    """The checked terms of one call of an entry point (all off by default)."""

    kl: KLPenalty = field(default_factory=KLPenalty)
    entropy_coef: float = 0.0
    correction: Correction = field(default_factory=Correction)

    @classmethod
    def of(cls, kl: KLPenalty | None = None, entropy_coef: float = 0.0, correction: Correction | None = None) -> Terms:
        """The terms of the entry points' keywords; ``ValueError`` naming the first invalid one."""
        if kl is not None and not isinstance(kl, KLPenalty):
            raise ValueError(f"kl must be a KLPenalty or None; got {kl!r}")
        if correction is not None and not isinstance(correction, Correction):
            raise ValueError(f"correction must be a Correction or None; got {correction!r}")
        _EntropyCoef(entropy_coef)
        return cls(kl or KLPenalty(), float(entropy_coef), correction or Correction())

    @property
    def kl_on(self) -> bool:
        return self.kl.coef > 0

    @property
    def entropy_on(self) -> bool:
        return self.entropy_coef > 0

    @property
    def correction_on(self) -> bool:
        return self.correction.mode != "none"

    def require(self, *, reference_logprobs, behaviour_logprobs, entropy) -> None:
        """Raise ``ValueError`` naming the input a term needs and did not get."""
        if self.kl_on and reference_logprobs is None:
            raise ValueError(f"kl.coef = {self.kl.coef:g} > 0 needs reference_logprobs")
        if self.correction_on and behaviour_logprobs is None:
            raise ValueError(f"correction mode {self.correction.mode!r} needs behaviour_logprobs")
        if self.entropy_on and entropy is None:
            raise ValueError(f"entropy_coef = {self.entropy_coef:g} > 0 needs entropy (with its gradient)")


def kl_estimate(delta: torch.Tensor, estimator: str) -> torch.Tensor:
    """``[N] -> [N]``: the estimator of SPEC's KL term at ``δ = ref − lp`` (differentiable)."""
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.expm1(delta) - delta  # exp(δ) − δ − 1 without the cancellation of the − 1
    raise ValueError(f"estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")


@dataclass(frozen=True)
class ImportanceWeights:
    """The correction of one micro-batch, detached, float64, 0 / False where the mask is 0."""

    weight: torch.Tensor  # [N] w_t (w_d broadcast to the tokens of d at the sequence levels)
    rejected: torch.Tensor  # [N] bool: masked out by ``mode="mask"`` (never in ``truncate``)

    def select(self, rows: torch.Tensor) -> ImportanceWeights:
        return ImportanceWeights(self.weight[rows], self.rejected[rows])


def importance_weights(correction: Correction, inputs: LossInputs) -> ImportanceWeights | None:
    """The weights ``w`` of ``correction`` for ``inputs`` (whole documents); None when it is off.

    ``old_logprobs`` is prox, ``behaviour_logprobs`` behav. Everything in log space and float64:
    ``log w = min(log ρ, log high)`` and ``low ≤ ρ ≤ high`` compared as logs."""
    if correction.mode == "none":
        return None
    labelled = inputs.mask > 0
    f64 = torch.float64
    log_ratio = torch.where(
        labelled, inputs.old_logprobs.detach().to(f64) - inputs.behaviour_logprobs.detach().to(f64), 0.0
    )  # [N]
    if correction.level != "token":
        segments = inputs.segments
        log_ratio = segments.sum(log_ratio)  # [S]
        if correction.level == "geometric":
            log_ratio = log_ratio / segments.sum(labelled.to(f64)).clamp(min=1)
        log_ratio = segments.broadcast(log_ratio)  # [N]
    if correction.mode == "truncate":
        weight = torch.exp(log_ratio.clamp(max=math.log(correction.high)))
        rejected = torch.zeros_like(labelled)
    else:  # mask
        rejected = (log_ratio < math.log(correction.low)) | (log_ratio > math.log(correction.high))
        weight = (~rejected).to(f64)
    return ImportanceWeights(torch.where(labelled, weight, 0.0), rejected & labelled)


def token_losses(
    loss: PolicyLoss,
    logprobs: torch.Tensor,
    inputs: LossInputs,
    terms: Terms,
    *,
    entropy: torch.Tensor | None = None,
    importance: ImportanceWeights | None = None,
) -> tuple[torch.Tensor, RatioUnits]:
    """``ℓ'_t = w_t ℓ_t + β k_t − c H_t`` [N] (0 where the mask is 0) and the loss's ratio units.

    ``ℓ_t`` is ``loss.per_token(logprobs, inputs)``; ``importance`` the weights of `importance_weights`
    for the same rows (None: no correction). Differentiable w.r.t. ``logprobs`` and ``entropy``.
    """
    losses, units = loss.per_token(logprobs, inputs)  # [N]
    labelled = inputs.mask > 0
    if importance is not None:
        losses = losses * importance.weight.detach().to(losses.dtype)
    if terms.kl_on:
        # values under the mask may be anything, -inf and NaN included: never read them
        delta = torch.where(labelled, inputs.reference_logprobs.detach().to(logprobs.dtype) - logprobs, 0.0)
        losses = losses + terms.kl.coef * kl_estimate(delta, terms.kl.estimator)
    if terms.entropy_on:
        losses = losses - terms.entropy_coef * torch.where(labelled, entropy, 0.0)
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
    when behaviour log-probs are, and with a correction ``is_weight_mean = μ(w)``, ``is_weight_max``
    (max over labelled tokens) and ``is_masked_fraction = μ(1[rejected])``."""
    if metrics == "none":
        return
    f64 = torch.float64
    labelled = inputs.mask > 0

    def log_ratio(numerator, denominator):
        return torch.where(labelled, numerator.detach().to(f64) - denominator.detach().to(f64), 0.0)

    if inputs.reference_logprobs is not None:
        k3 = _metric_k3(log_ratio(inputs.reference_logprobs, logprobs))
        partials.means["kl_ref"] = document_mean_numerator(k3, inputs)
    if inputs.behaviour_logprobs is not None:
        k3 = _metric_k3(log_ratio(inputs.old_logprobs, inputs.behaviour_logprobs))
        partials.means["mismatch_kl"] = document_mean_numerator(k3, inputs)
    if importance is not None:
        partials.means["is_weight_mean"] = document_mean_numerator(importance.weight, inputs)
        partials.maxima["is_weight_max"] = labelled_extreme(importance.weight, inputs, -math.inf, torch.max)
        partials.means["is_masked_fraction"] = document_mean_numerator(importance.rejected.to(f64), inputs)
