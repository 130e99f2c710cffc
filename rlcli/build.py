"""The one place that turns a validated config into objects: policy, data, module, callbacks, trainer."""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig

from rlcli.callbacks.checkpoint import StepCheckpoint
from rlcli.callbacks.checkpoint_io import RunDirCheckpointIO
from rlcli.callbacks.completions import CompletionsLog
from rlcli.callbacks.console import RichConsole
from rlcli.callbacks.documents import DocumentsLog
from rlcli.callbacks.evaluate import PeriodicEval, build_periodic_eval
from rlcli.callbacks.metrics import LogMetrics
from rlcli.callbacks.off_policy import OffPolicyWarning, RatioAtOneWarning
from rlcli.callbacks.preemption import StopOnSignal
from rlcli.callbacks.publish import WeightPublisher
from rlcli.callbacks.resume import RunIdentity
from rlcli.conf import build_target
from rlcli.conf.schema import HFModelConfig, TrainConfig, trains_adapters
from rlcli.errors import UserError
from rlcli.loggers import build_loggers
from rlcli.model.lora import add_adapters, base_fingerprint, has_adapters
from rlcli.model.policy import build_policy, compile_body
from rlcli.training.loss import MicroBatchLoss
from rlcli.training.module import PolicyModule
from rlcli.training.optim import build_optimizer
from rlcli.training.reward_kl import RewardKL
from rlcli.training.sources import DATA_KINDS
from rlcli.training.strategy import build_strategy


