"""`strategy=auto|ddp|fsdp|fsdp2`: the Lightning strategy and the sharding plan it calls for.

- ddp: DistributedDataParallel over gloo on CPU, nccl on GPU.
- fsdp: Lightning's FSDPStrategy (GPU only); the scorer is the FSDP root, one unit per decoder layer.
- fsdp2: `fully_shard` per decoder layer and on the root, through Lightning's
  ModelParallelStrategy; it also runs on CPU over gloo, which is how the sharded path is tested.
"""

from __future__ import annotations

from functools import partial

import torch

from rlcli.model.sharding import fsdp_wrap, fully_shard_policy


def build_strategy(cfg, policy: torch.nn.Module, world_size: int):
    """``(strategy for lightning.Trainer, sharding function for configure_model or None)``; the sharding
    function takes ``(scorer, device_mesh)`` and returns the module to call in its place."""
    backend = getattr(cfg, "process_group_backend", None)
    if cfg.name == "auto":
        return "auto", None
    if cfg.name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=backend), None
    if cfg.name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(
            sharding_strategy=cfg.sharding_strategy,
            cpu_offload=cfg.cpu_offload,
            state_dict_type="full",
            process_group_backend=backend,
        ), fsdp_wrap
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        data_parallel_size=world_size, tensor_parallel_size=1,
        save_distributed_checkpoint=False, process_group_backend=backend,
    )
    return strategy, partial(fully_shard_policy, mixed_precision=cfg.mixed_precision)
