"""The live loop's Redis stream, as a Python API for any sampler (a vLLM script, ...).

    from rlcli.stream import StreamWriter, group_advantages_for

    # `advantage` from `reward` per `group_id`, with the trainer's advantage.estimator and advantage.eps
    records = group_advantages_for(records, "grpo", eps=1e-6)
    with StreamWriter("redis://127.0.0.1:6379/0") as writer:
        writer.push_many(records)             # each with `id` and `policy_version`

`EmbeddedRedis` runs a redis-server of its own; `newest_weights` reads the trainer's newest
published weights (``version``, ``path``) and `unread` how many records it has still to read.
"""

from rlcli.stream.connection import RedisConnection, connect
from rlcli.stream.queue import newest_weights, unread
from rlcli.stream.records import DEFAULT_STREAM, check_record
from rlcli.stream.server import EmbeddedRedis
from rlcli.stream.writer import StreamWriter, group_advantages_for

__all__ = [
    "DEFAULT_STREAM",
    "EmbeddedRedis",
    "RedisConnection",
    "StreamWriter",
    "check_record",
    "connect",
    "group_advantages_for",
    "newest_weights",
    "unread",
]
