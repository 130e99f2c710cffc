"""The one place that turns a validated config into objects: policy, data, module, trainer."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from rlcli.callbacks.checkpoint import StepCheckpoint
from rlcli.callbacks.console import RichConsole
from rlcli.callbacks.preemption import StopOnSignal
from rlcli.data.document_stream import DocumentStream
from rlcli.data.readers import check_temperature, load_rollouts, write_rejections
from rlcli.data.schema import Rollout
from rlcli.data.toy import VOCAB_SIZE as TOY_VOCAB_SIZE
from rlcli.errors import UserError
from rlcli.loggers import build_loggers
from rlcli.model.policy import build_policy
from rlcli.rollout.advantages import apply_advantage_estimator
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.training.module import LossSettings, PolicyModule
from rlcli.training.optim import build_optimizer
from rlcli.training.sources import OnPolicySource, RolloutFileSource
from rlcli.training.strategy import build_strategy

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


def build_task(cfg: DictConfig):
    """The task of ``data=generate`` (any object with the protocol of `rlcli.rollout.tasks`)."""
    from hydra.utils import instantiate

    try:
        return instantiate(cfg.task)
    except Exception as err:  # a wrong _target_ or argument is the user's to fix
        raise UserError(f"task: cannot build {cfg.task.get('_target_')}: {err}") from None


def make_source_factory(cfg: DictConfig, rollouts: list[Rollout] | None, task, run_dir: Path):
    """``(rank, world_size) -> source``: rollout files, or on-policy generation on ``task``."""

    def make_source(rank: int, world_size: int):
        if task is None:
            stream = DocumentStream(
                rollouts, max_tokens=cfg.data.max_tokens, shuffle=cfg.data.shuffle, seed=cfg.seed,
                epochs=cfg.data.epochs, rank=rank, world_size=world_size,
            )
            return RolloutFileSource(
                stream, accumulate_microbatches=cfg.trainer.accumulate_microbatches,
                docs_per_step=cfg.trainer.docs_per_step, exact=cfg.trainer.docs_per_step_mode == "exact",
            )
        r = cfg.rollout
        generator = OnPolicyRollouts(
            task, prompts_per_step=r.prompts_per_step, group_size=r.group_size, max_new_tokens=r.max_new_tokens,
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            estimator=cfg.advantage.estimator,
            seed=cfg.seed, rank=rank, world_size=world_size,
        )
        name = "rollouts.jsonl" if world_size == 1 else f"rollouts.rank{rank}.jsonl"
        return OnPolicySource(generator, max_tokens=cfg.data.max_tokens, save_to=run_dir / name if r.save else None)

    return make_source


def build_trainer(cfg: DictConfig, run_dir: Path, strategy) -> L.Trainer:
    checkpoint = StepCheckpoint(run_dir / "checkpoints", cfg.trainer.checkpoint_every)
    return L.Trainer(
        max_steps=cfg.trainer.max_steps,
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=strategy,
        precision=cfg.trainer.precision,
        logger=build_loggers(cfg, run_dir),
        callbacks=[checkpoint, StopOnSignal(checkpoint), RichConsole(cfg, run_dir)],
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
    task = build_task(cfg) if cfg.data.kind == "generate" else None
    policy = build_policy(cfg.model, default_vocab_size=task.tokenizer.vocab_size if task else TOY_VOCAB_SIZE)
    vocab_size = policy.config.vocab_size
    if task is not None and task.tokenizer.vocab_size > vocab_size:
        raise UserError(f"task: its tokenizer has {task.tokenizer.vocab_size} ids, the model only {vocab_size}")
    rollouts = build_rollouts(cfg, vocab_size, run_dir) if task is None else None
    strategy, shard = build_strategy(cfg.strategy, policy, world_size=cfg.trainer.devices * cfg.trainer.num_nodes)
    module = PolicyModule(
        policy, loss_settings(cfg), partial(build_optimizer, cfg.optimizer, cfg.trainer.max_steps),
        make_source_factory(cfg, rollouts, task, run_dir), grad_clip=cfg.trainer.grad_clip,
        max_bad_steps=cfg.trainer.max_bad_steps, shard=shard,
    )
    return module, build_trainer(cfg, run_dir, strategy)
