"""``fused_micro_batch_loss``: the head and the policy loss in one pass, against the float64
references of the head (``ref_head``), the loss (``ref_loss``) and the metrics (``ref_metrics``);
its memory bound (at most ``chunk_tokens × V`` logits at once) and its work (6·M·H·V for the M
labelled tokens) counted op by op."""

from __future__ import annotations

import weakref
import zlib
from dataclasses import replace

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import AGGREGATIONS, F64, LOSSES, make_step, ref_head, ref_loss, ref_metrics, rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlcli.modules import (
    HeadSpec,
    LossSpec,
    Segments,
    StepTotals,
    auto_chunk_tokens,
    finalize_metrics,
    fused_head,
    fused_micro_batch_loss,
    lm_head,
)

H, V = 8, 40
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _case(seed, *, num_docs=10, max_len=9, vocab=V, dtype=F64):
    """A packed step, a head whose log-probs are near the step's old ones, and the step totals."""
    step = make_step(seed, num_docs=num_docs, max_len=max_len, num_groups=3, empty_docs=2)
    n = step["mask"].numel()
    g = torch.Generator().manual_seed(seed + 7)
    hidden = torch.randn(n, H, generator=g, dtype=F64)
    weight = torch.randn(vocab, H, generator=g, dtype=F64) * (2 / H**0.5)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[step["mask"] == 0] = -100  # as packing leaves them
    labels[int(torch.nonzero(step["mask"])[0])] = -1  # a labelled position whose label is ignored
    head_lp, _ = ref_head(hidden, weight, labels)
    labelled = step["mask"] > 0
    # sampler log-probs near the head's: ratios around 1, some clipped
    step["old"] = torch.where(labelled, head_lp + 0.3 * torch.randn(n, generator=g, dtype=F64), step["old"])
    group_ids, group_index = torch.unique(step["group"], return_inverse=True)
    totals = StepTotals.of_tokens(step["mask"], Segments.of(step["doc"]), group_index, group_ids.numel())
    return step, hidden.to(dtype), weight.to(dtype), labels, group_index, totals


def _fused(step, hidden, weight, labels, group_index, totals, *, scale=1.0, temperature=1.0, fp32=False,
           chunk_tokens="auto", **kw):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    head = HeadSpec(temperature=temperature, fp32=fp32, chunk_tokens=chunk_tokens)
    value, partials = fused_micro_batch_loss(hidden, weight, labels, step_inputs(step, group_index=group_index),
                                             totals, loss_spec(eps_low=EPS_LOW, eps_high=EPS_HIGH, **kw), head)
    (value * scale).backward()
    return value.detach(), finalize_metrics(partials, totals), hidden.grad, weight.grad


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
@pytest.mark.parametrize("chunk_tokens", [0, 1, 2, 5, 1000])
def test_value_gradients_and_metrics_match_the_float64_references(loss, aggregation, divisor, chunk_tokens):
    temperature = 0.7 if chunk_tokens % 2 else 1.0
    # a seed per case that does not change with PYTHONHASHSEED (hash() of strings does)
    seed = zlib.crc32(repr((loss, aggregation, divisor)).encode()) % 1000
    step, hidden, weight, labels, group_index, totals = _case(seed)
    value, metrics, grad_h, grad_w = _fused(
        step, hidden, weight, labels, group_index, totals, scale=2.5, loss=loss, aggregation=aggregation,
        divisor=divisor, metrics="with_entropy", temperature=temperature, chunk_tokens=chunk_tokens,
    )

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    ref_lp, ref_entropy = ref_head(h, w, labels, temperature)
    ref_value = ref_loss(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], step["group"], loss=loss,
                         aggregation=aggregation, divisor=divisor, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    (ref_value * 2.5).backward()

    assert value.dtype == F64 and grad_h.dtype == F64 and grad_w.dtype == F64
    assert rel_err(value, ref_value) <= 1e-12
    assert rel_err(grad_h, h.grad) <= 1e-10
    assert rel_err(grad_w, w.grad) <= 1e-10
    assert h.grad.abs().max() > 0  # the case has unclipped tokens: the comparison is not 0 == 0
    expected = ref_metrics(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], loss=loss,
                           eps_low=EPS_LOW, eps_high=EPS_HIGH, entropy=ref_entropy)
    for name, want in expected.items():
        assert metrics[name].item() == pytest.approx(want, rel=1e-10, abs=1e-13), name


