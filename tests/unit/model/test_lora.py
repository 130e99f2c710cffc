"""``model.lora`` (rlcli/model/lora.py) against peft itself and hand-derived values: the merged weights equal
peft's ``merge_and_unload``; the policy with its adapters off computes as the base model; a fresh adapter leaves
the policy as it was; the saved adapter loads into peft's `PeftModel` as the same model; the parameter counts;
the base weights' fingerprint.

Models: the tiny Llama of ``model=tiny`` (hidden 32, MLP 64, 2 layers, no biases) and a tiny Qwen2 (biases on
q/k/v, grouped key/values). Every adapter gets a random, non-zero B, so a mistake in the merge or in the scale
``alpha / rank`` (here 12 / 4 = 3) shows as a change of order 1e-2 in a weight.

How each test was checked to fail: with rlcli/model/lora.py edited in memory (a pytest plugin that execs the
module's source with one replacement; the file itself untouched), as each docstring says.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from factories import make_tiny_qwen2, tiny_policy
from rlcli.conf.schema import LoraConfig
from rlcli.errors import UserError
from rlcli.model.lora import (
    adapters_off,
    add_adapters,
    base_fingerprint,
    head_weight,
    merged_weights,
    parameter_counts,
    save_adapter,
)

VOCAB, HIDDEN, MLP, LAYERS = 50, 32, 64, 2  # the tiny Llama's sizes (tiny_policy: MLP = 2 x hidden)
RANK, ALPHA = 4, 12.0  # scale alpha / rank = 3
QV = ["q_proj", "v_proj"]


def _lora(target_modules="all-linear", init: str = "default") -> LoraConfig:
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=targets, init=init)


def _llama(dtype: str = "float32", seed: int = 0) -> torch.nn.Module:
    return tiny_policy(VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype=dtype, seed=seed).eval()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), hidden_size=32)


def _qwen2(directory) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _adapted(base: torch.nn.Module, targets="all-linear", init: str = "default") -> torch.nn.Module:
    """A copy of ``base`` with adapters whose B is random (seeded), not zero."""
    model = add_adapters(copy.deepcopy(base), _lora(targets, init))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=g))
    return model


def _ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(2))  # [B, T]


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits  # [B, T, V]


def _peft_merged(base: torch.nn.Module, adapted_state: dict, targets) -> dict[str, torch.Tensor]:
    """peft's own merge: ``base`` wrapped by `peft.get_peft_model` (a config written here, not rlcli's), the
    adapted model's weights loaded into it, then ``merge_and_unload``."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    reference = peft.get_peft_model(copy.deepcopy(base), config)
    reference.base_model.model.load_state_dict(adapted_state)  # strict: the same layers got adapters
    return reference.merge_and_unload().state_dict()


@pytest.mark.parametrize("model_kind, targets", [("llama", "all-linear"), ("llama", QV), ("qwen2", "all-linear")],
                         ids=["llama", "llama-qv", "qwen2"])
def test_merged_weights_equal_peft_merge_and_unload(model_kind, targets, qwen2_dir):
    """Names: the base model's state-dict names, in its order; values: peft's merge within float32 rounding
    (one rounding of W + 3·BA, |values| < 1: under 1e-7; a wrong scale or a B·A transposed/left out is off by
    ~1e-2). Qwen2's q/k/v biases pass through renamed. Fails with the scale alpha/rank changed to alpha, with
    ``b @ a`` replaced by 0 (no merge), and with the ``.base_layer.`` names kept (names differ)."""
    base = _llama() if model_kind == "llama" else _qwen2(qwen2_dir)
    adapted = _adapted(base, targets)
    merged = merged_weights(adapted)
    expected = _peft_merged(base, adapted.state_dict(), targets)
    assert list(merged) == list(base.state_dict()) == list(expected)
    for name, value in merged.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    changed = [name for name in merged if not torch.equal(merged[name], base.state_dict()[name])]
    assert changed and all(name.endswith("_proj.weight") for name in changed)


