"""Statistics over seeds (scipy.stats): bootstrap intervals, interquartile mean, probability of improvement."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["CONFIDENCE", "IQM_MIN_SEEDS", "RESAMPLES", "Estimate", "estimate", "mean_band",
           "probability_of_improvement"]

CONFIDENCE = 0.95
RESAMPLES = 10_000
RANDOM_STATE = 0  # a fixed seed: the same runs give the same report
IQM_MIN_SEEDS = 4


@dataclass
class Estimate:
    """The mean of one value over seeds, its 95% interval (``None`` with 1 seed) and IQM (``None`` under 4 seeds)."""

    n: int
    mean: float
    low: float | None
    high: float | None
    iqm: float | None


def _interval(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of the mean along axis 0 (seeds)."""
    result = stats.bootstrap((samples,), np.mean, axis=0, confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                             method="percentile", random_state=RANDOM_STATE)
    return result.confidence_interval.low, result.confidence_interval.high


def estimate(values: list[float]) -> Estimate:
    """Mean, 95% percentile bootstrap interval and IQM of one value per seed (``values`` must not be empty)."""
    samples = np.asarray(values, dtype=float)
    low = high = iqm = None
    if len(samples) >= 2:
        low, high = (float(x) for x in _interval(samples))
    if len(samples) >= IQM_MIN_SEEDS:
        iqm = float(stats.trim_mean(samples, 0.25))
    return Estimate(len(samples), float(samples.mean()), low, high, iqm)


def mean_band(curves: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Mean over seeds (rows) at each step (columns), and the 95% band; ``None`` bands with one seed."""
    if len(curves) < 2:
        return curves.mean(axis=0), None, None
    low, high = _interval(curves)
    return curves.mean(axis=0), low, high


def probability_of_improvement(x: list[float], y: list[float], maximize: bool = True) -> float:
    """P(X > Y) + P(X = Y) / 2 over pairs of seeds (rliable's definition): Mann-Whitney's U of ``x`` / (n m).

    With ``maximize=False`` lower is better: P(X < Y) + P(X = Y) / 2.
    """
    first, second = (x, y) if maximize else (y, x)
    return float(stats.mannwhitneyu(first, second).statistic) / (len(x) * len(y))
