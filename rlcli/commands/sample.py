"""`rlcli sample`: one sampler of the live loop, a Hydra app over the same config as `rlcli train`.

It reads ``task``, ``rollout.*`` (``rollout.engine``: the built-in sampler or vLLM), ``advantage.*``,
``seed``, ``data.*`` (``data.url`` required) and ``sample.*``, and runs a
`rlcli.stream.worker.SamplerWorker` until the trainer announces its final weights (exit 0) or a
SIGTERM (exit 0) / SIGINT (exit 130) ends it after the current round. The sampler's index among
``sample.workers`` comes from the environment variable ``RLCLI_SAMPLE_WORKER``
(default 0). Torch uses one thread unless ``OMP_NUM_THREADS`` says otherwise.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from omegaconf import DictConfig

from rlcli.commands.app import hydra_app
from rlcli.errors import UserError

log = logging.getLogger("rlcli")
WORKER_ENV = "RLCLI_SAMPLE_WORKER"


def with_stream_data(overrides: list[str]) -> list[str]:
    """``overrides`` with ``data=stream`` added unless they choose a ``data`` option themselves."""
    chosen = any(o.split("=", 1)[0].lstrip("+~") == "data" for o in overrides)
    return list(overrides) if chosen else [*overrides, "data=stream"]


def worker_index(workers: int) -> int:
    """This sampler's index, from `WORKER_ENV`; a `UserError` unless 0 <= index < ``workers``."""
    raw = os.environ.get(WORKER_ENV, "0")
    try:
        index = int(raw)
    except ValueError:
        index = -1
    if not 0 <= index < workers:
        raise UserError(f"{WORKER_ENV}={raw!r}: must be a sampler index from 0 to sample.workers - 1 = {workers - 1}")
    return index


class StopSignals:
    """Remembers the first SIGTERM or SIGINT; a second one gets the default behaviour (stops at once)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        self.received = signum
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def sample(cfg: DictConfig, run_dir: Path) -> int:
    """Run one sampler as ``cfg`` says, its ``completions.jsonl`` in ``run_dir``; returns the exit code."""
    import torch

    from rlcli.conf import build_target
    from rlcli.conf.validate import validate_config
    from rlcli.rollout.prompts import check_prompt_room
    from rlcli.stream.connection import connect
    from rlcli.stream.worker import SamplerWorker
    from rlcli.training.distill import reward_advantage

    typed = validate_config(cfg, command="sample")  # data=stream with a data.url and a task
    index = worker_index(typed.sample.workers)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # several samplers and a trainer share the machine's cores
    task = build_target(typed.task, "task")
    check_prompt_room(task, max_tokens=typed.data.max_tokens, max_new_tokens=typed.rollout.max_new_tokens)
    conn = connect(typed.data.url)
    signals = StopSignals()
    worker = SamplerWorker(
        conn, task, rollout=typed.rollout, advantage=reward_advantage(typed.advantage, typed.distill),
        reward=typed.reward, data=typed.data,
        sample=typed.sample,
        seed=typed.seed, worker=index, stop=lambda: signals.received is not None,
        trust_remote_code=getattr(typed.model, "trust_remote_code", False), completions=run_dir / "completions.jsonl",
        rejected=run_dir / "rejected.jsonl",
    )
    try:
        outcome = worker.run()
    finally:
        worker.close()
        conn.close()
    if outcome == "final":
        log.info("sampler %d: trainer finished", index)
        return 0
    log.info("sampler %d: stopped by %s", index, signal.Signals(signals.received).name)
    return 130 if signals.received == signal.SIGINT else 0


@hydra_app("sample")
def app(cfg: DictConfig, run_dir: Path) -> int:
    return sample(cfg, run_dir)
