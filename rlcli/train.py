"""`rlcli train`: the Hydra entry point and the `train(cfg)` function behind it."""

from __future__ import annotations

import itertools
import logging
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import rlcli.conf  # noqa: F401  (the config's resolvers)
from rlcli.errors import exit_on_user_error

log = logging.getLogger("rlcli")
task_started = False  # tells cli.main whether a failure came from Hydra's composition or from us


def _step_ticks():
    """The dataloader Lightning iterates: one tick per step (the module fetches its own data)."""
    from torch.utils.data import DataLoader, IterableDataset

    class Ticks(IterableDataset):
        def __iter__(self):
            return iter(itertools.count())

    return DataLoader(Ticks(), batch_size=None)


def _log_through_root_once() -> None:
    """Lightning adds its own console handler; Hydra's root handlers (console and train.log)
    already print its messages, so drop Lightning's to print each line once."""
    if logging.getLogger().handlers:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            for handler in list(logging.getLogger(name).handlers):
                logging.getLogger(name).removeHandler(handler)


def train(cfg: DictConfig, run_dir: Path):
    """Train as ``cfg`` says, writing everything into ``run_dir`` (the export in
    ``run_dir/export``); returns the trained `PolicyModule`."""
    from contextlib import nullcontext

    from rlcli.conf.validate import resolve_config, validate_config

    resolved, cfg = resolve_config(cfg), validate_config(cfg)  # before Lightning's import: config errors come fast
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from rlcli.run_lock import RunLock

    with RunLock(run_dir) if rank_zero_only.rank == 0 else nullcontext():
        return _train_locked(cfg, resolved, run_dir)


def _train_locked(cfg, resolved: DictConfig, run_dir: Path):
    import lightning as L
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from rlcli.build import build_training
    from rlcli.callbacks.resume import resume_point
    from rlcli.loggers import finish_loggers
    from rlcli.processes import saying_what_it_waits_for
    from rlcli.training.export import export_policy

    resume = resume_point(cfg.resume, run_dir, OmegaConf.to_container(resolved), cfg.trainer.max_steps)
    _log_through_root_once()
    if rank_zero_only.rank == 0:
        OmegaConf.save(resolved, run_dir / "config.yaml")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module, trainer = build_training(cfg, resolved, run_dir, resume.run)
    if resume.path is not None and trainer.is_global_zero:
        log.info("resuming from %s (run %s)", resume.path, resume.run.id)
    try:
        with saying_what_it_waits_for(trainer):
            trainer.fit(module, train_dataloaders=_step_ticks(), ckpt_path=resume.path, weights_only=True)
        if module.preempted:
            if trainer.is_global_zero:
                log.warning("stopped by a signal after step %d; checkpoint saved, continue with resume=auto",
                            module.steps_done)
            return module
        export_policy(module, trainer, run_dir / "export", cfg.model)
    finally:
        finish_loggers(trainer.loggers)
    if trainer.is_global_zero:
        log.info("trained %d steps on %d documents; policy exported to %s",
                 module.steps_done, module.documents_seen, run_dir / "export")
    return module


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rlcli.processes import wait_for_launched
    from rlcli.signals import RunSignals

    global task_started
    task_started = True
    with exit_on_user_error("train"), RunSignals():  # before the heavy imports: signals act from here on
        module = train(cfg, Path(HydraConfig.get().runtime.output_dir))
        wait_for_launched(module.trainer)  # the processes rank 0 started end before it does
    from rlcli.callbacks.preemption import stop_code
    from rlcli.signals import EXIT_CODES
    from rlcli.slurm.requeue import TIME_LIMIT, requeue

    code = stop_code(module.trainer)
    if code == EXIT_CODES[TIME_LIMIT]:
        requeue(signal.getsignal(TIME_LIMIT))  # the handler in force before the run's, back now
    if code and module.global_rank == 0:
        sys.exit(code)  # other ranks exit 0, so that no launcher kills rank 0 first