def test_merged_weights_of_bfloat16_merge_in_float32():
    """bfloat16 weights: the merge is done in float32 and rounded to bfloat16 once, so it equals peft's merge of
    the same weights in float32, rounded to bfloat16, exactly. Fails when the merge runs in bfloat16 (``.float()``
    dropped: W + bf16(3·BA) rounds twice) and when the result stays float32."""
    base = _llama(dtype="bfloat16")
    adapted = _adapted(base)
    merged = merged_weights(adapted)
    state32 = {name: value.float() for name, value in adapted.state_dict().items()}
    expected = _peft_merged(copy.deepcopy(base).float(), state32, "all-linear")
    assert list(merged) == list(base.state_dict())
    for name, value in merged.items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, expected[name].to(torch.bfloat16)), name


def test_adapters_off_computes_as_the_base_model():
    """Inside the block the adapted model's logits equal the base model's bit for bit (B is not zero: outside
    they differ); after it, also after an exception, the adapters require gradients again and the base does not.
    Fails when ``enable_adapters(False)`` is skipped (inside, the logits differ), when the ``finally`` re-enabling is
    skipped (outside, they stay the base's) and when add_adapters leaves the base trainable."""
    base = _llama()
    adapted = _adapted(base)
    ids = _ids()
    expected = _logits(base, ids)
    with adapters_off(adapted):
        assert torch.equal(_logits(adapted, ids), expected)
    assert not torch.allclose(_logits(adapted, ids), expected, atol=1e-3)
    with pytest.raises(RuntimeError, match="inside"), adapters_off(adapted):
        raise RuntimeError("inside")
    for name, param in adapted.named_parameters():
        assert param.requires_grad == (".lora_" in name), name


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_fresh_adapters_leave_the_model_as_it_was(init):
    """B = 0: the adapted model's logits equal the base model's bit for bit. A as peft draws it (hand-derived
    from torch's initialisers): default, Kaiming-uniform with a = sqrt(5), so |A| <= 1/sqrt(in); gaussian, a
    normal of std 1/rank (0.25, wider than that bound). Fails with model.lora.init mapped to the other
    initialisation."""
    base = _llama()
    adapted = add_adapters(copy.deepcopy(base), _lora(init=init))
    ids = _ids()
    assert torch.equal(_logits(adapted, ids), _logits(base, ids))
    a_weights = [(name, p) for name, p in adapted.named_parameters() if ".lora_A." in name]
    assert all(not p.any() for name, p in adapted.named_parameters() if ".lora_B." in name)
    within_bound = all(p.abs().max() <= p.shape[1] ** -0.5 for _, p in a_weights)  # p: [rank, in]
    assert within_bound == (init == "default")
    if init == "gaussian":
        std = torch.cat([p.flatten() for _, p in a_weights]).std().item()  # ~5000 draws: std within ~1%
        assert std == pytest.approx(1 / RANK, rel=0.05)


@pytest.mark.parametrize("targets, adapter_params", [
    # each layer: q, k, v, o (32 -> 32): A 4x32 + B 32x4; gate, up (32 -> 64): A 4x32 + B 64x4;
    # down (64 -> 32): A 4x64 + B 32x4
    ("all-linear", LAYERS * (4 * (RANK * HIDDEN + HIDDEN * RANK) + 3 * (RANK * HIDDEN + MLP * RANK))),
    (QV, LAYERS * 2 * (RANK * HIDDEN + HIDDEN * RANK)),
], ids=["all-linear", "qv"])
def test_add_adapters_trains_the_adapters_only(targets, adapter_params):
    """Only ``lora_`` parameters require gradients, and `parameter_counts` is (adapters, base + adapters) with
    the base counted by hand: embedding and head 50x32 each, per layer 4 attention 32x32, 3 MLP 32x64 and 2
    norms of 32, a final norm of 32 (no biases). Fails when the base is left trainable."""
    base_params = 2 * VOCAB * HIDDEN + LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP + 2 * HIDDEN) + HIDDEN
    model = add_adapters(_llama(), _lora(targets))
    assert parameter_counts(model) == (adapter_params, base_params + adapter_params)
    names = [name for name, _ in model.named_parameters()]
    assert any(".lora_" in name for name in names)
    for name, param in model.named_parameters():
        assert param.requires_grad == (".lora_" in name), name


def test_target_modules_that_match_nothing_are_a_user_error():
    """Fails when peft's ValueError is not turned into a UserError naming the key."""
    with pytest.raises(UserError, match=r"model\.lora\.target_modules.*no_such_proj"):
        add_adapters(_llama(), _lora(["no_such_proj"]))


