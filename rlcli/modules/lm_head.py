"""The LM head: hidden states -> log-probability (and entropy) of the label tokens.

`token_logprobs` never builds the full ``[tokens, vocab]`` logits when ``chunk_tokens > 0``: the
forward keeps one chunk of logits at a time, and the backward recomputes them chunk by chunk
(math.md#log-probabilities).

Cost per chunk of ``C`` tokens (``V`` vocabulary, ``H`` hidden): the forward is one ``[C, H] @ [H, V]``
matmul and one fused in-place log-softmax over the ``[C, V]`` logits; the backward recomputes the
logits (one matmul), turns them into probabilities ``P`` in place (one fused softmax) and needs
two more matmuls, ``P @ W`` and ``P.T @ h``. The per-token upstream gradient ``g`` and ``1 / T``
are applied to the ``[C, H]`` operands and results, never as extra passes over ``[C, V]``:

    d lp / d z = (onehot(y) - P) / T        ->  grad_h = (g / T) * (W[y] - P @ W)
                                                 grad_W = index_add(y, (g / T) * h) - P.T @ ((g / T) * h)

With entropy, ``d H / d z = -P * (log P + H) / T`` adds one fused ``[C, V]`` multiply-add. The
price of keeping memory at ``O(C·V)`` instead of ``O(N·V)`` is the recomputed matmul: 8·N·H·V
floating-point operations instead of 6·N·H·V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlcli.modules.bounds import TEMPERATURE, check_bounds

IGNORE_INDEX = -100

# ``chunk_tokens="auto"``: the float32 logits of one chunk fill about this many elements. Small chunks
# save memory, large ones keep the matmuls efficient; measured in benchmarks/lm_head.py: on CPU
# 64 MiB keeps the head within 0.1x the naive path's memory at no loss of speed, a GPU needs
# larger matmuls to be efficient and has the memory for them (1 GiB).
AUTO_CHUNK_LOGITS = {"cpu": 1 << 24, "cuda": 1 << 28}
AUTO_CHUNK_MULTIPLE = 16
# Below this a chunk's three matmuls read the whole [V, H] weight for too little work: at V = 152064
# on a 2-core CPU, 96-token chunks ran at 60% of the matmul rate, 256-token ones at 80-88%.
AUTO_CHUNK_MIN_TOKENS = 128


def auto_chunk_tokens(vocab_size: int, device_type: str) -> int:
    """``chunk_tokens`` for ``"auto"``: the largest multiple of 16 tokens whose logits fit the
    device's budget (`AUTO_CHUNK_LOGITS`; CPU's for other devices), at least 128.

    Args:
        vocab_size: ``V``, the rows of the head's weight.
        device_type: ``"cpu"`` (64 MiB of float32 logits), ``"cuda"`` (1 GiB) or another torch device type.

    Returns:
        The number of tokens per chunk.
    """
    budget = AUTO_CHUNK_LOGITS.get(device_type, AUTO_CHUNK_LOGITS["cpu"])
    return max(AUTO_CHUNK_MIN_TOKENS, budget // vocab_size // AUTO_CHUNK_MULTIPLE * AUTO_CHUNK_MULTIPLE)


@dataclass(frozen=True)
class HeadSpec:
    """How the LM head scores the labels; checked on construction (``ValueError`` naming the option).

    Attributes:
        temperature: the sampler's temperature, ``> 0``; the logits are divided by it.
        fp32: for float16/bfloat16 inputs, do the matmul and everything after it in float32
            (gradients come back in the inputs' dtypes).
        chunk_tokens: a number ``> 0`` keeps at most ``chunk_tokens × V`` logits at any moment;
            ``0`` scores every token in one chunk; ``"auto"`` is `auto_chunk_tokens` for the
            vocabulary and device.
        compile: `fused_micro_batch_loss` runs the loss on the head's log-probs (`micro_batch_loss`: its
            value, metrics and, for a micro-batch in one chunk, gradient) through ``torch.compile`` with
            dynamic shapes, its many small elementwise operations fused into few kernels. The chunks'
            matrix products, and the per-chunk gradient of a micro-batch in several chunks, stay eager.
    """

    temperature: float = field(default=1.0, metadata=TEMPERATURE)
    fp32: bool = False
    chunk_tokens: int | str = "auto"
    compile: bool = False

    def __post_init__(self):
        check_bounds(self)
        chunk_tokens = self.chunk_tokens
        if chunk_tokens != "auto" and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                       or chunk_tokens < 0):
            raise ValueError(f"chunk_tokens must be an integer >= 0 or 'auto', got {chunk_tokens!r}")

    def chunk_size(self, weight: torch.Tensor) -> int:
        """``chunk_tokens`` as a number: ``"auto"`` is `auto_chunk_tokens` of the weight's vocabulary and device."""
        if self.chunk_tokens == "auto":
            return auto_chunk_tokens(weight.shape[0], weight.device.type)
        return self.chunk_tokens


