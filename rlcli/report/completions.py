"""The last lines of a member's ``completions.jsonl``: what the model wrote, with its reward and advantage."""

from __future__ import annotations

import json
from collections import deque

from rlcli.report.runs import Run

__all__ = ["LAST", "last_completions"]

LAST = 3  # lines shown per group


def last_completions(run: Run, n: int = LAST) -> list[dict] | None:
    """The last ``n`` lines of ``run``'s ``completions.jsonl`` (a line that is not a JSON object, e.g. one
    still being written, becomes ``{"unreadable line": text}``); ``None`` without that file."""
    path = run.path / "completions.jsonl"
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        lines = deque((line for line in f if line.strip()), maxlen=n)
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        records.append(record if isinstance(record, dict) else {"unreadable line": line.strip()})
    return records
