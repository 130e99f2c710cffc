"""EmbeddedRedis: a real server that answers, keeps a stream across a restart, and stops cleanly."""

from __future__ import annotations

import re
import socket
import time

import pytest
import redis

from rlcli.errors import UserError
from rlcli.stream import connection
from rlcli.stream.connection import connect
from rlcli.stream.server import EmbeddedRedis, free_port


def test_server_answers_on_loopback(redis_url):
    assert redis_url.startswith("redis://127.0.0.1:") and redis_url.endswith("/0")
    conn = connect(redis_url)
    assert conn.call("ping") is True
    assert conn.call("config_get", "appendonly") == {"appendonly": "yes"}
    conn.close()


def test_stream_survives_restart(tmp_path):
    server = EmbeddedRedis(tmp_path)
    with server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        ids = [client.xadd("s", {"record": f'{{"n":{n}}}'}) for n in range(3)]
        client.close()
        port = server.port
        server.restart()
        assert server.port == port
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.xrange("s") == [(i, {"record": f'{{"n":{n}}}'}) for n, i in enumerate(ids)]
        client.close()
    assert (tmp_path / "redis.log").is_file()


def test_stop_twice_and_port_freed(tmp_path):
    server = EmbeddedRedis(tmp_path).start()
    server.stop()
    server.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1)


def test_connect_to_closed_port_is_a_user_error(monkeypatch):
    monkeypatch.setattr(connection, "CONNECT_TIMEOUT", 0.3)
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(UserError, match=re.escape(url)):
        connect(url)
    assert time.monotonic() - started < 3
