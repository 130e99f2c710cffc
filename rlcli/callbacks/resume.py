"""Which checkpoint a run continues from (``resume=auto|PATH``), and whether it may.

Every checkpoint holds ``run``: the run's id (made when a run starts afresh, kept by every resume)
and the resolved config it was written with. ``resume=auto`` takes the newest written
``step-<N>.ckpt`` of the run directory that can be read, naming each one it skips; a checkpoint of
another config is refused with the keys that differ, unless they are in `SAFE_TO_CHANGE`. A fresh
run (``resume=null``) refuses a run directory that already holds checkpoints.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from rlcli.errors import UserError

log = logging.getLogger("rlcli")

STEP_CHECKPOINT = re.compile(r"step-(\d+)\.ckpt")
# config keys a resumed run may change (each with the keys below it): how long to train, how often
# to save, what to log, what to optimise, where the samplers are and how many tokens a micro-batch
# packs (a run stopped by a document longer than data.max_tokens continues with a larger one);
# every other difference is refused
SAFE_TO_CHANGE = ("resume", "trainer.max_steps", "trainer.checkpoint_every", "trainer.max_bad_steps", "logger",
                  "eval.every", "objective", "callbacks", "allow_targets", "data.url", "data.wait_warning",
                  "data.idle_timeout", "data.max_tokens")


@dataclass(frozen=True)
class RunIdentity:
    id: str
    config: dict  # the resolved config, as plain containers

    @classmethod
    def fresh(cls, config: dict) -> RunIdentity:
        return cls(uuid.uuid4().hex[:12], config)

    def state_dict(self) -> dict:
        return {"id": self.id, "config": self.config}


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to continue from (None: start afresh) and the identity the run's checkpoints carry."""

    path: Path | None
    run: RunIdentity


class UnreadableCheckpoint(Exception):
    """A file that is not a complete rlcli checkpoint; the message says why."""


def read_run(path: Path) -> tuple[RunIdentity, int]:
    """The identity and the step of the checkpoint at ``path`` (tensors memory-mapped, not read)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # empty, truncated or garbage: torch says which in many ways
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnreadableCheckpoint(f"not a readable checkpoint ({reason})") from None
    if not (isinstance(checkpoint, dict) and isinstance(checkpoint.get("run"), dict) and "rlcli" in checkpoint):
        raise UnreadableCheckpoint("not an rlcli checkpoint with a run identity")
    run = checkpoint["run"]
    return RunIdentity(run["id"], run["config"]), checkpoint["rlcli"]["steps_done"]


def step_checkpoints(run_dir: Path) -> list[Path]:
    """The run directory's complete ``step-<N>.ckpt`` files, the newest written first."""
    found = [path for path in (run_dir / "checkpoints").glob("step-*.ckpt") if STEP_CHECKPOINT.fullmatch(path.name)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, int(STEP_CHECKPOINT.fullmatch(p.name).group(1))),
                  reverse=True)


def _flatten(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix: node}
    flat = {}
    for key, value in node.items():
        flat |= _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return flat


def _safe(key: str) -> bool:
    return any(key == safe or key.startswith(safe + ".") for safe in SAFE_TO_CHANGE)


def config_changes(written: dict, now: dict) -> list[str]:
    """``"key: old -> new"`` for each key whose value differs and may not change on resume."""
    old, new = _flatten(written), _flatten(now)
    show = lambda flat, key: repr(flat[key]) if key in flat else "(absent)"
    return [f"{key}: {show(old, key)} -> {show(new, key)}" for key in sorted(old.keys() | new.keys())
            if (key in old, old.get(key)) != (key in new, new.get(key)) and not _safe(key)]


def _newest_readable(run_dir: Path) -> tuple[Path, RunIdentity, int] | None:
    for path in step_checkpoints(run_dir):
        try:
            return path, *read_run(path)
        except UnreadableCheckpoint as err:
            log.warning("resume: skipping %s: %s", path, err)
    return None


def resume_point(resume: str | None, run_dir: Path, config: dict, max_steps: int) -> ResumePoint:
    """Where a run with ``config`` (resolved, plain containers) continues: see the module's docstring."""
    if resume is None:
        existing = step_checkpoints(run_dir)
        if existing:
            raise UserError(f"{run_dir / 'checkpoints'} already holds checkpoints ({existing[0].name}, ...): "
                            "continue that run with resume=auto, or give this run its own hydra.run.dir")
        return ResumePoint(None, RunIdentity.fresh(config))
    if resume == "auto":
        found = _newest_readable(run_dir)
        if found is None:
            return ResumePoint(None, RunIdentity.fresh(config))
        path, run, step = found
    else:
        path = Path(resume).expanduser()
        if not path.is_file():
            raise UserError(f"resume: no checkpoint file at {path}")
        try:
            run, step = read_run(path)
        except UnreadableCheckpoint as err:
            raise UserError(f"resume: {path} is {err}") from None
    changes = config_changes(run.config, config)
    if changes:
        lines = "\n".join(f"  - {change}" for change in changes)
        raise UserError(f"resume: {path} was written with another config; these keys differ (checkpoint -> now):\n"
                        f"{lines}\n  (a resumed run may change only {', '.join(SAFE_TO_CHANGE)})")
    if step > max_steps:
        raise UserError(f"resume: {path} is at step {step}, beyond trainer.max_steps={max_steps}; "
                        "raise trainer.max_steps to train on from it")
    return ResumePoint(path, RunIdentity(run.id, config))
