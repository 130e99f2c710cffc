"""How rollout records travel through a Redis stream, the one check of a stream record, and the keys
that go with a stream.

An entry holds one field, ``record``: the rollout-record.md record as JSON, plus ``id`` (a unique string),
``policy_version`` (the weights version that sampled it) and its advantages, so any Redis client can
write one. `check_record` is that contract: `StreamWriter` checks a record with it before a push, the
trainer's `StreamReader` every entry it reads.

Beside the stream ``S`` live ``S:rejected`` (records the trainer rejected, with the reason),
``S:weights`` (the trainer's newest published weights, as JSON) and, for an hour each,
``S:pushed:<token>`` (the entry IDs of a `StreamWriter` batch, so that a retried batch adds nothing twice);
for each consumer group ``G``, ``S:ids:G`` (the ids it has read, `rlcli.stream.ids`) and ``S:trainer:G`` (the
lease of its trainer, `rlcli.stream.lease`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from rlcli.data.errors import RecordError
from rlcli.data.schema import Rollout, validate_record

FIELD = "record"
DEFAULT_STREAM = "rlcli:rollouts"
# Lists and objects a record may nest (a rollout record has two levels): deeper values would exhaust
# Python's recursion limit wherever the record is checked or written again.
MAX_DEPTH = 32


def rejected_key(stream: str) -> str:
    return f"{stream}:rejected"


def weights_key(stream: str) -> str:
    return f"{stream}:weights"


def encode(record: Mapping[str, Any]) -> dict[str, str]:
    """The fields of the stream entry that carries ``record``."""
    return {FIELD: json.dumps(record, separators=(",", ":"))}


def decode(fields: Mapping[str, str | bytes]) -> Any:
    """The record an entry carries (its field as text, or as the bytes Redis holds); a ``ValueError`` with
    the reason when it carries none: no such field, not UTF-8, not JSON, or nested too deep to parse."""
    if FIELD not in fields:
        raise ValueError(f"the entry has no {FIELD!r} field (fields: {', '.join(sorted(fields)) or 'none'})")
    text = fields[FIELD]
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as err:
        raise ValueError(f"the {FIELD!r} field is not UTF-8 text: {err}") from None
    except RecursionError:
        raise ValueError(f"the {FIELD!r} field is JSON nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as err:  # a JSONDecodeError, or an int of more digits than Python converts
        raise ValueError(f"the {FIELD!r} field is not JSON: {err}") from None


def _deeper_than(value: Any, depth: int) -> bool:
    """Whether ``value`` has lists or objects nested more than ``depth`` levels deep (found without recursion)."""
    containers = (list, tuple, Mapping)
    level = [value] if isinstance(value, containers) else []  # the containers at the level reached
    for _ in range(depth):
        level = [item for node in level for item in (node.values() if isinstance(node, Mapping) else node)
                 if isinstance(item, containers)]
    return bool(level)


def check_record(
    record: Any, where: str, *, index: int = 0, vocab_size: int | None = None, max_tokens: int | None = None
) -> Rollout:
    """``record`` as a `Rollout` with its ``id`` and ``policy_version``; a `RecordError` naming ``where``
    and the field when it breaks the stream contract.

    A stream record is a JSON object (no NaN or infinity: strict JSON; nested at most `MAX_DEPTH` deep) with
    ``id`` (a non-empty string), ``policy_version`` (an int >= 0) and ``advantage`` or ``advantages`` (the
    trainer cannot compute them: a group may reach it in pieces), and it obeys rollout-record.md
    (`validate_record`, with the trainer's ``vocab_size`` and ``max_tokens`` where known; its errors name
    ``where (id ...)``). ``index`` is the document's position among those read.
    """
    if _deeper_than(record, MAX_DEPTH):
        raise RecordError(where, None, f"is JSON nested more than {MAX_DEPTH} levels deep")
    if not _is_json(record):
        fields = record.items() if isinstance(record, Mapping) else ()
        field = next((key for key, value in fields if not _is_json(value)), None)
        raise RecordError(where, field, "is not JSON (NaN, infinity, or a value of a type JSON has not)")
    if not isinstance(record, Mapping):
        raise RecordError(where, None, f"expected a JSON object, got {type(record).__name__}")
    record_id, version = record.get("id"), record.get("policy_version")
    if not isinstance(record_id, str) or not record_id:
        raise RecordError(where, "id", f"is {record_id!r}, expected a non-empty string (every stream record has one)")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise RecordError(where, "policy_version", f"is {version!r}, expected an int >= 0")
    if record.get("advantage") is None and record.get("advantages") is None:
        raise RecordError(where, "advantages", "no 'advantage' or 'advantages': a stream record carries them "
                          "(fill them from 'reward' per 'group_id' with rlcli.stream.group_advantages_for)")
    source = where if record_id == where else f"{where} (id {record_id})"
    doc = validate_record(record, source=source, index=index, vocab_size=vocab_size, max_tokens=max_tokens)
    return dataclasses.replace(doc, id=record_id, policy_version=version)


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