class _OpCounter(TorchDispatchMode):
    """Records the largest tensor any op produces, the FLOPs of the matrix products, and how many
    logits buffers (``[*, vocab]`` or ``[vocab, *]`` made by ``mm``; the weight's gradient is summed
    in place by ``addmm_``) were alive at once."""

    def __init__(self, vocab: int = -1):
        super().__init__()
        self.largest = 0
        self.matmul_flops = 0
        self.vocab = vocab
        self.logits = []  # weak references to the [*, vocab] products
        self.most_logits_alive = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in ("mm", "addmm", "addmm_"):
            a, b = (args[1], args[2]) if name.startswith("addmm") else (args[0], args[1])
            self.matmul_flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            if name == "mm" and self.vocab in out.shape:
                self.logits = [ref for ref in self.logits if ref() is not None] + [weakref.ref(out)]
                self.most_logits_alive = max(self.most_logits_alive, len(self.logits))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("loss", LOSSES)
def test_large_logits_and_entropy_summed_in_blocks_match_the_float64_references(loss, monkeypatch):
    # every logit raised by 1000 (a constant input feature): the softmax is unchanged, but exp()
    # overflows float64 unless it is shifted by the maximum; 64-element blocks over chunks of <= 5
    # tokens: the entropy is summed over 4 blocks of V = 40
    monkeypatch.setattr(fused_head, "ENTROPY_BLOCK_ELEMENTS", 64)
    step, hidden, weight, labels, group_index, totals = _case(17)
    hidden = torch.cat([hidden, torch.ones_like(hidden[:, :1])], 1)  # [N, H + 1]
    weight = torch.cat([weight, torch.full_like(weight[:, :1], 1000.0)], 1)  # [V, H + 1]
    assert torch.exp(hidden @ weight.T).isinf().all()
    value, metrics, grad_h, grad_w = _fused(step, hidden, weight, labels, group_index, totals, loss=loss,
                                            metrics="with_entropy", chunk_tokens=5)

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    ref_lp, ref_entropy = ref_head(h, w, labels)
    ref_value = ref_loss(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], step["group"], loss=loss,
                         aggregation="token_mean", eps_low=EPS_LOW, eps_high=EPS_HIGH)
    ref_value.backward()
    assert h.grad.abs().max() > 0 and rel_err(value, ref_value) <= 1e-12
    assert rel_err(grad_h, h.grad) <= 1e-10 and rel_err(grad_w, w.grad) <= 1e-10
    expected = ref_metrics(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], loss=loss,
                           eps_low=EPS_LOW, eps_high=EPS_HIGH, entropy=ref_entropy)
    assert metrics["entropy"].item() == pytest.approx(expected["entropy"], rel=1e-10)
    assert metrics["new_logprobs"].item() == pytest.approx(expected["new_logprobs"], rel=1e-12)


@pytest.mark.parametrize("loss", LOSSES)
def test_at_most_a_chunk_of_logits_exists_and_labelled_rows_are_scored_once(loss):
    vocab, chunk = 500, 4
    step, hidden, weight, labels, group_index, totals = _case(3, num_docs=24, max_len=4, vocab=vocab)
    n = labels.numel()
    labelled = int((step["mask"] > 0).sum())
    assert labelled < n and n * vocab > 8 * max(chunk * vocab, vocab * H)
    with _OpCounter(vocab) as counter:
        _fused(step, hidden, weight, labels, group_index, totals, loss=loss, metrics="with_entropy",
               chunk_tokens=chunk)
    # the largest tensors: one chunk of logits, or the head weight and its gradient
    assert counter.largest <= max(chunk * vocab, vocab * H, n * H)
    # logits, P @ W and P.T @ h once per labelled row (documents of <= 4 tokens fit one chunk)
    assert counter.matmul_flops == 6 * labelled * H * vocab
    assert counter.most_logits_alive == 1


@pytest.mark.parametrize(("vocab", "device", "expected"), [
    (32000, "cpu", 512),  # 2**24 // 32000 = 524 -> the multiple of 16 below
    (100000, "cpu", 160),  # 167 -> 160
    (152064, "cpu", 128),  # 110 -> 96, raised to the minimum
    (152064, "cuda", 1760),  # 2**28 // 152064 = 1765 -> 1760
    (32000, "mps", 512),  # other devices take the CPU's budget
])
def test_auto_chunk_tokens_fills_the_device_budget_in_multiples_of_16(vocab, device, expected):
    assert auto_chunk_tokens(vocab, device) == expected


