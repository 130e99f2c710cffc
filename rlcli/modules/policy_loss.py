"""The step loss: per-token losses × aggregation weights, for a micro-batch or a whole step."""

from __future__ import annotations

import torch

from rlcli.modules.aggregation import StepTotals, check_aggregation_options, token_weights
from rlcli.modules.losses import LossInputs, PolicyLoss, make_loss
from rlcli.modules.metrics import (
    MetricPartials,
    check_metrics_level,
    finalize_metrics,
    metric_partials,
)
from rlcli.modules.regularizers import (
    Correction,
    KLPenalty,
    Terms,
    add_term_partials,
    importance_weights,
    token_losses,
)
from rlcli.modules.segments import Segments


def check_policy_loss_options(
    *, loss: str | PolicyLoss = "grpo", aggregation: str, divisor: float | None, metrics: str, **loss_options
) -> PolicyLoss:
    """Raise ``ValueError`` naming the first invalid option; return the loss (see `make_loss`)."""
    loss = make_loss(loss, **loss_options)
    check_aggregation_options(aggregation, divisor)
    check_metrics_level(metrics)
    return loss


def _check_shapes(named: dict[str, torch.Tensor | None]) -> None:
    shape = named["logprobs"].shape
    if len(shape) != 1:
        raise ValueError(f"logprobs must be a flat [N] tensor; got shape {tuple(shape)}")
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}; got {tuple(tensor.shape)}")


def micro_batch_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    document_index: torch.Tensor,
    totals: StepTotals,
    group_index: torch.Tensor | None = None,
    *,
    loss: str | PolicyLoss = "grpo",
    aggregation: str = "token_mean",
    divisor: float | None = None,
    metrics: str = "basic",
    entropy: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    kl: KLPenalty | None = None,
    entropy_coef: float = 0.0,
    correction: Correction | None = None,
    **loss_options,
) -> tuple[torch.Tensor, MetricPartials]:
    """This micro-batch's share of the step loss ``L`` and its metric partials.

    The micro-batch holds whole documents; ``totals`` are the whole step's (all micro-batches,
    all ranks) and ``group_index`` uses the step's group numbering. Summing the returned losses
    (and their gradients) over every micro-batch of the step gives exactly ``L`` (and ``∇L``).
    ``loss`` is a registered name with its options as keywords, or a `PolicyLoss`. The terms
    (``kl``, ``entropy_coef``, ``correction``; all off by default) are those of `policy_loss`.
    """
    loss = check_policy_loss_options(loss=loss, aggregation=aggregation, divisor=divisor, metrics=metrics,
                                     **loss_options)
    terms = Terms.of(kl, entropy_coef, correction)
    _check_shapes(
        dict(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
             document_index=document_index, group_index=group_index, entropy=entropy,
             reference_logprobs=reference_logprobs, behaviour_logprobs=behaviour_logprobs)
    )
    terms.require(reference_logprobs=reference_logprobs, behaviour_logprobs=behaviour_logprobs, entropy=entropy)
    inputs = LossInputs(old_logprobs, advantages, mask.to(logprobs.dtype), document_index, group_index,
                        behaviour_logprobs=behaviour_logprobs, reference_logprobs=reference_logprobs)
    importance = importance_weights(terms.correction, inputs)  # whole documents: the micro-batch's
    losses, units = token_losses(loss, logprobs, inputs, terms, entropy=entropy, importance=importance)  # [N]
    weights = token_weights(
        inputs.mask, inputs.segments, totals, aggregation=aggregation, divisor=divisor, group_index=group_index
    )  # [N]
    partials = metric_partials(logprobs, inputs, units, loss=loss, metrics=metrics, entropy=entropy)
    add_term_partials(partials, logprobs, inputs, importance, metrics=metrics)
    return (weights * losses).sum(), partials


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    document_index: torch.Tensor,
    group_index: torch.Tensor | None = None,
    *,
    loss: str | PolicyLoss = "grpo",
    aggregation: str = "token_mean",
    divisor: float | None = None,
    metrics: str = "basic",
    entropy: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    kl: KLPenalty | None = None,
    entropy_coef: float = 0.0,
    correction: Correction | None = None,
    **loss_options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss ``L`` of SPEC §3–§4 and the metrics of SPEC §6 for one whole step.

    All tensors are flat ``[N]`` over the step's tokens: ``mask`` is 1 for labelled tokens,
    ``document_index`` the document of each token, ``group_index`` its group (any integer ids).
    ``loss`` is a registered name with its options as keywords (``loss="gspo", eps_high=0.28``) or
    a `PolicyLoss`. The returned loss carries autograd to ``logprobs`` (and ``entropy``); metric
    values are detached float64 scalars.

    Terms added to every labelled token's loss before the aggregation (`rlcli.modules.regularizers`):
    ``kl=KLPenalty(coef, estimator)`` needs ``reference_logprobs`` ([N]) when ``coef > 0`` (metric
    ``kl_ref`` whenever they are given); ``entropy_coef > 0`` subtracts ``entropy_coef · entropy`` and
    needs ``entropy`` with its gradient; ``correction=Correction(mode, level, low, high)`` weights the
    loss's own term by the detached importance weight of ``old_logprobs`` (the trainer's log-probs
    at the start of the batch) over ``behaviour_logprobs`` (the sampler's; metric ``mismatch_kl``
    whenever they are given).
    """
    loss = check_policy_loss_options(loss=loss, aggregation=aggregation, divisor=divisor, metrics=metrics,
                                     **loss_options)
    Terms.of(kl, entropy_coef, correction)
    _check_shapes(
        dict(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
             document_index=document_index, group_index=group_index, entropy=entropy,
             reference_logprobs=reference_logprobs, behaviour_logprobs=behaviour_logprobs)
    )
    if aggregation == "prompt_mean" and group_index is None:
        raise ValueError("aggregation 'prompt_mean' needs group_index (the group of each token)")
    if group_index is not None:
        group_ids, group_index = torch.unique(group_index, return_inverse=True)
        num_groups = group_ids.numel()
    else:
        num_groups = 0
    totals = StepTotals.of_tokens(mask, Segments.of(document_index), group_index, num_groups)
    step_loss, partials = micro_batch_loss(
        logprobs, old_logprobs, advantages, mask, document_index, totals, group_index,
        loss=loss, aggregation=aggregation, divisor=divisor, metrics=metrics, entropy=entropy,
        reference_logprobs=reference_logprobs, behaviour_logprobs=behaviour_logprobs,
        kl=kl, entropy_coef=entropy_coef, correction=correction,
    )
    return step_loss, {"loss": step_loss.detach().to(torch.float64)} | finalize_metrics(partials, totals)
