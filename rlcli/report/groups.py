"""Members grouped by configuration (their overrides without ``seed``) and each group's statistics over seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlcli.report.runs import Run, logged_values
from rlcli.report.stats import Estimate, estimate, probability_of_improvement

__all__ = ["KEY_METRICS", "OBJECTIVE", "Group", "final_value", "group_runs", "improvement", "primary"]

# key metric -> which value is better (None: no better direction); summary.py's member table uses the same
KEY_METRICS = {"loss": "min", "reward": "max", "accuracy": "max", "ratio_new_old": None, "kl_new_old": "min",
               "entropy": None}
OBJECTIVE = "objective"  # the column of objective.json's value
SEED_KEYS = ("seed", "+seed", "++seed")
PRIMARY_METRICS = ("reward", "accuracy", "loss")  # compared by P(improvement) when no member has an objective


def _split_seed(overrides: list[str]) -> tuple[list[str], str | None]:
    """The overrides without ``seed=...``, and the seed (``None``: the config's own)."""
    seed = None
    rest = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key in SEED_KEYS:
            seed = value
        else:
            rest.append(override)
    return rest, seed


def final_value(run: Run, metric: str) -> float | None:
    """The last non-empty value of a metrics.csv column, or the objective's value; ``None`` if it has none."""
    if metric == OBJECTIVE:
        value = (run.objective or {}).get("value")
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None
    values = logged_values(run, metric)
    return values[-1] if values else None


@dataclass
class Group:
    """One configuration: its id (``G1``, ...), overrides without seed, members and their seeds."""

    id: str
    overrides: list[str]
    members: list[Run]
    seeds: list[str | None]
    finals: dict[str, Estimate] = field(default_factory=dict)  # metric -> mean, interval, IQM of final values

    @property
    def label(self) -> str:
        return " ".join(self.overrides) or "(no overrides besides seed)"

    def finals_of(self, metric: str) -> list[float]:
        """One final value per member that has one."""
        return [v for v in (final_value(run, metric) for run in self.members) if v is not None]


def group_runs(runs: list[Run], metrics: list[str]) -> list[Group]:
    """Group ``runs`` by their overrides without seed (in order of first member), with each group's
    `estimate` of the final value of each of ``metrics`` that some member has."""
    by_config: dict[tuple[str, ...], Group] = {}
    for run in runs:
        rest, seed = _split_seed(run.overrides)
        group = by_config.setdefault(tuple(rest), Group(f"G{len(by_config) + 1}", rest, [], []))
        group.members.append(run)
        group.seeds.append(seed)
    for group in by_config.values():
        for metric in metrics:
            values = group.finals_of(metric)
            if values:
                group.finals[metric] = estimate(values)
    return list(by_config.values())


def primary(groups: list[Group]) -> tuple[str, bool] | None:
    """The value that P(improvement) compares and whether higher is better: the objective when some member
    has one, else the first of reward, accuracy, loss that some member has; ``None`` without any."""
    runs = [run for group in groups for run in group.members]
    objectives = [run.objective for run in runs if final_value(run, OBJECTIVE) is not None]
    if objectives:
        return OBJECTIVE, objectives[0].get("direction", "maximize") != "minimize"
    for metric in PRIMARY_METRICS:
        if any(final_value(run, metric) is not None for run in runs):
            return metric, KEY_METRICS[metric] == "max"
    return None


def improvement(groups: list[Group], metric: str, maximize: bool) -> dict[tuple[str, str], float]:
    """(X id, Y id) -> probability that a seed of X beats a seed of Y on ``metric``'s final value,
    for every ordered pair of groups that both have values."""
    finals = {group.id: group.finals_of(metric) for group in groups}
    return {(x, y): probability_of_improvement(finals[x], finals[y], maximize)
            for x in finals for y in finals if x != y and finals[x] and finals[y]}
