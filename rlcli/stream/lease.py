"""One trainer per consumer group: a lease in Redis at ``<stream>:trainer:<group>`` that names the run holding it.

A trainer takes the lease before it reads the stream (`GroupLease.take`) and renews it every `RENEW` seconds
from a thread of its first process; it lapses `TTL` seconds after the last renewal and is given up when the
run ends. The lease names the run by its directory (with the host and process for the message): a trainer
of another run directory is refused while the lease is held (a `UserError`, exit 2), and a trainer of the
same directory takes it over at once, since the run-directory lock it holds (`rlcli.run_lock`) proves that
the run before it has ended. So a crashed trainer resumed in its own directory waits for nothing, and one
that is not resumed holds the group for at most `TTL` seconds. A trainer whose lease lapsed and was taken
by another run (its process was stopped for longer than `TTL`) stops before its next batch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import weakref
from pathlib import Path

from rlcli.errors import UserError
from rlcli.processes import launcher
from rlcli.stream.connection import RedisConnection

log = logging.getLogger("rlcli")

TTL = 30.0  # seconds a lease outlives its holder's last renewal
RENEW = TTL / 3  # seconds between renewals

# Takes (ARGV[4] == 'take') or renews the lease KEYS[1] for run ARGV[1] (its holder's JSON: ARGV[2]) for ARGV[3]
# ms: 1 when this run holds it now, 0 when a renewal finds it gone (a renewal does not bring it back), else the
# JSON of the run that holds it.
_TAKE = """
local held = redis.call('GET', KEYS[1])
if held then
  local ok, holder = pcall(cjson.decode, held)
  if not ok or type(holder) ~= 'table' or holder['run'] ~= ARGV[1] then return held end
elseif ARGV[4] ~= 'take' then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""
# Gives up the lease KEYS[1] if run ARGV[1] holds it.
_GIVE_UP = """
local held = redis.call('GET', KEYS[1])
if held then
  local ok, holder = pcall(cjson.decode, held)
  if ok and type(holder) == 'table' and holder['run'] == ARGV[1] then redis.call('DEL', KEYS[1]) end
end
return 0
"""


def lease_key(stream: str, group: str) -> str:
    return f"{stream}:trainer:{group}"


class GroupLease:
    """The lease of consumer group ``group`` of ``stream`` for the run in ``run_dir``. ``renew``: whether this
    process keeps it (the run's first process) or only checks it (a process that the first one started)."""

    def __init__(self, conn: RedisConnection, stream: str, group: str, run_dir: Path, *, renew: bool) -> None:
        self.conn = conn
        self.stream, self.group = stream, group
        self.key = lease_key(stream, group)
        self.run = str(Path(run_dir).resolve())
        self.holder = json.dumps({"run": self.run, "host": socket.gethostname(), "pid": launcher() or os.getpid()})
        self.renew = renew
        self.taken_by: str | None = None  # the holder's JSON when another run took the lease from this one

    def take(self) -> GroupLease:
        """Hold the lease (renewed from here on when ``renew``); a `UserError` naming the holder when another
        run holds it."""
        held = self._call("take")
        if isinstance(held, str):
            raise UserError(f"data.group: {self._holding(held)}; give this run its own data.group (or data.stream), "
                            f"or end that run (if it died, its lease lapses {TTL:.0f} s after its last renewal; "
                            "resumed in its own run directory it takes the group over at once)")
        if self.renew:
            stop = threading.Event()
            threading.Thread(target=_keep, args=(weakref.ref(self), stop), name="rlcli-group-lease",
                             daemon=True).start()
            weakref.finalize(self, _give_up, self.conn, self.key, self.run, stop)  # at exit, or once unused
        return self

    def check(self) -> None:
        """A `UserError` when another run has taken the lease from this one."""
        if self.taken_by is not None:
            raise UserError(f"data.group: {self._holding(self.taken_by)}, which took it after this run's lease "
                            f"lapsed (not renewed for {TTL:.0f} s); this run stops reading")

    def _call(self, action: str) -> int | str:
        return self.conn.call("eval", _TAKE, 1, self.key, self.run, self.holder, int(TTL * 1000), action)

    def _renewed(self) -> bool:
        """Renew the lease; False when it is not this run's any more (taken: `taken_by` says by whom; or gone)."""
        try:
            held = self._call("renew")
        except UserError as err:  # Redis away for longer than its clients wait: the reader fails too
            log.warning("stream: could not renew the lease of data.group %r: %s", self.group, err)
            return False
        if isinstance(held, str):
            self.taken_by = held
            log.error("stream: %s", self._holding(held))
        elif held == 0:
            log.warning("stream: the lease of data.group %r is gone from Redis (deleted, or it lapsed); this run "
                        "no longer holds it", self.group)
        return held == 1

    def _holding(self, held: str) -> str:
        try:
            holder = json.loads(held)
            who = f"the run in {holder['run']} (host {holder['host']}, process {holder['pid']})"
        except (ValueError, TypeError, KeyError):
            who = f"{held!r}"
        return f"the consumer group {self.group!r} of stream {self.stream!r} is held by {who}"


def _keep(lease: weakref.ref, stop: threading.Event) -> None:
    """Renew the lease every `RENEW` seconds until it is given up, unused, or not this run's any more."""
    while not stop.wait(RENEW):
        held = lease()
        if held is None or not held._renewed():
            return
        del held


def _give_up(conn: RedisConnection, key: str, run: str, stop: threading.Event) -> None:
    """Stop renewing and delete the lease if ``run`` holds it: once, without retrying (it lapses anyway)."""
    stop.set()
    try:
        conn.client.eval(_GIVE_UP, 1, key, run)
    except Exception:  # noqa: BLE001 - at exit, Redis may be gone
        pass
