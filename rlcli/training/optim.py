"""The optimizer and its learning-rate schedule, from the `optimizer` config group.

An optimizer is a function registered in `OPTIMIZERS` under its ``optimizer.name``:
``(params, cfg) -> torch.optim.Optimizer``, with ``cfg`` the group's typed config
(`rlcli.conf.schema`; its defaults live in ``rlcli/conf/optimizer/<name>.yaml``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from rlcli.modules.registry import Registry

OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = Registry("optimizer")


@OPTIMIZERS.register("adamw")
def adamw(params: list[torch.nn.Parameter], cfg) -> torch.optim.Optimizer:
    # fused: one kernel for all parameters, and the step counts stay on the device (the default implementation
    # reads each parameter's count on the host every step)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=True)


@OPTIMIZERS.register("sgd")
def sgd(params: list[torch.nn.Parameter], cfg) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Linear warmup to the base rate, then constant or cosine decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(cfg, total_steps: int, policy: torch.nn.Module):
    """``(optimizer, LambdaLR scheduler)`` from the ``optimizer`` group."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = OPTIMIZERS[cfg.name](params, cfg)
    multiplier = partial(
        lr_multiplier, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
        schedule=cfg.schedule, min_lr_ratio=cfg.min_lr_ratio,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
