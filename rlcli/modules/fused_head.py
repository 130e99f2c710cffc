"""The LM head and the policy loss in one pass: each chunk's gradients are taken in the forward.

`token_logprobs` followed by `micro_batch_loss` keeps the head's inputs until the backward and, when
chunked, recomputes every chunk of logits there: 8·N·H·V floating-point operations. The policy loss
reads a chunk's log-probs only through the chunk's own tokens, or its own documents for a
sequence-level loss (gspo; its chunks end at document boundaries), so ``g = dL/dlp`` of a chunk is
known as soon as its logits are. `fused_micro_batch_loss` computes each chunk's logits once, gets
``g`` by autograd on the chunk's ``[C]`` log-probs, and turns the logits into the head's gradients
at once (6·N·H·V, one ``[V, C]`` buffer):

    s = g / T                              per token (0 where the label is ignored)
    grad_h = s * (W[y] - P.T @ W)          P = softmax(z) [V, C], in place of the logits
    grad_W = index_add(y, s * h) - P @ (s * h)

Only labelled tokens (``mask > 0``) go through the head: the loss and the metrics never read the
others. A document of a sequence-level loss with more labelled tokens than ``chunk_tokens`` does
not fit one chunk: it is cut into pieces of ``chunk_tokens`` (the first takes the remainder), their
log-probs are computed first, then the gradients, the last piece's from the buffer still held and
the others' from recomputed logits: ``2·(length - chunk_tokens)·H·V`` more operations for the
document. The backward only scales the stored gradients by the incoming scalar. When one chunk
holds every labelled row (the usual case), ``g``, the loss's value and its metrics come from one
`micro_batch_loss` pass over the micro-batch; with several chunks, ``g`` comes chunk by chunk and
the value and metrics from a last pass. Given `LabelledRows` and ``inputs.documents``, nothing in
here reads a tensor back to the host.

The terms of `rlcli.modules.regularizers` go through the same autograd on the chunk's ``[C]``
tensors. The KL term and the correction change ``g`` only (the correction's weights depend on the
inputs alone, so they are computed once for the micro-batch and a chunk need not hold whole
documents for them). The entropy bonus also needs ``dL/dH`` (``gH``, by the same autograd, on the
chunk's entropies): with ``a`` the raw logits, ``z = a / T``, ``p = softmax(z)``, ``H = −Σ p log p``,

    dH/dz_j = −p_j (log p_j + H)         (dp_k/dz_j = p_k (1[k = j] − p_j), Σ p = 1)
    dL/da_j = [g (1[j = y] − p_j) − gH p_j (log p_j + H)] / T

so in place of ``s · P`` the buffer becomes ``Q = P ⊙ (s + (gH / T)(log P + H))``. It holds
``e = exp(y)``, ``y = z − max z``, ``Σ e = S``, so ``log p = y − log S`` and ``Q = e ⊙ (A + B·y)`` with
``A = (s + (gH / T)(H − log S)) / S`` and ``B = (gH / T) / S`` per token; ``e·y`` is
``xlogy(e, e)`` (0 where ``e`` underflowed). With the bonus on, each chunk costs one more
elementwise pass over its ``[V, C]`` buffer (a log, two multiplies and an add per element, in blocks
of `ENTROPY_BLOCK_ELEMENTS`) and the forward computes the entropies (as ``metrics="with_entropy"``
does); the matrix products, 6·N·H·V, and the one ``[V, C]`` buffer stay as they are.

`head_logprobs` scores a micro-batch without gradients through exactly the chunks and the code of
`fused_micro_batch_loss`: its log-probs are the fused loss's own, bit for bit, so a trainer can get
its proximal (and a reference model's) log-probs with ratio 1 and ``kl_ref`` 0 exactly.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.autograd.function import once_differentiable

from rlcli.modules.aggregation import StepTotals, token_weights
from rlcli.modules.lm_head import (
    HeadSpec,
    check_head_shapes,
    check_label_range,
    chunk_logits,
    head_compute_dtype,
    head_operands,
)
from rlcli.modules.losses import LossInputs
from rlcli.modules.metrics import MetricPartials
from rlcli.modules.policy_loss import LossSpec, micro_batch_loss
from rlcli.modules.regularizers import importance_weights, token_losses
from rlcli.modules.segments import Segments

# entropies are summed over blocks of vocabulary rows of at most this many elements (bounds the temporaries)
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
        """``[R] -> [V, R]``: the rows' temperature-scaled logits, vocabulary-major, in ``acc_dtype``
        (a fresh buffer). ``W @ h.T`` rather than ``h @ W.T``: on CPU the same product runs 25-35%
        faster this way round and its BLAS workspace is 3 MiB instead of 12 MiB."""
        return chunk_logits(self.hidden[rows].to(self.compute_dtype), self.weight, self.temperature,
                            self.acc_dtype, vocab_major=True)


def _make_head(hidden, weight, labels, spec: HeadSpec) -> tuple[_Head, int]:
    """Check the head's tensors' shapes; the head in the dtypes of its chunks, and the chunk size as a number."""
    check_head_shapes(hidden, weight, labels)
    head_hidden, head_weight = head_operands(hidden, weight, spec.fp32)
    compute_dtype = head_compute_dtype(head_hidden.dtype, spec.fp32)
    acc_dtype = torch.promote_types(compute_dtype, torch.float32)
    head = _Head(head_hidden.detach(), head_weight.detach().to(compute_dtype), float(spec.temperature),
                 compute_dtype, acc_dtype)
    return head, spec.chunk_size(weight)


@dataclass
class _Scored:
    """A chunk's softmax, kept unnormalised: ``P = exps / sums`` column by column."""

    exps: torch.Tensor  # [V, R] exp(z - max_v z), in place of the logits
    sums: torch.Tensor  # [R] Σ_v exps
    labels: torch.Tensor  # [R] the rows' labels, 0 where ignored
    logprobs: torch.Tensor  # [R], 0 where the label is ignored
    entropy: torch.Tensor | None  # [R], 0 where the label is ignored


