"""Fixtures for the stream tests: one real redis-server per test module, emptied before each test."""

from __future__ import annotations

import pytest
import redis

from rlcli.stream.server import EmbeddedRedis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """An `EmbeddedRedis` in a temporary directory, running for the whole module."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """The URL of the module's server, with every database emptied first."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
