"""`rlcli train`: its Hydra app (`app`) and the `train(cfg, run_dir)` function behind it."""

from __future__ import annotations

import itertools
import logging
import signal
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import rlcli.conf  # noqa: F401  (the config's resolvers)
from rlcli.commands.app import Score, hydra_app, one_line, user_error

log = logging.getLogger("rlcli")


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

    from rlcli.conf.validate import load_config

    resolved, cfg = load_config(cfg)  # before Lightning's import: config errors come fast
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from rlcli.run_lock import RunLock

    with RunLock(run_dir) if rank_zero_only.rank == 0 else nullcontext():
        return _train_locked(cfg, resolved, run_dir)


def _train_locked(cfg, resolved: DictConfig, run_dir: Path):
    import lightning as L
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from rlcli.build import build_training
    from rlcli.callbacks.preemption import stop_code
    from rlcli.callbacks.resume import resume_point
    from rlcli.loggers import finish_loggers
    from rlcli.processes import saying_what_it_waits_for
    from rlcli.signals import StepInterrupted
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
        try:
            with saying_what_it_waits_for(trainer):
                trainer.fit(module, train_dataloaders=_step_ticks(), ckpt_path=resume.path, weights_only=True)
        except StepInterrupted as stop:
            log.warning("%s: the rewards of step %d did not end, so the step was abandoned and is not saved; "
                        "resume=auto continues from the last checkpoint", stop.signum.name, module.steps_done + 1)
            raise
        if stop_code(trainer) is not None:
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


@hydra_app("train")
def app(cfg: DictConfig, run_dir: Path) -> int | Score:
    """`rlcli train`: the run with its signals; at a time limit, the job handed over to its requeue. On rank 0,
    the stopping signal's exit code, or the run's objective (written to objective.json, a failure too); 0 on
    the other ranks, so that no launcher kills rank 0 first."""
    from rlcli.manifest import is_rank_zero
    from rlcli.objective import record_failure
    from rlcli.processes import wait_for_launched
    from rlcli.signals import RunSignals, StepInterrupted
    from rlcli.slurm.requeue import requeue

    with RunSignals(at_time_limit=requeue):  # before the heavy imports: signals act from here on
        try:
            module = train(cfg, run_dir)
        except StepInterrupted as stop:  # the processes of the run that got the signal end alike
            if is_rank_zero():
                record_failure(run_dir, f"stopped by a signal (exit code {stop.code}) while a step's rewards ran")
            return stop.code
        except Exception as err:
            if is_rank_zero():
                record_failure(run_dir, one_line(user_error(err) or f"{type(err).__name__}: {err}"))
            raise
        wait_for_launched(module.trainer)  # the processes rank 0 started end before it does
    from rlcli.callbacks.preemption import stop_code
    from rlcli.signals import EXIT_CODES, TIME_LIMIT

    code = stop_code(module.trainer)
    if code is not None and module.global_rank == 0:
        record_failure(run_dir, f"stopped by a signal (exit code {code}) after step {module.steps_done}")
    if code == EXIT_CODES[TIME_LIMIT]:
        requeue(signal.getsignal(TIME_LIMIT))  # the handler in force before the run's, back now
    if module.global_rank != 0:
        return 0
    return code if code is not None else _score(cfg, run_dir)


def _score(cfg: DictConfig, run_dir: Path) -> Score:
    """The objective of the finished run, written to ``run_dir/objective.json`` (the reason if it has none)."""
    from rlcli.conf.schema import ObjectiveConfig
    from rlcli.objective import NoObjective, write_objective

    spec = ObjectiveConfig(**OmegaConf.to_container(cfg.objective, resolve=True))
    try:
        return Score(write_objective(run_dir, spec))
    except NoObjective as err:
        return Score(None, str(err))
