"""A run's objective: one number from a column of its ``metrics.csv`` (config group ``objective``), which
`rlcli train` writes to ``objective.json`` and hands to Hydra's optimising sweepers.

``objective.json`` holds ``{"metric", "reduce", "direction", "value", "steps"}`` (``steps``: the steps whose
values made ``value``), or ``{"value": null, "failed": REASON}`` for a run without one.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rlcli.report.runs import ReportError, read_metrics
from rlcli.storage import replace_text

log = logging.getLogger("rlcli")

FILE = "objective.json"
# final: the last value; best: the largest (maximize) or smallest (minimize); mean_last: the mean of the last last_k
REDUCTIONS = ("final", "best", "mean_last")
DIRECTIONS = ("maximize", "minimize")


class NoObjective(Exception):
    """The run's metrics give no objective; the message says why."""


@dataclass(frozen=True)
class Objective:
    metric: str
    reduce: str
    direction: str
    value: float
    steps: list[int]


def reduce_metric(metrics: dict[str, list[float]], metric: str, reduce: str, direction: str,
                  last_k: int | None = None) -> Objective:
    """The objective of ``metrics`` (`read_metrics`' columns, NaN for an empty cell) over the steps where
    ``metric`` has a value; `NoObjective` when the column is missing, empty, or the value is not finite."""
    if metric not in metrics:
        columns = ", ".join(c for c in metrics if c != "step")
        raise NoObjective(f"objective.metric: metrics.csv has no column {metric!r}; its columns: {columns}")
    logged = [(int(step), value) for step, value in zip(metrics["step"], metrics[metric]) if not math.isnan(value)]
    if not logged:
        raise NoObjective(f"objective.metric: the column {metric!r} of metrics.csv has no value")
    if reduce == "final":
        chosen = logged[-1:]
        value = chosen[0][1]
    elif reduce == "best":
        pick = max if direction == "maximize" else min
        chosen = [pick(logged, key=lambda step_value: step_value[1])]
        value = chosen[0][1]
    elif reduce == "mean_last":
        chosen = logged[-last_k:]
        value = math.fsum(v for _, v in chosen) / len(chosen)
    else:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not math.isfinite(value):
        raise NoObjective(f"objective: {reduce} of {metric!r} is {value}, not a finite number")
    return Objective(metric, reduce, direction, value, [step for step, _ in chosen])


def write_objective(run_dir: Path, spec) -> float:
    """Compute the objective that ``spec`` (the run's `ObjectiveConfig`) names from ``run_dir/metrics.csv``
    and write it to ``run_dir/objective.json``; its value. A run without one: `NoObjective`, the reason
    logged and written to objective.json."""
    try:
        metrics = read_metrics(run_dir / "metrics.csv")
        objective = reduce_metric(metrics, spec.metric, spec.reduce, spec.direction, spec.last_k)
    except (NoObjective, ReportError, OSError) as err:
        reason = f"cannot read metrics.csv: {err}" if isinstance(err, OSError) else str(err)
        log.warning("no objective: %s", reason)
        record_failure(run_dir, reason)
        raise NoObjective(reason) from None
    replace_text(run_dir / FILE, json.dumps(asdict(objective)) + "\n")
    log.info("objective: %s of %s = %.6g (steps %s)", objective.reduce, objective.metric, objective.value,
             _steps(objective.steps))
    return objective.value


def record_failure(run_dir: Path, reason: str) -> None:
    """Write ``{"value": null, "failed": reason}`` to ``run_dir/objective.json``; a storage that refuses
    it is logged (the run's own error says more)."""
    try:
        replace_text(run_dir / FILE, json.dumps({"value": None, "failed": reason}) + "\n")
    except OSError as err:
        log.warning("cannot write %s: %s", run_dir / FILE, err)


def _steps(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 2 else ", ".join(map(str, steps))
