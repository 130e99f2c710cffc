"""``rlcli report PATH [--out DIR]``: plots of a run or a multirun; a multirun's tables and report.html."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from rlcli.report.equal import equal_pairs
from rlcli.report.group_summary import GroupReport, group_report
from rlcli.report.groups import KEY_METRICS, OBJECTIVE, group_runs
from rlcli.report.html import write_html
from rlcli.report.plots import plot_groups, plot_metrics
from rlcli.report.runs import ReportError, Run, find_runs
from rlcli.report.summary import Summary, markdown_table, print_summary, summarize, write_csv, write_markdown

__all__ = ["Report", "report_command", "write_report"]


@dataclass
class Report:
    """What `write_report` found and wrote; ``summary`` and ``groups`` are ``None`` for a single run."""

    kind: str  # "run" or "multirun"
    runs: list[Run]
    plots: list[Path]  # the members' plots, then the groups' (report_group_<metric>.png)
    skipped: list[str]
    summary: Summary | None
    groups: GroupReport | None = None


def _member_labels(runs: list[Run]) -> list[str]:
    """Legend labels: the member's name and its overrides that not every plotted member shares."""
    shared = set.intersection(*(set(run.overrides) for run in runs)) if len(runs) > 1 else set()
    labels = []
    for run in runs:
        own = " ".join(o for o in run.overrides if o not in shared)
        labels.append(f"{run.name}: {own}" if own else run.name)
    return labels


def _group_markdown(groups: GroupReport) -> list[str]:
    lines = ["", "## Groups (members with the same overrides apart from seed)", "", *markdown_table(groups.table), ""]
    lines += [line for note in groups.notes() for line in (note, "")]
    if groups.improvement is not None:
        lines += ["## Probability of improvement", "", *markdown_table(groups.improvement)]
    return lines


def _write_groups(path: Path, runs: list[Run], member_plots: list[Path], out_dir: Path,
                  console: Console) -> tuple[Summary, GroupReport, list[Path]]:
    """The multirun's files: summary.csv/.md, groups.csv, report_group_*.png and report.html; prints the tables."""
    found = group_runs(runs, [OBJECTIVE, *KEY_METRICS])
    groups = group_report(found, equal_pairs(found))
    repeated = any(sum(run.metrics is not None for run in g.members) > 1 for g in found)
    group_plots = plot_groups(groups.groups, out_dir) if repeated else []
    summary = summarize(runs, found)
    title = f"Multirun {path} ({len(runs)} members)"
    write_csv(summary, out_dir / "summary.csv")
    write_csv(groups.csv, out_dir / "groups.csv")
    write_markdown(summary, out_dir / "summary.md", title, _group_markdown(groups))
    write_html(out_dir / "report.html", title, groups, summary, group_plots, member_plots)
    print_summary(summary, title, console)
    print_summary(groups.table, f"{len(found)} groups (members with the same overrides apart from seed)", console,
                  "\n".join(groups.notes()))
    if groups.improvement is not None:
        print_summary(groups.improvement, "Probability of improvement", console, "")
    console.print(f"wrote summary.csv, summary.md, groups.csv and report.html to {out_dir}", markup=False)
    return summary, groups, group_plots


def write_report(path: str | Path, out: str | Path | None = None, console: Console | None = None) -> Report:
    """Write the report of the run or multirun directory ``path`` into ``out`` (default: ``path``).

    Plots: ``report_<metric>.png`` per metric that some run has. A multirun also gets
    ``summary.csv``, ``summary.md``, ``groups.csv`` and ``report.html``, with ``report_group_<metric>.png``
    when some configuration ran with several seeds, and its tables are printed. Raises `ReportError` if
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
    summary = groups = None
    if kind == "multirun":
        summary, groups, group_plots = _write_groups(path, runs, plots, out_dir, console)
        plots = plots + group_plots
    console.print(f"wrote {len(plots)} plots to {out_dir}: {', '.join(p.name for p in plots) or '-'}", markup=False)
    if skipped:
        console.print(f"skipped (no values in metrics.csv): {', '.join(skipped)}")
    return Report(kind, runs, plots, skipped, summary, groups)


def report_command(path: str | Path, out: str | Path | None, console: Console) -> int:
    """`write_report` for the CLI: exit code 0, or 2 with one error line on stderr."""
    try:
        write_report(path, out, console)
    except (ReportError, OSError) as err:
        print(f"rlcli report: error: {err}", file=sys.stderr)
        return 2
    return 0
