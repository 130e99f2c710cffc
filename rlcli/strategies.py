"""`strategy=auto|ddp|fsdp|fsdp2`: Lightning strategies and the FSDP2 sharding plan.

- ddp: DistributedDataParallel over gloo on CPU, nccl on GPU.
- fsdp: Lightning's FSDPStrategy (GPU only), one FSDP unit per decoder layer.
- fsdp2: `fully_shard` per decoder layer and on the root, through Lightning's
  ModelParallelStrategy; it also runs on CPU over gloo, which is how the sharded path is tested.
"""

from __future__ import annotations

from functools import partial

import torch
from omegaconf import DictConfig


def decoder_layer_classes(policy: torch.nn.Module) -> set[type]:
    """The classes a Hugging Face model names in ``_no_split_modules`` (its decoder layers)."""
    names = set(getattr(policy, "_no_split_modules", None) or [])
    return {type(m) for m in policy.modules() if type(m).__name__ in names}


def fully_shard_policy(scorer: torch.nn.Module, device_mesh, *, mixed_precision: str | None) -> None:
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh["data_parallel"]
    policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layer_classes = tuple(decoder_layer_classes(scorer.policy))
    for module in scorer.modules():
        if layer_classes and isinstance(module, layer_classes):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(scorer, mesh=mesh, mp_policy=policy)


def build_strategy(cfg: DictConfig, policy: torch.nn.Module, world_size: int):
    """``(strategy for lightning.Trainer, sharding function for configure_model or None)``."""
    backend = cfg.get("process_group_backend") or None
    if cfg.name == "auto":
        return "auto", None
    if cfg.name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=backend), None
    if cfg.name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(
            auto_wrap_policy=decoder_layer_classes(policy),
            sharding_strategy=cfg.sharding_strategy,
            cpu_offload=cfg.cpu_offload,
            state_dict_type="full",
            process_group_backend=backend,
        ), None
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        data_parallel_size=world_size, tensor_parallel_size=1,
        save_distributed_checkpoint=False, process_group_backend=backend,
    )
    return strategy, partial(fully_shard_policy, mixed_precision=cfg.mixed_precision)
