"""One PNG per metric over ``step``, every run on the same axes, and per group its mean with a 95% band
(matplotlib, Agg renderer)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlcli.report.groups import Group
from rlcli.report.runs import has_values
from rlcli.report.stats import mean_band

__all__ = ["EVAL_PANELS", "PANELS", "group_curve", "plot_groups", "plot_metrics"]

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


def _axes() -> tuple[Figure, object]:
    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    return figure, figure.subplots()


def _finish(figure: Figure, axes, metric: str, title: str, path: Path, legend: bool) -> None:
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(metric)
    axes.grid(alpha=0.3)
    if legend:
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.savefig(path, bbox_inches="tight")


def _title(metric: str) -> str:
    return PANELS.get(metric) or EVAL_PANELS.get(metric, metric)


def _plot(metric: str, series: list[tuple[str, dict[str, list[float]]]], path: Path) -> None:
    figure, axes = _axes()
    for i, (label, metrics) in enumerate(series):
        if not has_values(metrics, metric):
            continue
        steps, values = _points(metrics, metric)
        marker = "o" if len(steps) <= MARKERS_UP_TO else None
        axes.plot(steps, values, label=label or None, marker=marker, markersize=3,
                  color=f"C{i % 10}", linestyle=LINESTYLES[i // 10 % len(LINESTYLES)])  # a run's style in every panel
    _finish(figure, axes, metric, _title(metric), path, any(label for label, _ in series))


def _plotted(series: list[tuple[str, dict[str, list[float]]]]) -> list[str]:
    """`PANELS`, then the eval/<metric> columns that some run has (`EVAL_PANELS` first)."""
    columns = dict.fromkeys(c for _, metrics in series for c in metrics)
    evaluated = [m for m in [*EVAL_PANELS, *columns] if m.startswith("eval/")]
    return list(dict.fromkeys([*PANELS, *evaluated]))


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
    for metric in _plotted(series):
        if not any(has_values(metrics, metric) for _, metrics in series):
            if metric in PANELS:
                skipped.append(metric)
            continue
        path = out_dir / f"report_{metric.replace('/', '_')}.png"
        _plot(metric, series, path)
        written.append(path)
    return written, skipped


def group_curve(group: Group, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The steps at which every member of ``group`` with metrics has a value of ``metric``, and those values
    (one row per member); empty when a member lacks the metric."""
    runs = [run.metrics for run in group.members if run.metrics is not None]
    points = [{s: v for s, v in zip(m["step"], m.get(metric, [])) if math.isfinite(v)} for m in runs]
    steps = sorted(set.intersection(*(set(p) for p in points))) if points else []
    return np.array(steps), np.array([[p[s] for s in steps] for p in points]).reshape(len(points), len(steps))


def _plot_groups(metric: str, groups: list[Group], path: Path) -> None:
    figure, axes = _axes()
    for i, group in enumerate(groups):
        steps, curves = group_curve(group, metric)
        if not len(steps):
            continue
        mean, low, high = mean_band(curves)
        color = f"C{i % 10}"
        axes.plot(steps, mean, color=color, linestyle=LINESTYLES[i // 10 % len(LINESTYLES)],
                  marker="o" if len(steps) <= MARKERS_UP_TO else None, markersize=3,
                  label=f"{group.id} ({len(curves)} seeds): {group.label}")
        if low is not None:
            axes.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
    _finish(figure, axes, metric, f"{_title(metric)}: mean over seeds, 95% band", path, True)


def plot_groups(groups: list[Group], out_dir: Path) -> list[Path]:
    """Write ``report_group_<metric>.png`` into ``out_dir`` for each metric that `plot_metrics` plots and some
    group has at every member: per group the mean over seeds at each step and its 95% bootstrap band."""
    series = [("", run.metrics) for group in groups for run in group.members if run.metrics is not None]
    written = []
    for metric in _plotted(series):
        if not any(len(group_curve(group, metric)[0]) for group in groups):
            continue
        path = out_dir / f"report_group_{metric.replace('/', '_')}.png"
        _plot_groups(metric, groups, path)
        written.append(path)
    return written
