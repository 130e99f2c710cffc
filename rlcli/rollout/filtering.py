"""DAPO's dynamic sampling (math.md#dynamic-sampling): the groups that ``zero_variance`` drops, judged on
which metric, and the rejections that name them.

`rlcli.rollout.onpolicy.OnPolicyRollouts` filters the groups it samples (the trainer's own sampling,
``rollout.filter``, and ``rlcli sample``'s); `filter_rollouts` filters rollout files on read (``data.filter``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from rlcli.data.errors import DataError
from rlcli.data.readers import Rejection
from rlcli.data.schema import Rollout
from rlcli.data.writers import to_record

__all__ = ["FILTERS", "FILTER_METRICS", "NO_FILTER", "GroupFilter", "count_groups", "filter_metric_of",
           "filter_rollouts", "filtered_reason", "zero_variance_groups"]

FILTERS = ("none", "zero_variance")
FILTER_METRICS = ("accuracy", "reward")  # and null: `filter_metric_of` picks one for the task


def filter_metric_of(task: Any, metric: str | None) -> str:
    """The metric the filter judges a completion by: ``metric``; for null, ``accuracy`` where the task's reward
    has an accuracy term (``task.has_accuracy_term``), else ``reward`` (the task's, before any shaping)."""
    if metric is not None:
        return metric
    return "accuracy" if getattr(task, "has_accuracy_term", False) else "reward"


def zero_variance_groups(values: Sequence[float], group_ids: Sequence[Hashable]) -> set[Hashable]:
    """The groups whose ``values`` are all equal (exactly), a group of one included."""
    seen: dict[Hashable, set[float]] = {}
    for value, group in zip(values, group_ids):
        seen.setdefault(group, set()).add(value)
    return {group for group, distinct in seen.items() if len(distinct) == 1}


def filtered_reason(key: str, metric: str, group: Hashable, size: int, value: float) -> str:
    """Why a document of a dropped group is not trained: the text of its rejection."""
    return f"{key}=zero_variance: all {size} documents of group {group!r} have {metric} {value}"


def _group_of(rollout: Rollout) -> Hashable:
    """A rollout's group: its ``group_id``; a rollout without one is a group of its own."""
    return rollout.source if rollout.group_id is None else ("group", rollout.group_id)


def count_groups(rollouts: Sequence[Rollout]) -> int:
    """The groups of ``rollouts`` (a rollout without a ``group_id`` is a group of its own)."""
    return len({_group_of(r) for r in rollouts})


def filter_rollouts(rollouts: Sequence[Rollout], key: str = "data.filter") -> tuple[list[Rollout], list[Rejection]]:
    """The rollouts of the groups (records sharing a ``group_id``; a record without one is a group of its own)
    whose ``reward`` differs within the group, and a `Rejection` for each of the others. A record without a
    ``reward`` is a `DataError` naming it: the filter judges groups by their rewards."""
    lacking = [r for r in rollouts if r.reward is None]
    if lacking:
        raise DataError(f"{lacking[0].source}: no 'reward', and {key}=zero_variance judges each group by its "
                        f"records' rewards ({len(lacking)} records lack one); set {key}=none to train on them")
    groups = [_group_of(r) for r in rollouts]
    dropped = zero_variance_groups([r.reward for r in rollouts], groups)
    sizes = Counter(groups)
    kept, rejections = [], []
    for rollout, group in zip(rollouts, groups):
        if group not in dropped:
            kept.append(rollout)
            continue
        name = rollout.source if rollout.group_id is None else rollout.group_id
        reason = filtered_reason(key, "reward", name, sizes[group], rollout.reward)
        rejections.append(Rejection(rollout.source, "reward", reason, to_record(rollout)))
    return kept, rejections


@dataclass(frozen=True)
class GroupFilter:
    """Which sampled groups a step keeps: ``mode`` (``none`` | ``zero_variance``), judged on ``metric``
    (`FILTER_METRICS`, None: `filter_metric_of` the task), with at most ``max_rounds`` sampling rounds a step."""

    mode: str = "none"
    metric: str | None = None
    max_rounds: int = 1

    def __post_init__(self) -> None:
        if self.mode not in FILTERS:
            raise ValueError(f"filter must be one of {', '.join(FILTERS)}, got {self.mode!r}")
        if self.metric is not None and self.metric not in FILTER_METRICS:
            raise ValueError(f"filter metric must be one of {', '.join(FILTER_METRICS)} or None, got {self.metric!r}")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")

    @classmethod
    def of(cls, rollout: Any) -> GroupFilter:
        """The filter the ``rollout`` config group asks for."""
        return cls(rollout.filter, rollout.filter_metric, rollout.max_sampling_rounds)


NO_FILTER = GroupFilter()
