"""Attention over packed rows as variable-length sequences (``model.attn_implementation=varlen``).

A packed row holds whole documents whose position ids restart at 0. With ``sdpa`` the model
attends over the whole row under a block-diagonal mask: ``L²`` scores per row, most of them masked.
``varlen`` attends within each document only, as flash-attention's variable-length kernels do: on
CUDA through `torch.nn.attention.varlen.varlen_attn` (torch ≥ 2.10), elsewhere one causal
``scaled_dot_product_attention`` per document. Calls with a padding mask or a KV cache (the
on-policy sampler) take the ``sdpa`` path unchanged.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "varlen"


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L] -> [S + 1]`` int32 offsets into the flattened ``B·L`` tokens: a document starts at
    every position id 0 and at every row start; the last offset is ``B·L``."""
    batch, length = position_ids.shape
    row_starts = torch.arange(0, batch * length, length, device=position_ids.device)  # [B]
    restarts = torch.nonzero(position_ids.reshape(-1) == 0).flatten()  # [R]
    end = torch.tensor([batch * length], device=position_ids.device)
    return torch.cat([torch.unique(torch.cat([row_starts, restarts])), end]).to(torch.int32)


def packed_row_kwargs(position_ids: torch.Tensor) -> dict:
    """The document offsets of packed rows ``[B, L]`` as the model's keyword arguments (the names
    flash-attention uses), worked out once per forward instead of once per layer (each costs a
    device synchronisation)."""
    offsets = document_starts(position_ids)  # [S + 1]
    longest = int((offsets[1:] - offsets[:-1]).max())
    return dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=longest, max_length_k=longest)


@functools.cache
def _causal_option() -> dict:
    """How this torch's `varlen_attn` is told to be causal: torch 2.10 takes is_causal, later ones
    window_size (looked up once, not in every layer's call)."""
    from torch.nn.attention.varlen import varlen_attn

    options = inspect.signature(varlen_attn).parameters
    return {"is_causal": True} if "is_causal" in options else {"window_size": (-1, 0)}


def _cuda_varlen(query, key, value, offsets, longest, scaling):
    """``[T, Hq, D]`` queries, ``[T, Hkv, D]`` keys and values -> ``[T, Hq, D]``, causal per document."""
    from torch.nn.attention.varlen import varlen_attn

    if key.shape[1] != query.shape[1]:  # grouped-query attention: one key head per group of queries
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
    return varlen_attn(query, key, value, offsets, offsets, longest, longest, scale=scaling, **_causal_option())


def _per_document(query, key, value, offsets, longest, scaling):
    """The same on any device: one causal SDPA per document. ``[T, H, D]`` in and out."""
    gqa = key.shape[1] != query.shape[1]
    out = torch.empty_like(query)
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [H, n, D]
        out[start:end] = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa
        ).transpose(0, 1)
    return out


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A Hugging Face attention function: ``query [B, Hq, L, D]``, ``key``/``value [B, Hkv, L, D]``
    -> ``([B, L, Hq, D], None)``. Dropout is not supported (RL fine-tuning runs without it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    if attention_mask is not None or key.shape[2] != length or (module.training and dropout > 0):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if kwargs.get("cu_seq_lens_q") is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(length, device=query.device)
        kwargs = packed_row_kwargs(position_ids.expand(batch, length))
    offsets, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]  # [S + 1], int
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))  # [T, H, D]
    attend = _cuda_varlen if query.is_cuda else _per_document
    return attend(q, k, v, offsets, longest, scaling).view(batch, length, heads, dim), None


def _mask(*args, attention_mask=None, **kwargs):
    """No mask for a packed row (the documents are the mask); the sdpa mask when padding is given."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make ``attn_implementation="varlen"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, _mask)
