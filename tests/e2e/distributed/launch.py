"""Start `dist_worker.py` as a 2-process gloo job on this machine and wait for it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
TESTS = HERE.parents[1]  # the shared test helpers (train_helpers, factories)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(jobs: list[dict], out_dir: Path, world_size: int = 2, timeout: float = 600) -> None:
    """Run ``jobs`` (see dist_worker.py) on ``world_size`` CPU processes; raise with their output
    if any of them fails or the job does not finish in time (a hang fails the test)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs_file = out_dir / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    base = dict(
        os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
        NODE_RANK="0", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(HERE), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    procs = []
    for rank in range(world_size):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        log = (out_dir / f"rank{rank}.log").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "dist_worker.py"), str(jobs_file), str(out_dir)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        ))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"distributed job hung; logs in {out_dir}") from None
    if any(codes):
        logs = "\n".join((out_dir / f"rank{r}.log").read_text()[-4000:] for r in range(world_size))
        raise AssertionError(f"ranks exited with {codes}:\n{logs}")
