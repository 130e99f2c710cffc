"""Who can reach the live loop, and what its files show: the loop's own Redis admits only its user and
refuses the commands that would turn it against the machine; a Redis password never lands in a file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from rlcli.stream.server import EmbeddedRedis, free_port, redis_server_binary
from train_helpers import run_rlcli

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Unix sockets, /proc and another user's process")

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # outside any home directory: another user may run it
SECRET = "s3cret-Pa55word-4e1f"


def server_pid(server: EmbeddedRedis) -> int:
    """The pid of ``server``'s redis-server: the child of this test that holds a file of its directory open
    (its append-only file)."""
    found = [p.pid for p in psutil.Process().children()
             if any(Path(f.path).parent == server.directory for f in p.open_files())]
    assert len(found) == 1, found
    return found[0]


PROBE = """
import socket, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
if url.scheme == "unix":
    client, address = socket.socket(socket.AF_UNIX), urllib.parse.unquote(url.path)
else:
    client, address = socket.socket(), (url.hostname, url.port)
try:
    client.connect(address)
except OSError as err:
    sys.exit(f"refused: {err}")
client.sendall(b"PING\\r\\n")
print("answered", client.recv(64))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON),
                    reason="needs root, to run a client as another user, and a Python that user may run")
def test_another_user_cannot_reach_the_loops_redis(tmp_path):
    """Fails on a server that listens on TCP without a password: uid 65534 then gets its PONG (and could
    push records, stop the loop or write files as the run's user)."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        other = subprocess.run([SYSTEM_PYTHON, "-c", PROBE, server.url], user=NOBODY, group=NOBODY,
                               capture_output=True, text=True, timeout=60, cwd="/")
        assert other.returncode == 1 and "answered" not in other.stdout, (other.stdout, other.stderr)
        assert other.stderr.startswith("refused: [Errno 13] Permission denied"), other.stderr
        assert redis.Redis.from_url(server.url).ping()  # its own user gets in


def test_the_loops_redis_listens_on_no_tcp_port_and_keeps_its_directory_private(tmp_path):
    """Fails on a server bound to 127.0.0.1:<port>, or a data directory other users may enter."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        assert psutil.Process(server_pid(server)).net_connections(kind="inet") == []
        mode = (tmp_path / "redis").stat()
        assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.geteuid()
        assert server.url.startswith("unix://")


@pytest.mark.parametrize("command", [
    ("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"), ("MODULE", "LOAD", "/tmp/x.so"),
    ("DEBUG", "SLEEP", "0"), ("SAVE",), ("BGSAVE",), ("REPLICAOF", "127.0.0.1", "1"),
    ("ACL", "SETUSER", "default", "on"),
    ("SHUTDOWN", "NOSAVE"),
], ids=lambda c: " ".join(c[:2]))
def test_dangerous_commands_are_refused_even_through_the_socket(tmp_path, command):
    """Fails when the server runs the command (CONFIG SET dir + SAVE writes a file anywhere, MODULE LOAD runs
    a library); the stream commands the loop needs keep working, and the server still stops and keeps
    its data (a SIGTERM instead of the renamed SHUTDOWN)."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)
        entry = client.xadd("s", {"record": "{}"})
        client.xgroup_create("s", "g", id="0")
        assert client.xreadgroup("g", "c", {"s": ">"}) == [["s", [(entry, {"record": "{}"})]]]
        client.close()
        server.restart()
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.xrange("s") == [(entry, {"record": "{}"})]
        client.close()
    assert not server.socket_path.exists()


@pytest.fixture
def password_redis(tmp_path):
    """An external redis-server on a TCP port that requires the password `SECRET`: its URL without it."""
    port = free_port()
    data = tmp_path / "external"
    data.mkdir()
    process = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--requirepass",
                                SECRET, "--save", "", "--appendonly", "no", "--dir", str(data)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=SECRET, socket_connect_timeout=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "the external redis-server did not start"
            time.sleep(0.05)
    client.close()
    yield f"127.0.0.1:{port}/0"
    process.terminate()
    process.wait()


def files_holding(root: Path, secret: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


@pytest.mark.slow
def test_a_password_in_data_url_is_in_no_file_and_run_files_are_private(tmp_path, password_redis):
    """A loop (trainer and a sampler) on a Redis with a password: the URL works, but no file of the run
    (config.yaml, .hydra/, manifest.json, logs, checkpoints, the samplers' directories) and no line of
    the console holds the password; every file is 0600 and every directory 0700. Fails when the password
    reaches config.yaml or the .hydra/ files, or a checkpoint is 0644."""
    result = run_rlcli(["loop", f"data.url=redis://:{SECRET}@{password_redis}", "trainer.max_steps=2",
                        "sample.workers=1", "trainer.checkpoint_every=1", "hydra.run.dir=run"], tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    run = tmp_path / "run"
    assert (run / "checkpoints").is_dir() and (run / "sampler-0" / ".hydra").is_dir()
    assert files_holding(run, SECRET.encode()) == []
    assert SECRET not in output
    assert f"url: redis://:****@{password_redis}" in (run / "config.yaml").read_text()
    loose = [f"{p}: {stat.S_IMODE(p.stat().st_mode):o}" for p in [run, *run.rglob("*")]
             if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) & 0o077]
    assert loose == []
