"""Writing rollouts as rollout-record.md records, readable again by `rlcli.data.readers`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcli.data.schema import Rollout


def to_record(r: Rollout) -> dict[str, Any]:
    """``r`` as a rollout-record.md record (absent optional fields left out)."""
    record = {
        "prompt_ids": list(r.prompt_ids),
        "completion_ids": list(r.completion_ids),
        "old_logprobs": list(r.old_logprobs),
        "ref_logprobs": None if r.ref_logprobs is None else list(r.ref_logprobs),
        "advantages": None if r.advantages is None else list(r.advantages),
        "reward": r.reward,
        "group_id": r.group_id,
        "completion_mask": list(r.completion_mask),
        "temperature": r.temperature,
    }
    return {k: v for k, v in record.items() if v is not None}


def append_jsonl(rollouts: Sequence[Rollout], path: str | Path) -> None:
    """Append ``rollouts`` to ``path`` as rollout-record.md JSON Lines records (readable by `load_rollouts`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        for r in rollouts:
            handle.write(json.dumps(to_record(r)) + "\n")
