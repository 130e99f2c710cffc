"""The LM head and the policy loss in one pass: each chunk's gradients are taken in the forward.

`token_logprobs` followed by `micro_batch_loss` keeps the head's inputs until the backward and, when
chunked, recomputes every chunk of logits there: 8·N·H·V floating-point operations. The policy loss
reads a chunk's log-probs only through the chunk's own tokens (grpo) or its own documents (gspo),
so ``g = dL/dlp`` of a chunk is known as soon as its logits are. `fused_micro_batch_loss` computes
each chunk's logits once, gets ``g`` by autograd on the chunk's ``[C]`` log-probs, and turns the
logits into the head's gradients at once (6·N·H·V, one ``[C, V]`` buffer):

    s = g / T                              per token (0 where the label is ignored)
    grad_h = s * (W[y] - P @ W)            P = softmax(z) [C, V], in place of the logits
    grad_W = index_add(y, s * h) - P.T @ (s * h)

Only labelled tokens (``mask > 0``) go through the head: the loss and the metrics never read the
others. A gspo document with more labelled tokens than ``chunk_tokens`` does not fit one chunk: its
log-probs are computed first (chunk by chunk, forward only), then its chunks again for the
gradients. The backward only scales the stored gradients by the incoming scalar.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from rlcli.modules.aggregation import StepTotals, token_weights
from rlcli.modules.lm_head import (
    check_head_inputs,
    chunk_logits,
    head_compute_dtype,
    head_operands,
    labels_and_valid,
    resolve_chunk_tokens,
)
from rlcli.modules.losses import per_token_loss
from rlcli.modules.metrics import MetricPartials
from rlcli.modules.policy_loss import micro_batch_loss
from rlcli.modules.segments import Segments

# entropies are summed over blocks of rows of at most this many elements (bounds the temporary)
ENTROPY_BLOCK_ELEMENTS = 1 << 22


@dataclass
class _Head:
    """The head's operands, in the dtypes the chunks are computed in."""

    hidden: torch.Tensor  # [N, H] as given (gradients go to it)
    weight: torch.Tensor  # [V, H] compute dtype
    temperature: float
    compute_dtype: torch.dtype  # of the matmuls
    acc_dtype: torch.dtype  # of the softmax, log-probs and gradient sums

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R] -> [R, V]`` temperature-scaled logits in ``acc_dtype``, a fresh buffer."""
        return chunk_logits(self.hidden[rows].to(self.compute_dtype), self.weight, self.temperature, self.acc_dtype)


def _entropy(log_p: torch.Tensor) -> torch.Tensor:
    """``[C, V] -> [C]``: ``-Σ p log p`` of each row, in row blocks."""
    block = max(1, ENTROPY_BLOCK_ELEMENTS // log_p.shape[1])
    parts = []
    for rows in log_p.split(block):
        p = rows.exp()  # [b, V]
        parts.append(torch.bmm(p[:, None, :], rows[:, :, None]).view(-1).neg_())  # [b]
    return torch.cat(parts)


def _score(head: _Head, rows: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
    """Log-softmax of the rows' logits, in place: ``(log_p [R, V], logprobs [R], entropy [R] | None)``;
    both are 0 where the label is ignored."""
    log_p = head.logits(rows)
    torch.log_softmax(log_p, -1, out=log_p)  # [R, V]
    safe_labels, valid = labels_and_valid(labels)
    picked = log_p.gather(1, safe_labels[:, None]).squeeze(1)  # [R]
    logprobs = torch.where(valid, picked, 0.0)
    entropy = torch.where(valid, _entropy(log_p), 0.0) if with_entropy else None
    return log_p, logprobs, entropy


def _add_gradients(head: _Head, rows, labels, probs, scale, grad_hidden, grad_weight) -> None:
    """Add the rows' head gradients for ``d L / d z = scale * (onehot(y) - P)``.

    probs [R, V] softmax (consumed); scale [R] = (dL/dlp) / T, 0 where the label is ignored.
    """
    safe_labels, _ = labels_and_valid(labels)
    probs = probs.to(head.compute_dtype)  # no-op unless a half matmul
    if grad_hidden is not None:
        pw = (probs @ head.weight).to(head.acc_dtype)  # [R, H]
        label_rows = head.weight.index_select(0, safe_labels).to(head.acc_dtype)  # [R, H]
        grad_hidden[rows] = (label_rows - pw).mul_(scale[:, None])  # [R, H]
    if grad_weight is not None:
        scaled_h = head.hidden[rows].to(head.acc_dtype) * scale[:, None]  # [R, H]
        if head.compute_dtype == head.acc_dtype:
            grad_weight.addmm_(probs.T, scaled_h, alpha=-1)  # [V, H], no temporary
        else:
            grad_weight -= (probs.T @ scaled_h.to(head.compute_dtype)).to(head.acc_dtype)
        grad_weight.index_add_(0, safe_labels, scaled_h)  # the one-hot term


def _slices(m: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``(start, end)`` of consecutive slices of at most ``chunk_tokens`` of ``m`` rows (0: one slice)."""
    size = chunk_tokens if chunk_tokens > 0 else max(m, 1)
    return [(start, min(start + size, m)) for start in range(0, m, size)]


