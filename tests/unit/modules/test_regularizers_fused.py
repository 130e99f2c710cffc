"""The terms in the fused head: `fused_micro_batch_loss` with the KL term, the entropy bonus (whose
gradient the head adds) and the correction against the float64 references, within the head's
memory and work bounds; `head_logprobs` gives the fused loss's own log-probs, bit for bit."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import (
    AGGREGATIONS,
    F64,
    LOSSES,
    ref_head,
    ref_loss_with_terms,
    ref_metrics,
    ref_term_metrics,
    rel_err,
)
from test_fused_head import EPS_HIGH, EPS_LOW, H, _case, _OpCounter
from test_regularizers import library_terms, reference_terms

from rlcli.modules import (
    GRPO,
    GSPO,
    Correction,
    HeadSpec,
    KLPenalty,
    LossSpec,
    Segments,
    finalize_metrics,
    fused_head,
    fused_micro_batch_loss,
    head_logprobs,
    lm_head,
)

ALL_TERMS = [
    dict(kl_coef=0.3, estimator="k3", entropy_coef=0.05, mode="truncate", level="token"),
    dict(kl_coef=0.2, estimator="k2", entropy_coef=0.1, mode="mask", level="sequence"),
    dict(kl_coef=0.4, estimator="k1", entropy_coef=0.03, mode="mask", level="geometric"),
    dict(kl_coef=0.3, estimator="k3", ratio_weighted=True, mode="mask", level="token"),
]


def terms_case(seed, **kw):
    """`_case` of test_fused_head plus reference and behaviour log-probs near the head's."""
    step, hidden, weight, labels, group_index, totals = _case(seed, **kw)
    n = labels.numel()
    g = torch.Generator().manual_seed(seed + 99)
    labelled = step["mask"] > 0
    head_lp, _ = ref_head(hidden.to(F64), weight.to(F64), labels)
    step["ref"] = torch.where(labelled, head_lp + 0.4 * torch.randn(n, generator=g, dtype=F64), math.nan)
    step["behav"] = torch.where(labelled, step["old"] + 0.5 * torch.randn(n, generator=g, dtype=F64), -math.inf)
    return step, hidden, weight, labels, group_index, totals


def fused(step, hidden, weight, labels, group_index, totals, *, setting, scale=1.0, temperature=1.0, fp32=False,
          chunk_tokens="auto", **kw):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    options = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH) if isinstance(kw.get("loss", "grpo"), str) else {}
    inputs = step_inputs(step, group_index=group_index, reference_logprobs=step["ref"], sampler_logprobs=step["behav"])
    spec = loss_spec(**library_terms(**setting), **options, **kw)
    head = HeadSpec(temperature=temperature, fp32=fp32, chunk_tokens=chunk_tokens)
    value, partials = fused_micro_batch_loss(hidden, weight, labels, inputs, totals, spec, head)
    (value * scale).backward()
    return value.detach(), finalize_metrics(partials, totals), hidden.grad, weight.grad


def reference(step, hidden, weight, labels, *, loss, aggregation, divisor, temperature, setting, scale=1.0):
    h = hidden.detach().clone().to(F64).requires_grad_(True)
    w = weight.detach().clone().to(F64).requires_grad_(True)
    lp, entropy = ref_head(h, w, labels, temperature)
    value = ref_loss_with_terms(lp, step["old"], step["adv"], step["mask"], step["doc"], step["group"], loss=loss,
                                aggregation=aggregation, divisor=divisor, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                ref=step["ref"], entropy=entropy, behav=step["behav"], **reference_terms(**setting))
    (value * scale).backward()
    ref = reference_terms(**setting)
    metrics = ref_metrics(lp, step["old"], step["adv"], step["mask"], step["doc"], loss=loss, eps_low=EPS_LOW,
                          eps_high=EPS_HIGH, entropy=entropy)
    metrics |= ref_term_metrics(lp, step["old"], step["mask"], step["doc"], ref=step["ref"], behav=step["behav"],
                                mode=ref["mode"], level=ref["level"], low=ref["low"], high=ref["high"])
    return value.detach(), h.grad, w.grad, metrics


