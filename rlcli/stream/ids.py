"""Each stream id trains at most once per consumer group: the first entry that carries an id claims it.

The claims live in the hash ``<stream>:ids:<group>`` (record id -> the entry ID that claimed it), kept as
long as the group is, so an id pushed again (``rlcli stream push`` of the same file twice) is a duplicate
however late it comes and whichever process of the trainer reads it. Reading the claiming entry again (a
resumed trainer, or one that reconnected) finds its own claim: the claims need nothing from the checkpoint.
"""

from __future__ import annotations

from rlcli.stream.connection import RedisConnection

# The entry that claimed id ARGV[1] in hash KEYS[1]: ARGV[2] itself when no entry did before it.
_CLAIM = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return ARGV[2] end
return redis.call('HGET', KEYS[1], ARGV[1])
"""


def ids_key(stream: str, group: str) -> str:
    return f"{stream}:ids:{group}"


def claim(conn: RedisConnection, stream: str, group: str, record_id: str, entry: str) -> str:
    """The entry of ``stream`` whose record first had ``record_id`` for ``group``: ``entry``, unless it is a
    duplicate of an earlier one."""
    return conn.call("eval", _CLAIM, 1, ids_key(stream, group), record_id, entry)
