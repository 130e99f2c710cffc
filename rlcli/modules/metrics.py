"""Step metrics of math.md#metrics as partials that combine exactly across micro-batches and ranks.

Each micro-batch yields ``MetricPartials``: sums (added), maxima and minima. Document means
``μ(v) = (1/D) Σ_d (1/max(n_d,1)) Σ_t m_t v_t`` are kept as their numerators and divided by the
step's ``D`` once, in ``finalize_metrics``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from rlcli.modules.aggregation import StepTotals
from rlcli.modules.losses import LossInputs, RatioUnits, plain

if TYPE_CHECKING:
    from rlcli.modules.policy_loss import LossSpec

METRIC_LEVELS = ("none", "basic", "with_entropy")


class Metric(NamedTuple):
    """What a column of ``metrics.csv`` is, declared next to the code that computes it: each module that
    emits metrics holds ``METRICS = {name: Metric(when, description)}`` (a name like ``reward/<name>``
    stands for one column per name). The metrics reference page of the docs is generated from them."""

    when: str  # the config that puts it in a row ("always", "metrics=basic", "kl.coef > 0", ...)
    description: str  # one line: what it is, with its formula where it has one


METRICS = {
    "num_documents": Metric("always", "`D`: the step's documents, also those with no labelled token (not those "
                            "`correction.mode=reject` rejected)"),
    "num_tokens": Metric("always", "`T`: the step's labelled tokens, `Σ m_t` (the kept ones with "
                         "`correction.mode=reject`)"),
    "old_logprobs": Metric("metrics=basic", "`μ(old_lp)`: the document mean of the ratio's old log-prob "
                           "(the sampler's, or the trainer's own with `loss.old_logprobs=recompute`)"),
    "new_logprobs": Metric("metrics=basic", "`μ(lp)`: the document mean of the policy's log-prob"),
    "advantage": Metric("metrics=basic", "`μ(A)`: the document mean of the advantage"),
    "max_advantage": Metric("metrics=basic", "the largest `A_t` over labelled tokens; empty in a step with none"),
    "min_advantage": Metric("metrics=basic", "the smallest `A_t` over labelled tokens; empty in a step with none"),
    "ratio_new_old": Metric("metrics=basic", "`μ(r)`, the document mean of the ratio `r_t = exp(lp_t − old_lp_t)`; "
                            "over documents `(1/D) Σ_d R_d` for gspo and gspo_token"),
    "ratio_new_old_sum": Metric("metrics=basic", "`Σ m_t r_t` (gspo: `Σ_d R_d` over documents with `n_d > 0`)"),
    "ratio_new_old_squared_sum": Metric("metrics=basic", "`Σ m_t r_t²` (gspo: `Σ_d R_d²`)"),
    "kl_new_old": Metric("metrics=basic", "`μ(r − 1 − log r)`: the k3 estimate of the KL from the old policy"),
    "clipped_ratio_fraction": Metric("metrics=basic, a loss with a clip (not sapo)",
                                     "the document mean of `1[r < 1 − eps_low or r > 1 + eps_high]`, whatever "
                                     "the sign of A (cispo: `r > 1 + eps_high`)"),
    "num_segments": Metric("metrics=basic, loss=gspo or gspo_token", "documents with `n_d > 0`: the units the "
                           "sequence ratio metrics are taken over (a sum)"),
    "dual_clipped_fraction": Metric("metrics=basic, loss.dual_clip set (grpo, gspo_token)",
                                    "`μ(1[A_t < 0 and x_t > c])`: the document mean of the tokens the dual clip "
                                    "caps at `−c·A_t` (`x_t`: `r_t` for grpo, `R_d` for gspo_token)"),
    "entropy": Metric("metrics=with_entropy", "`μ(H_t)`: the document mean of the entropy of the "
                      "temperature-scaled distribution at each labelled position"),
}


def check_metrics_level(metrics: str) -> None:
    if metrics not in METRIC_LEVELS:
        raise ValueError(f"metrics must be one of {', '.join(METRIC_LEVELS)}; got {metrics!r}")


def document_mean_numerators(values: dict[str, torch.Tensor], inputs: LossInputs) -> dict[str, torch.Tensor]:
    """``Σ_d (1/max(n_d,1)) Σ_{t∈d} m_t v_t`` in float64 for each of ``values`` (``[N]`` each, whole
    documents): the numerators of their document means ``μ(v)``, in one matrix-vector product. Values
    under the mask are never read."""
    stacked = torch.stack([plain(value) for value in values.values()]).to(torch.float64)  # [K, N]
    return dict(zip(values, torch.where(inputs.labelled, stacked, 0.0) @ inputs.document_mean_weight))  # [K]


def labelled_extreme(values: torch.Tensor, inputs: LossInputs, fill: float, reduce) -> torch.Tensor:
    """``reduce`` (torch.max or torch.min) of ``values`` [N] over the labelled tokens, float64; ``fill``
    (-inf for a max, inf for a min) where there is none: `finalize_metrics` drops it."""
    values = plain(values).to(torch.float64)
    if values.numel() == 0:
        return values.new_tensor(fill)
    return reduce(torch.where(inputs.labelled, values, fill))


@dataclass
class MetricPartials:
    """Partial metrics of part of a step (a micro-batch, a process): ``a + b`` combines two parts.

    Attributes:
        means: document-mean numerators, added; `finalize_metrics` divides them by the step's ``D``.
        sums: plain sums, added.
        maxima: maxima over labelled tokens, combined with ``torch.maximum``.
        minima: minima over labelled tokens, combined with ``torch.minimum``.
    """

    means: dict[str, torch.Tensor] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    minima: dict[str, torch.Tensor] = field(default_factory=dict)

    def __add__(self, other: MetricPartials) -> MetricPartials:
        def combine(a, b, op):
            return {k: op(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}

        return MetricPartials(
            means=combine(self.means, other.means, torch.add),
            sums=combine(self.sums, other.sums, torch.add),
            maxima=combine(self.maxima, other.maxima, torch.maximum),
            minima=combine(self.minima, other.minima, torch.minimum),
        )


def metric_partials(
    logprobs: torch.Tensor,
    inputs: LossInputs,
    units: RatioUnits,
    spec: LossSpec,
    *,
    entropy: torch.Tensor | None = None,
) -> MetricPartials:
    """The math.md#metrics partials at ``spec.metrics`` of one micro-batch (whole documents), with the ``units``
    of ``spec.loss.per_token`` and the loss's own metrics. All inputs ``[N]``; float64 out."""
    loss, metrics = spec.loss, spec.metrics
    partials = MetricPartials()
    if metrics == "none":
        return partials
    f64 = torch.float64

    # math.md#metrics names the ratio's denominator old_logprobs
    means = {"old_logprobs": inputs.proximal_logprobs, "new_logprobs": logprobs, "advantage": inputs.advantages}
    if metrics == "with_entropy":
        if entropy is None:
            raise ValueError("metrics 'with_entropy' needs the per-token entropy")
        means["entropy"] = entropy
    partials.means |= document_mean_numerators(means, inputs)

    ratio, log_ratio = torch.stack([units.ratio, units.log_ratio]).to(f64)  # [U] each
    unit_means = {"ratio_new_old": ratio, "kl_new_old": ratio - 1 - log_ratio}
    clipped = loss.clipped(ratio)  # [U] | None
    if clipped is not None:
        unit_means["clipped_ratio_fraction"] = clipped
    partials.means |= dict(zip(unit_means, torch.stack(list(unit_means.values())) @ units.mean_weight.to(f64)))
    sums = torch.stack([ratio, ratio.square()]) @ units.count_weight.to(f64)  # [2]
    partials.sums |= dict(zip(("ratio_new_old_sum", "ratio_new_old_squared_sum"), sums))

    partials.maxima["max_advantage"] = labelled_extreme(inputs.advantages, inputs, -math.inf, torch.max)
    partials.minima["min_advantage"] = labelled_extreme(inputs.advantages, inputs, math.inf, torch.min)
    loss.add_metric_partials(partials, units, inputs)
    return partials


