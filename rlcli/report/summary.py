"""The multirun table: one row per member with its steps and the final and best key metrics."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from rlcli.report.groups import KEY_METRICS as BEST
from rlcli.report.groups import Group
from rlcli.report.runs import STATUSES, Run, has_values, logged_values

__all__ = ["NOTE", "Summary", "cell_text", "markdown_table", "print_summary", "rich_table", "summarize", "write_csv",
           "write_markdown"]

NOTE = (
    "final = the last non-empty value; best = min for loss and kl_new_old, max for reward and accuracy "
    "(the rule is in the column name); ratio_new_old and entropy have no better direction: final only."
)

Cell = str | int | float | None


@dataclass
class Summary:
    """The table's column names and its rows (column -> cell)."""

    columns: list[str]
    rows: list[dict[str, Cell]]


def summarize(runs: list[Run], groups: list[Group] | None = None) -> Summary:
    """The table: ``member, status, overrides, steps``, then ``<metric>_final`` and
    ``<metric>_best_<min|max>`` for each key metric that some member has, then the member's
    ``group`` when ``groups`` are given. A member without metrics, or without a value of a
    metric, has ``None`` in those cells."""
    metrics = [m for m in BEST if any(run.metrics and has_values(run.metrics, m) for run in runs)]
    columns = ["member", "status", "overrides", "steps"]
    for metric in metrics:
        columns += [f"{metric}_final"] + ([f"{metric}_best_{BEST[metric]}"] if BEST[metric] else [])
    group_of = {run.path: group.id for group in groups or [] for run in group.members}
    columns += ["group"] if groups else []
    rows = []
    for run in runs:
        row: dict[str, Cell] = dict.fromkeys(columns)
        row.update(member=run.name, status=run.status, overrides=" ".join(run.overrides))
        if groups:
            row["group"] = group_of[run.path]
        if run.metrics is not None:
            steps = logged_values(run, "step")
            row["steps"] = int(steps[-1]) if steps else 0
        for metric in metrics:
            values = logged_values(run, metric)
            if values:
                row[f"{metric}_final"] = values[-1]
                if BEST[metric]:
                    row[f"{metric}_best_{BEST[metric]}"] = min(values) if BEST[metric] == "min" else max(values)
        rows.append(row)
    return Summary(columns, rows)


def cell_text(cell: Cell) -> str:
    if cell is None:
        return ""
    return f"{cell:.6g}" if isinstance(cell, float) else str(cell)


def write_csv(summary: Summary, path: Path) -> None:
    """Numbers at full precision, empty cells for missing values."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=summary.columns)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in summary.rows)


def markdown_table(summary: Summary) -> list[str]:
    """The lines of a Markdown table (numbers to 6 significant digits)."""
    lines = ["| " + " | ".join(summary.columns) + " |", "|" + "---|" * len(summary.columns)]
    for row in summary.rows:
        cells = (cell_text(row[c]).replace("|", "\\|") for c in summary.columns)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_markdown(summary: Summary, path: Path, title: str, more: list[str] = ()) -> None:
    """The member table, the rule for final and best, the statuses, then the lines ``more``."""
    lines = [f"# {title}", "", *markdown_table(summary), "", NOTE, "", "Status:", ""]
    lines += [f"- `{status}`: {meaning}" for status, meaning in STATUSES.items()]
    path.write_text("\n".join([*lines, *more]) + "\n")


def rich_table(summary: Summary, title: str, caption: str = NOTE) -> Table:
    """The same table for the console; cells wrap between words, never inside one."""
    table = Table(title=Text(title), caption=caption, box=box.SIMPLE_HEAD)
    for column in summary.columns:
        header = column.replace("_final", "\nfinal").replace("_best_", "\nbest ")  # e.g. "loss" over "best min"
        words = [w for text in (header, *(cell_text(row[column]) for row in summary.rows)) for w in text.split()]
        justify = "left" if column in ("member", "status", "overrides") else "right"
        table.add_column(header, justify=justify, min_width=max(map(len, words)))
    for row in summary.rows:
        table.add_row(*(Text(cell_text(row[c])) for c in summary.columns))
    return table


def print_summary(summary: Summary, title: str, console: Console, caption: str = NOTE) -> None:
    """Print `rich_table`, or, on a console too narrow for it, one block of text per row: its first
    three cells on one line, the others as ``column=value`` under it."""
    table = rich_table(summary, title, caption)
    unclamped = console.options.update_width(1_000_000)  # a measurement is clamped to the width it is given
    if Measurement.get(console, unclamped, table).minimum <= console.width:
        console.print(table)
        return
    console.print(Text(title, style="bold"))
    for row in summary.rows:
        console.print(Text("  ".join(cell_text(row[c]) for c in summary.columns[:3])))
        numbers = [f"{c}={cell_text(row[c])}" for c in summary.columns[3:] if row[c] not in (None, "")]
        if numbers:
            console.print(Padding(Text("  ".join(numbers)), (0, 0, 0, 4), expand=False))
    console.print(caption)
