"""How rollout records travel through a Redis stream, and the keys that go with a stream.

An entry holds one field, ``record``: the SPEC §7 record as JSON, plus ``id`` (a unique string)
and ``policy_version`` (the weights version that sampled it), so any Redis client can write one.
Beside the stream ``S`` live ``S:rejected`` (records the trainer rejected, with the reason),
``S:weights`` (the trainer's newest published weights, as JSON) and, for an hour each,
``S:pushed:<token>`` (the entry IDs of a `StreamWriter` batch, so that a retried batch adds nothing twice).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

FIELD = "record"
DEFAULT_STREAM = "rlcli:rollouts"


def rejected_key(stream: str) -> str:
    return f"{stream}:rejected"


def weights_key(stream: str) -> str:
    return f"{stream}:weights"


def encode(record: Mapping[str, Any]) -> dict[str, str]:
    """The fields of the stream entry that carries ``record``."""
    return {FIELD: json.dumps(record, separators=(",", ":"))}


def decode(fields: Mapping[str, str]) -> Any:
    """The record an entry carries; a ``ValueError`` with the reason when it carries none."""
    if FIELD not in fields:
        raise ValueError(f"the entry has no {FIELD!r} field (fields: {', '.join(sorted(fields)) or 'none'})")
    try:
        return json.loads(fields[FIELD])
    except json.JSONDecodeError as err:
        raise ValueError(f"the {FIELD!r} field is not JSON: {err}") from None
