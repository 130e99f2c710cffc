"""LoRA adapters on the policy (``model.lora``, with the `peft` package).

peft injects its LoRA layers into the policy in place (`peft.inject_adapter_in_model`): the policy stays the
transformers model it was, each targeted linear layer holding its frozen ``base_layer`` and the adapter pair
``lora_A``, ``lora_B``; only the adapters require gradients. From there:

- the reference of ``kl.reference=initial`` is the policy with its adapters switched off (`adapters_off`): B
  starts at zero, so that is the starting policy, without a second copy of the weights;
- samplers and exports take the merged weights (`merged_weights`), named as the base model names them;
- checkpoints hold the adapters only, and `base_fingerprint` names the base weights they belong to;
- ``export/adapter/`` is the adapters in peft's own format (`save_adapter`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rlcli.errors import UserError

ADAPTER = "default"  # peft's name of the one adapter
PEFT_PREFIX = "base_model.model."  # what peft's saved adapters prefix the model's names with
_INITS = {"default": True, "gaussian": "gaussian"}  # model.lora.init -> peft's init_lora_weights


def add_adapters(model: torch.nn.Module, cfg, base_path: str | None = None) -> torch.nn.Module:
    """``model`` with LoRA adapters of ``cfg`` (``model.lora``, rank > 0) in its linear layers, the rest of it
    frozen; a `UserError` naming ``model.lora.target_modules`` when it matches no layer or a layer whose
    adapters rlcli cannot merge or compute with (an embedding, a transposed Conv1D, a tied or dropped-out LM
    head)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners import lora as peft_lora

    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                        init_lora_weights=_INITS[cfg.init], base_model_name_or_path=base_path)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:
        raise UserError(f"model.lora.target_modules: {cfg.target_modules!r} cannot take adapters: {err}") from None
    unmergeable = [name for name, layer in model.named_modules() if _is_adapted(layer) and (
        not isinstance(layer, peft_lora.Linear) or layer.fan_in_fan_out)]
    if unmergeable:
        raise UserError(f"model.lora.target_modules: {cfg.target_modules!r} puts adapters on {', '.join(unmergeable)}: "
                        "rlcli merges adapters of linear layers (torch.nn.Linear) only, not of embeddings or "
                        "transposed (Conv1D) layers; name linear layers")
    if _is_adapted(model.get_output_embeddings()):
        if model.config.tie_word_embeddings:
            raise UserError(f"model.lora.target_modules: {cfg.target_modules!r} puts an adapter on the LM head, "
                            "which this model ties to its embeddings; leave it out")
        if cfg.dropout:
            raise UserError("model.lora.dropout: the LM head's adapter changes the head's weight (rlcli computes "
                            "the head from it), where no dropout applies; set it to 0 or leave lm_head out of "
                            "model.lora.target_modules")
    return model


def has_adapters(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _is_adapted(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is one of peft's LoRA layers (its base layer and an adapter pair)."""
    from peft.tuners.lora import LoraLayer

    return isinstance(layer, LoraLayer)


def head_weight(model: torch.nn.Module) -> torch.Tensor:
    """``[V, H]``: the weight the LM head computes with: its own, plus ``(alpha / rank) · B A`` while a LoRA
    adapter on it is on (differentiable: the fused head's gradient of the weight reaches A and B)."""
    head = model.get_output_embeddings()
    weight = head.weight  # [V, H]; an adapted layer's is its base layer's
    if has_adapters(model) and _is_adapted(head) and not head.disable_adapters:  # no peft import without LoRA
        weight = weight + head.get_delta_weight(ADAPTER)  # [V, H]
    return weight


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters of ``model``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if _is_adapted(module)]


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Within: ``model`` computes as its base model, each adapter layer its ``base_layer`` alone."""
    layers = _lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # peft's set_adapter: the adapters require gradients again


def _scaling(model: torch.nn.Module) -> float:
    config = model.peft_config[ADAPTER]
    return config.lora_alpha / config.r


def merged_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """The weights of the model the adapters make, named as the base model names them: each adapted layer's
    ``W + (alpha / rank) · B A`` (computed in float32, stored in W's dtype); ``state`` is the adapted model's
    state dict (its own by default, or one gathered from every shard). Without adapters, ``state`` itself."""
    state = dict(model.state_dict() if state is None else state)
    if not has_adapters(model):
        return state
    scaling = _scaling(model)
    merged = {}
    for name, value in state.items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            layer, kind = name.split(".base_layer.")
            if kind == "weight":
                a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()  # [rank, in]
                b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()  # [out, rank]
                value = (value.float() + scaling * (b @ a)).to(value.dtype)  # [out, in]
            name = f"{layer}.{kind}"
        merged[name] = value
    return merged


def served_weights(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of the weights a sampler serves, as a Hugging Face checkpoint names them: the
    policy's parameters, merged with its adapters when it has them."""
    return merged_weights(model).items() if has_adapters(model) else model.named_parameters()


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' entries of the state dict ``state``."""
    return {name: value for name, value in state.items() if ".lora_" in name}


def save_adapter(model: torch.nn.Module, state: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Write the adapters of ``state`` (the policy's state dict) to ``directory`` in peft's format:
    ``adapter_config.json`` and ``adapter_model.safetensors``, which `peft.PeftModel.from_pretrained` and
    vLLM's LoRA support load on top of the base model."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    adapters = get_peft_model_state_dict(model, state_dict=dict(state), adapter_name=ADAPTER)
    save_file({PEFT_PREFIX + name: value.contiguous() for name, value in adapters.items()},
              directory / "adapter_model.safetensors")
    model.peft_config[ADAPTER].save_pretrained(directory)


@dataclass(frozen=True)
class PublishedAdapter:
    """A directory of adapters in peft's format (``publish.lora=adapter``): the base model they apply to and
    their rank."""

    base: str
    rank: int


def published_adapter(path: str | Path) -> PublishedAdapter | None:
    """The adapters at ``path`` when it holds adapters alone (``adapter_config.json``, no ``config.json``);
    None for a whole model."""
    path = Path(path)
    if (path / "config.json").is_file() or not (path / "adapter_config.json").is_file():
        return None
    config = json.loads((path / "adapter_config.json").read_text())
    return PublishedAdapter(base=config["base_model_name_or_path"], rank=config["r"])


def base_fingerprint(model: torch.nn.Module) -> str:
    """A SHA-256 of the base model's weights (every entry of the state dict but the adapters), in name order:
    a checkpoint of adapters names the base model it belongs to."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if ".lora_" in name:
            continue
        tensor = value.detach().to("cpu").contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
