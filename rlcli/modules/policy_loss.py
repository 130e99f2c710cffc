"""The step loss: per-token losses × aggregation weights, for a micro-batch or a whole step.

What to optimise is one `LossSpec`, checked once when it is built; what to optimise it on is one
`LossInputs`; the policy's own log-probs (and entropies) are the arguments that carry gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rlcli.modules.aggregation import StepTotals, check_aggregation_options, token_weights
from rlcli.modules.bounds import check_bounds
from rlcli.modules.losses import LossInputs, PolicyLoss, make_loss
from rlcli.modules.metrics import MetricPartials, check_metrics_level, finalize_metrics, metric_partials
from rlcli.modules.regularizers import (
    TERM_COEF,
    Correction,
    KLPenalty,
    add_term_partials,
    importance_weights,
    reject_tokens,
    token_losses,
)


@dataclass(frozen=True)
class LossSpec:
    """What the step loss is: the policy loss, its aggregation (math.md#aggregation), the metrics level (#metrics)
    and the terms of `rlcli.modules.regularizers` (all off by default).

    ``loss``: a registered name (its default options) or a `PolicyLoss` (``make_loss("gspo",
    eps_high=0.28)``, ``GSPO(eps_high=0.28)``). ``divisor`` goes with ``aggregation="constant"`` only.
    ``kl`` needs ``reference_logprobs`` when ``kl.coef > 0``; ``entropy_coef > 0`` needs the entropy,
    with its gradient; ``correction`` needs ``sampler_logprobs``. Raises ``ValueError`` naming the
    first invalid option.

    Attributes:
        loss: the policy loss, a name of ``LOSSES`` or a `PolicyLoss` instance.
        aggregation: ``token_mean``, ``sample_mean``, ``prompt_mean`` or ``constant``.
        divisor: the constant of ``aggregation="constant"``; ``None`` for the others.
        metrics: ``none``, ``basic`` or ``with_entropy``.
        kl: the KL penalty to a reference (`KLPenalty`), or ``None``.
        entropy_coef: the entropy bonus ``c``, ``>= 0``.
        correction: the mismatch correction (`Correction`), or ``None``.
    """

    loss: PolicyLoss | str = "grpo"
    aggregation: str = "token_mean"
    divisor: float | None = None
    metrics: str = "basic"
    kl: KLPenalty | None = None
    entropy_coef: float = field(default=0.0, metadata=TERM_COEF)
    correction: Correction | None = None

    def __post_init__(self):
        object.__setattr__(self, "loss", make_loss(self.loss))
        check_aggregation_options(self.aggregation, self.divisor)
        check_metrics_level(self.metrics)
        if self.kl is not None and not isinstance(self.kl, KLPenalty):
            raise ValueError(f"kl must be a KLPenalty or None; got {self.kl!r}")
        if self.correction is not None and not isinstance(self.correction, Correction):
            raise ValueError(f"correction must be a Correction or None; got {self.correction!r}")
        check_bounds(self)
        object.__setattr__(self, "entropy_coef", float(self.entropy_coef))

    @property
    def kl_on(self) -> bool:
        return self.kl is not None and self.kl.coef > 0

    @property
    def entropy_on(self) -> bool:
        return self.entropy_coef > 0

    @property
    def correction_on(self) -> bool:
        return self.correction is not None and self.correction.mode != "none"

    @property
    def with_entropy(self) -> bool:
        """The entropy is needed: for the bonus or for the metrics."""
        return self.entropy_on or self.metrics == "with_entropy"

    def require(self, inputs: LossInputs, entropy: torch.Tensor | bool | None) -> None:
        """Raise ``ValueError`` naming the input a term needs and did not get."""
        if self.kl_on and inputs.reference_logprobs is None:
            raise ValueError(f"kl.coef = {self.kl.coef:g} > 0 needs reference_logprobs")
        if self.correction_on and inputs.sampler_logprobs is None:
            raise ValueError(f"correction mode {self.correction.mode!r} needs sampler_logprobs")
        if self.entropy_on and entropy is None:
            raise ValueError(f"entropy_coef = {self.entropy_coef:g} > 0 needs entropy (with its gradient)")


def _check_shapes(logprobs: torch.Tensor, inputs: LossInputs, entropy: torch.Tensor | None) -> None:
    for name, tensor in dict(logprobs=logprobs, entropy=entropy).items():
        if tensor is not None and tensor.shape != inputs.shape:
            raise ValueError(f"{name} must have the shape of the inputs {tuple(inputs.shape)}; "
                             f"got {tuple(tensor.shape)}")


def micro_batch_loss(
    logprobs: torch.Tensor,
    inputs: LossInputs,
    totals: StepTotals,
    spec: LossSpec,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MetricPartials]:
    """This micro-batch's share of the step loss ``L`` and its metric partials.

    ``logprobs`` [N] (and ``entropy`` [N]) are the policy's, with their gradients. The micro-batch
    holds whole documents; ``totals`` are the whole step's (all micro-batches, all ranks) and
    ``inputs.group_index`` uses the step's group numbering. Summing the returned losses (and their
    gradients) over every micro-batch of the step gives exactly ``L`` (and ``∇L``).
    With ``correction.mode="reject"`` the mask must already hold the kept tokens only (`reject_tokens`),
    and ``totals`` count them, as `policy_loss` and the trainer's batch stage do.

    Args:
        logprobs: ``[N]`` the policy's log-probs of the micro-batch's tokens, with their gradient.
        inputs: the micro-batch's `LossInputs`, ``[N]`` each.
        totals: the whole step's `StepTotals`, summed over every micro-batch and process.
        spec: the `LossSpec`.
        entropy: ``[N]`` the entropy of each position, with its gradient; needed by the entropy
            bonus and by ``metrics="with_entropy"``.

    Returns:
        ``(loss, partials)``: this micro-batch's share of ``L`` (a scalar with autograd) and its
        `MetricPartials`.
    """
    _check_shapes(logprobs, inputs, entropy)
    spec.require(inputs, entropy)
    inputs = replace(inputs, mask=inputs.mask.to(logprobs.dtype))
    importance = importance_weights(spec.correction, inputs)  # whole documents: the micro-batch's
    losses, units = token_losses(logprobs, inputs, spec, entropy=entropy, importance=importance)  # [N]
    weights = token_weights(inputs.mask, inputs.segments, totals, aggregation=spec.aggregation,
                            divisor=spec.divisor, group_index=inputs.group_index)  # [N]
    partials = metric_partials(logprobs, inputs, units, spec, entropy=entropy)
    add_term_partials(partials, logprobs, inputs, importance, metrics=spec.metrics)
    return (weights * losses).sum(), partials


def policy_loss(
    logprobs: torch.Tensor,
    inputs: LossInputs,
    spec: LossSpec,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss ``L`` of math.md#policy-losses, #aggregation and the metrics of #metrics for one whole step.

    ``logprobs`` [N] (and ``entropy`` [N], for the bonus or ``metrics="with_entropy"``) are the
    policy's over the step's tokens; the returned loss carries autograd to them. Metric values are
    detached float64 scalars: ``kl_ref`` whenever ``inputs.reference_logprobs`` are given,
    ``mismatch_kl`` whenever ``inputs.sampler_logprobs`` are. With ``correction.mode="reject"`` the
    rejected tokens leave the mask first (`reject_tokens`), so every total counts the kept ones.

    Args:
        logprobs: ``[N]`` the policy's log-probs of the step's tokens, with their gradient.
        inputs: the step's `LossInputs`, ``[N]`` each.
        spec: the `LossSpec`.
        entropy: ``[N]`` the entropy of each position, with its gradient; needed by the entropy
            bonus and by ``metrics="with_entropy"``.

    Returns:
        ``(loss, metrics)``: the step loss ``L`` (a scalar with autograd) and the metrics by name
        (``loss`` among them).
    """
    _check_shapes(logprobs, inputs, entropy)
    group_index = inputs.group_index
    if spec.aggregation == "prompt_mean" and group_index is None:
        raise ValueError("aggregation 'prompt_mean' needs group_index (the group of each token)")
    if group_index is not None:
        group_ids, group_index = torch.unique(group_index, return_inverse=True)
        num_groups = group_ids.numel()
    else:
        num_groups = 0
    inputs, rejected = reject_tokens(spec.correction, replace(inputs, group_index=group_index))
    totals = StepTotals.of_tokens(inputs.mask, inputs.segments, group_index, num_groups, rejected)
    step_loss, partials = micro_batch_loss(logprobs, inputs, totals, spec, entropy=entropy)
    return step_loss, {"loss": step_loss.detach().to(torch.float64)} | finalize_metrics(partials, totals)