@pytest.mark.parametrize("setting", ALL_TERMS, ids=[str(s) for s in ALL_TERMS])
@pytest.mark.parametrize("chunk_tokens", [0, 1, 3, "auto"])
@pytest.mark.parametrize(("loss", "aggregation", "divisor"),
                         [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS])
def test_fused_with_every_term_matches_the_reference(loss, aggregation, divisor, chunk_tokens, setting):
    temperature = 0.7 if chunk_tokens in (1, "auto") else 1.0
    case = terms_case(zlib.crc32(f"{loss}{aggregation}{divisor}".encode()) % 1000)
    step, hidden, weight, labels, _, _ = case
    value, metrics, grad_h, grad_w = fused(*case, setting=setting, scale=2.5, loss=loss, aggregation=aggregation,
                                           divisor=divisor, metrics="with_entropy", temperature=temperature,
                                           chunk_tokens=chunk_tokens)
    ref_value, ref_h, ref_w, expected = reference(step, hidden, weight, labels, loss=loss, aggregation=aggregation,
                                                  divisor=divisor, temperature=temperature, setting=setting, scale=2.5)
    assert rel_err(value, ref_value) <= 1e-12
    assert rel_err(grad_h, ref_h) <= 1e-10 and rel_err(grad_w, ref_w) <= 1e-10
    assert set(metrics) == set(expected)
    for name, want in expected.items():
        assert metrics[name].item() == pytest.approx(want, rel=1e-10, abs=1e-13), name


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("chunk_tokens", [0, 1, 3, "auto"])
def test_the_entropy_bonus_alone_adds_its_gradient_through_the_head(loss, chunk_tokens):
    # advantages 0 and no other term: for grpo the gradient is the entropy bonus's only
    step, hidden, weight, labels, group_index, totals = terms_case(21)
    if loss == "grpo":
        step["adv"] = torch.zeros_like(step["adv"])
    setting = dict(entropy_coef=0.2)
    value, metrics, grad_h, grad_w = fused(step, hidden, weight, labels, group_index, totals, setting=setting,
                                           loss=loss, metrics="basic", temperature=0.8, chunk_tokens=chunk_tokens)
    ref_value, ref_h, ref_w, _ = reference(step, hidden, weight, labels, loss=loss, aggregation="token_mean",
                                           divisor=None, temperature=0.8, setting=setting)
    assert ref_h.abs().max() > 0 and "entropy" not in metrics
    assert rel_err(value, ref_value) <= 1e-12
    assert rel_err(grad_h, ref_h) <= 1e-10 and rel_err(grad_w, ref_w) <= 1e-10


@pytest.mark.parametrize("loss", LOSSES)
def test_with_every_term_one_chunk_of_logits_and_6NHV_stay(loss, monkeypatch):
    vocab, chunk = 500, 4
    # 64-element blocks: the entropy's fold runs over several blocks of each chunk
    monkeypatch.setattr(fused_head, "ENTROPY_BLOCK_ELEMENTS", 64)
    step, hidden, weight, labels, group_index, totals = terms_case(3, num_docs=24, max_len=4, vocab=vocab)
    labelled = int((step["mask"] > 0).sum())
    n = labels.numel()
    with _OpCounter(vocab) as counter:
        value, _, grad_h, _ = fused(step, hidden, weight, labels, group_index, totals, setting=ALL_TERMS[1],
                                    loss=loss, metrics="with_entropy", chunk_tokens=chunk)
    assert counter.largest <= max(chunk * vocab, vocab * H, n * H)
    assert counter.matmul_flops == 6 * labelled * H * vocab
    assert counter.most_logits_alive == 1
    ref_value, ref_h, _, _ = reference(step, hidden, weight, labels, loss=loss, aggregation="token_mean",
                                       divisor=None, temperature=1.0, setting=ALL_TERMS[1])
    assert rel_err(value, ref_value) <= 1e-12 and rel_err(grad_h, ref_h) <= 1e-10


