"""Describe a rollout dataset: the table behind ``rlcli data check``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rlcli.data.errors import DataError
from rlcli.data.readers import Rejection, collect_rollouts, expand_paths
from rlcli.data.schema import Rollout

__all__ = ["data_check", "print_summary", "summarize"]


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}


def summarize(rollouts: Sequence[Rollout], rejections: Sequence[Rejection]) -> dict[str, Any]:
    """Counts and min/mean/max statistics of a dataset.

    ``reward`` is over documents that carry one; ``advantage`` is over labelled tokens of
    documents that carry advantages. A statistic with no value is ``None``.
    """
    rewards = [r.reward for r in rollouts if r.reward is not None]
    advantages = [
        a
        for r in rollouts
        if r.advantages is not None
        for a, keep in zip(r.advantages, r.completion_mask)
        if keep
    ]
    return {
        "documents": len(rollouts),
        "groups": len({r.group_id for r in rollouts if r.group_id is not None}),
        "prompt_tokens": _stats([len(r.prompt_ids) for r in rollouts]),
        "completion_tokens": _stats([len(r.completion_ids) for r in rollouts]),
        "labelled_tokens": sum(r.num_labelled for r in rollouts),
        "reward": _stats(rewards),
        "advantage": _stats(advantages),
        "rejected": len(rejections),
    }


def print_summary(summary: dict[str, Any], console: Console) -> None:
    """Print ``summarize``'s dictionary as a table: counts, then min/mean/max rows."""
    table = Table(title="Rollout data")
    for column in ("", "total", "min", "mean", "max"):
        table.add_column(column, justify="left" if not column else "right")
    for name in ("documents", "groups", "labelled_tokens", "rejected"):
        table.add_row(name.replace("_", " "), str(summary[name]), "", "", "")
    for name in ("prompt_tokens", "completion_tokens", "reward", "advantage"):
        stats = summary[name]
        cells = ("-", "-", "-") if stats is None else tuple(f"{stats[k]:.6g}" for k in ("min", "mean", "max"))
        table.add_row(name.replace("_", " "), "", *cells)
    console.print(table)


def data_check(
    paths: Sequence[str | Path], vocab_size: int | None, max_tokens: int | None, console: Console
) -> int:
    """Validate rollout files, print the summary and every rejection; exit code 0 if all valid, else 2.

    ``vocab_size=None`` checks token ids only for being >= 0.
    """
    try:
        files = expand_paths(paths)
        rollouts, rejections = collect_rollouts(files, vocab_size=vocab_size, max_tokens=max_tokens)
    except DataError as err:
        console.print(Text(f"error: {err}", style="red"))
        return 2
    print_summary(summarize(rollouts, rejections), console)
    for rejection in rejections:
        console.print(Text(str(rejection), style="red"))
    if rejections:
        console.print(Text(f"{len(rejections)} invalid records, {len(rollouts)} valid", style="bold red"))
        return 2
    if not rollouts:
        console.print(Text("no documents found", style="bold red"))
        return 2
    return 0
