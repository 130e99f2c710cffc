"""Sharding plans of the scorer: FSDP1 (`wrap`) and FSDP2 (`fully_shard`), one unit per decoder layer."""

from __future__ import annotations

import torch


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
