"""Per-token policy losses of math.md#policy-losses as registered objects: GRPO (token ratios) and GSPO
(sequence ratios).

A loss is a frozen dataclass subclass of `PolicyLoss` whose fields are its options (bounds in the
field metadata, keys ``ge``/``gt``/``le``/``lt``, and ``doc``, the option's one-line description that
``rlcli train --help`` and the config reference show), registered by name in `LOSSES`:

    @LOSSES.register()
    @dataclass(frozen=True)
    class MyLoss(PolicyLoss):
        name = "my_loss"
        sequence_level = False
        eps: float = field(default=0.1, metadata={"gt": 0, "doc": "the clip range"})

        def per_token(self, logprobs, inputs): ...

Nothing else in `rlcli.modules` names a loss: a `LossSpec` takes its name (or an instance).
"""

from __future__ import annotations

import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar, Optional

import torch

from rlcli.modules.bounds import FLOAT32_MAX, check_bounds
from rlcli.modules.registry import Registry
from rlcli.modules.segments import Segments

if TYPE_CHECKING:
    from rlcli.modules.metrics import MetricPartials

_INDICES = ("document_index", "group_index")
# 1 + eps_high, a float32 bound of the ratios, rounds to at most FLOAT32_MAX
EPS_HIGH = {"ge": 0, "le": FLOAT32_MAX}
# c of the dual clip: above 1 (at c <= 1 the cap would act inside the clip range), and a float32 number
DUAL_CLIP = {"gt": 1, "le": FLOAT32_MAX}


class computed_once:  # noqa: N801 (a decorator, like the functools one it stands for)
    """`functools.cached_property` without its lock, which ``torch.compile`` cannot trace (Python 3.11):
    the value is computed on the first read and kept in the instance from then on."""

    def __init__(self, function):
        self.function, self.name, self.__doc__ = function, function.__name__, function.__doc__

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = self.function(instance)
        instance.__dict__[self.name] = value  # read before this descriptor from now on
        return value


