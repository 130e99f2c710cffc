"""``HeadSpec(compile=True)`` (``model.compile=true``): the fused head's loss math through ``torch.compile`` gives
eager's value, metrics and head gradients within float32 rounding, for a micro-batch in one chunk (one
`micro_batch_loss` pass) and in several (`token_losses` per chunk), and compiles once for micro-batches of any size.

Tolerance: compiled and eager float32 differ in the order of their sums (inductor fuses and reorders them); the
longest sums here run over a micro-batch's tokens (at most 64), so 64·eps relative to the largest value bounds
the rounding. Against a wrong loss (the head's log-probs ignored) the values differ by ~1e-1. Breaking the
compile switch (the eager functions for compile=True) fails the graph count.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from rlcli.modules import HeadSpec, LossInputs, LossSpec, StepTotals, fused_micro_batch_loss
from rlcli.modules.segments import Segments

EPS = torch.finfo(torch.float32).eps
LONGEST_SUM = 64  # terms: the tokens of the largest micro-batch


def _case(lengths: list[int], seed: int):
    """A micro-batch of documents of ``lengths`` tokens: hidden [N, H], weight [V, H], labels, inputs, totals."""
    g = torch.Generator().manual_seed(seed)
    n, hidden_size, vocab = sum(lengths), 16, 50
    document_index = torch.cat([torch.full((k,), d) for d, k in enumerate(lengths)])
    mask = (torch.rand(n, generator=g) > 0.25).float()
    labels = torch.where(mask > 0, torch.randint(0, vocab, (n,), generator=g), -100)
    documents = Segments(inverse=document_index, count=len(lengths))  # as the trainer gives them
    inputs = LossInputs(proximal_logprobs=-torch.rand(n, generator=g) * 3, advantages=torch.randn(n, generator=g),
                        mask=mask, document_index=document_index, documents=documents)
    totals = StepTotals.of_tokens(mask, documents)
    hidden = torch.randn(n, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.3
    return hidden, weight, labels, inputs, totals


def _run(case, spec: LossSpec, head: HeadSpec):
    hidden, weight, labels, inputs, totals = case
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    value, partials = fused_micro_batch_loss(hidden, weight, labels, inputs, totals, spec, head)
    value.backward()
    return value.detach(), partials, hidden.grad, weight.grad


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= LONGEST_SUM * EPS * max(want.abs().max().item(), 1e-3))


@pytest.mark.slow  # compiling on CPU: ~10 s a loss
@pytest.mark.parametrize("loss, chunk_tokens", [("grpo", 0), ("gspo", 8)])  # one chunk; several, whole documents
def test_the_compiled_loss_equals_eager_and_compiles_once(loss, chunk_tokens):
    torch._dynamo.reset()
    counters.clear()  # the counts of this test only (a reset leaves them)
    spec = LossSpec(loss=loss, metrics="with_entropy")
    eager, compiled = HeadSpec(chunk_tokens=chunk_tokens), HeadSpec(chunk_tokens=chunk_tokens, compile=True)
    for seed, lengths in enumerate([[9, 14, 5], [20, 7, 11, 26]]):  # two sizes: one graph for both
        case = _case(lengths, seed)
        want, got = _run(case, spec, eager), _run(case, spec, compiled)
        assert _close(got[0], want[0]), (got[0], want[0])
        for kind in ("means", "sums", "maxima", "minima"):
            for name, value in getattr(want[1], kind).items():
                assert _close(getattr(got[1], kind)[name], value), name
        assert _close(got[2], want[2]) and _close(got[3], want[3])  # the head's gradients
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert counters["stats"]["unique_graphs"] <= 2  # once (a forward, or the per-chunk loss and the whole one)
