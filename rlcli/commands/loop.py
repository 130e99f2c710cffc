"""`rlcli loop`: the whole live loop on one machine with one command.

It checks the config (`rlcli train`'s, ``data=stream``), starts a Redis server in ``<run dir>/redis``
unless ``data.url`` names one, then ``sample.workers`` processes of `rlcli sample` (sampler ``i`` in
``<run dir>/sampler-<i>``, its index in ``RLCLI_SAMPLE_WORKER``) and one `rlcli train` in the run
directory, all with the user's overrides (the samplers wait for this trainer's first announcement: the
stream's last one, of a run that ended, is deleted first). Every line they print appears prefixed with
the process's name in its own colour. When the trainer exits, the samplers get a few seconds to see its final
announcement, the rest are stopped, and the loop exits with the trainer's code; SIGINT (Ctrl-C) or
SIGTERM stops every process with a SIGTERM and exits 130. Each child leads its own process group,
killed as a whole on the way out. The loop holds the run directory's lock (`rlcli.run_lock`) from before it
starts anything, so a second loop in the directory is refused at once, and hands it to its trainer.

When the loop dies without stopping them (kill -9), its children die with it: Linux sends the samplers and
the trainer a SIGKILL and Redis a SIGTERM (its append-only file is then complete). The processes they
started in turn die with them (`rlcli.processes`, the reward pool's workers), and ``resume=auto`` continues
from the trainer's last checkpoint, as after any crash.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from rlcli.commands.app import hydra_app
from rlcli.processes import die_with_parent
from rlcli.run_lock import HANDED_OVER, RunLock

SAMPLER_GRACE = 10.0  # seconds the samplers get to exit on the trainer's final announcement
STOP_TIMEOUT = 60.0  # seconds the processes get to exit after a SIGTERM before they are killed
TRAINER = "trainer"
COLOURS = ("green", "magenta", "yellow", "blue", "bright_green", "bright_magenta", "bright_yellow", "bright_blue")


class Signals:
    """Counts SIGINT and SIGTERM: the first stops the loop gracefully, a second one hurries it."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.count = 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.first = self.first or signum
        self.count += 1


class Child:
    """One process of the loop, leader of its own process group; its output goes to one pipe."""

    def __init__(self, name: str, colour: str, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> None:
        self.name, self.colour = name, colour
        self.process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", start_new_session=True, pass_fds=pass_fds,
            preexec_fn=partial(die_with_parent, signal.SIGKILL),  # in the child, before exec
        )
        self.reported = False  # whether the loop said that it exited

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's whole process group (what it started too)."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass


class Loop:
    """The processes of the loop and the console they print to."""

    def __init__(self, console) -> None:
        self.console = console
        self.children: list[Child] = []
        self.lines: queue.Queue = queue.Queue()  # (child, line) from every reader thread

    def start(self, name: str, colour: str, argv: list[str], pass_fds: tuple[int, ...] = (), **env: str) -> Child:
        child = Child(name, colour, argv, dict(os.environ, PYTHONUNBUFFERED="1", **env), pass_fds)
        self.children.append(child)
        return child

    def read_output(self) -> None:
        """Start one thread per child that queues its lines (after every child started: no fork
        happens while they run)."""
        for child in self.children:
            threading.Thread(target=self._read, args=(child,), daemon=True).start()

    def _read(self, child: Child) -> None:
        for line in child.process.stdout:
            self.lines.put((child, line))

    def say(self, message: str) -> None:
        from rich.text import Text

        self.console.print(Text.assemble((f"{'loop':>10} | ", "bold"), (message, "bold")), soft_wrap=True)

    def pump(self, seconds: float) -> None:
        """Print the children's lines for ``seconds``."""
        from rich.text import Text

        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                child, line = self.lines.get(timeout=left)
            except queue.Empty:
                return
            self.console.print(Text.assemble((f"{child.name:>10} | ", child.colour), line.rstrip("\n")),
                               soft_wrap=True, highlight=False)

    def report_exits(self) -> None:
        """Say which children exited since the last call, and with which code."""
        for child in self.children:
            code = child.process.poll()
            if code is None or child.reported:
                continue
            child.reported = True
            running = {c.name for c in self.children if c.process.poll() is None}
            note = ""
            if code and TRAINER in running:
                samplers = len(running) - 1
                note = (f"; {samplers} sampler(s) still running" if samplers else
                        "; no sampler is left: the trainer waits until one pushes rollouts")
            self.say(f"{child.name} exited with code {code}{note}")

    def wait(self, children: list[Child], seconds: float = float("inf"), stop=lambda: False) -> bool:
        """Print output until every one of ``children`` exited (True), ``seconds`` passed or ``stop()``."""
        deadline = time.monotonic() + seconds
        while True:
            self.report_exits()
            if all(c.process.poll() is not None for c in children):
                return True
            if time.monotonic() >= deadline or stop():
                return False
            self.pump(0.1)

    def stop_all(self, timeout: float, hurry=lambda: False) -> None:
        """SIGTERM to every running child, SIGKILL to what is left of each process group after
        ``timeout`` seconds or as soon as ``hurry()``."""
        running = [c for c in self.children if c.process.poll() is None]
        for child in running:
            child.signal_group(signal.SIGTERM)
        if running and not self.wait(running, timeout, stop=hurry):
            self.say(f"killing {', '.join(c.name for c in running if c.process.poll() is None)}")
        for child in self.children:
            child.signal_group(signal.SIGKILL)  # leftovers of groups whose leader exited
            child.process.wait()
        self.pump(0.5)  # the last lines


