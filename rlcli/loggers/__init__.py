"""The loggers of a run: `metrics.csv` always, plus wandb and TensorBoard when the `logger` group
asks for them."""

from __future__ import annotations

import netrc
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlcli.conf.schema import LoggerConfig


def wandb_mode(configured: str | None) -> str:
    """``WANDB_MODE`` if set, else the configured mode, else online only with an API key."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if configured:
        return configured
    return "online" if _has_wandb_api_key() else "offline"


def _has_wandb_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def _hydra_run_names(run_dir: Path) -> tuple[str, str | None]:
    """``(run name, sweep group)``: a sweep member is named by its overrides and grouped by the
    sweep directory; a single run is named by its directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return run_dir.name, None
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN:
        return hydra.job.override_dirname or run_dir.name, str(hydra.sweep.dir)
    return run_dir.name, None


def build_loggers(cfg: LoggerConfig, resolved: DictConfig, run_dir: Path) -> list:
    """``metrics.csv`` and the loggers ``cfg`` turns on; wandb records the whole ``resolved`` config."""
    from rlcli.loggers.metrics_csv import MetricsCSVLogger  # imports Lightning: only when a run starts

    loggers = [MetricsCSVLogger(run_dir / "metrics.csv")]
    if cfg.wandb is not None:
        from lightning.pytorch.loggers import WandbLogger

        w = cfg.wandb
        name, group = _hydra_run_names(run_dir)
        loggers.append(WandbLogger(
            project=w.project, entity=w.entity, name=w.name or name, group=w.group or group,
            tags=list(w.tags), notes=w.notes, mode=wandb_mode(w.mode), save_dir=str(run_dir),
            config=OmegaConf.to_container(resolved, resolve=True),
        ))
    if cfg.tensorboard is not None:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name=cfg.tensorboard.subdir, version=""))
    return loggers


def finish_loggers(loggers: list) -> None:
    """Close each logger's run, so the next member of a multirun starts a new one."""
    for logger in loggers:
        logger.finalize("success")
        if type(logger).__name__ == "WandbLogger":
            import wandb

            wandb.finish()
