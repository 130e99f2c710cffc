"""Build the policy: a tiny random-init causal LM from a config, or a local Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from rlcli.conf.schema import HFModelConfig, TinyModelConfig
from rlcli.errors import UserError
from rlcli.model import varlen_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_model_config(cfg: TinyModelConfig, default_vocab_size: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size or default_vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.init_std or cfg.hidden_size ** -0.5,
        tie_word_embeddings=False,
        attn_implementation=cfg.attn_implementation,
    )


def build_policy(cfg: TinyModelConfig | HFModelConfig, default_vocab_size: int = 64,
                 key: str = "model.path") -> torch.nn.Module:
    """The causal LM described by ``cfg.model`` (seed the RNG first for a reproducible tiny model);
    a tiny model with ``vocab_size: null`` gets ``default_vocab_size`` ids. ``key`` is the config key of
    the checkpoint's path that errors name (``kl.reference`` for a reference model)."""
    from transformers import AutoModelForCausalLM

    if cfg.attn_implementation == varlen_attention.NAME:
        if cfg.compile:
            raise UserError("model.compile: not with model.attn_implementation=varlen, whose attention loops over "
                            "each row's documents (inductor fails to compile it); use sdpa, or flash_attention_2 "
                            "on a GPU")
        varlen_attention.register()
    if cfg.kind == "tiny":
        model = AutoModelForCausalLM.from_config(tiny_model_config(cfg, default_vocab_size)).to(DTYPES[cfg.dtype])
    else:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise UserError(f"{key}: {path} is not a Hugging Face checkpoint directory (no config.json)")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=DTYPES[cfg.dtype],
                attn_implementation=cfg.attn_implementation,
                trust_remote_code=cfg.trust_remote_code,
            )
        except (OSError, ValueError) as err:
            raise UserError(f"{key}: cannot load {path}: {err}") from None
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise UserError("model: LM heads with a bias are not supported (rlcli computes the head itself)")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    if cfg.compile:
        compile_body(model)
    return model


def compile_body(model: torch.nn.Module) -> None:
    """``model.compile``: `torch.compile` the transformer body (``model.base_model``, what `TokenScorer`
    runs) in place, with dynamic shapes, so that packed rows of any length share one compiled graph; the
    compilation itself happens at the first forward. A `UserError` where torch.compile cannot run here,
    checked now rather than at the first step: inductor finds no working C++ compiler (it builds CPU kernels
    with one)."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
        model.base_model.compile(dynamic=True)
    except RuntimeError as err:
        raise UserError(f"model.compile: torch.compile cannot run here ({err}); install a C++ compiler (g++, or "
                        f"name one in the CXX environment variable) or set model.compile=false") from None


def save_tokenizer_if_any(cfg: TinyModelConfig | HFModelConfig, out_dir: Path) -> bool:
    """Copy the checkpoint's tokenizer files next to an export; False if it has none."""
    if cfg.kind != "hf":
        return False
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(Path(cfg.path).expanduser(), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, TypeError):
        return False
    if len(tokenizer) == 0:  # transformers builds an empty tokenizer for a directory without tokenizer files
        return False
    tokenizer.save_pretrained(out_dir)
    return True
