"""The LM head: hidden states -> log-probability (and entropy) of the label tokens.

`token_logprobs` never builds the full ``[tokens, vocab]`` logits when ``chunk_tokens > 0``: the
forward keeps one chunk of logits at a time, and the backward recomputes them chunk by chunk
(SPEC §2).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _compute_dtype(dtype: torch.dtype, fp32: bool) -> torch.dtype:
    """The dtype of the head matmul: float32 for half inputs when ``fp32``, else the inputs' own."""
    if fp32 and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    size = chunk_tokens if chunk_tokens > 0 else max(num_tokens, 1)
    return [(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]


def _chunk_softmax(hidden, weight, labels, temperature, compute_dtype):
    """Log-softmax of one chunk of temperature-scaled logits.

    hidden [C, H], weight [V, H], labels [C] -> (log_p [C, V] float32+, safe_labels [C], valid [C]).
    """
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T  # [C, V]
    softmax_dtype = torch.promote_types(compute_dtype, torch.float32)
    logits = logits.to(softmax_dtype)
    if temperature != 1.0:
        logits.div_(temperature)
    log_p = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))  # [C, V], in place
    valid = labels >= 0  # [C]
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))  # [C]
    return log_p, safe_labels, valid


class _TokenLogprobs(torch.autograd.Function):
    """Chunked head: logits exist for one chunk at a time in the forward and in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, fp32, chunk_tokens, with_entropy):
        compute_dtype = _compute_dtype(hidden.dtype, fp32)
        out_dtype = torch.promote_types(compute_dtype, torch.float32)
        num_tokens = hidden.shape[0]
        logprobs = hidden.new_zeros(num_tokens, dtype=out_dtype)  # [N]
        entropy = hidden.new_zeros(num_tokens, dtype=out_dtype) if with_entropy else None  # [N]
        with torch.no_grad():
            for start, end in _chunk_bounds(num_tokens, chunk_tokens):
                log_p, safe_labels, valid = _chunk_softmax(
                    hidden[start:end], weight, labels[start:end], temperature, compute_dtype
                )
                picked = log_p.gather(1, safe_labels[:, None]).squeeze(1)  # [C]
                logprobs[start:end] = torch.where(valid, picked, torch.zeros_like(picked))
                if with_entropy:
                    ent = -(log_p.exp() * log_p).sum(-1)  # [C]
                    entropy[start:end] = torch.where(valid, ent, torch.zeros_like(ent))
        ctx.save_for_backward(hidden, weight, labels, entropy if with_entropy else None)
        ctx.settings = (temperature, compute_dtype, chunk_tokens, with_entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, entropy = ctx.saved_tensors
        temperature, compute_dtype, chunk_tokens, with_entropy = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        grad_hidden = torch.zeros_like(hidden, dtype=acc_dtype) if need_hidden else None  # [N, H]
        grad_weight = torch.zeros_like(weight, dtype=acc_dtype) if need_weight else None  # [V, H]
        w = weight.to(compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start, end in _chunk_bounds(hidden.shape[0], chunk_tokens):
                h = hidden[start:end].to(compute_dtype)  # [C, H]
                log_p, safe_labels, valid = _chunk_softmax(
                    h, w, labels[start:end], temperature, compute_dtype
                )
                g_lp = torch.where(valid, grad_logprobs[start:end], torch.zeros_like(log_p[:, 0]))  # [C]
                # d lp / d z_j = (1[j = y] - p_j) / T ; d H / d z_j = -p_j (log p_j + H) / T
                if with_entropy and grad_entropy is not None:
                    g_ent = torch.where(valid, grad_entropy[start:end], torch.zeros_like(g_lp))  # [C]
                    p = log_p.exp()  # [C, V]
                    coef = log_p.add_(entropy[start:end, None]).mul_(g_ent[:, None]).add_(g_lp[:, None])
                    g_logits = p.mul_(coef).neg_()  # [C, V]
                    del coef
                else:
                    g_logits = log_p.exp_().mul_(-g_lp[:, None])  # [C, V], in place
                g_logits.scatter_add_(1, safe_labels[:, None], g_lp[:, None])
                if temperature != 1.0:
                    g_logits.div_(temperature)
                g_logits = g_logits.to(compute_dtype)
                del log_p
                if need_hidden:
                    grad_hidden[start:end] = g_logits @ w  # [C, H]
                if need_weight and grad_weight.dtype == g_logits.dtype:
                    grad_weight.addmm_(g_logits.T, h)  # [V, H], no temporary
                elif need_weight:
                    grad_weight += g_logits.T @ h  # [V, H] half-precision product, float32 sum
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    fp32: bool = False,
    chunk_tokens: int = 0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each label under ``softmax(hidden @ weight.T / temperature)``.

    Args:
        hidden: ``[N, H]`` final hidden states.
        weight: ``[V, H]`` LM-head weight (no bias).
        labels: ``[N]`` token ids; positions with ``labels < 0`` are ignored (value 0 there).
        temperature: the sampler's temperature, > 0.
        fp32: for float16/bfloat16 inputs do the matmul and everything after it in float32;
            gradients come back in the inputs' dtypes.
        chunk_tokens: if > 0, at most ``chunk_tokens x V`` logits exist at any moment.
        with_entropy: also return the entropy of each position's temperature-scaled distribution.

    Returns:
        ``(logprobs [N], entropy [N] or None)`` in float32 (float64 for float64 inputs).
    """
    if not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be an integer >= 0, got {chunk_tokens!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H]; got hidden {tuple(hidden.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"labels must be [N] = {tuple(hidden.shape[:1])}, got {tuple(labels.shape)}"
        )
    if labels.numel() and int(labels.max()) >= weight.shape[0]:
        raise ValueError(f"labels must be < vocab size {weight.shape[0]}, got {int(labels.max())}")
    device_type = hidden.device.type
    if not fp32 and torch.is_autocast_enabled(device_type):
        # mixed precision: the head runs in the autocast dtype, as the model's own head would
        autocast_dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(autocast_dtype), weight.to(autocast_dtype)
    with torch.autocast(device_type, enabled=False):
        return _TokenLogprobs.apply(
            hidden, weight, labels.long(), float(temperature), fp32, chunk_tokens, with_entropy
        )
