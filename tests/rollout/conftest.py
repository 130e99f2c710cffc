"""Fixtures for the tests of ``rlcli.rollout``: tiny random-init Llama models."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from rlcli.model.policy import tiny_model_config


def build_tiny_model(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0):
    """A float32 tiny Llama with ``vocab_size`` tokens, seeded for reproducible weights."""
    cfg = OmegaConf.create(
        dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_layers=num_layers,
            num_heads=4,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_model_config(cfg))


@pytest.fixture
def tiny_model():
    """``tiny_model(vocab_size, **kwargs)`` builds a fresh tiny model (see `build_tiny_model`)."""
    return build_tiny_model
