"""Find and read the run directories behind a report: one run, or the members of a multirun."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

__all__ = ["STATUSES", "ReportError", "Run", "find_runs", "has_values", "load_run", "logged_values", "read_json_object",
           "read_metrics", "read_objective", "read_overrides"]


class ReportError(Exception):
    """A path or file the report cannot use; the CLI prints it and exits with code 2."""


@dataclass
class Run:
    """A run directory: its Hydra overrides, its status, its ``metrics.csv`` columns and ``objective.json``.

    ``metrics`` maps each column (``step`` included) to one float per row, NaN for an empty
    cell; it is ``None`` when the run has no readable ``metrics.csv``. ``objective`` is
    ``objective.json`` (``{"metric", "reduce", "direction", "value", ...}``, or ``{"value": null,
    "failed": reason}``), ``None`` without that file.
    """

    path: Path
    overrides: list[str]
    status: str
    metrics: dict[str, list[float]] | None
    objective: dict | None = None

    @property
    def name(self) -> str:
        return self.path.name


# What a run's status means; summary.md repeats it under the table.
STATUSES = {
    "done": "metrics.csv and export/: the run finished",
    "partial": "metrics.csv but no export/: still running, or stopped before the end",
    "no metrics": "no metrics.csv: failed before its first step, or not started yet",
    "unreadable": "a file of the run could not be read (the reason follows)",
}


def logged_values(run: Run, metric: str) -> list[float]:
    """The non-empty cells of a run's ``metrics.csv`` column, in step order (``[]`` without metrics or column)."""
    return [v for v in (run.metrics or {}).get(metric, []) if not math.isnan(v)]


def has_values(metrics: dict[str, list[float]], metric: str) -> bool:
    """Whether ``metric`` is a column with at least one non-empty cell."""
    return any(not math.isnan(v) for v in metrics.get(metric, []))


def _number(text: str | None, where: str, column: str) -> float:
    if text is None or text.strip() == "":
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise ReportError(f"{where}: column {column!r}: {text!r} is not a number") from None


def read_metrics(path: Path) -> dict[str, list[float]]:
    """The columns of a ``metrics.csv``; rows without a step (a line still being written) are left out."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = [c for c in reader.fieldnames or [] if c]
        if "step" not in columns:
            raise ReportError(f"{path}: no 'step' column in the header")
        metrics: dict[str, list[float]] = {c: [] for c in columns}
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if math.isnan(_number(row["step"], where, "step")):
                continue
            for column in columns:
                metrics[column].append(_number(row[column], where, column))
    return metrics


def read_overrides(run_dir: Path) -> list[str]:
    """Hydra's command-line overrides of a run (``.hydra/overrides.yaml``), ``[]`` without that file."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    try:
        overrides = OmegaConf.load(path)
    except Exception as err:  # OmegaConf raises several YAML and config error types
        raise ReportError(f"{path}: {err}") from None
    if not isinstance(overrides, ListConfig):
        raise ReportError(f"{path}: expected a list of overrides")
    return [str(o) for o in overrides]


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path`` (a run's ``objective.json``, ``manifest.json``), ``None`` without that file;
    raises `ReportError` for a file that does not hold one."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except ValueError as err:
        raise ReportError(f"{path}: not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ReportError(f"{path}: expected a JSON object")
    return value


def read_objective(run_dir: Path) -> dict | None:
    """A run's ``objective.json``, ``None`` without that file."""
    objective = read_json_object(run_dir / "objective.json")
    if objective is not None and "value" not in objective:
        raise ReportError(f"{run_dir / 'objective.json'}: expected a JSON object with a 'value'")
    return objective


def load_run(run_dir: Path) -> Run:
    """Read one run directory; raises `ReportError` for a file it cannot read."""
    overrides = read_overrides(run_dir)
    objective = read_objective(run_dir)
    metrics_path = run_dir / "metrics.csv"
    if not metrics_path.is_file():
        return Run(run_dir, overrides, "no metrics", None, objective)
    status = "done" if (run_dir / "export").is_dir() else "partial"
    return Run(run_dir, overrides, status, read_metrics(metrics_path), objective)


def _load_member(run_dir: Path) -> Run:
    try:
        return load_run(run_dir)
    except (ReportError, OSError) as err:
        return Run(run_dir, [], f"unreadable: {err}", None)


def _members(path: Path) -> list[Path]:
    numbered = [p for p in path.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(numbered, key=lambda p: int(p.name))


def find_runs(path: Path) -> tuple[str, list[Run]]:
    """``("run", [run])`` for a run directory, ``("multirun", members)`` for a multirun directory.

    A run directory holds ``metrics.csv``. A multirun directory holds numbered member directories
    and either ``multirun.yaml`` or a member with ``metrics.csv``; every numbered member is
    returned, an unreadable one with status ``unreadable: <reason>``.
    """
    if not path.exists():
        raise ReportError(f"{path} does not exist")
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory: give the run directory that holds metrics.csv")
    if (path / "metrics.csv").is_file():
        return "run", [load_run(path)]
    members = _members(path)
    if members and ((path / "multirun.yaml").is_file() or any((m / "metrics.csv").is_file() for m in members)):
        return "multirun", [_load_member(m) for m in members]
    raise ReportError(
        f"{path} is neither a run directory nor a multirun directory: it holds no metrics.csv, and no "
        "numbered member directories (0/, 1/, ...) with metrics.csv or multirun.yaml"
    )
