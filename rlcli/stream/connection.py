"""A Redis client that says clearly when the server cannot be reached and rides out restarts.

`connect` fails fast with a `UserError` (exit 2) when nothing answers at the URL; afterwards
`RedisConnection.call` retries a command with exponential backoff while the server is away (a
restart), and counts the reconnections so a reader can re-check what it may have missed.
"""

from __future__ import annotations

import logging
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
        except TRANSIENT as err:
            if time.monotonic() > deadline:
                raise UserError(f"{key}: no Redis server answers at {masked(url)} ({err}); start one, or let "
                                "`rlcli loop` start its own") from None
            time.sleep(BACKOFF_FIRST)
        except redis.RedisError as err:  # e.g. a password is needed, or the db number is out of range
            raise UserError(f"{key}: Redis at {masked(url)} refused the connection: {err}") from None
