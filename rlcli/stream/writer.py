"""Pushing rollout records into a Redis stream: what a sampler needs from rlcli.

A record is a rollout-record.md record plus ``id`` (a string unique in the stream) and ``policy_version``
(the weights version that sampled it, an int >= 0). It must also carry ``advantage`` (one value for all
completion tokens) or ``advantages`` (one per token): the trainer of a stream reads a group in
pieces and cannot normalise rewards within it, so a sampler that has only rewards fills them with
`group_advantages_for` first. The writer refuses a record that `check_record` rejects, the check the
trainer makes too; the trainer also rejects what breaks its own config (a token id outside its
vocabulary, a record longer than ``data.max_tokens``, another sampling temperature, ...).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlcli.data.errors import format_problem
from rlcli.data.schema import validate_record
from rlcli.rollout.advantages import estimator_keywords, group_advantages
from rlcli.stream.connection import connect
from rlcli.stream.records import DEFAULT_STREAM, FIELD, check_record, encode

# Adds one entry to stream KEYS[1] per argument after the first (the field's name) and returns their
# IDs: a batch is one round trip, and all of it or none of it is in the stream. KEYS[2] names this
# batch: a retried batch (its reply lost with the connection) returns the IDs it was first given
# instead of adding the records again.
_XADD_MANY = """
if redis.call('EXISTS', KEYS[2]) == 1 then return redis.call('LRANGE', KEYS[2], 0, -1) end
local ids = {}
for i = 2, #ARGV do ids[i - 1] = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i]) end
for i = 1, #ids do redis.call('RPUSH', KEYS[2], ids[i]) end
redis.call('EXPIRE', KEYS[2], 3600)
return ids
"""


def group_advantages_for(
    records: Sequence[Mapping[str, Any]],
    estimator: str,
    *,
    eps: float,
    k: int | None = None,
    names: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Copies of ``records`` where each one without ``advantage``/``advantages`` gets ``advantage``
    from its ``reward`` within the records sharing its ``group_id``.

    ``estimator``, ``eps`` and ``k`` are the trainer's ``advantage.estimator``, ``advantage.eps`` and
    ``advantage.k``, as in `rlcli.rollout.advantages.group_advantages` (``grpo``: ``(r - mean) / (std + eps)``,
    population std; ``dr_grpo``: ``r - mean``; ``rloo``, ``opo``, ``passk``: docs/concepts/math.md#advantages;
    ``opo`` weighs by the labelled tokens of each record, which must then be a whole rollout record);
    records that carry an advantage are kept as they are and left out of the groups. Give whole groups:
    a group split across two calls is normalised in two pieces; ``reinforce_pp_baseline`` and
    ``grpo_batch_std`` normalise over all the records of the call (their batch). Errors name the record as ``names[i]``
    (default ``record i``).
    """
    names = names if names is not None else [f"record {i}" for i in range(len(records))]
    pending = [i for i, r in enumerate(records) if r.get("advantage") is None and r.get("advantages") is None]
    for i in pending:
        reward, group_id = records[i].get("reward"), records[i].get("group_id")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(format_problem(names[i], "reward", f"is {reward!r}, expected a finite number "
                                            "(the record has no 'advantage' or 'advantages')"))
        if isinstance(group_id, bool) or not isinstance(group_id, (str, int)):
            raise ValueError(format_problem(names[i], "group_id", f"is {group_id!r}, expected a string or an int "
                                            "(the record has no 'advantage' or 'advantages')"))
    lengths = None
    if "lengths" in estimator_keywords(estimator):
        lengths = [validate_record(records[i], source=names[i], index=i, vocab_size=None).num_labelled
                   for i in pending]
    values = group_advantages([records[i]["reward"] for i in pending], [records[i]["group_id"] for i in pending],
                              estimator, eps=eps, k=k, lengths=lengths, names=[names[i] for i in pending])
    result = [dict(r) for r in records]
    for i, value in zip(pending, values):
        result[i]["advantage"] = value
    return result


class StreamWriter:
    """Pushes records into the Redis stream ``stream`` at ``url``.

    ``connect``'s `UserError` (naming ``key``) when nothing answers at ``url``; afterwards a push
    rides out a server restart. Every push is named by a random token that Redis keeps for an hour,
    so a push retried after its reply was lost adds nothing twice.
    """

    def __init__(self, url: str, stream: str = DEFAULT_STREAM, *, key: str = "url") -> None:
        self.stream = stream
        self.conn = connect(url, key)

    def push(self, record: Mapping[str, Any]) -> str:
        """Add ``record`` (checked by `check_record`) to the stream; its entry ID."""
        return self.push_many([record])[0]

    def push_many(self, records: Iterable[Mapping[str, Any]]) -> list[str]:
        """Add ``records`` in one round trip, all checked before any is added (errors name the
        ``record i``); their entry IDs in order."""
        records = list(records)
        for i, record in enumerate(records):
            check_record(record, f"record {i}")
        payloads = [encode(record)[FIELD] for record in records]
        if not payloads:
            return []
        batch = f"{self.stream}:pushed:{secrets.token_hex(8)}"
        return self.conn.call("eval", _XADD_MANY, 2, self.stream, batch, FIELD, *payloads)

    def length(self) -> int:
        """The number of entries in the stream."""
        return int(self.conn.call("xlen", self.stream))

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
