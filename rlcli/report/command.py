"""``rlcli report PATH [--out DIR]``: plots of a run or a multirun, and the multirun's summary table."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from rlcli.report.plots import plot_metrics
from rlcli.report.runs import ReportError, Run, find_runs
from rlcli.report.summary import Summary, print_summary, summarize, write_csv, write_markdown

__all__ = ["Report", "report_command", "write_report"]


@dataclass
class Report:
    """What `write_report` found and wrote; ``summary`` is ``None`` for a single run."""

    kind: str  # "run" or "multirun"
    runs: list[Run]
    plots: list[Path]
    skipped: list[str]
    summary: Summary | None


def _member_labels(runs: list[Run]) -> list[str]:
    """Legend labels: the member's name and its overrides that not every plotted member shares."""
    shared = set.intersection(*(set(run.overrides) for run in runs)) if len(runs) > 1 else set()
    labels = []
    for run in runs:
        own = " ".join(o for o in run.overrides if o not in shared)
        labels.append(f"{run.name}: {own}" if own else run.name)
    return labels


def write_report(path: str | Path, out: str | Path | None = None, console: Console | None = None) -> Report:
    """Write the report of the run or multirun directory ``path`` into ``out`` (default: ``path``).

    Plots: ``report_<metric>.png`` per metric that some run has. A multirun also gets
    ``summary.csv`` and ``summary.md``, and its table is printed. Raises `ReportError` if
    ``path`` is neither kind of directory.
    """
    console = console or Console()
    path = Path(path)
    out_dir = path if out is None else Path(out)
    kind, runs = find_runs(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    plotted = [run for run in runs if run.metrics is not None]
    labels = _member_labels(plotted) if kind == "multirun" else [" ".join(run.overrides) for run in plotted]
    series = [(label, run.metrics) for label, run in zip(labels, plotted)]
    plots, skipped = plot_metrics(series, out_dir)
    summary = None
    if kind == "multirun":
        summary = summarize(runs)
        title = f"Multirun {path} ({len(runs)} members)"
        write_csv(summary, out_dir / "summary.csv")
        write_markdown(summary, out_dir / "summary.md", title)
        print_summary(summary, title, console)
        console.print(f"wrote summary.csv and summary.md to {out_dir}", markup=False)
    console.print(f"wrote {len(plots)} plots to {out_dir}: {', '.join(p.name for p in plots) or '-'}", markup=False)
    if skipped:
        console.print(f"skipped (no values in metrics.csv): {', '.join(skipped)}")
    return Report(kind, runs, plots, skipped, summary)


def report_command(path: str | Path, out: str | Path | None, console: Console) -> int:
    """`write_report` for the CLI: exit code 0, or 2 with one error line on stderr."""
    try:
        write_report(path, out, console)
    except (ReportError, OSError) as err:
        print(f"rlcli report: error: {err}", file=sys.stderr)
        return 2
    return 0