def test_a_long_gspo_document_recomputes_its_pieces_with_the_entropy_gradient():
    vocab, chunk = 300, 2
    step, hidden, weight, labels, group_index, totals = terms_case(5, num_docs=12, max_len=9, vocab=vocab)
    doc_labelled = Segments.of(step["doc"]).sum((step["mask"] > 0).to(F64))
    recomputed = int((doc_labelled[doc_labelled > chunk] - chunk).sum())
    assert recomputed > 0
    with _OpCounter(vocab) as counter:
        value, _, grad_h, grad_w = fused(step, hidden, weight, labels, group_index, totals, setting=ALL_TERMS[0],
                                         loss="gspo", chunk_tokens=chunk, temperature=0.9)
    assert counter.matmul_flops == 6 * int(doc_labelled.sum()) * H * vocab + 2 * recomputed * H * vocab
    assert counter.most_logits_alive == 1
    ref_value, ref_h, ref_w, _ = reference(step, hidden, weight, labels, loss="gspo", aggregation="token_mean",
                                           divisor=None, temperature=0.9, setting=ALL_TERMS[0])
    assert rel_err(value, ref_value) <= 1e-12
    assert rel_err(grad_h, ref_h) <= 1e-10 and rel_err(grad_w, ref_w) <= 1e-10


def test_float32_and_bfloat16_heads_with_every_term_are_finite_and_close():
    step, hidden, weight, labels, group_index, totals = terms_case(11)
    setting = ALL_TERMS[0]
    kw = dict(loss="grpo", metrics="with_entropy", chunk_tokens=3)
    v64, m64, h64, w64 = fused(step, hidden, weight, labels, group_index, totals, setting=setting, **kw)
    v32, m32, h32, w32 = fused(step, hidden.float(), weight.float(), labels, group_index, totals, setting=setting,
                               **kw)
    v16, _, h16, w16 = fused(step, hidden.bfloat16(), weight.bfloat16(), labels, group_index, totals,
                             setting=setting, fp32=True, **kw)
    assert v32.dtype == torch.float32 and h16.dtype == torch.bfloat16
    assert rel_err(v32, v64) <= 1e-5 and rel_err(h32, h64) <= 1e-4 and rel_err(w32, w64) <= 1e-4
    assert torch.isfinite(v16) and torch.isfinite(h16).all() and torch.isfinite(w16).all()
    for name in m64:
        assert m32[name].item() == pytest.approx(m64[name].item(), rel=1e-4, abs=1e-6), name


def test_extreme_log_ratios_in_the_fused_head_are_finite():
    step, hidden, weight, labels, group_index, totals = terms_case(12)
    labelled = torch.nonzero((step["mask"] > 0) & (labels >= 0)).flatten()
    head_lp, _ = ref_head(hidden, weight, labels)
    for i, (mismatch, kl_delta) in enumerate([(800.0, 80.0), (-800.0, -80.0)]):
        t = labelled[2 * i]
        step["behav"][t] = step["old"][t] - mismatch
        step["ref"][t] = head_lp[t] + kl_delta
    for dtype in (F64, torch.float32):
        for setting in ALL_TERMS:
            value, metrics, grad_h, grad_w = fused(step, hidden.to(dtype), weight.to(dtype), labels, group_index,
                                                   totals, setting=setting, loss="gspo", chunk_tokens=3)
            assert torch.isfinite(value) and torch.isfinite(grad_h).all() and torch.isfinite(grad_w).all()
            assert all(torch.isfinite(v) for v in metrics.values())