def test_an_adapter_on_the_lm_head_changes_the_weight_the_fused_head_reads():
    """rlcli's fused head reads the head's weight, not its forward: `head_weight` is W + (alpha / rank) B A while
    the adapter is on (W alone while it is off), and its gradient reaches A and B as peft's own forward of the
    head sends it. Fails if the adapter is left out of the weight (the head's adapters would never train) or
    stays in it with the adapters off."""
    model = _adapted(_llama(), ["q_proj", "lm_head"])
    head = model.lm_head
    a, b = head.lora_A["default"].weight, head.lora_B["default"].weight  # [r, H], [V, r]
    expected = head.base_layer.weight + (ALPHA / RANK) * (b @ a)  # [V, H]
    torch.testing.assert_close(head_weight(model), expected, rtol=0, atol=1e-7)
    with adapters_off(model):
        assert torch.equal(head_weight(model), head.base_layer.weight)
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))  # [N, H]
    (hidden @ head_weight(model).T).square().sum().backward()
    ours = [a.grad.clone(), b.grad.clone()]
    a.grad = b.grad = None
    head(hidden).square().sum().backward()  # peft's forward: W x + scale · B A x
    torch.testing.assert_close(ours, [a.grad, b.grad], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("targets", "change", "message"), [
    (["q_proj", "embed_tokens"], None, r"adapters on model\.embed_tokens: rlcli merges adapters of linear layers"),
    (["q_proj", "lm_head"], "tie", r"puts an adapter on the LM head, which this model ties to its embeddings"),
    (["q_proj", "lm_head"], "dropout", r"model\.lora\.dropout: the LM head's adapter"),
])
def test_adapters_rlcli_cannot_compute_with_are_a_user_error(targets, change, message):
    """Embeddings (peft's lora.Embedding, which the merge does not know), a head tied to the embeddings, and
    dropout on the head's adapter (applied to the weight, where no dropout applies) are refused up front. Fails
    if any is let through."""
    model, lora = _llama(), _lora(targets)
    if change == "tie":
        model.config.tie_word_embeddings = True
    if change == "dropout":
        lora.dropout = 0.1
    with pytest.raises(UserError, match=message):
        add_adapters(model, lora)


def test_adapters_on_transposed_conv1d_layers_are_a_user_error():
    """GPT-2's Conv1D layers store their weight transposed (peft's fan_in_fan_out): refused rather than merged
    wrongly. Fails if all-linear adapters on a GPT-2 are let through."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(UserError, match=r"transposed \(Conv1D\) layers"):
        add_adapters(gpt2, _lora())


def test_saved_adapter_loads_into_peft_as_the_same_model(tmp_path):
    """``save_adapter``'s directory, loaded by `peft.PeftModel.from_pretrained` on a copy of the base model, gives
    the adapted model's logits bit for bit (the same computation); the merged weights loaded (strict) into a
    fresh model give them within float32 rounding of the reordered sums (1e-5; B·A left out: ~1e-1). Fails when
    the saved names lose their ``base_model.model.`` prefix or the config its alpha (peft then loads B = 0 or
    another scale), and when the merged names keep ``.base_layer.``."""
    base = _llama()
    adapted = _adapted(base)
    ids = _ids()
    expected = _logits(adapted, ids)
    save_adapter(adapted, adapted.state_dict(), tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    assert torch.equal(_logits(loaded, ids), expected)
    fresh = _llama(seed=5)
    fresh.load_state_dict(merged_weights(adapted))
    torch.testing.assert_close(_logits(fresh, ids), expected, rtol=1e-5, atol=1e-5)


def test_base_fingerprint_names_the_base_weights_only():
    """Two models built with the same seed share the fingerprint, also when their adapters differ; one base weight
    element changed (in an adapted layer's ``base_layer``) changes it. Fails when the ``.lora_`` entries are
    hashed too, and when ``.base_layer.`` entries are skipped."""
    one, two = add_adapters(_llama(seed=3), _lora()), _adapted(_llama(seed=3))
    assert base_fingerprint(one) == base_fingerprint(two)
    with torch.no_grad():
        two.model.layers[1].mlp.down_proj.base_layer.weight[3, 5] += 1e-3
    assert base_fingerprint(one) != base_fingerprint(two)