def run_loop(cfg: DictConfig, overrides: list[str], run_dir: Path, lock: RunLock) -> int:
    """Run the loop that ``cfg`` (composed from ``overrides``) describes in ``run_dir``, whose ``lock`` it holds;
    the exit code."""
    from rich.console import Console

    from rlcli.commands.sample import WORKER_ENV
    from rlcli.conf.validate import validate_config
    from rlcli.stream.connection import connect
    from rlcli.stream.queue import withdraw_weights
    from rlcli.stream.server import EmbeddedRedis

    typed = validate_config(cfg, command="loop")  # data=stream; data.url null: the loop's own server
    signals = Signals()
    loop = Loop(Console(highlight=False))
    server = None
    url = typed.data.url  # None: the loop's own server
    try:
        if url is None:
            server = EmbeddedRedis(run_dir / "redis").start()
            url = server.url
            loop.say(f"Redis at {url} (data in {run_dir / 'redis'})")
        conn = connect(url)
        withdraw_weights(conn, typed.data.stream)  # a finished run's `final` would stop the new samplers at once
        conn.close()
        passed = [o for o in overrides if not o.startswith("data.url=")]
        command = [sys.executable, "-m", "rlcli"]
        for i in range(typed.sample.workers):
            loop.start(f"sampler {i}", COLOURS[i % len(COLOURS)],
                       [*command, "sample", *passed, f"data.url={url}", f"hydra.run.dir={run_dir / f'sampler-{i}'}"],
                       **{WORKER_ENV: str(i)})
        trainer = loop.start(TRAINER, "bold cyan",
                             [*command, "train", *passed, f"data.url={url}", f"hydra.run.dir={run_dir}"],
                             pass_fds=(lock.fileno(),), **{HANDED_OVER: str(lock.fileno())})
        loop.read_output()
        loop.say(f"started {typed.sample.workers} sampler(s) and the trainer in {run_dir}")
        loop.wait([trainer], stop=lambda: signals.first is not None)
        if signals.first is not None:
            loop.say(f"{signal.Signals(signals.first).name}: stopping every process; a second signal kills them")
            return 130
        code = trainer.process.returncode
        samplers = [c for c in loop.children if c is not trainer]
        if not loop.wait(samplers, SAMPLER_GRACE):
            loop.say("stopping the samplers that are still running")
        return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, like a shell
    finally:
        loop.stop_all(STOP_TIMEOUT, hurry=lambda: signals.count > 1)
        if server is not None:
            server.stop()


@hydra_app("loop")
def app(cfg: DictConfig, run_dir: Path) -> int:
    from hydra.core.hydra_config import HydraConfig

    with RunLock(run_dir) as lock:  # before anything starts
        return run_loop(cfg, list(HydraConfig.get().overrides.task), run_dir, lock)