def test_fused_term_errors_are_named():
    step, hidden, weight, labels, group_index, totals = terms_case(13)
    inputs = step_inputs(step, group_index=group_index)

    def call(inputs=inputs, **spec):
        return fused_micro_batch_loss(hidden, weight, labels, inputs, totals, LossSpec(**spec), HeadSpec())

    with pytest.raises(ValueError, match=r"^kl.coef = 0.1 > 0 needs reference_logprobs$"):
        call(kl=KLPenalty(coef=0.1))
    with pytest.raises(ValueError, match=r"^correction mode 'mask' needs sampler_logprobs$"):
        call(correction=Correction(mode="mask"))
    with pytest.raises(ValueError, match=r"^entropy_coef must be"):
        call(entropy_coef=-0.5)
    with pytest.raises(ValueError, match=r"^reference_logprobs must have the shape of proximal_logprobs"):
        call(replace(inputs, reference_logprobs=step["ref"][:-1]))
    with pytest.raises(ValueError, match=r"^the inputs must have the shape of labels"):
        call(inputs.select(torch.arange(labels.numel() - 1)))
    # the fused head computes the entropy itself: the bonus needs no entropy argument
    call(entropy_coef=0.5)


# --------------------------------------------------------------------------------------------
# head_logprobs: the fused loss's own log-probs, bit for bit
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CaptureGRPO(GRPO):
    """grpo that keeps the log-probs it is given (a test's loss, passed as an instance)."""

    seen: ClassVar[list] = []

    def per_token(self, logprobs, inputs):
        self.seen.append(logprobs.detach().clone())
        return super().per_token(logprobs, inputs)


@dataclass(frozen=True)
class _CaptureGSPO(GSPO):
    seen: ClassVar[list] = []

    def per_token(self, logprobs, inputs):
        self.seen.append(logprobs.detach().clone())
        return super().per_token(logprobs, inputs)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capture", [_CaptureGRPO, _CaptureGSPO])
@pytest.mark.parametrize("chunk_tokens", [0, 1, 3, 5, "auto"])
def test_head_logprobs_are_the_fused_losses_own_bit_for_bit(capture, chunk_tokens, dtype, monkeypatch):
    monkeypatch.setattr(fused_head, "ENTROPY_BLOCK_ELEMENTS", 64)  # several exp blocks per chunk
    step, hidden, weight, labels, group_index, totals = terms_case(30, vocab=53)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    fp32 = dtype == torch.bfloat16
    head = dict(temperature=0.7, fp32=fp32, chunk_tokens=chunk_tokens)
    scored = head_logprobs(hidden, weight, labels, step["mask"], step["doc"], LossSpec(capture()), HeadSpec(**head))
    assert scored.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.all(scored[(step["mask"] == 0) | (labels < 0)] == 0)
    for metrics, setting in (("basic", {}), ("with_entropy", {}), ("none", dict(entropy_coef=0.1))):
        capture.seen.clear()
        fused(step, hidden, weight, labels, group_index, totals, setting=setting, loss=capture(), metrics=metrics,
              **head)
        internal = capture.seen[-1]  # the last call scores the whole micro-batch
        assert internal.shape == scored.shape and torch.equal(internal, scored), (metrics, setting)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_proximal_and_reference_log_probs_from_head_logprobs_give_ratio_1_and_kl_0_exactly(loss, dtype):
    step, hidden, weight, labels, group_index, totals = terms_case(31)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    head = dict(temperature=0.9, chunk_tokens=3)
    own = head_logprobs(hidden, weight, labels, step["mask"], step["doc"], LossSpec(loss), HeadSpec(**head))
    step["behav"] = step["old"].clone()  # the sampler's
    step["old"] = own  # the proximal: the trainer's own at the start of the batch
    step["ref"] = own.clone()  # a reference model equal to the policy
    _, metrics, _, _ = fused(step, hidden, weight, labels, group_index, totals, loss=loss, metrics="with_entropy",
                             setting=ALL_TERMS[0], **head)
    assert metrics["kl_ref"].item() == 0 and metrics["kl_new_old"].item() == 0
    units = metrics["num_segments"] if loss == "gspo" else metrics["num_tokens"]
    assert metrics["ratio_new_old_sum"].item() == units.item()
    assert metrics["clipped_ratio_fraction"].item() == 0


