"""Weights back to the samplers: the policy in Hugging Face format at ``publish.dir/v<version>/`` (with
``publish.lora=adapter``, its LoRA adapters alone, in peft's format),
announced in Redis at ``<stream>:weights`` as ``{version, path, documents_seen, final}``.

The version is the number of training steps done: v0 the starting weights, at the start of training;
every ``every`` steps after the update; the last at the end of training, announced ``final`` unless a
signal stopped the run (its samplers wait for the resumed run). Rank 0 writes under a
temporary name and renames, so a sampler never loads a half-written version; the policy is gathered
from every shard first (a collective, so every rank calls `publish`). The newest ``keep`` are kept. On
start, the versions above the step the run starts from (written before a crash) are removed first, so
that the pruning keeps the version the run announces then.
Weights holding a NaN or an infinity are never published: `export_policy` refuses them on every rank.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import lightning as L

from rlcli.callbacks.preemption import stop_code
from rlcli.modules.metrics import Metric
from rlcli.stream.connection import connect
from rlcli.stream.queue import announce_weights
from rlcli.training.export import export_policy

log = logging.getLogger("rlcli")
VERSION_DIR = re.compile(r"v(\d+)")
METRICS = {
    "weight_publish_time": Metric("data=stream, on steps that publish (`publish.every`)",
                                  "seconds to gather, write and announce the weights"),
}


class WeightPublisher(L.Callback):
    """Publishes the policy's weights as training goes (a `rlcli.callbacks.metrics.StepMetricsCallback`:
    a step's ``weight_publish_time`` joins its row)."""

    def __init__(self, directory: Path, *, url: str, stream: str, every: int, keep: int, model_cfg,
                 adapter_only: bool = False) -> None:
        self.directory = Path(directory).absolute()
        self.url = url
        self.stream = stream
        self.every = every
        self.keep = keep
        self.model_cfg = model_cfg
        self.adapter_only = adapter_only  # publish.lora=adapter: the LoRA adapters alone
        self.published: int | None = None  # the newest version published by this process
        self._conn = None

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self._remove_above(pl_module.steps_done)
        self.publish(pl_module, pl_module.steps_done)  # the weights samplers start from

    def step_metrics(self, trainer, pl_module) -> dict[str, float]:
        version = pl_module.steps_done
        if version % self.every or version == self.published:
            return {}
        return {"weight_publish_time": self.publish(pl_module, version)}

    def on_train_end(self, trainer, pl_module) -> None:
        # a run stopped by a signal continues later: its samplers keep waiting
        self.publish(pl_module, pl_module.steps_done, final=stop_code(trainer) is None)

    def publish(self, module, version: int, *, final: bool = False) -> float:
        """Publish the module's policy as ``version`` (on every rank); returns the seconds it took."""
        started = time.perf_counter()
        trainer = module.trainer
        if version != self.published:
            partial = self.directory / f".v{version}.partial"
            try:
                export_policy(module, trainer, partial, self.model_cfg, adapter_only=self.adapter_only)
            except Exception:  # a full disk: the half-written version goes, the run ends with the message
                shutil.rmtree(partial, ignore_errors=True)
                raise
            if trainer.is_global_zero:
                target = self.directory / f"v{version}"
                shutil.rmtree(target, ignore_errors=True)  # a resumed run publishes its version again
                partial.rename(target)
                self._prune()
            self.published = version
        if trainer.is_global_zero:
            if self._conn is None:
                self._conn = connect(self.url)
            announce_weights(self._conn, self.stream, {
                "version": version, "path": str(self.directory / f"v{version}"),
                "documents_seen": module.documents_seen, "final": final,
            })
        return time.perf_counter() - started

    def _versions(self) -> list[tuple[int, Path]]:
        """The published versions on disk, with their directories, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted((int(m.group(1)), path) for path in self.directory.iterdir()
                      if (m := VERSION_DIR.fullmatch(path.name)))

    def _remove_above(self, step: int) -> None:
        """Delete the versions above ``step``: a run killed after them resumes from an earlier step, and the
        newest ``keep`` on disk must be the versions this run publishes."""
        for version, path in self._versions():
            if version > step:
                log.info("publish: removing %s, published after step %d that this run continues from", path, step)
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        for _, path in self._versions()[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)
