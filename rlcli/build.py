"""The one place that turns a validated config into objects: policy, data, module, trainer."""

from __future__ import annotations

import logging
import math
from functools import partial
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig

from rlcli.callbacks.checkpoint import StepCheckpoint
from rlcli.callbacks.console import RichConsole
from rlcli.data.readers import check_temperature, load_rollouts, write_rejections
from rlcli.data.schema import Rollout
from rlcli.data.stream import DocumentStream
from rlcli.loggers import build_loggers
from rlcli.models import build_policy
from rlcli.modules.policy_module import LossSettings, PolicyModule, StepSettings
from rlcli.rollout.advantages import apply_advantage_estimator
from rlcli.strategies import build_strategy

log = logging.getLogger("rlcli")


def loss_settings(cfg: DictConfig) -> LossSettings:
    return LossSettings(
        loss=cfg.loss.name,
        aggregation=cfg.aggregation.name,
        divisor=cfg.aggregation.divisor,
        eps_low=cfg.loss.eps_low,
        eps_high=cfg.loss.eps_high,
        metrics=cfg.metrics.level,
        temperature=cfg.loss.temperature,
        fp32_lm_head=cfg.loss.fp32_lm_head,
        chunk_tokens=cfg.loss.chunk_tokens,
    )


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Linear warmup to the base rate, then constant or cosine decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(cfg: DictConfig, total_steps: int, policy: torch.nn.Module):
    """``(optimizer, LambdaLR scheduler)`` from the ``optimizer`` group."""
    params = [p for p in policy.parameters() if p.requires_grad]
    if cfg.name == "adamw":
        optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    else:
        optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    multiplier = partial(
        lr_multiplier, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
        schedule=cfg.schedule, min_lr_ratio=cfg.min_lr_ratio,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def build_rollouts(cfg: DictConfig, vocab_size: int, run_dir: Path) -> list[Rollout]:
    """Read, validate and complete (advantages) the rollout files of ``cfg.data``."""
    rollouts, rejections = load_rollouts(
        list(cfg.data.paths), vocab_size=vocab_size, max_tokens=cfg.data.max_tokens,
        on_invalid=cfg.data.on_invalid,
    )
    if rejections:
        path = run_dir / "rejected.jsonl"
        write_rejections(rejections, path)
        log.warning("data: %d invalid records skipped (data.on_invalid=skip), listed in %s", len(rejections), path)
    mismatches = check_temperature(
        rollouts, cfg.loss.temperature, allow_mismatch=cfg.data.allow_temperature_mismatch
    )
    if mismatches:
        log.warning("data: %d records were sampled at a temperature other than loss.temperature=%s",
                    mismatches, cfg.loss.temperature)
    rollouts = apply_advantage_estimator(rollouts, cfg.advantage.estimator)
    log.info("data: %d documents for training", len(rollouts))
    return rollouts


def build_module(cfg: DictConfig, policy: torch.nn.Module, rollouts: list[Rollout], shard=None) -> PolicyModule:
    def make_stream(rank: int, world_size: int) -> DocumentStream:
        return DocumentStream(
            rollouts, max_tokens=cfg.data.max_tokens, shuffle=cfg.data.shuffle, seed=cfg.seed,
            epochs=cfg.data.epochs, rank=rank, world_size=world_size,
        )

    step_settings = StepSettings(
        accumulate_microbatches=cfg.trainer.accumulate_microbatches,
        docs_per_step=cfg.trainer.docs_per_step,
        exact=cfg.trainer.docs_per_step_mode == "exact",
        grad_clip=cfg.trainer.grad_clip,
    )
    return PolicyModule(
        policy, loss_settings(cfg), step_settings,
        partial(build_optimizer, cfg.optimizer, cfg.trainer.max_steps), make_stream, shard,
    )


def build_trainer(cfg: DictConfig, run_dir: Path, strategy) -> L.Trainer:
    return L.Trainer(
        max_steps=cfg.trainer.max_steps,
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=strategy,
        precision=cfg.trainer.precision,
        logger=build_loggers(cfg, run_dir),
        callbacks=[StepCheckpoint(run_dir / "checkpoints", cfg.trainer.checkpoint_every), RichConsole(cfg, run_dir)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=run_dir,
        log_every_n_steps=1,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def build_training(cfg: DictConfig, run_dir: Path) -> tuple[PolicyModule, L.Trainer]:
    """Policy, data, module and trainer of a validated config (seed the RNGs first)."""
    policy = build_policy(cfg.model)
    rollouts = build_rollouts(cfg, policy.config.vocab_size, run_dir)
    strategy, shard = build_strategy(cfg.strategy, policy, world_size=cfg.trainer.devices * cfg.trainer.num_nodes)
    return build_module(cfg, policy, rollouts, shard), build_trainer(cfg, run_dir, strategy)