def build_user_callbacks(specs: list[dict]) -> list[L.Callback]:
    """The ``callbacks`` list of the config: each a trusted ``_target_`` and its arguments. A target is
    checked to be a Callback class before anything is called (a trusted module's function could run)."""
    from hydra.utils import get_object

    callbacks = []
    for i, spec in enumerate(specs):
        target = spec.get("_target_")
        try:
            cls = get_object(str(target))
        except Exception as err:
            raise UserError(f"callbacks[{i}]._target_: cannot import {target!r}: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, L.Callback)):
            raise UserError(f"callbacks[{i}]._target_: {target!r} is not a lightning Callback class")
        callbacks.append(build_target(spec, f"callbacks[{i}]"))
    return callbacks


def build_callbacks(cfg: TrainConfig, resolved: DictConfig, run_dir: Path, run: RunIdentity,
                    evaluation: PeriodicEval | None) -> list[L.Callback]:
    """The run's callbacks, in the order Lightning calls them: the step's row, documents and completions
    are written before its checkpoint; the weights are published after every other callback, at the
    start and the end of training as within a step."""
    checkpoint = StepCheckpoint(run_dir / "checkpoints", cfg.trainer.checkpoint_every, run)
    publisher = build_publisher(cfg, run_dir)
    return [
        LogMetrics(), DocumentsLog(run_dir / "documents.jsonl"), CompletionsLog(run_dir / "completions.jsonl"),
        OffPolicyWarning(cfg.loss.temperature), RatioAtOneWarning(),
        checkpoint, StopOnSignal(checkpoint), RichConsole(resolved, run_dir), *([evaluation] if evaluation else []),
        *build_user_callbacks(cfg.callbacks), *([publisher] if publisher else []),
    ]


def build_trainer(cfg: TrainConfig, resolved: DictConfig, run_dir: Path, strategy,
                  callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        max_steps=cfg.trainer.max_steps,
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=strategy,
        precision=cfg.trainer.precision,
        plugins=[RunDirCheckpointIO()],
        logger=build_loggers(cfg.logger, resolved, run_dir),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=run_dir,
        log_every_n_steps=1,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def build_reference(cfg: TrainConfig, policy: torch.nn.Module) -> torch.nn.Module | None:
    """The reference policy of the KL penalty when its log-probs come from a model: a frozen copy of the
    starting weights (``kl.reference=initial``; with LoRA the policy itself, whose adapters are switched off
    for it) or a checkpoint; None without a penalty or with the rollouts' own ``ref_logprobs``."""
    if cfg.kl.coef == 0 or cfg.kl.reference == "rollouts":
        return None
    if cfg.kl.reference == "initial":
        if has_adapters(policy):
            return policy  # the policy with its adapters off (`PolicyModule`)
        reference = copy.deepcopy(policy)  # a copy is not compiled
        if cfg.model.compile:
            compile_body(reference)
        return reference
    return load_frozen_model("kl.reference", cfg.kl.reference, cfg, policy)


def build_teacher(cfg: TrainConfig, policy: torch.nn.Module,
                  reference: torch.nn.Module | None) -> torch.nn.Module | None:
    """The teacher of on-policy distillation (``advantage.estimator=distill``): ``reference`` itself when
    ``kl.reference`` is the same checkpoint (one model, one forward for both), else ``teacher.path``'s."""
    path = cfg.teacher.path
    if cfg.advantage.estimator != "distill":
        return None
    if reference is not None and cfg.kl.reference not in ("initial", "rollouts") and \
            Path(cfg.kl.reference).resolve() == Path(path).resolve():
        return reference
    return load_frozen_model("teacher.path", path, cfg, policy)


def load_frozen_model(key: str, path: str, cfg: TrainConfig, policy: torch.nn.Module) -> torch.nn.Module:
    """The checkpoint at ``path`` (config key ``key``) with the policy's dtype and attention; a
    `UserError` naming both models when its vocabulary is not the policy's."""
    model = cfg.model
    frozen = build_policy(HFModelConfig(
        kind="hf", path=path, dtype=model.dtype, gradient_checkpointing=False,
        attn_implementation=model.attn_implementation, trust_remote_code=getattr(model, "trust_remote_code", False),
        suggested_lr=model.suggested_lr, compile=model.compile, lora=None,
    ), key=key)
    if frozen.config.vocab_size != policy.config.vocab_size:
        student = model.path if model.kind == "hf" else "model=tiny"
        raise UserError(f"{key}: {path} has {frozen.config.vocab_size} token ids, the policy ({student}) "
                        f"{policy.config.vocab_size}; it must share the policy's tokenizer")
    return frozen


def build_publisher(cfg: TrainConfig, run_dir: Path) -> WeightPublisher | None:
    """The weights' way back to the samplers of a stream (``publish``); None for other data."""
    if cfg.data.kind != "stream":
        return None
    p = cfg.publish
    return WeightPublisher(Path(p.dir) if p.dir else run_dir / "weights", url=cfg.data.url, stream=cfg.data.stream,
                           every=p.every, keep=p.keep, model_cfg=cfg.model, adapter_only=p.lora == "adapter")


def build_training(cfg: TrainConfig, resolved: DictConfig, run_dir: Path,
                   run: RunIdentity) -> tuple[PolicyModule, L.Trainer]:
    """Policy, data, module and trainer of a validated config (seed the RNGs first); ``resolved`` is the
    same config as Hydra composed it, for the console and the loggers; ``run`` goes into every checkpoint."""
    data = DATA_KINDS[cfg.data.kind](cfg, run_dir)
    evaluation = build_periodic_eval(cfg, getattr(data, "task", None))  # eval.every: on the data kind's task
    policy = build_policy(cfg.model, default_vocab_size=data.default_vocab_size)
    fingerprint = None
    if trains_adapters(cfg.model):
        add_adapters(policy, cfg.model.lora, base_path=getattr(cfg.model, "path", None))
        fingerprint = base_fingerprint(policy)
    strategy, shard = build_strategy(cfg.strategy, policy, world_size=cfg.trainer.processes)
    loss = MicroBatchLoss(cfg.loss, cfg.aggregation, cfg.metrics.level, cfg.kl, cfg.correction, cfg.model.compile)
    reference = build_reference(cfg, policy)
    module = PolicyModule(
        policy, loss, cfg.trainer, partial(build_optimizer, cfg.optimizer, cfg.trainer.max_steps),
        data.source_factory(policy), seed=cfg.seed, max_tokens=cfg.data.max_tokens,
        reference=reference, teacher=build_teacher(cfg, policy, reference),
        distill_coef=cfg.distill.coef if cfg.advantage.estimator == "distill" else None, shard=shard,
        reward_kl=RewardKL.of(cfg), base_fingerprint=fingerprint,
    )
    callbacks = build_callbacks(cfg, resolved, run_dir, run, evaluation)
    return module, build_trainer(cfg, resolved, run_dir, strategy, callbacks)
