"""A Redis server that answers but will not serve the stream is one clear message, not a traceback nor
"no server answers" (issue 32, items 16 and 18): a wrong or missing password, a server that cannot write
its append-only file (``MISCONF``: its file size limit stands for a full disk), and a server without
persistence that restarted and lost the consumer group (``NOGROUP``). Each server is a real
redis-server started here with the option the case needs."""

from __future__ import annotations

import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from stream_helpers import VOCAB, records

from rlcli.errors import UserError
from rlcli.stream.connection import CONNECT_TIMEOUT, StreamRefused, connect
from rlcli.stream.reader import ReaderOptions, StreamReader
from rlcli.stream.server import free_port, redis_server_binary
from rlcli.stream.writer import StreamWriter

AOF_LIMIT = 64 * 1024  # bytes the server's files may grow to: its "disk"


@contextmanager
def server(directory: Path, *options: str, limit: int | None = None, port: int | None = None) -> Iterator[str]:
    """A redis-server on a free port with ``options``, its files in ``directory``; with ``limit``, no file it
    writes may grow beyond ``limit`` bytes (RLIMIT_FSIZE; SIGXFSZ ignored, so a write fails with EFBIG as
    on a full disk). Yields its URL (without a password)."""
    port = port or free_port()

    def limited() -> None:
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # kept across exec: the write fails, the server lives
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    process = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir",
                                str(directory), "--save", "", *options], preexec_fn=limited,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, socket_connect_timeout=1).ping()
                break
            except redis.AuthenticationError:
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and process.poll() is None, "redis-server did not start"
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def options(stream: str = "s") -> ReaderOptions:
    return ReaderOptions(stream=stream, group="trainer", max_tokens=4096, vocab_size=VOCAB, max_lag=10, temperature=1.0,
                         allow_temperature_mismatch=False, need_ref_logprobs=False, wait_warning=60.0,
                         idle_timeout=None)


@pytest.mark.parametrize("given", ["wrong", None])
def test_a_wrong_or_missing_password_says_so_at_once(tmp_path, given):
    """redis-py's AuthenticationError is a ConnectionError: before the fix it was retried for
    CONNECT_TIMEOUT seconds and reported as "no Redis server answers"."""
    with server(tmp_path, "--requirepass", "s3cret") as url:
        given_url = url.replace("//", f"//:{given}@") if given else url
        started = time.monotonic()
        with pytest.raises(UserError) as caught:
            connect(given_url)
        assert time.monotonic() - started < CONNECT_TIMEOUT / 2
        message = str(caught.value)
        assert message.startswith(f"data.url: Redis at {url.replace('//', '//:****@') if given else url} refused "
                                  "the password")
        assert "no Redis server answers" not in message and ":wrong@" not in message  # nor the secret
        connect(url.replace("//", "//:s3cret@")).close()  # the right one is let in


def test_a_server_that_cannot_write_its_append_only_file_is_one_message_to_sampler_and_trainer(tmp_path):
    """The sampler's push (a script) and the trainer's consumer group (XGROUP CREATE) get MISCONF once the
    append-only file cannot grow; before the fix each raised redis' ResponseError with a traceback."""
    with server(tmp_path, "--appendonly", "yes", "--appendfsync", "everysec", limit=AOF_LIMIT) as url:
        writer, batch = StreamWriter(url, "s"), records("r", 100)
        with pytest.raises(StreamRefused) as sampler:
            for _ in range(AOF_LIMIT // 100):  # far more than the file may hold
                writer.push_many(batch)
        with pytest.raises(StreamRefused) as trainer:
            StreamReader(connect(url), options("other"), "trainer-0", tmp_path / "rejected.jsonl")
        for caught in (sampler, trainer):
            assert str(caught.value).startswith(f"data.url: Redis at {url} cannot write its data to disk and refuses "
                                                "writes (")
            assert "MISCONF" in str(caught.value)


def test_a_server_without_persistence_that_restarted_is_one_message_to_the_trainer(tmp_path):
    """The restarted server has no consumer group: XREADGROUP answers NOGROUP, which before the fix was
    a ResponseError with a traceback."""
    port = free_port()
    with server(tmp_path, "--appendonly", "no", port=port) as url:
        reader = StreamReader(connect(url), options(), "trainer-0", tmp_path / "rejected.jsonl")
    with server(tmp_path, "--appendonly", "no", port=port) as url:
        StreamWriter(url, "s").push_many(records("r", 1))  # a sampler pushes again: a stream without the group
        with pytest.raises(StreamRefused) as caught:
            reader.next_micro_batch()
    message = str(caught.value)
    assert message.startswith(f"data.url: the stream's consumer group is gone from Redis at {url} (")
    assert "NOGROUP" in message and "restarted without persistence" in message
