"""`strategy=auto|ddp|fsdp|fsdp2`: Lightning strategies and the FSDP2 sharding plan.

- ddp: DistributedDataParallel over gloo on CPU, nccl on GPU.
- fsdp: Lightning's FSDPStrategy (GPU only); the scorer is the FSDP root, one unit per decoder layer.
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


def fsdp_wrap(scorer: torch.nn.Module, device_mesh) -> torch.nn.Module:
    """FSDP1: the scorer as the root FSDP unit, one unit per decoder layer, so that calling it runs
    FSDP's forward and backward hooks (Lightning would make the LightningModule the root, whose forward
    rlcli never calls). Called in ``configure_model``, inside the strategy's ``enable_wrap`` context."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, wrap

    return wrap(scorer, auto_wrap_policy=ModuleWrapPolicy(decoder_layer_classes(scorer.policy)))


def fully_shard_policy(scorer: torch.nn.Module, device_mesh, *, mixed_precision: str | None) -> torch.nn.Module:
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
    return fully_shard(scorer, mesh=mesh, mp_policy=policy)


def build_strategy(cfg: DictConfig, policy: torch.nn.Module, world_size: int):
    """``(strategy for lightning.Trainer, sharding function for configure_model or None)``; the sharding
    function takes ``(scorer, device_mesh)`` and returns the module to call in its place."""
    backend = cfg.get("process_group_backend") or None
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
