"""EmbeddedRedis: a real server that answers, keeps a stream across a restart, and stops cleanly."""

from __future__ import annotations

import re
import time

import pytest
import redis

from rlcli.errors import UserError
from rlcli.stream import connection
from rlcli.stream.connection import connect
from rlcli.stream.server import EmbeddedRedis, free_port


def test_server_answers_on_its_socket(redis_url):
    assert redis_url.startswith("unix:///") and redis_url.endswith("/redis.sock")
    conn = connect(redis_url)
    assert conn.call("ping") is True
    conn.close()


def test_stream_survives_restart(tmp_path):
    server = EmbeddedRedis(tmp_path)
    with server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        ids = [client.xadd("s", {"record": f'{{"n":{n}}}'}) for n in range(3)]
        client.close()
        url = server.url
        server.restart()
        assert server.url == url
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.xrange("s") == [(i, {"record": f'{{"n":{n}}}'}) for n, i in enumerate(ids)]
        client.close()
    assert (tmp_path / "redis.log").is_file()


def test_stop_twice_and_socket_removed(tmp_path):
    server = EmbeddedRedis(tmp_path).start()
    server.stop()
    server.stop()
    assert not server.socket_path.exists()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()


def test_a_socket_path_too_long_for_the_system_is_one_clear_error(tmp_path):
    deep = tmp_path / ("d" * 100)
    with pytest.raises(UserError, match="the path of Redis's socket is .* bytes, more than the 103"):
        EmbeddedRedis(deep).start()
    assert not deep.exists()  # refused before anything is made


def test_connect_to_closed_port_is_a_user_error(monkeypatch):
    monkeypatch.setattr(connection, "CONNECT_TIMEOUT", 0.3)
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(UserError, match=re.escape(url)):
        connect(url)
    assert time.monotonic() - started < 3