def _chunks(documents: torch.Tensor, chunk_tokens: int, whole_documents: bool) -> list[tuple[int, int]]:
    """Split ``M`` rows (``documents`` [M], each document's rows together) into ``(start, end)``
    chunks of at most ``chunk_tokens`` rows (0: one chunk); with ``whole_documents`` a chunk
    ends only at a document boundary, and a longer document is a chunk of its own."""
    m = documents.numel()
    if not whole_documents or chunk_tokens == 0 or m == 0:
        return _slices(m, chunk_tokens)
    ends = (torch.nonzero(documents[1:] != documents[:-1]).flatten() + 1).tolist() + [m]
    chunks, start, previous_end = [], 0, 0
    for end in ends:
        if end - start > chunk_tokens and previous_end > start:
            chunks.append((start, previous_end))
            start = previous_end
        previous_end = end
    chunks.append((start, m))
    return chunks


class _WithGradients(torch.autograd.Function):
    """``value`` with gradients for ``hidden`` and ``weight`` that were computed in the forward."""

    @staticmethod
    def forward(ctx, value, hidden, weight, grad_hidden, grad_weight):
        ctx.grads = (grad_hidden, grad_weight)
        return value.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_value):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # hand the buffers over: the weight's gradient is not copied
        if not bool(grad_value == 1):
            for grad in (grad_hidden, grad_weight):
                if grad is not None:
                    grad.mul_(grad_value.to(grad.dtype))
        return None, grad_hidden, grad_weight, None, None


