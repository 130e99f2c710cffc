"""Groups whose curves coincide to float rounding, seed by seed, and why that usually happens."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlcli.report.groups import Group
from rlcli.report.runs import Run

__all__ = ["COMPARED", "EqualPair", "RTOL", "equal_pairs"]

# the curves compared: the key metrics that measure the outcome (ratio_new_old and kl_new_old are
# rounding noise around 1 and 0 on-policy, so they differ in their last digits even when the runs do not)
COMPARED = ("reward", "accuracy", "loss", "entropy")
RTOL = 1e-6  # |a - b| <= RTOL * the largest |value| of the metric's two curves: float32 losses differ in the 7th digit
ON_POLICY = (
    "the ratio new/old is 1 at every step and no ratio was clipped: each step made one update on rollouts the "
    "current policy had just sampled, so the clip never acts and losses that differ only off-policy (GRPO and "
    "GSPO with token_mean, other eps_low/eps_high) give the same gradient. They differ with trainer.minibatches > 1, "
    "trainer.batch_epochs > 1, off-policy rollout files, or loss.old_logprobs=recompute on stale data."
)
NO_EFFECT = "the settings that differ between these groups did not change these metrics in these runs."


@dataclass
class EqualPair:
    """Two groups whose compared curves are equal within rounding for every seed, the metrics compared, and why."""

    first: str
    second: str
    metrics: list[str]
    reason: str


def _points(run: Run, metric: str) -> dict[float, float]:
    metrics = run.metrics or {}
    return {s: v for s, v in zip(metrics["step"], metrics.get(metric, [])) if not math.isnan(v)}


def _same_curve(a: dict[float, float], b: dict[float, float]) -> bool:
    scale = max(map(abs, [*a.values(), *b.values()]), default=0.0)
    return a.keys() == b.keys() and all(abs(a[s] - b[s]) <= RTOL * scale for s in a)


def _equal_metrics(first: Group, second: Group) -> list[str]:
    """The metrics compared when every seed's curves are equal, else ``[]``."""
    by_seed = [dict(zip(g.seeds, g.members)) for g in (first, second)]
    repeated = any(len(seeds) != len(g.members) for seeds, g in zip(by_seed, (first, second)))
    if repeated or by_seed[0].keys() != by_seed[1].keys():
        return []  # different (or repeated) seeds: nothing to compare seed by seed
    pairs = [(a, by_seed[1][seed]) for seed, a in by_seed[0].items()]
    if any(a.metrics is None or b.metrics is None for a, b in pairs):
        return []
    compared = [m for m in COMPARED if all(_points(a, m) and _points(b, m) for a, b in pairs)]
    same = compared and all(_same_curve(_points(a, m), _points(b, m)) for a, b in pairs for m in compared)
    return compared if same else []


def _on_policy(runs: list[Run]) -> bool:
    """Whether every logged ratio new/old is 1 (within float rounding) and no ratio was ever clipped."""
    ratios = [v for run in runs for v in _points(run, "ratio_new_old").values()]
    clipped = [v for run in runs for v in _points(run, "clipped_ratio_fraction").values()]
    return bool(ratios) and all(abs(r - 1) <= RTOL for r in ratios) and not any(clipped)


def equal_pairs(groups: list[Group]) -> list[EqualPair]:
    """Every pair of groups with the same seeds whose curves of `COMPARED` metrics are equal within `RTOL`."""
    found = []
    for i, first in enumerate(groups):
        for second in groups[i + 1:]:
            metrics = _equal_metrics(first, second)
            if metrics:
                reason = ON_POLICY if _on_policy(first.members + second.members) else NO_EFFECT
                found.append(EqualPair(first.id, second.id, metrics, reason))
    return found
