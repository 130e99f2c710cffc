"""Rich console output on rank 0: the config at start, a live progress line, a summary at the end."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree

from rlcli.callbacks.metrics import step_row
from rlcli.callbacks.preemption import stop_code
from rlcli.model.lora import parameter_counts

# metric -> True if higher is better (the summary's "best" column)
SUMMARY_METRICS = {"loss": False, "reward": True, "accuracy": True, "kl_new_old": False}


def config_tree(cfg: DictConfig) -> Tree:
    """The resolved config as a tree: one branch per group."""
    tree = Tree("[bold]config")
    for key, value in cfg.items():
        if isinstance(value, DictConfig):
            branch = tree.add(f"[bold cyan]{key}")
            for line in OmegaConf.to_yaml(value).rstrip().splitlines():
                branch.add(line)
        else:
            tree.add(f"{key}: {value}")
    return tree


class RichConsole(L.Callback):
    """Prints on global rank 0 only. Reads each step's metrics from the ``outputs`` of its training step."""

    def __init__(self, cfg: DictConfig, run_dir: Path, console: Console | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task = None
        self.history: dict[str, list[float]] = {}
        self._last_time = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        self.console.print(config_tree(self.cfg))
        trainable, total = parameter_counts(pl_module.policy)
        device = type(trainer.accelerator).__name__.replace("Accelerator", "")
        self.console.print(f"policy: {total:,} parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%), "
                           f"{trainer.world_size} process(es) on {device}")
        self.console.print(f"run directory: {self.run_dir}")
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=trainer.max_steps, status="")
        self._last_time = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = step_row(outputs)
        if not trainer.is_global_zero or self.progress is None or metrics is None:
            return
        now = time.perf_counter()
        tokens_per_second = metrics["num_tokens"] / max(now - self._last_time, 1e-9)
        self._last_time = now
        for name in SUMMARY_METRICS:
            if name in metrics:
                self.history.setdefault(name, []).append(metrics[name])
        status = f"docs {int(metrics['documents_seen'])}  tok/s {tokens_per_second:,.0f}  loss {metrics['loss']:+.4f}"
        if "reward" in metrics:
            status += f"  reward {metrics['reward']:.3f}"
        self.progress.update(self.task, completed=pl_module.steps_done, status=status)

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or self.progress is None:
            return
        self.progress.stop()
        table = Table(title=f"rlcli: {pl_module.steps_done} steps, {pl_module.documents_seen} documents")
        table.add_column("metric")
        table.add_column("final", justify="right")
        table.add_column("best", justify="right")
        for name, higher_is_better in SUMMARY_METRICS.items():
            values = self.history.get(name)
            if values:
                best = max(values) if higher_is_better else min(values)
                table.add_row(name, f"{values[-1]:.4f}", f"{best:.4f}")
        self.console.print(table)
        self.console.print(f"metrics: {self.run_dir / 'metrics.csv'}\ncheckpoints: {self.run_dir / 'checkpoints'}")
        if stop_code(trainer) is None:  # a run a signal stopped is not exported
            self.console.print(f"export (Hugging Face): {self.run_dir / 'export'}")