def test_auto_chunks_keep_the_bound_and_equal_the_explicit_chunk(monkeypatch):
    vocab = 500
    monkeypatch.setitem(lm_head.AUTO_CHUNK_LOGITS, "cpu", 16 * vocab + 15)  # "auto" = 16 tokens
    monkeypatch.setattr(lm_head, "AUTO_CHUNK_MIN_TOKENS", 16)
    step, hidden, weight, labels, group_index, totals = _case(3, num_docs=24, max_len=4, vocab=vocab)
    assert int((step["mask"] > 0).sum()) > 2 * 16
    kw = dict(loss="grpo", metrics="with_entropy")
    with _OpCounter() as counter:
        auto = _fused(step, hidden, weight, labels, group_index, totals, chunk_tokens="auto", **kw)
    assert counter.largest <= max(16 * vocab, vocab * H, labels.numel() * H)
    explicit = _fused(step, hidden, weight, labels, group_index, totals, chunk_tokens=16, **kw)
    assert torch.equal(auto[0], explicit[0]) and torch.equal(auto[2], explicit[2]) and torch.equal(auto[3], explicit[3])


def test_a_gspo_document_longer_than_a_chunk_recomputes_all_but_its_last_chunk_within_the_bound():
    vocab, chunk = 300, 2
    step, hidden, weight, labels, group_index, totals = _case(5, num_docs=12, max_len=9, vocab=vocab)
    doc_labelled = Segments.of(step["doc"]).sum((step["mask"] > 0).to(F64))
    recomputed = int((doc_labelled[doc_labelled > chunk] - chunk).sum())
    assert recomputed > 0 and bool(((doc_labelled % chunk) == 1).any())  # some pieces of 1 token
    with _OpCounter(vocab) as counter:
        _fused(step, hidden, weight, labels, group_index, totals, loss="gspo", chunk_tokens=chunk)
    labelled = int(doc_labelled.sum())
    assert counter.matmul_flops == 6 * labelled * H * vocab + 2 * recomputed * H * vocab
    assert counter.largest <= max(chunk * vocab, vocab * H)
    assert counter.most_logits_alive == 1  # each piece's logits are gone before the next piece's exist


def test_bfloat16_inputs_with_the_fp32_head_match_float32_and_return_bfloat16_gradients():
    step, hidden, weight, labels, group_index, totals = _case(11, dtype=torch.bfloat16)
    kw = dict(loss="grpo", aggregation="token_mean", metrics="basic", chunk_tokens=3)
    value16, _, gh16, gw16 = _fused(step, hidden, weight, labels, group_index, totals, fp32=True, **kw)
    value32, _, gh32, gw32 = _fused(step, hidden.float(), weight.float(), labels, group_index, totals, **kw)
    assert gh16.dtype == gw16.dtype == torch.bfloat16 and value16.dtype == torch.float32
    assert rel_err(value16, value32) <= 1e-6
    assert rel_err(gh16, gh32) <= 1e-2 and rel_err(gw16, gw32) <= 1e-2


def test_without_gradients_or_labelled_tokens():
    step, hidden, weight, labels, group_index, totals = _case(13)
    inputs = step_inputs(step, group_index=group_index)
    args = (labels, inputs, totals, LossSpec(), HeadSpec(chunk_tokens=4))
    with_grad, _ = fused_micro_batch_loss(hidden.clone().requires_grad_(True), weight, *args)
    with torch.no_grad():
        without, _ = fused_micro_batch_loss(hidden.clone().requires_grad_(True), weight, *args)
    assert without.grad_fn is None and without.item() == pytest.approx(with_grad.item(), rel=1e-14)

    # a frozen head weight: only the hidden states get a gradient
    h = hidden.clone().requires_grad_(True)
    frozen = weight.clone()
    fused_micro_batch_loss(h, frozen, *args)[0].backward()
    assert frozen.grad is None and h.grad.abs().max() > 0

    # a stand-in micro-batch with no labelled token: zero loss and zero (not missing) gradients
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    nothing = torch.zeros_like(step["mask"])
    value, _ = fused_micro_batch_loss(h, w, labels, replace(inputs, mask=nothing), totals, LossSpec(), HeadSpec())
    value.backward()
    assert value.item() == 0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_invalid_head_arguments_are_named():
    step, hidden, weight, labels, group_index, totals = _case(17)
    args = (step_inputs(step, group_index=group_index), totals, LossSpec())
    for bad in (-1, "all"):
        with pytest.raises(ValueError, match="chunk_tokens"):
            fused_micro_batch_loss(hidden, weight, labels, *args, HeadSpec(chunk_tokens=bad))
    with pytest.raises(ValueError, match="temperature"):
        fused_micro_batch_loss(hidden, weight, labels, *args, HeadSpec(temperature=0.0))
    with pytest.raises(ValueError, match="vocab size"):
        fused_micro_batch_loss(hidden, weight, labels + V, *args, HeadSpec())