def _exponentiate(shifted: torch.Tensor, with_dot: bool) -> torch.Tensor | None:
    """Exponentiate ``shifted`` [V, R] in place, in blocks of rows; with ``with_dot`` return
    ``Σ_v exp(y_v) y_v`` [R]. The blocks are the same either way, so are the exponentials, bit for
    bit: a chunk's log-probs do not depend on whether its entropies are computed."""
    block = max(1, ENTROPY_BLOCK_ELEMENTS // shifted.shape[1])
    dot = shifted.new_zeros(shifted.shape[1]) if with_dot else None  # [R]
    for y in shifted.split(block):  # [b, R], contiguous
        if with_dot:
            e = y.exp()  # [b, R]
            dot += y.mul_(e).sum(0)
            y.copy_(e)
        else:
            y.exp_()
    return dot


def _score(head: _Head, rows: torch.Tensor, labels: torch.Tensor, with_entropy: bool,
           valid: torch.Tensor | None) -> _Scored:
    """The rows' log-probs (and entropies) and their softmax, from one ``[V, R]`` buffer; 0 where ``valid``
    [R] (None: every row has a label) says a row's label is ignored.

    With ``y = z - max z`` and ``s = Σ exp(y)``: ``log p(label) = y_label - log s`` and
    ``entropy = log s - Σ exp(y) y / s``."""
    exps = head.logits(rows)  # [V, R]
    exps.sub_(exps.amax(0))  # y, in place
    if valid is not None:
        labels = torch.where(valid, labels, 0)
    picked = exps[labels, torch.arange(rows.numel(), device=rows.device)]  # [R]
    dot = _exponentiate(exps, with_entropy)  # [R] | None
    sums = exps.sum(0)  # [R]
    log_sums = sums.log()
    logprobs = picked - log_sums
    entropy = log_sums - dot / sums if with_entropy else None
    if valid is not None:
        logprobs = torch.where(valid, logprobs, 0.0)
        entropy = torch.where(valid, entropy, 0.0) if with_entropy else None
    return _Scored(exps, sums, labels, logprobs, entropy)


def _fold_entropy_gradient(scored: _Scored, scale, entropy_scale, entropy) -> None:
    """Turn ``scored.exps`` (``e``) into ``Q = P ⊙ (scale + entropy_scale (log P + H))`` in place, in
    blocks of rows: ``Q = e ⊙ (A + B y)`` with ``y = log e``, ``A = (scale + entropy_scale (H − log S)) / S``,
    ``B = entropy_scale / S`` [R] (see the module's docstring)."""
    exps, sums = scored.exps, scored.sums
    a = (scale + entropy_scale * (entropy - sums.log())) / sums  # [R]
    b = entropy_scale / sums  # [R]
    block = max(1, ENTROPY_BLOCK_ELEMENTS // exps.shape[1])
    for e in exps.split(block):  # [b, R], contiguous
        ey = torch.xlogy(e, e)  # [b, R] e·y, 0 where e underflowed to 0
        e.mul_(a).add_(ey.mul_(b))


def _add_gradients(head: _Head, rows, scored: _Scored, scale, grad_hidden, grad_weight,
                   entropy_scale=None, entropy=None) -> None:
    """Add the rows' head gradients for ``d L / d z = scale * (onehot(y) - P)``, ``P = exps / sums``,
    and with ``entropy_scale`` [R] (``(dL/dH) / T``) the entropy's ``− entropy_scale · P ⊙ (log P + H)``.

    scored.exps [V, R] is consumed; scale [R] = (dL/dlp) / T, both 0 where the label is ignored.
    Without the entropy term the ``1 / sums`` of ``P`` is applied to the ``[R, H]`` operands, never as a
    pass over ``[V, R]``; with it, one pass over the buffer folds in everything (`_fold_entropy_gradient`).
    """
    safe_labels = scored.labels
    if entropy_scale is not None:
        _fold_entropy_gradient(scored, scale, entropy_scale, entropy)  # the buffer is Q: no more scaling
        p_scale = None
    else:
        p_scale = (scale / scored.sums)[:, None]  # [R, 1]
    exps = scored.exps.to(head.compute_dtype)  # [V, R], a no-op unless a half matmul
    scored.exps = None
    if grad_hidden is not None:
        ew = (exps.T @ head.weight).to(head.acc_dtype)  # [R, H]
        if p_scale is not None:
            ew.mul_(p_scale)
        label_rows = head.weight.index_select(0, safe_labels).to(head.acc_dtype)  # [R, H]
        grad_hidden[rows] = label_rows.mul_(scale[:, None]).sub_(ew)  # [R, H]
    if grad_weight is not None:
        h = head.hidden[rows].to(head.acc_dtype)  # [R, H]
        h_scaled = h * p_scale if p_scale is not None else h  # [R, H]
        if head.compute_dtype == head.acc_dtype:
            grad_weight.addmm_(exps, h_scaled, alpha=-1)  # [V, H], no temporary
        else:
            grad_weight -= (exps @ h_scaled.to(head.compute_dtype)).to(head.acc_dtype)
        grad_weight.index_add_(0, safe_labels, h.mul_(scale[:, None]))  # the one-hot term (after the product)


def _slices(m: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``(start, end)`` of consecutive slices of at most ``chunk_tokens`` of ``m`` rows (0: one slice);
    the first takes the remainder, so only it can be shorter."""
    if m == 0:
        return []
    size = chunk_tokens if chunk_tokens > 0 else m
    first = m % size or size
    return [(0, first)] + [(start, start + size) for start in range(first, m, size)]


def _chunks(counts: tuple[int, ...], chunk_tokens: int, whole_documents: bool) -> list[tuple[int, int]]:
    """Split the labelled rows (``counts``: each document's, in order) into ``(start, end)`` chunks of at
    most ``chunk_tokens`` rows (0: one chunk); with ``whole_documents`` a chunk ends only at a document
    boundary, and a longer document is a chunk of its own."""
    m = sum(counts)
    if not whole_documents or chunk_tokens == 0 or m == 0:
        return _slices(m, chunk_tokens)
    chunks, start, previous_end = [], 0, 0
    for end in itertools.accumulate(counts):
        if end - start > chunk_tokens and previous_end > start:
            chunks.append((start, previous_end))
            start = previous_end
        previous_end = end
    chunks.append((start, m))
    return chunks


@dataclass(frozen=True)
class LabelledRows:
    """The labelled positions of a micro-batch (``mask > 0``), each document's together: what the head
    scores. Found from the tensors (`of_tokens`, which waits for the device) or given by a caller that
    knows them already (the trainer, from the packer: no host synchronisation).

    Attributes:
        rows: ``[M]`` long, the positions; each document's in order, documents by ascending index.
        runs: ``[M]`` long, the document of each row, numbered 0.. over the documents with a row.
        counts: the rows of each of those documents, in order (host integers).
        valid: ``[M]`` bool, whether each row's label is ``>= 0`` (a row with an ignored label is scored 0
            and gets no gradient); None: every row's is.
    """

    rows: torch.Tensor  # [M]
    runs: torch.Tensor  # [M]
    counts: tuple[int, ...]
    valid: torch.Tensor | None = None  # [M] bool

    @classmethod
    def of_tokens(cls, mask: torch.Tensor, document_index: torch.Tensor, labels: torch.Tensor) -> LabelledRows:
        """From ``mask``, ``document_index`` (any document ids) and ``labels`` [N]: reads the documents' row
        counts on the host (one synchronisation)."""
        rows = torch.nonzero(mask > 0).flatten()  # [M]
        rows = rows[torch.argsort(document_index[rows], stable=True)]
        _, runs, counts = torch.unique_consecutive(document_index[rows], return_inverse=True, return_counts=True)
        valid = labels[rows] >= 0  # [M]
        return cls(rows=rows, runs=runs, counts=tuple(counts.tolist()), valid=None if bool(valid.all()) else valid)

    def valid_rows(self, start: int, end: int) -> torch.Tensor | None:
        """``valid`` of the rows ``start:end``."""
        return None if self.valid is None else self.valid[start:end]

    def documents(self, start: int, end: int) -> Segments:
        """The documents of the rows ``start:end``, numbered from 0 (`Segments.of` of their document ids)."""
        first = bisect.bisect_right(self._ends, start)  # the document of row `start`
        last = bisect.bisect_left(self._ends, end)  # the document of row `end - 1`
        return Segments(inverse=self.runs[start:end] - first, count=last - first + 1)

    @cached_property
    def _ends(self) -> list[int]:
        return list(itertools.accumulate(self.counts))


def _score_chunk(head: _Head, labels, chunk_rows, valid, chunk_tokens: int, with_entropy: bool, logprobs, entropy):
    """Score one chunk into ``logprobs`` (and ``entropy``) [N], piece by piece (one piece unless a
    document of a sequence-level loss is longer than a chunk); return the pieces and the last
    piece's `_Scored` (its buffer is the only one alive)."""
    pieces = _slices(chunk_rows.numel(), chunk_tokens)
    scored = None
    for s, e in pieces:
        piece = chunk_rows[s:e]
        scored = None  # free the previous buffer before the next one exists
        scored = _score(head, piece, labels[piece], with_entropy, None if valid is None else valid[s:e])
        logprobs[piece] = scored.logprobs
        if with_entropy:
            entropy[piece] = scored.entropy
    return pieces, scored


@functools.cache
def _compiled(function):
    """``function`` through ``torch.compile`` with dynamic shapes: one graph for micro-batches of any size."""
    return torch.compile(function, dynamic=True)


def _loss_function(head: HeadSpec):
    """`micro_batch_loss`, compiled when ``head.compile`` says so."""
    return _compiled(micro_batch_loss) if head.compile else micro_batch_loss


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
        grads = [grad for grad in (grad_hidden, grad_weight) if grad is not None]
        # scaled in place even by 1 (exact): looking at the value first would wait for the device
        torch._foreach_mul_(grads, grad_value)
        return None, grad_hidden, grad_weight, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    document_index: torch.Tensor,
    spec: LossSpec,
    head: HeadSpec,
    *,
    labelled: LabelledRows | None = None,
) -> torch.Tensor:
    """The log-probs [N] that `fused_micro_batch_loss` computes for the same arguments, bit for bit.

    No gradient. The labelled positions (``mask > 0``) go through the head in the fused loss's own
    chunks (which depend on ``mask``, ``document_index``, ``spec.loss`` and ``head.chunk_tokens``) and
    code; the others, and labels < 0, get 0. In float32 (float64 for float64 inputs), as the fused
    loss reads them: given to it as ``proximal_logprobs`` or ``reference_logprobs`` they give ratio 1
    and ``kl_ref = 0`` exactly while the head is unchanged.

    Args:
        hidden: ``[N, H]`` final hidden states.
        weight: ``[V, H]`` LM-head weight (no bias).
        labels: ``[N]`` token ids.
        mask: ``[N]`` 1 where a token is trained on.
        document_index: ``[N]`` the document of each token.
        spec: the `LossSpec` of the fused loss (its loss decides the chunks).
        head: the `HeadSpec`.
        labelled: the labelled rows when the caller knows them (no host synchronisation); else found
            from ``mask`` and ``document_index``, and the labels checked against the vocabulary.

    Returns:
        ``[N]`` log-probs, 0 at unlabelled positions.
    """
    operands, chunk_tokens = _make_head(hidden, weight, labels, head)
    if labelled is None:
        labelled = _labelled_rows(mask, document_index, labels, weight)
    labels = labels.long()
    logprobs = torch.zeros(hidden.shape[0], dtype=operands.acc_dtype, device=hidden.device)  # [N]
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        for start, end in _chunks(labelled.counts, chunk_tokens, spec.loss.sequence_level):
            _score_chunk(operands, labels, labelled.rows[start:end], labelled.valid_rows(start, end), chunk_tokens,
                         False, logprobs, None)
    return logprobs


def _labelled_rows(mask, document_index, labels, weight) -> LabelledRows:
    """The labelled rows found from the tensors, with the labels checked (both read on the host)."""
    check_label_range(labels, weight.shape[0])
    return LabelledRows.of_tokens(mask, document_index, labels)


def fused_micro_batch_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inputs: LossInputs,
    totals: StepTotals,
    spec: LossSpec,
    head: HeadSpec,
    *,
    labelled: LabelledRows | None = None,
) -> tuple[torch.Tensor, MetricPartials]:
    """`micro_batch_loss` of ``token_logprobs(hidden, weight, labels, head)``, in one pass over the head.

    Same value, metric partials (entropy with ``metrics="with_entropy"``) and gradients for
    ``hidden`` [N, H] and ``weight`` [V, H]; at most ``chunk_tokens × V`` logits exist at once
    (``chunk_tokens = 0``: all labelled tokens in one chunk; ``"auto"``: `auto_chunk_tokens`). The
    gradients are computed during the call, so the returned loss can be backpropagated once. The
    entropy of the bonus is the head's own, with its gradient.

    Args:
        hidden: ``[N, H]`` final hidden states of the micro-batch (whole documents).
        weight: ``[V, H]`` LM-head weight (no bias).
        labels: ``[N]`` token ids; positions with ``labels < 0`` are not scored.
        inputs: the micro-batch's `LossInputs`, ``[N]`` each.
        totals: the whole step's `StepTotals`.
        spec: the `LossSpec`.
        head: the `HeadSpec`.
        labelled: the labelled rows when the caller knows them; with ``inputs.documents`` too, the call
            reads nothing on the host (`LabelledRows`). Else found from ``inputs``, and the labels
            checked against the vocabulary.

    Returns:
        ``(loss, partials)``, as `micro_batch_loss` returns them.
    """
    spec.require(inputs, entropy=True)
    operands, chunk_tokens = _make_head(hidden, weight, labels, head)
    if inputs.shape != labels.shape:
        raise ValueError(f"the inputs must have the shape of labels {tuple(labels.shape)}; got {tuple(inputs.shape)}")
    if labelled is None:
        labelled = _labelled_rows(inputs.mask, inputs.document_index, labels, weight)
    acc_dtype = operands.acc_dtype
    inputs = inputs.detached(acc_dtype)
    labels = labels.long()
    need_hidden = torch.is_grad_enabled() and hidden.requires_grad
    need_weight = torch.is_grad_enabled() and weight.requires_grad
    with_entropy = spec.with_entropy
    num_tokens = hidden.shape[0]
    logprobs = torch.zeros(num_tokens, dtype=acc_dtype, device=hidden.device)  # [N]
    entropy = torch.zeros_like(logprobs) if with_entropy else None  # [N]
    grad_hidden = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None

    need_grad = need_hidden or need_weight
    loss_of_logprobs = _loss_function(head)
    chunks = _chunks(labelled.counts, chunk_tokens, spec.loss.sequence_level)
    # one chunk holds every labelled row: the loss, its metrics and its gradient come from one pass
    whole = need_grad and len(chunks) == 1
    if need_grad and not whole:
        importance = importance_weights(spec.correction, inputs)  # inputs only: once, for whole documents
        weights = token_weights(inputs.mask, inputs.segments, totals, aggregation=spec.aggregation,
                                divisor=spec.divisor, group_index=inputs.group_index)  # [N]

    def scaled(grads, valid):
        """``dL/dlp`` (and ``dL/dH``) of the rows, over ``T``; 0 where ``valid`` says the label is ignored."""
        if operands.temperature != 1.0:
            grads = [grad / operands.temperature for grad in grads]
        if valid is not None:
            grads = [torch.where(valid, grad, 0.0) for grad in grads]
        return grads[0], grads[1] if spec.entropy_on else None

    def loss_gradient(chunk_rows, valid, documents, chunk_logprobs, chunk_entropy):
        """``[R] -> [R], [R] | None``: ``dL/dlp`` and ``dL/dH`` (with the entropy bonus) of the rows
        (whole documents for a sequence-level loss), by autograd through `token_losses`, over ``T``."""
        leaves = [chunk_logprobs.detach().requires_grad_(True)]
        if spec.entropy_on:
            leaves.append(chunk_entropy.detach().requires_grad_(True))
        with torch.enable_grad():
            losses, _ = token_losses(
                leaves[0], inputs.select(chunk_rows, documents), spec, entropy=leaves[1] if spec.entropy_on else None,
                importance=None if importance is None else importance.select(chunk_rows),
            )  # [R]
            grads = torch.autograd.grad((weights[chunk_rows] * losses).sum(), leaves)
        return scaled(grads, valid)

    def whole_loss(rows, valid):
        """`micro_batch_loss` of the micro-batch, and ``dL/dlp`` and ``dL/dH`` of ``rows`` (every labelled
        row) by autograd through it: one pass where a chunk holds every labelled row."""
        leaves = [logprobs.detach().requires_grad_(True)]  # [N]
        if spec.entropy_on:
            leaves.append(entropy.detach().requires_grad_(True))
        with torch.enable_grad():
            value, partials = loss_of_logprobs(leaves[0], inputs, totals, spec,
                                               entropy=leaves[1] if spec.entropy_on else entropy)
            grads = torch.autograd.grad(value, leaves)
        return value.detach(), partials, scaled([grad[rows] for grad in grads], valid)

    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        for start, end in chunks:
            chunk_rows = labelled.rows[start:end]
            # one piece, unless a document of a sequence-level loss is longer than a chunk: then the
            # log-probs of all its pieces come first, and only the last piece's buffer is still there
            # for the gradients
            valid = labelled.valid_rows(start, end)  # [R] | None
            pieces, scored = _score_chunk(operands, labels, chunk_rows, valid, chunk_tokens, with_entropy, logprobs,
                                          entropy)
            if not need_grad:
                continue
            if whole:
                value, partials, (scale, entropy_scale) = whole_loss(chunk_rows, valid)
            else:
                scale, entropy_scale = loss_gradient(chunk_rows, valid, labelled.documents(start, end),
                                                     logprobs[chunk_rows],
                                                     entropy[chunk_rows] if with_entropy else None)  # [R]
            for s, e in reversed(pieces):
                piece = chunk_rows[s:e]
                if scored is None:  # an earlier piece: its logits again
                    scored = _score(operands, piece, labels[piece], False, None if valid is None else valid[s:e])
                _add_gradients(operands, piece, scored, scale[s:e], grad_hidden, grad_weight,
                               entropy_scale=None if entropy_scale is None else entropy_scale[s:e],
                               entropy=entropy[piece] if entropy_scale is not None else None)
                scored = None  # one [V, *] buffer at a time

        if not whole:
            value, partials = loss_of_logprobs(logprobs, inputs, totals, spec, entropy=entropy)
    if not need_grad:
        return value, partials
    if grad_hidden is not None:
        grad_hidden = grad_hidden.to(hidden.dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return _WithGradients.apply(value, hidden, weight, grad_hidden, grad_weight), partials
