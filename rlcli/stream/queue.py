"""What both ends of the loop read from Redis: how far the trainer is behind the samplers.

`unread` counts the entries of a stream that a consumer group has not been given yet (the queue
the samplers filled and the trainer has still to read); `announce_weights` and `newest_weights`
write and read the trainer's announcement of its newest published weights.
"""

from __future__ import annotations

import json
from typing import Any

from rlcli.stream.connection import RedisConnection
from rlcli.stream.records import weights_key

# Entries after the group's last delivered ID, counted on the server (no entry is sent back).
# A stream without that group (the trainer has not started) counts every entry.
_UNREAD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
for _, info in ipairs(groups) do
  local name, last = nil, nil
  for i = 1, #info, 2 do
    if info[i] == 'name' then name = info[i + 1] end
    if info[i] == 'last-delivered-id' then last = info[i + 1] end
  end
  if name == ARGV[1] then return #redis.call('XRANGE', KEYS[1], '(' .. last, '+') end
end
return redis.call('XLEN', KEYS[1])
"""


def unread(conn: RedisConnection, stream: str, group: str) -> int:
    """Entries of ``stream`` that consumer group ``group`` has not read yet."""
    return int(conn.call("eval", _UNREAD, 1, stream, group))


def announce_weights(conn: RedisConnection, stream: str, announcement: dict[str, Any]) -> None:
    """Make ``announcement`` (``version``, ``path``, ...) the newest weights of ``stream``'s trainer."""
    conn.call("set", weights_key(stream), json.dumps(announcement))


def newest_weights(conn: RedisConnection, stream: str) -> dict[str, Any] | None:
    """The trainer's latest announcement, or None before its first."""
    raw = conn.call("get", weights_key(stream))
    return None if raw is None else json.loads(raw)
