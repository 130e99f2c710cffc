"""A Redis client that says clearly when the server cannot be reached and rides out restarts.

`connect` fails fast with a `UserError` (exit 2) when nothing answers at the URL; afterwards
`RedisConnection.call` retries a command with exponential backoff while the server is away (a
restart), and counts the reconnections so a reader can re-check what it may have missed.
"""

from __future__ import annotations

import logging
import re
import time
from urllib.parse import urlparse

import redis

from rlcli.errors import UserError
from rlcli.redis_password import masked, revealed

log = logging.getLogger("rlcli")

CONNECT_TIMEOUT = 5.0  # seconds a first connection may take
RECONNECT_TIMEOUT = 120.0  # seconds a running client keeps retrying before giving up
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 2.0  # seconds between retries: doubling from the first to the max
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


class StreamUnavailable(UserError):
    """The Redis server went away and did not come back in time."""


class StreamRefused(UserError):
    """The Redis server answers but cannot serve the stream: it cannot write its data (``MISCONF``: a full
    disk), or the stream's consumer group is gone (``NOGROUP``: a server without persistence restarted)."""


def _refusal(url: str, err: redis.ResponseError) -> StreamRefused | None:
    """The `StreamRefused` that ``err`` (a Redis error reply) means, or None for any other reply."""
    found = re.search(r"\b(MISCONF|NOGROUP)\b", str(err))  # where a script's error quotes the reply, too
    code = found and found.group(1)
    if code == "MISCONF":
        return StreamRefused(f"data.url: Redis at {url} cannot write its data to disk and refuses writes ({err}); "
                             "free space where it keeps them (its --dir, for `rlcli loop` the run directory's redis/) "
                             "and run again")
    if code == "NOGROUP":
        return StreamRefused(f"data.url: the stream's consumer group is gone from Redis at {url} ({err}): the server "
                             "lost its data, e.g. it restarted without persistence (appendonly); what it held is lost, "
                             "start the run again with a server that keeps its data")
    return None


def check_url(url: str, key: str = "data.url") -> str:
    """``url`` if it is a Redis URL (``redis://host:port/db``, ``rediss://`` with TLS, ``unix:///socket``),
    else a `UserError` naming ``key``."""
    parsed = urlparse(url)
    if not (parsed.scheme in ("redis", "rediss") and parsed.hostname or parsed.scheme == "unix" and parsed.path):
        raise UserError(f"{key}: {masked(url)!r} is not a Redis URL (redis://host:port/db, rediss://... with TLS "
                        "or unix:///path/to/socket)")
    return url


class RedisConnection:
    """One client of the server at ``url``; use `call` for every command."""

    def __init__(self, url: str, client: redis.Redis) -> None:
        self.url = url
        self.client = client
        self.reconnects = 0  # times the server was found away and came back

    def call(self, command: str, *args, **kwargs):
        """``client.<command>(*args, **kwargs)``, retried with backoff while the server is away."""
        delay, deadline = BACKOFF_FIRST, None
        while True:
            try:
                result = getattr(self.client, command)(*args, **kwargs)
            except redis.AuthenticationError as err:  # a ConnectionError, but no restart: the password changed
                raise UserError(f"data.url: Redis at {masked(self.url)} refused the password: {err}") from None
            except redis.ResponseError as err:
                refusal = _refusal(masked(self.url), err)
                if refusal is None:
                    raise
                raise refusal from None
            except TRANSIENT as err:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + RECONNECT_TIMEOUT
                    log.warning("stream: Redis at %s is unreachable (%s); reconnecting", masked(self.url), err)
                if now > deadline:
                    raise StreamUnavailable(
                        f"data.url: Redis at {masked(self.url)} has not answered for {RECONNECT_TIMEOUT:.0f} s ({err})"
                    ) from None
                time.sleep(delay)
                delay = min(2 * delay, BACKOFF_MAX)
                continue
            if deadline is not None:
                self.reconnects += 1
                log.warning("stream: Redis at %s is back", masked(self.url))
            return result

    def close(self) -> None:
        self.client.close()


def connect(url: str, key: str = "data.url") -> RedisConnection:
    """A connection to the Redis server at ``url``, checked with a PING; a `UserError` naming ``key``
    when the URL is malformed or nothing answers within `CONNECT_TIMEOUT` seconds."""
    check_url(url, key)
    client = redis.Redis.from_url(revealed(url, key), socket_connect_timeout=CONNECT_TIMEOUT, decode_responses=True)
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        try:
            client.ping()
            return RedisConnection(url, client)
        except redis.AuthenticationError as err:  # a ConnectionError: it must not read as "no server answers"
            raise UserError(f"{key}: Redis at {masked(url)} refused the password: {err}; give the server's "
                            "password in the URL (redis://:PASSWORD@host:port/db)") from None
        except TRANSIENT as err:
            if time.monotonic() > deadline:
                raise UserError(f"{key}: no Redis server answers at {masked(url)} ({err}); start one, or let "
                                "`rlcli loop` start its own") from None
            time.sleep(BACKOFF_FIRST)
        except redis.RedisError as err:  # e.g. the db number is out of range, or MISCONF (it refuses even a PING)
            refusal = _refusal(masked(url), err) if isinstance(err, redis.ResponseError) else None
            raise refusal or UserError(f"{key}: Redis at {masked(url)} refused the connection: {err}") from None
