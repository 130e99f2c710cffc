"""One PNG per metric over ``step``, every run on the same axes (matplotlib, Agg renderer)."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlcli.report.runs import has_values

__all__ = ["EVAL_PANELS", "PANELS", "plot_metrics"]

# metric column -> panel title; each becomes report_<metric>.png
PANELS = {
    "loss": "loss",
    "reward": "reward",
    "accuracy": "accuracy",
    "ratio_new_old": "ratio new/old (mean over tokens)",
    "kl_new_old": "KL(new, old)",
    "clipped_ratio_fraction": "fraction of clipped ratios",
    "entropy": "entropy",
    "grad_norm": "gradient norm (before clipping)",
    "num_documents": "documents per step",
}
# the columns of `eval.every` (rlcli.rollout.evaluate): plotted when a run has them, never reported as skipped;
# any other eval/<metric> column is plotted too, titled by its name. eval/<metric> -> report_eval_<metric>.png
EVAL_PANELS = {
    "eval/reward": "eval: mean reward",
    "eval/pass@1": "eval: pass@1",
    "eval/pass@k": "eval: pass@k (k = eval.samples)",
    "eval/length": "eval: mean completion length",
    "eval/stopped_fraction": "eval: fraction of completions that stopped",
}
LINESTYLES = ("-", "--", ":", "-.")  # runs 0-9 solid, 10-19 dashed, ... in the 10 default colours
MARKERS_UP_TO = 30  # points per line; fewer get markers, so that a run of a few steps shows


def _points(metrics: dict[str, list[float]], metric: str) -> tuple[list[float], list[float]]:
    pairs = [(s, v) for s, v in zip(metrics["step"], metrics.get(metric, [])) if math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _plot(metric: str, series: list[tuple[str, dict[str, list[float]]]], path: Path) -> None:
    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for i, (label, metrics) in enumerate(series):
        if not has_values(metrics, metric):
            continue
        steps, values = _points(metrics, metric)
        marker = "o" if len(steps) <= MARKERS_UP_TO else None
        axes.plot(steps, values, label=label or None, marker=marker, markersize=3,
                  color=f"C{i % 10}", linestyle=LINESTYLES[i // 10 % len(LINESTYLES)])  # a run's style in every panel
    axes.set_title(PANELS.get(metric) or EVAL_PANELS.get(metric, metric))
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(metric)
    axes.grid(alpha=0.3)
    if any(label for label, _ in series):
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.savefig(path, bbox_inches="tight")


def plot_metrics(
    series: list[tuple[str, dict[str, list[float]]]], out_dir: Path
) -> tuple[list[Path], list[str]]:
    """Write ``report_<metric>.png`` into ``out_dir`` for each metric of `PANELS` that some run has, then
    ``report_eval_<metric>.png`` for each ``eval/<metric>`` column that some run has (`EVAL_PANELS` first).

    ``series`` is ``(legend label, metrics columns)`` per run; an empty label has no legend
    entry; a run without a value of a metric is left out of its panel. Returns the files written
    and the metrics of `PANELS` skipped because no run has a value of them.
    """
    written, skipped = [], []
    columns = dict.fromkeys(c for _, metrics in series for c in metrics)
    evaluated = [m for m in [*EVAL_PANELS, *columns] if m.startswith("eval/")]
    for metric in dict.fromkeys([*PANELS, *evaluated]):
        if not any(has_values(metrics, metric) for _, metrics in series):
            if metric in PANELS:
                skipped.append(metric)
            continue
        path = out_dir / f"report_{metric.replace('/', '_')}.png"
        _plot(metric, series, path)
        written.append(path)
    return written, skipped
