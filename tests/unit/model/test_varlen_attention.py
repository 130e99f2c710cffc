"""``model.attn_implementation=varlen``: attention within each packed document equals the block-diagonal
``sdpa`` mask and the model run on each document alone; padded or cached calls (the sampler) are unchanged."""

from __future__ import annotations

import pytest
import torch

from factories import tiny_policy
from rlcli.model.varlen_attention import document_starts, packed_row_kwargs

LENGTHS = [5, 1, 9, 3]  # documents of one packed row


def _tiny(attn: str, *, kv_heads: int | None = None) -> torch.nn.Module:
    model = tiny_policy(50, hidden_size=32, attn_implementation=attn).double()
    if kv_heads is not None:  # grouped-query attention: fewer key/value heads, same weights otherwise
        for layer in model.model.layers:
            attn_module = layer.self_attn
            keep = kv_heads * attn_module.head_dim
            for proj in (attn_module.k_proj, attn_module.v_proj):
                proj.weight = torch.nn.Parameter(proj.weight[:keep].clone())
        model.config.num_key_value_heads = kv_heads
        for layer in model.model.layers:
            layer.self_attn.num_key_value_groups = 4 // kv_heads
    return model


def _packed_row():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (sum(LENGTHS),), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return ids[None], positions[None]  # [1, L]


def test_document_starts_are_the_position_restarts_and_row_starts():
    _, positions = _packed_row()
    assert document_starts(positions).tolist() == [0, 5, 6, 15, 18]
    assert document_starts(positions).dtype == torch.int32
    two_rows = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]])
    assert document_starts(two_rows).tolist() == [0, 3, 4, 8]
    continued = torch.tensor([[3, 4, 5], [7, 8, 9]])  # rows that do not start at position 0
    assert document_starts(continued).tolist() == [0, 3, 6]
    kwargs = packed_row_kwargs(positions)
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 9
    assert torch.equal(kwargs["cu_seq_lens_q"], document_starts(positions))


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_packed_row_equals_sdpa_block_mask_and_each_document_alone(kv_heads):
    ids, positions = _packed_row()
    outputs = {}
    for attn in ("varlen", "sdpa"):
        model = _tiny(attn, kv_heads=kv_heads)
        hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state  # [1, L, H]
        hidden.square().sum().backward()
        outputs[attn] = hidden.detach(), model.model.layers[0].self_attn.q_proj.weight.grad
        if attn == "varlen":
            alone = [model.model(input_ids=part[None], use_cache=False).last_hidden_state[0]
                     for part in ids[0].split(LENGTHS)]
            assert (hidden[0].detach() - torch.cat(alone).detach()).abs().max() <= 1e-12
    (h_varlen, g_varlen), (h_sdpa, g_sdpa) = outputs["varlen"], outputs["sdpa"]
    assert (h_varlen - h_sdpa).abs().max() <= 1e-12
    assert (g_varlen - g_sdpa).abs().max() <= 1e-10 * g_sdpa.abs().max()
    # the case is not trivial: attending across the documents would change the result
    model = _tiny("sdpa", kv_heads=kv_heads)
    across = model.model(input_ids=ids, use_cache=False).last_hidden_state.detach()
    assert (across - h_sdpa).abs().max() > 1e-3


def test_padded_and_cached_calls_take_the_sdpa_path():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 50, (2, 7), generator=g)
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])  # left padding, as the sampler builds it
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    for attn in ("varlen", "sdpa"):
        model = _tiny(attn)
        out = model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
        step = model(input_ids=ids[:, :1], attention_mask=torch.cat([attention_mask, torch.ones(2, 1)], -1).long(),
                     position_ids=positions[:, -1:] + 1, past_key_values=out.past_key_values, use_cache=True)
        logits[attn] = out.logits, step.logits
    for varlen, sdpa in zip(logits["varlen"], logits["sdpa"]):
        assert (varlen - sdpa).abs().max() <= 1e-12


def test_the_scorer_finds_the_documents_once_per_row(monkeypatch):
    from rlcli.model import varlen_attention
    from rlcli.model.scorer import TokenScorer
    from rlcli.modules import HeadSpec

    ids, positions = _packed_row()
    labels = torch.roll(ids[0], -1)
    calls = []
    counted = varlen_attention.document_starts
    monkeypatch.setattr(varlen_attention, "document_starts", lambda p: calls.append(1) or counted(p))
    logprobs = {}
    for attn in ("varlen", "sdpa"):
        scorer = TokenScorer(_tiny(attn), HeadSpec(chunk_tokens=0), with_entropy=False)
        logprobs[attn], _ = scorer(ids[0], positions[0], labels)
    assert len(calls) == 1  # not once per layer
    assert (logprobs["varlen"] - logprobs["sdpa"]).abs().max() <= 1e-12