@dataclass(frozen=True, kw_only=True, eq=False)
class LossInputs:
    """The per-token inputs of a loss besides the policy's own log-probs, all ``[N]`` over whole
    documents, each named by where it comes from (keywords only). A loss reads only the fields it needs.

    Attributes:
        proximal_logprobs: the ratio's denominator: the sampler's log-probs, or the trainer's own
            recomputed at the start of the batch (decoupled PPO).
        advantages: the advantage of each token.
        mask: 1 for a token that is trained on (labelled), 0 elsewhere.
        document_index: the document of each token (any integer ids).
        group_index: the group (prompt) of each token (any integer ids); ``aggregation="prompt_mean"``
            needs it.
        sampler_logprobs: the behaviour policy's (the sampler's) log-probs, for the mismatch correction.
        reference_logprobs: a reference policy's log-probs, for the KL penalty.
        documents: ``Segments.of(document_index)`` when the caller knows it already (the trainer, from
            the packer): finding the documents of a device tensor waits for the device (``unique``).
    """

    proximal_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    mask: torch.Tensor  # [N] 1 for labelled tokens, 0 elsewhere
    document_index: torch.Tensor  # [N] the document of each token (any integer ids)
    group_index: torch.Tensor | None = None  # [N] the group of each token (any integer ids)
    sampler_logprobs: torch.Tensor | None = None  # [N]
    reference_logprobs: torch.Tensor | None = None  # [N]
    documents: Segments | None = None  # the documents of document_index when the caller knows them

    def __post_init__(self):
        shape = self.proximal_logprobs.shape
        if len(shape) != 1:
            raise ValueError(f"proximal_logprobs must be a flat [N] tensor; got shape {tuple(shape)}")
        for name, tensor in self.tensors().items():
            if tensor is not None and tensor.shape != shape:
                raise ValueError(f"{name} must have the shape of proximal_logprobs {tuple(shape)}; "
                                 f"got {tuple(tensor.shape)}")

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Every ``[N]`` field by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "documents"}

    @property
    def shape(self) -> torch.Size:
        """``[N]``"""
        return self.proximal_logprobs.shape

    @computed_once
    def labelled(self) -> torch.Tensor:
        """``mask > 0`` [N] bool: the tokens trained on (computed once)."""
        return self.mask > 0

    @computed_once
    def document_mean_weight(self) -> torch.Tensor:
        """``m_t / max(n_d, 1)`` [N] float64: summed against values, the numerator of their document mean
        ``μ`` (math.md#metrics); computed once."""
        mask = plain(self.mask).to(torch.float64)
        return mask / self.segments.broadcast(self.segments.sum(mask).clamp(min=1))

    @computed_once
    def segments(self) -> Segments:
        """The documents of ``document_index``: ``documents`` when given, else found once."""
        return self.documents if self.documents is not None else Segments.of(self.document_index)

    def select(self, rows: torch.Tensor, documents: Segments | None = None) -> LossInputs:
        """The inputs of the tokens ``rows`` [R] (whole documents for a sequence-level loss), with their
        ``documents`` when the caller knows them."""
        return LossInputs(**{name: None if value is None else value[rows] for name, value in self.tensors().items()},
                          documents=documents)

    def detached(self, dtype: torch.dtype) -> LossInputs:
        """The inputs without autograd, every one but the indices in ``dtype`` (each as it is where it is
        so already)."""
        return LossInputs(**{name: value if value is None or name in _INDICES else plain(value).to(dtype)
                             for name, value in self.tensors().items()}, documents=self.documents)

    def log_ratio(self, logprobs: torch.Tensor) -> torch.Tensor:
        """``lp − prox`` [N], 0 where the mask is 0."""
        # values under the mask (prompt, padding) may be anything, -inf and NaN included: never read them
        return torch.where(self.labelled, logprobs - self.proximal_logprobs, 0.0)

    @property
    def labelled_advantages(self) -> torch.Tensor:
        """``A`` [N], 0 where the mask is 0."""
        return torch.where(self.labelled, self.advantages, 0.0)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without autograd: detached only where it has any (a detach is one more operation)."""
    return tensor.detach() if tensor.requires_grad else tensor


@dataclass(frozen=True)
class RatioUnits:
    """The importance ratios the metrics are taken over: tokens (grpo) or documents (gspo).

    ``mean_weight`` turns a sum over units into the document mean's numerator (math.md#metrics, before the
    division by D); ``count_weight`` marks the units that enter the plain sums. All detached.
    """

    ratio: torch.Tensor  # [U]
    log_ratio: torch.Tensor  # [U]
    mean_weight: torch.Tensor  # [U]
    count_weight: torch.Tensor  # [U]

    @classmethod
    def of_tokens(cls, log_ratio: torch.Tensor, inputs: LossInputs) -> RatioUnits:
        """One unit per token: ``log_ratio`` [N], 0 where the mask is 0."""
        log_ratio = log_ratio.detach()
        return cls(ratio=torch.exp(log_ratio), log_ratio=log_ratio,
                   mean_weight=inputs.document_mean_weight, count_weight=inputs.mask)

    @classmethod
    def of_documents(cls, log_ratio: torch.Tensor, doc_tokens: torch.Tensor) -> RatioUnits:
        """One unit per document with labelled tokens: ``log_ratio`` [S], ``doc_tokens`` [S] n_d."""
        log_ratio = log_ratio.detach()
        has_tokens = (doc_tokens > 0).to(doc_tokens.dtype)  # [S]
        return cls(ratio=torch.exp(log_ratio), log_ratio=log_ratio, mean_weight=has_tokens, count_weight=has_tokens)


@dataclass(frozen=True)
class PolicyLoss(ABC):
    """A per-token policy loss; its dataclass fields are its options, checked against their bounds.

    ``sequence_level``: the loss of a token depends on its whole document, so callers must keep a
    document's tokens together (the fused head chunks at document boundaries). A subclass that
    defines ``__post_init__`` calls ``super().__post_init__()``.
    """

    name: ClassVar[str]
    sequence_level: ClassVar[bool]

    def __post_init__(self):
        check_bounds(self)
        hints = typing.get_type_hints(type(self))
        for f in fields(self):  # a float option given as an int (a config's eps_high=2**64): torch compares
            value = getattr(self, f.name)  # tensors with floats of any size, not with ints beyond 64 bits
            if float in (hints[f.name], *typing.get_args(hints[f.name])) and type(value) is int:
                object.__setattr__(self, f.name, float(value))

    @abstractmethod
    def per_token(self, logprobs: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, RatioUnits]:
        """The loss of every token and the ratios the metrics are taken over.

        Args:
            logprobs: ``[N]`` the policy's log-probs ``lp_t``, with gradient.
            inputs: the step's other per-token tensors.

        Returns:
            ``ℓ_t`` (``[N]``, 0 where the mask is 0) and the `RatioUnits` (tokens or documents) of the
            ratio metrics.
        """

    def clipped(self, ratio: torch.Tensor) -> torch.Tensor | None:
        """``[U] -> [U]`` bool: the units ``clipped_ratio_fraction`` counts; None: no such metric."""
        return None

    def add_metric_partials(self, partials: MetricPartials, units: RatioUnits, inputs: LossInputs) -> None:
        """Add this loss's own metrics (float64) to the micro-batch's ``partials``."""
        return None  # the shared metrics only


@dataclass(frozen=True)
class ClippedRatioLoss(PolicyLoss):
    """A loss of ``min(r·A, clip(r)·A)``, ``clip(r) = min(max(r, 1 − eps_low), 1 + eps_high)``."""

    eps_low: float = field(default=0.2, metadata={
        "ge": 0, "lt": 1, "doc": "the clip's lower side: a ratio below 1 - eps_low is clipped"})
    eps_high: float = field(default=0.2, metadata={
        **EPS_HIGH, "doc": "the clip's upper side: a ratio above 1 + eps_high is clipped"})

    def clipped_objective(self, ratio: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
        """``min(r A, clip(r) A)`` elementwise."""
        clipped = torch.clamp(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)
        return torch.minimum(ratio * advantage, clipped * advantage)

    def clipped(self, ratio: torch.Tensor) -> torch.Tensor:
        """Ratios outside ``[1 − eps_low, 1 + eps_high]``, whatever the sign of A."""
        return (ratio < 1 - self.eps_low) | (ratio > 1 + self.eps_high)


@dataclass(frozen=True)
class DualClipLoss(ClippedRatioLoss):
    """A clipped ratio loss with the dual clip of math.md#dual-clip: ``ℓ_t`` becomes ``min(ℓ_t, −c·A_t)``
    where ``A_t < 0``, a constant ``−c·A_t`` (no gradient) where the token's ratio ``x_t`` exceeds ``c``."""

    # Optional, not `float | None`: the config's type check walks typing.Optional
    dual_clip: Optional[float] = field(default=None, metadata={  # noqa: UP045
        **DUAL_CLIP, "doc": "c of the dual clip: a token with A < 0 has its loss capped at -c x A (null: off)"})

    def dual_capped(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor | None:
        """``[N] -> [N]`` bool: the tokens the dual clip caps, ``A_t < 0`` and ``x_t > c``; None when it is
        off. ``log_ratio`` is ``log x_t``, ``advantages`` 0 where the mask is 0."""
        if self.dual_clip is None:
            return None
        return (advantages < 0) & (torch.exp(log_ratio.detach()) > self.dual_clip)

    def dual_clipped(self, losses: torch.Tensor, capped: torch.Tensor | None, advantages: torch.Tensor
                     ) -> torch.Tensor:
        """``ℓ^dc_t`` [N]: ``−c·A_t`` where ``capped``, ``losses`` elsewhere."""
        if capped is None:
            return losses
        return torch.where(capped, -self.dual_clip * advantages, losses)

    def add_dual_clip_partials(self, partials: MetricPartials, log_ratio: torch.Tensor, inputs: LossInputs) -> None:
        """``dual_clipped_fraction`` (when on), with ``log_ratio`` [N] the value of each token's ``log x_t``."""
        if self.dual_clip is not None:
            capped = self.dual_capped(log_ratio, inputs.labelled_advantages).to(torch.float64)  # [N]
            partials.means["dual_clipped_fraction"] = (inputs.document_mean_weight * capped).sum()


LOSSES: Registry[type[PolicyLoss]] = Registry("loss")
"""The policy losses by name: grpo, gspo, gspo_token, cispo, sapo and every class registered with
``@LOSSES.register()``."""


def make_loss(loss: str | PolicyLoss = "grpo", **options: float) -> PolicyLoss:
    """A loss object from a registered name and options.

    Args:
        loss: a name in `LOSSES`, or a `PolicyLoss` instance (returned as is).
        **options: the loss class's options (its dataclass fields), e.g. ``eps_low=0.1``.

    Returns:
        The loss registered as ``loss`` with the given options, or the instance ``loss``.

    Raises:
        ValueError: an unknown name, an unknown option or one out of its bounds, or options given with
            an instance.
    """
    if isinstance(loss, PolicyLoss):
        if options:
            raise ValueError(f"options {', '.join(options)} given with the loss instance {loss!r}; set them on it")
        return loss
    cls = LOSSES[loss]
    known = [f.name for f in fields(cls) if f.init]
    for option in options:
        if option not in known:
            raise ValueError(f"{option} is not an option of loss {loss!r}; it takes {', '.join(known) or 'none'}")
    return cls(**options)


@LOSSES.register()
@dataclass(frozen=True)
class GRPO(DualClipLoss):
    """``ℓ_t = −min(r_t·A_t, clip(r_t)·A_t)`` with token ratios ``r_t = exp(lp_t − old_lp_t)``; with
    ``dual_clip`` c, ``min(ℓ_t, −c·A_t)`` where ``A_t < 0``."""

    name = "grpo"
    sequence_level = False

    def per_token(self, logprobs: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, RatioUnits]:
        log_ratio = inputs.log_ratio(logprobs)  # [N]
        advantages = inputs.labelled_advantages  # [N]
        capped = self.dual_capped(log_ratio, advantages)  # [N] | None
        # a capped token's ratio is never read: exp(0) there, so an overflowing exp cannot make its 0 gradient NaN
        ratio = torch.exp(log_ratio if capped is None else torch.where(capped, 0.0, log_ratio))  # [N]
        losses = self.dual_clipped(-self.clipped_objective(ratio, advantages), capped, advantages)  # [N]
        return torch.where(inputs.labelled, losses, 0.0), RatioUnits.of_tokens(log_ratio, inputs)

    def add_metric_partials(self, partials: MetricPartials, units: RatioUnits, inputs: LossInputs) -> None:
        self.add_dual_clip_partials(partials, units.log_ratio, inputs)


@LOSSES.register()
@dataclass(frozen=True)
class GSPO(ClippedRatioLoss):
    """Every labelled token of document d gets ``λ_d = −min(R_d·Ā_d, clip(R_d)·Ā_d)``, with the
    sequence ratio ``R_d = exp(mean_d(lp − old_lp))`` and ``Ā_d = mean_d(A)``; the gradient flows
    through ``R_d`` only."""

    name = "gspo"
    sequence_level = True

    def per_token(self, logprobs: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, RatioUnits]:
        segments = inputs.segments
        doc_tokens = segments.sum(inputs.mask)  # [S] n_d
        doc_norm = doc_tokens.clamp(min=1)  # [S]
        rho = segments.sum(inputs.log_ratio(logprobs)) / doc_norm  # [S]
        seq_advantage = (segments.sum(inputs.labelled_advantages.detach()) / doc_norm).detach()  # [S]
        doc_loss = -self.clipped_objective(torch.exp(rho), seq_advantage)  # [S]
        return segments.broadcast(doc_loss) * inputs.mask, RatioUnits.of_documents(rho, doc_tokens)

    def add_metric_partials(self, partials: MetricPartials, units: RatioUnits, inputs: LossInputs) -> None:
        partials.sums["num_segments"] = units.count_weight.to(torch.float64).sum()


# σ(x) rounds to exactly 1 in every floating dtype once x >= this (e^-50 is far below half an ulp of 1)
_SIGMOID_IS_ONE = 50.0
# τ and the gate's height 4/τ are float32 numbers
_SAPO_TAU = {"ge": 4 / FLOAT32_MAX, "le": FLOAT32_MAX}


@LOSSES.register()
@dataclass(frozen=True)
class CISPO(PolicyLoss):
    """CISPO (MiniMax-M1): ``ℓ_t = −sg(min(r_t, 1 + eps_high))·A_t·lp_t``.

    A REINFORCE term whose importance weight is truncated at ``1 + eps_high`` and carries no gradient:
    a token with a large ratio keeps its gradient, only with a bounded weight. There is no lower bound
    (MiniMax-M1 sets its ε_low so large that it never acts). ``clipped``: the tokens whose weight was
    truncated, ``r_t > 1 + eps_high``.
    """

    name = "cispo"
    sequence_level = False
    # IS weight capped at 5: the truncation TRL recommends for CISPO (ScaleRL's ε_max = 5); MiniMax-M1
    # tunes its bound but does not publish it
    eps_high: float = field(default=4.0, metadata={
        **EPS_HIGH, "doc": "the importance weight is truncated at 1 + eps_high"})

    def per_token(self, logprobs: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, RatioUnits]:
        log_ratio = inputs.log_ratio(logprobs)  # [N]
        # exp may overflow to inf: the min with the bound is still exact, and the weight has no gradient
        weight = torch.clamp(torch.exp(log_ratio.detach()), max=1.0 + self.eps_high)  # [N]
        labelled_logprobs = torch.where(inputs.labelled, logprobs, 0.0)  # [N]
        losses = torch.where(inputs.labelled, -weight * inputs.labelled_advantages * labelled_logprobs, 0.0)
        return losses, RatioUnits.of_tokens(log_ratio, inputs)

    def clipped(self, ratio: torch.Tensor) -> torch.Tensor:
        """The tokens whose importance weight was truncated: ``r > 1 + eps_high``, whatever the sign of A."""
        return ratio > 1 + self.eps_high


@LOSSES.register()
@dataclass(frozen=True)
class SAPO(PolicyLoss):
    """SAPO (Soft Adaptive Policy Optimization, Qwen 2025): ``ℓ_t = −f_t(r_t)·A_t`` with the soft gate
    ``f_t(r) = σ(τ_t·(r − 1))·4/τ_t``, ``τ_t = tau_pos`` if ``A_t > 0`` else ``tau_neg``.

    In place of a hard clip the gradient ``−4σ(1 − σ)·r_t·A_t·∇lp_t`` is the plain policy gradient at
    ``r_t = 1`` and fades smoothly as the ratio leaves 1, faster for a larger τ. There is no hard clip,
    so no ``clipped_ratio_fraction``.
    """

    name = "sapo"
    sequence_level = False
    # the paper's: a negative advantage's gate decays a little faster
    tau_pos: float = field(default=1.0, metadata={
        **_SAPO_TAU, "doc": "the gate's steepness tau for a positive advantage"})
    tau_neg: float = field(default=1.05, metadata={
        **_SAPO_TAU, "doc": "the gate's steepness tau for a negative advantage"})

    def per_token(self, logprobs: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, RatioUnits]:
        log_ratio = inputs.log_ratio(logprobs)  # [N]
        advantages = inputs.labelled_advantages  # [N]
        positive = advantages > 0
        tau = torch.where(positive, log_ratio.new_tensor(self.tau_pos), log_ratio.new_tensor(self.tau_neg))  # [N]
        # beyond log(1 + 50/τ) the gate is exactly 4/τ: stop there, so that exp cannot overflow into inf·0 = NaN
        saturated = torch.where(positive, log_ratio.new_tensor(math.log1p(_SIGMOID_IS_ONE / self.tau_pos)),
                                log_ratio.new_tensor(math.log1p(_SIGMOID_IS_ONE / self.tau_neg)))  # [N]
        log_ratio_gate = torch.where(log_ratio > saturated, saturated, log_ratio)  # [N]
        gate = torch.sigmoid(tau * torch.expm1(log_ratio_gate)) * (4.0 / tau)  # [N] f_t(r_t)
        losses = torch.where(inputs.labelled, -gate * advantages, 0.0)
        return losses, RatioUnits.of_tokens(log_ratio, inputs)


@LOSSES.register()
@dataclass(frozen=True)
class GSPOToken(GSPO, DualClipLoss):
    """GSPO-token (GSPO paper §4.3): ``ℓ_t = −min(s_t·A_t, clip(s_t)·A_t)`` with per-token advantages and
    ``s_t = sg(R_d)·exp(lp_t − sg(lp_t))``, ``R_d = exp(mean_{t∈d}(lp_t − old_lp_t))``; with ``dual_clip``
    c, ``min(ℓ_t, −c·A_t)`` where ``A_t < 0``.

    ``s_t`` equals ``R_d``, but its gradient is ``R_d·∇lp_t``: each token's own, not that of ``R_d``'s mean.
    With ``A_t = Ā_d`` for every token it has gspo's value and gradient. The ratios, the clip fraction
    (``R_d`` outside ``[1 − eps_low, 1 + eps_high]``) and ``num_segments`` are gspo's, over documents;
    ``dual_clipped_fraction`` is over tokens, as the cap acts token by token.
    """

    name = "gspo_token"

    def per_token(self, logprobs: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, RatioUnits]:
        segments = inputs.segments
        doc_tokens = segments.sum(inputs.mask)  # [S] n_d
        rho = segments.sum(inputs.log_ratio(logprobs)) / doc_tokens.clamp(min=1)  # [S]
        advantages = inputs.labelled_advantages  # [N]
        log_seq_ratio = segments.broadcast(rho.detach())  # [N] log R_d
        capped = self.dual_capped(log_seq_ratio, advantages)  # [N] | None
        # with A_t >= 0 the objective reads s_t only through min(s_t, 1 + eps_high): a larger log R_d gives the
        # same value, so stop it where exp stays finite (an inf R_d times the clipped branch's 0 would be NaN);
        # a capped token's s_t is never read: its log R_d is 0 there, for the same reason
        cap = math.log1p(self.eps_high) + 1.0
        log_seq_ratio = torch.where((advantages >= 0) & (log_seq_ratio > cap), cap, log_seq_ratio)
        if capped is not None:
            log_seq_ratio = torch.where(capped, 0.0, log_seq_ratio)
        labelled_logprobs = torch.where(inputs.labelled, logprobs, 0.0)  # [N]
        token_ratio = torch.exp(log_seq_ratio) * torch.exp(labelled_logprobs - labelled_logprobs.detach())  # [N] s_t
        losses = self.dual_clipped(-self.clipped_objective(token_ratio, advantages), capped, advantages)  # [N]
        return torch.where(inputs.labelled, losses, 0.0), RatioUnits.of_documents(rho, doc_tokens)

    def add_metric_partials(self, partials: MetricPartials, units: RatioUnits, inputs: LossInputs) -> None:
        super().add_metric_partials(partials, units, inputs)  # gspo's num_segments
        self.add_dual_clip_partials(partials, inputs.segments.broadcast(units.log_ratio), inputs)
