"""What both ends of the loop read from Redis: how far the trainer is behind the samplers.

`unread` counts the entries of a stream that a consumer group has not been given yet (the queue
the samplers filled and the trainer has still to read), up to a bound: the count visits at most that
many entries, whatever the backlog. `announce_weights` and `newest_weights` write and read the
trainer's announcement of its newest published weights.
"""

from __future__ import annotations

import json
from typing import Any

from rlcli.stream.connection import RedisConnection
from rlcli.stream.records import weights_key

COUNTED = 10_000  # the most unread entries that `unread` counts by default (a larger backlog counts as this)

# Entries after the group's last delivered ID, at most ARGV[2] of them, counted on the server (no entry is
# sent back; Redis < 7 keeps no count of them, so they are visited). A stream without that group (the
# trainer has not started) counts every entry, up to ARGV[2].
_UNREAD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local at_most = tonumber(ARGV[2])
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
for _, info in ipairs(groups) do
  local name, last = nil, nil
  for i = 1, #info, 2 do
    if info[i] == 'name' then name = info[i + 1] end
    if info[i] == 'last-delivered-id' then last = info[i + 1] end
  end
  if name == ARGV[1] then return #redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', at_most) end
end
return math.min(redis.call('XLEN', KEYS[1]), at_most)
"""


def unread(conn: RedisConnection, stream: str, group: str, at_most: int = COUNTED) -> int:
    """Entries of ``stream`` that consumer group ``group`` has not read yet, counted up to ``at_most``: the
    count costs time in proportion to ``at_most`` at worst, not to the backlog."""
    return int(conn.call("eval", _UNREAD, 1, stream, group, at_most))


def announce_weights(conn: RedisConnection, stream: str, announcement: dict[str, Any]) -> None:
    """Make ``announcement`` (``version``, ``path``, ...) the newest weights of ``stream``'s trainer."""
    conn.call("set", weights_key(stream), json.dumps(announcement))


def withdraw_weights(conn: RedisConnection, stream: str) -> None:
    """Forget ``stream``'s announcement (of a trainer that ended, maybe ``final``): samplers started now wait
    for the announcement of the trainer starting with them."""
    conn.call("delete", weights_key(stream))


def newest_weights(conn: RedisConnection, stream: str) -> dict[str, Any] | None:
    """The trainer's latest announcement, or None before its first."""
    raw = conn.call("get", weights_key(stream))
    return None if raw is None else json.loads(raw)
