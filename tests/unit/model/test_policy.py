"""The tiny model's initial weights (``model.init_std``): drawn with standard deviation 1/sqrt(hidden_size)
unless a value is set, norms at 1."""

from __future__ import annotations

import pytest
import torch

from rlcli.model.policy import build_policy
from train_helpers import compose_train_config


@pytest.mark.parametrize(("overrides", "std"), [
    ([], 64 ** -0.5),
    (["model.hidden_size=256", "model.intermediate_size=512", "model.num_heads=8"], 256 ** -0.5),
    (["model.init_std=0.02"], 0.02),
])
def test_the_tiny_model_draws_its_weights_with_init_std(overrides, std):
    """Every linear layer and the embeddings have the sample standard deviation ``std`` (within 5%: each holds
    at least 4096 draws, whose estimate is off by under 2%) and mean about 0; every norm's weight is 1. Fails
    if ``model.init_std`` or its default is not passed to the model (Hugging Face's own 0.02)."""
    torch.manual_seed(0)
    model = build_policy(compose_train_config(overrides).model)
    weights = {name: module.weight for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))}
    assert len(weights) == 2 * 7 + 2  # 7 linear layers in each of the 2 decoder layers, the embeddings, the head
    for name, weight in weights.items():
        assert weight.numel() >= 4096, name
        assert weight.double().std().item() == pytest.approx(std, rel=0.05), name
        assert abs(weight.double().mean().item()) < 0.1 * std, name
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 2 * 2 + 1 and all(torch.equal(p, torch.ones_like(p)) for p in norms)