def finalize_metrics(partials: MetricPartials, totals: StepTotals) -> dict[str, torch.Tensor]:
    """Turn the step's combined partials into metric values.

    Maxima and minima over labelled tokens (``max_advantage``, ``min_advantage``, ``is_weight_max``)
    are left out of a step with no labelled token (there is no value to report, and a placeholder
    would be wrong).

    Args:
        partials: the sum of every micro-batch's partials, over all processes.
        totals: the whole step's `StepTotals`.

    Returns:
        The metrics by name, float64 scalars (``num_documents`` and ``num_tokens`` included).
    """
    return without_empty_extremes(metric_values(partials, totals), partials)


def metric_values(partials: MetricPartials, totals: StepTotals) -> dict[str, torch.Tensor]:
    """Every metric value of `finalize_metrics`, computed on the partials' device, with the fill value of
    a maximum or minimum over no labelled token still in: nothing is read on the host."""
    documents = totals.documents.to(torch.float64).clamp(min=1)
    out = {
        "num_documents": totals.documents.to(torch.float64),
        "num_tokens": totals.tokens.to(torch.float64),
    }
    out |= {name: value / documents for name, value in partials.means.items()}
    out |= dict(partials.sums)
    return out | partials.maxima | partials.minima


def without_empty_extremes(values: dict, partials: MetricPartials) -> dict:
    """``values`` without the maxima and minima of ``partials`` that hold their fill value (a step with
    no labelled token); values are tensors or host numbers."""
    extremes = partials.maxima.keys() | partials.minima.keys()
    return {k: v for k, v in values.items() if k not in extremes or math.isfinite(v)}
