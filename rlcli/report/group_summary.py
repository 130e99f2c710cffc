"""The group tables of a multirun: final values over seeds with 95% intervals, and P(improvement) between groups."""

from __future__ import annotations

from dataclasses import dataclass

from rlcli.report.equal import RTOL, EqualPair
from rlcli.report.groups import KEY_METRICS, OBJECTIVE, Group, final_value, improvement, primary
from rlcli.report.stats import CONFIDENCE, IQM_MIN_SEEDS, RESAMPLES, Estimate
from rlcli.report.summary import Cell, Summary

__all__ = ["GroupReport", "INTERVALS", "group_report"]

INTERVALS = (
    f"final = the last non-empty value of each seed; shown as the mean over seeds [{CONFIDENCE:.0%} interval]: a "
    f"percentile bootstrap of the mean over seeds (scipy.stats.bootstrap, {RESAMPLES} resamples, fixed random "
    f"state). 1 seed: no interval. 2-3 seeds: the interval only spans the few values seen and is too narrow. "
    f"IQM = interquartile mean (scipy.stats.trim_mean, 25% cut at each end) with {IQM_MIN_SEEDS} seeds or more."
)


@dataclass
class GroupReport:
    """Everything the report says about the groups: the tables and the lines that explain them."""

    groups: list[Group]  # best first by `compared`
    metrics: list[str]  # the final values estimated: the objective first when some member has one
    compared: tuple[str, bool] | None  # P(improvement)'s metric and whether higher is better
    equal: list[EqualPair]
    csv: Summary  # numbers at full precision: groups.csv
    table: Summary  # formatted cells: the terminal, summary.md, report.html
    improvement: Summary | None  # P(row's group better than column's group)

    def notes(self) -> list[str]:
        """What the tables mean, and the pairs of equal groups with the reason."""
        lines = [INTERVALS]
        if OBJECTIVE in self.metrics:
            kinds = dict.fromkeys(f"{o.get('metric')} ({o.get('reduce')}, {o.get('direction')})"
                                  for g in self.groups for o in (r.objective for r in g.members) if o and "metric" in o)
            lines.append(f"objective = the value in the members' objective.json: {'; '.join(kinds) or '?'}.")
        if self.compared:
            metric, maximize = self.compared
            lines.append(f"P(improvement) of X over Y = P(x {'>' if maximize else '<'} y) + P(x = y)/2 over every pair "
                         f"of a seed x of X and a seed y of Y, on the final {metric} (rliable's definition; "
                         f"scipy.stats.mannwhitneyu's U / (n m)).")
        for pair in self.equal:
            lines.append(f"EQUAL: {pair.first} and {pair.second} have the same {', '.join(pair.metrics)} curves seed "
                         f"by seed (within {RTOL:g} of each curve's largest value), so this sweep cannot tell them "
                         f"apart. Why: {pair.reason}")
        return lines


def _short(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def _cell(estimate: Estimate | None) -> str:
    if estimate is None:
        return ""
    if estimate.low is None:
        return f"{_short(estimate.mean)} (1 seed)"
    return f"{_short(estimate.mean)} [{_short(estimate.low)}, {_short(estimate.high)}]"


def _failed(group: Group) -> int:
    return sum(1 for run in group.members if run.objective is not None and final_value(run, OBJECTIVE) is None)


def _order(groups: list[Group], compared: tuple[str, bool] | None) -> list[Group]:
    if compared is None:
        return groups
    metric, maximize = compared
    with_value = [g for g in groups if metric in g.finals]
    with_value.sort(key=lambda g: g.finals[metric].mean, reverse=maximize)
    return with_value + [g for g in groups if metric not in g.finals]


def _seeds(group: Group) -> str:
    return " ".join("default" if seed is None else seed for seed in group.seeds)


def _csv(groups: list[Group], metrics: list[str], equal_to: dict[str, list[str]],
         probabilities: dict[tuple[str, str], float]) -> Summary:
    columns = ["group", "overrides", "seeds", "members"]
    for metric in metrics:
        columns += [f"{metric}_mean", f"{metric}_ci_low", f"{metric}_ci_high", f"{metric}_iqm"]
    columns += ["objective_failed"] if OBJECTIVE in metrics else []
    columns += ["equal_to"] + [f"p_better_than_{g.id}" for g in groups]
    rows = []
    for group in groups:
        row: dict[str, Cell] = dict.fromkeys(columns)
        row.update(group=group.id, overrides=group.label, seeds=_seeds(group), members=len(group.members),
                   equal_to=" ".join(equal_to[group.id]))
        for metric in metrics:
            if (estimate := group.finals.get(metric)) is not None:
                row.update({f"{metric}_mean": estimate.mean, f"{metric}_ci_low": estimate.low,
                            f"{metric}_ci_high": estimate.high, f"{metric}_iqm": estimate.iqm})
        if OBJECTIVE in metrics:
            row["objective_failed"] = _failed(group)
        for other in groups:
            row[f"p_better_than_{other.id}"] = probabilities.get((group.id, other.id))
        rows.append(row)
    return Summary(columns, rows)


def _table(groups: list[Group], metrics: list[str], equal_to: dict[str, list[str]]) -> Summary:
    iqm = [m for m in metrics if any(g.finals.get(m) and g.finals[m].iqm is not None for g in groups)]
    columns = ["group", "seeds", "overrides", *(f"{m} final" for m in metrics), *(f"{m} IQM" for m in iqm)]
    columns += ["equal to"] if any(equal_to.values()) else []
    rows = []
    for group in groups:
        row: dict[str, Cell] = dict.fromkeys(columns, "")
        row.update(group=group.id, seeds=_seeds(group), overrides=group.label)
        for metric in metrics:
            row[f"{metric} final"] = _cell(group.finals.get(metric))
        if OBJECTIVE in metrics and (failed := _failed(group)):
            row[f"{OBJECTIVE} final"] = f"{row[f'{OBJECTIVE} final']} {failed} failed".strip()
        for metric in iqm:
            row[f"{metric} IQM"] = _short(group.finals[metric].iqm if group.finals.get(metric) else None)
        if "equal to" in columns:
            row["equal to"] = " ".join(equal_to[group.id])
        rows.append(row)
    return Summary(columns, rows)


def _improvement(groups: list[Group], probabilities: dict[tuple[str, str], float]) -> Summary:
    columns = ["P(row better than column)", *(g.id for g in groups)]
    rows = []
    for x in groups:
        row: dict[str, Cell] = {columns[0]: x.id}
        row.update({y.id: "" if (x.id, y.id) not in probabilities else f"{probabilities[x.id, y.id]:.2f}"
                    for y in groups})
        rows.append(row)
    return Summary(columns, rows)


def group_report(groups: list[Group], equal: list[EqualPair]) -> GroupReport:
    """The tables of ``groups`` (from `group_runs` with every metric) and the pairs of ``equal`` groups."""
    metrics = [m for m in [OBJECTIVE, *KEY_METRICS] if any(m in g.finals for g in groups)]
    compared = primary(groups)
    probabilities = improvement(groups, *compared) if compared else {}
    groups = _order(groups, compared)
    equal_to = {g.id: [] for g in groups}
    for pair in equal:
        equal_to[pair.first].append(pair.second)
        equal_to[pair.second].append(pair.first)
    table = _improvement(groups, probabilities) if probabilities else None
    return GroupReport(groups, metrics, compared, equal, _csv(groups, metrics, equal_to, probabilities),
                       _table(groups, metrics, equal_to), table)
