"""`strategy=auto|ddp|fsdp|fsdp2`: the Lightning strategy and the sharding plan it calls for.

- ddp: DistributedDataParallel over gloo on CPU, nccl on GPU.
- fsdp: Lightning's FSDPStrategy (GPU only); the scorer is the FSDP root, one unit per decoder layer.
- fsdp2: `fully_shard` per decoder layer and on the root, through Lightning's
  ModelParallelStrategy; it also runs on CPU over gloo, which is how the sharded path is tested.

A strategy is a function registered in `STRATEGIES` under its ``strategy.name``:
``(cfg, world_size) -> (strategy for lightning.Trainer, sharding function or None)``, with ``cfg``
the group's typed config (defaults in ``rlcli/conf/strategy/<name>.yaml``). The sharding function
takes ``(scorer, device_mesh)`` in ``configure_model`` and returns the module to call in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from rlcli.model.sharding import fsdp_wrap, fully_shard_policy
from rlcli.modules.registry import Registry

Sharding = Callable[..., torch.nn.Module] | None

STRATEGIES: Registry[Callable[..., tuple[Any, Sharding]]] = Registry("strategy")


@STRATEGIES.register("auto")
def auto(cfg, world_size: int) -> tuple[str, Sharding]:
    return "auto", None


@STRATEGIES.register("ddp")
def ddp(cfg, world_size: int) -> tuple[Any, Sharding]:
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(process_group_backend=cfg.process_group_backend), None


@STRATEGIES.register("fsdp")
def fsdp(cfg, world_size: int) -> tuple[Any, Sharding]:
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(
        sharding_strategy=cfg.sharding_strategy,
        cpu_offload=cfg.cpu_offload,
        state_dict_type="full",
        process_group_backend=cfg.process_group_backend,
    ), fsdp_wrap


def _model_parallel_strategy(**kwargs):
    """Lightning's ModelParallelStrategy, which also resumes from a checkpoint of LoRA adapters and from one of an
    optimizer that keeps no state.

    - A checkpoint of adapters holds them, not the base weights (`PolicyModule.on_save_checkpoint`). The strategy
      loads a checkpoint into the sharded model before ``on_load_checkpoint`` can complete it with the base
      weights, so here it loads it non-strictly: the adapters from the file, the base weights staying as built
      from the model (which ``on_load_checkpoint`` then checks by hash).
    - An optimizer without state (SGD without momentum) saves none, which Lightning's loading takes for a
      malformed state (an IndexError); here its saved param groups (learning rates and the rest), all there is
      of it, are loaded directly."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from rlcli.model.lora import has_adapters

    class ResumingStrategy(ModelParallelStrategy):
        def load_checkpoint(self, checkpoint_path, weights_only=None):
            module, optimizers = self.lightning_module, self.optimizers
            saved = torch.load(checkpoint_path, mmap=True, map_location="cpu", weights_only=weights_only)
            stateless = not any(state["state"] for state in saved["optimizer_states"])
            adapters = has_adapters(module.policy)
            strict, module.strict_loading = module.strict_loading, module.strict_loading and not adapters
            if stateless:
                self.optimizers = []  # Lightning loads the model and the rest of the checkpoint alone
            try:
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            finally:
                module.strict_loading = strict
                if stateless:
                    self.optimizers = optimizers
            if stateless:
                for optimizer, state in zip(optimizers, checkpoint["optimizer_states"], strict=True):
                    optimizer.load_state_dict(state)  # its param groups: no state to place on the shards
            if adapters:
                checkpoint["state_dict"] = {}  # loaded already: this strategy loads nothing after on_load_checkpoint
            return checkpoint

    return ResumingStrategy(**kwargs)


@STRATEGIES.register("fsdp2")
def fsdp2(cfg, world_size: int) -> tuple[Any, Sharding]:
    strategy = _model_parallel_strategy(
        data_parallel_size=world_size, tensor_parallel_size=1,
        save_distributed_checkpoint=False, process_group_backend=cfg.process_group_backend,
    )
    return strategy, partial(fully_shard_policy, mixed_precision=cfg.mixed_precision)


def build_strategy(cfg, policy: torch.nn.Module, world_size: int):
    """``(strategy for lightning.Trainer, sharding function for configure_model or None)`` from the
    ``strategy`` group (see the module's docstring)."""
    return STRATEGIES[cfg.name](cfg, world_size)