def fused_micro_batch_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    document_index: torch.Tensor,
    totals: StepTotals,
    group_index: torch.Tensor | None = None,
    *,
    loss: str = "grpo",
    aggregation: str = "token_mean",
    divisor: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    metrics: str = "basic",
    temperature: float = 1.0,
    fp32: bool = False,
    chunk_tokens: int | str = 0,
) -> tuple[torch.Tensor, MetricPartials]:
    """``micro_batch_loss`` of ``token_logprobs(hidden, weight, labels, ...)``, in one pass over the head.

    Same value, metric partials (entropy with ``metrics="with_entropy"``) and gradients for
    ``hidden`` [N, H] and ``weight`` [V, H]; at most ``chunk_tokens × V`` logits exist at once
    (``chunk_tokens = 0``: all labelled tokens in one chunk; ``"auto"``: `auto_chunk_tokens`). The
    gradients are computed during the call, so the returned loss can be backpropagated once.
    """
    check_head_inputs(hidden, weight, labels, temperature, chunk_tokens)
    chunk_tokens = resolve_chunk_tokens(chunk_tokens, weight)
    head_hidden, head_weight = head_operands(hidden, weight, fp32)
    compute_dtype = head_compute_dtype(head_hidden.dtype, fp32)
    acc_dtype = torch.promote_types(compute_dtype, torch.float32)
    head = _Head(head_hidden.detach(), head_weight.detach().to(compute_dtype), float(temperature),
                 compute_dtype, acc_dtype)
    old_logprobs, advantages, mask = (t.detach().to(acc_dtype) for t in (old_logprobs, advantages, mask))
    labels = labels.long()
    need_hidden = torch.is_grad_enabled() and hidden.requires_grad
    need_weight = torch.is_grad_enabled() and weight.requires_grad
    with_entropy = metrics == "with_entropy"
    num_tokens = hidden.shape[0]
    logprobs = torch.zeros(num_tokens, dtype=acc_dtype, device=hidden.device)  # [N]
    entropy = torch.zeros_like(logprobs) if with_entropy else None  # [N]
    grad_hidden = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None

    # the labelled rows, each document's rows together: [M]
    rows = torch.nonzero(mask > 0).flatten()
    rows = rows[torch.argsort(document_index[rows], stable=True)]
    weights = token_weights(mask, Segments.of(document_index), totals, aggregation=aggregation,
                            divisor=divisor, group_index=group_index)  # [N]

    def loss_gradient(chunk_rows, chunk_logprobs):
        """``[R] -> [R]`` ``dL/dlp`` of the rows (whole documents for gspo), by autograd."""
        leaf = chunk_logprobs.detach().requires_grad_(True)
        with torch.enable_grad():
            losses, _ = per_token_loss(
                leaf, old_logprobs[chunk_rows], advantages[chunk_rows], mask[chunk_rows],
                Segments.of(document_index[chunk_rows]), loss=loss, eps_low=eps_low, eps_high=eps_high,
            )  # [R]
            (grad,) = torch.autograd.grad((weights[chunk_rows] * losses).sum(), leaf)
        return grad / temperature

    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        for start, end in _chunks(document_index[rows], chunk_tokens, whole_documents=loss == "gspo"):
            chunk_rows = rows[start:end]
            # one piece, unless a gspo document is longer than a chunk: then its log-probs come
            # first, piece by piece, and its pieces' logits are recomputed for the gradients
            pieces = _slices(end - start, chunk_tokens)
            for s, e in pieces:
                piece = chunk_rows[s:e]
                log_p = None  # free the previous buffer before the next one exists
                log_p, logprobs[piece], piece_entropy = _score(head, piece, labels[piece], with_entropy)
                if with_entropy:
                    entropy[piece] = piece_entropy
            if not (need_hidden or need_weight):
                continue
            scale = loss_gradient(chunk_rows, logprobs[chunk_rows])  # [R]
            scale = torch.where(labels[chunk_rows] >= 0, scale, 0.0)
            for s, e in pieces:
                piece = chunk_rows[s:e]
                probs = log_p.exp_() if len(pieces) == 1 else None  # [R, V], in place of the log-probabilities
                log_p = None  # one [*, V] buffer at a time: the last piece's goes before a piece is recomputed
                if probs is None:
                    probs = head.logits(piece)  # [r, V], recomputed
                    torch.softmax(probs, -1, out=probs)
                _add_gradients(head, piece, labels[piece], probs, scale[s:e], grad_hidden, grad_weight)
                del probs

        value, partials = micro_batch_loss(
            logprobs, old_logprobs, advantages, mask, document_index, totals, group_index,
            loss=loss, aggregation=aggregation, divisor=divisor, eps_low=eps_low, eps_high=eps_high,
            metrics=metrics, entropy=entropy,
        )
    if not (need_hidden or need_weight):
        return value, partials
    if grad_hidden is not None:
        grad_hidden = grad_hidden.to(hidden.dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return _WithGradients.apply(value, hidden, weight, grad_hidden, grad_weight), partials
