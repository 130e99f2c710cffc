"""`rlcli train`: the Hydra entry point and the `train(cfg)` function behind it."""

from __future__ import annotations

import itertools
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from rlcli.errors import UserError

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
    import lightning as L

    from rlcli.build import build_module, build_rollouts, build_trainer
    from rlcli.conf.validate import validate_config
    from rlcli.models import build_policy, save_tokenizer_if_any

    cfg = validate_config(cfg)
    _log_through_root_once()
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    policy = build_policy(cfg.model)
    rollouts = build_rollouts(cfg, policy.config.vocab_size, run_dir)
    module = build_module(cfg, policy, rollouts)
    trainer = build_trainer(cfg, run_dir)
    trainer.fit(module, train_dataloaders=_step_ticks())
    export_dir = run_dir / "export"
    if trainer.is_global_zero:
        module.policy.save_pretrained(export_dir)
        save_tokenizer_if_any(cfg.model, export_dir)
        log.info("trained %d steps on %d documents; policy exported to %s",
                 trainer.global_step, module.documents_seen, export_dir)
    return module


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    global task_started
    task_started = True
    try:
        train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except UserError as err:
        print(f"rlcli train: error: {err}", file=sys.stderr)
        sys.exit(2)