def head_compute_dtype(dtype: torch.dtype, fp32: bool) -> torch.dtype:
    """The dtype of the head matmul: float32 for half inputs when ``fp32``, else the inputs' own."""
    if fp32 and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    size = chunk_tokens if chunk_tokens > 0 else max(num_tokens, 1)
    return [(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]


def chunk_logits(h, w, temperature, softmax_dtype, vocab_major: bool = False):
    """Temperature-scaled logits of one chunk in ``softmax_dtype`` (float32 or float64).

    h [C, H] and w [V, H] in the compute dtype -> [C, V] (``vocab_major``: [V, C], as ``w @ h.T``),
    a fresh tensor that may be overwritten.
    """
    def product(h):
        return torch.mm(w, h.T) if vocab_major else h @ w.T

    if h.dtype == softmax_dtype:
        if temperature != 1.0:
            h = h / temperature  # [C, H]: cheaper than dividing the [C, V] logits
        return product(h)
    logits = product(h).to(softmax_dtype)  # half matmul, float32 softmax
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def labels_and_valid(labels):
    valid = labels >= 0  # [C]
    return torch.where(valid, labels, torch.zeros_like(labels)), valid


def check_head_inputs(hidden, weight, labels) -> None:
    """Raise ``ValueError`` naming the first invalid tensor of the head."""
    check_head_shapes(hidden, weight, labels)
    check_label_range(labels, weight.shape[0])


def check_head_shapes(hidden, weight, labels) -> None:
    """Raise ``ValueError`` naming the first tensor of the head with a wrong shape."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H]; got hidden {tuple(hidden.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"labels must be [N] = {tuple(hidden.shape[:1])}, got {tuple(labels.shape)}"
        )


def check_label_range(labels, vocab_size: int) -> None:
    """Raise ``ValueError`` for a label id beyond the vocabulary (reads the largest on the host)."""
    if labels.numel() and int(labels.max()) >= vocab_size:
        raise ValueError(f"labels must be < vocab size {vocab_size}, got {int(labels.max())}")


def head_operands(hidden, weight, fp32: bool):
    """Under autocast (and without ``fp32``) the head runs in the autocast dtype, as the model's
    own head would; otherwise in the inputs' dtype. Differentiable casts."""
    device_type = hidden.device.type
    if not fp32 and torch.is_autocast_enabled(device_type):
        autocast_dtype = torch.get_autocast_dtype(device_type)
        return hidden.to(autocast_dtype), weight.to(autocast_dtype)
    return hidden, weight


class _TokenLogprobs(torch.autograd.Function):
    """Chunked head: logits exist for one chunk at a time in the forward and in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, fp32, chunk_tokens, with_entropy):
        compute_dtype = head_compute_dtype(hidden.dtype, fp32)
        out_dtype = torch.promote_types(compute_dtype, torch.float32)
        num_tokens = hidden.shape[0]
        logprobs = hidden.new_zeros(num_tokens, dtype=out_dtype)  # [N]
        entropy = hidden.new_zeros(num_tokens, dtype=out_dtype) if with_entropy else None  # [N]
        with torch.no_grad():
            w = weight.to(compute_dtype)  # [V, H], converted once (a no-op unless fp32 on half)
            for start, end in _chunk_bounds(num_tokens, chunk_tokens):
                log_p = chunk_logits(hidden[start:end].to(compute_dtype), w, temperature, out_dtype)
                torch.log_softmax(log_p, -1, out=log_p)  # [C, V], fused and in place
                safe_labels, valid = labels_and_valid(labels[start:end])
                picked = log_p.gather(1, safe_labels[:, None]).squeeze(1)  # [C]
                logprobs[start:end] = torch.where(valid, picked, torch.zeros_like(picked))
                if with_entropy:
                    p = torch.exp(log_p)  # [C, V]
                    ent = torch.bmm(p[:, None, :], log_p[:, :, None]).view(-1).neg_()  # [C], row dot products
                    entropy[start:end] = torch.where(valid, ent, torch.zeros_like(ent))
                    del p
                del log_p
        ctx.save_for_backward(hidden, weight, labels, entropy if with_entropy else None)
        # an output that does not reach the loss (the entropy as a mere metric) gets None, not
        # zeros, so the backward takes the cheaper path without the entropy term
        ctx.set_materialize_grads(False)
        ctx.settings = (temperature, compute_dtype, chunk_tokens, with_entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, entropy = ctx.saved_tensors
        temperature, compute_dtype, chunk_tokens, with_entropy = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        grad_hidden = torch.empty_like(hidden, dtype=acc_dtype) if need_hidden else None  # [N, H]
        grad_weight = torch.zeros_like(weight, dtype=acc_dtype) if need_weight else None  # [V, H]
        if not (need_hidden or need_weight):
            return None, None, None, None, None, None, None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(hidden.shape[0], dtype=acc_dtype, device=hidden.device)
        use_entropy = with_entropy and grad_entropy is not None
        w = weight.to(compute_dtype)  # [V, H]
        w_acc = w if compute_dtype == acc_dtype else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start, end in _chunk_bounds(hidden.shape[0], chunk_tokens):
                h = hidden[start:end].to(compute_dtype)  # [C, H]
                safe_labels, valid = labels_and_valid(labels[start:end])
                zero = torch.zeros((), dtype=acc_dtype, device=h.device)
                g_lp = torch.where(valid, grad_logprobs[start:end].to(acc_dtype), zero)  # [C]
                s_lp = g_lp / temperature  # [C]: d L / d z_y of the label term, per token
                logits = chunk_logits(h, w, temperature, acc_dtype)  # [C, V]
                if use_entropy:
                    # d L / d z_j = [g_lp (1[j = y] - p_j) - g_ent p_j (log p_j + H)] / T
                    #             = [g_lp 1[j = y] - p_j (c + g_ent log p_j)] / T,  c = g_lp + g_ent H
                    g_ent = torch.where(valid, grad_entropy[start:end].to(acc_dtype), zero)  # [C]
                    c = g_lp + g_ent * entropy[start:end].to(acc_dtype)  # [C]
                    log_p = torch.log_softmax(logits, -1, out=logits)  # [C, V], in place
                    q = torch.exp(log_p)  # [C, V]
                    torch.addcmul(c[:, None], log_p, g_ent[:, None], out=log_p)  # [C, V], in place
                    q.mul_(log_p)  # [C, V]: p (c + g_ent log p)
                    del log_p, logits
                    row_scale = None  # q carries the per-token factor; 1 / T still to apply
                else:
                    q = torch.softmax(logits, -1, out=logits)  # [C, V] probabilities, in place
                    del logits
                    row_scale = s_lp[:, None]  # [C, 1]
                q_c = q.to(compute_dtype)  # no-op unless a half matmul
                del q
                if need_hidden:
                    qw = (q_c @ w).to(acc_dtype)  # [C, H]
                    qw = qw.mul_(row_scale) if row_scale is not None else qw.div_(temperature)
                    w_rows = (w_acc if w_acc is not None else w).index_select(0, safe_labels).to(acc_dtype)  # [C, H]
                    grad_hidden[start:end] = torch.addcmul(qw.neg_(), w_rows, s_lp[:, None])  # [C, H]
                if need_weight:
                    h_acc = h.to(acc_dtype)
                    h_scaled = h_acc * row_scale if row_scale is not None else h_acc / temperature  # [C, H]
                    if compute_dtype == acc_dtype:
                        grad_weight.addmm_(q_c.T, h_scaled, alpha=-1)  # [V, H], no temporary
                    else:
                        grad_weight -= (q_c.T @ h_scaled.to(compute_dtype)).to(acc_dtype)  # half product, fp32 sum
                    grad_weight.index_add_(0, safe_labels, h_acc * s_lp[:, None])  # the one-hot term
                del q_c
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    head: HeadSpec,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each label under ``softmax(hidden @ weight.T / head.temperature)``.

    Args:
        hidden: ``[N, H]`` final hidden states.
        weight: ``[V, H]`` LM-head weight (no bias).
        labels: ``[N]`` token ids; positions with ``labels < 0`` are ignored (value 0 there).
        head: the temperature, fp32 head and chunk size (`HeadSpec`).
        with_entropy: also return the entropy of each position's temperature-scaled distribution.

    Returns:
        ``(logprobs [N], entropy [N] or None)`` in float32 (float64 for float64 inputs).
    """
    check_head_inputs(hidden, weight, labels)
    chunk_tokens = head.chunk_size(weight)
    hidden, weight = head_operands(hidden, weight, head.fp32)
    device_type = hidden.device.type
    with torch.autocast(device_type, enabled=False):
        return _TokenLogprobs.apply(
            hidden, weight, labels.long(), float(head.temperature), head.fp32, chunk_tokens, with_entropy
        )