def test_head_logprobs_checks_its_arguments():
    step, hidden, weight, labels, _, _ = terms_case(32)
    args = (hidden, weight, labels, step["mask"], step["doc"], LossSpec())
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs(*args, HeadSpec(temperature=0.0))
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_logprobs(*args, HeadSpec(chunk_tokens=-1))
    with pytest.raises(ValueError, match=r"^unknown loss 'ppo'"):
        head_logprobs(hidden, weight, labels, step["mask"], step["doc"], LossSpec("ppo"), HeadSpec())
    with pytest.raises(ValueError, match="labels"):
        head_logprobs(hidden, weight, labels[:-1], step["mask"], step["doc"], LossSpec(), HeadSpec())
    hidden.requires_grad_(True)
    assert head_logprobs(*args, HeadSpec()).grad_fn is None


def test_head_logprobs_with_auto_chunks_equals_the_explicit_chunk(monkeypatch):
    vocab = 500
    monkeypatch.setitem(lm_head.AUTO_CHUNK_LOGITS, "cpu", 16 * vocab + 15)  # "auto" = 16 tokens
    monkeypatch.setattr(lm_head, "AUTO_CHUNK_MIN_TOKENS", 16)
    step, hidden, weight, labels, _, _ = terms_case(3, num_docs=24, max_len=4, vocab=vocab)
    args = (hidden, weight, labels, step["mask"], step["doc"], LossSpec())
    assert torch.equal(head_logprobs(*args, HeadSpec(chunk_tokens="auto")),
                       head_logprobs(*args, HeadSpec(chunk_tokens=16)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("loss", LOSSES)
def test_on_the_gpu_every_term_matches_float64_and_head_logprobs_are_bitwise(loss):
    cuda = torch.device("cuda")
    step, hidden, weight, labels, group_index, totals = terms_case(40, num_docs=30, max_len=20, vocab=3000)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    setting = ALL_TERMS[0]
    to = {k: (v.to(cuda) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
    totals_ = type(totals)(*(t.to(cuda) for t in (totals.documents, totals.tokens, totals.group_documents,
                                                   totals.group_tokens)))
    kw = dict(loss=loss, metrics="with_entropy", temperature=0.8, fp32=True, chunk_tokens=16)
    value, metrics, grad_h, grad_w = fused(to, hidden.to(cuda), weight.to(cuda), labels.to(cuda),
                                           group_index.to(cuda), totals_, setting=setting, **kw)
    ref_value, ref_h, ref_w, expected = reference(step, hidden, weight, labels, loss=loss, aggregation="token_mean",
                                                  divisor=None, temperature=0.8, setting=setting)
    assert grad_h.dtype == torch.bfloat16
    assert rel_err(value.cpu().to(F64), ref_value) <= 1e-5
    assert rel_err(grad_h.cpu().to(F64), ref_h) <= 1e-2 and rel_err(grad_w.cpu().to(F64), ref_w) <= 1e-2
    for name, want in expected.items():
        assert metrics[name].item() == pytest.approx(want, rel=1e-4, abs=1e-5), name
    # the trainer's proximal log-probs: ratio 1 and kl_ref 0 exactly on the GPU too
    own = head_logprobs(hidden.to(cuda), weight.to(cuda), labels.to(cuda), to["mask"], to["doc"], LossSpec(loss),
                        HeadSpec(temperature=0.8, fp32=True, chunk_tokens=16))
    to["behav"], to["old"], to["ref"] = to["old"], own, own.clone()
    _, metrics, _, _ = fused(to, hidden.to(cuda), weight.to(cuda), labels.to(cuda), group_index.to(cuda), totals_,
                             setting=setting, **kw)
    assert metrics["kl_ref"].item() == 0 and metrics["kl_new_old"].item() == 0
