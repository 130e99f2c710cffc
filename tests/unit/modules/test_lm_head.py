"""``token_logprobs`` (math.md#log-probabilities): chunking, ignored labels, temperature, the fp32 head, and the whole
path hidden/weight -> log-probs -> policy loss against a float64 autograd reference."""

from __future__ import annotations

import pytest
import torch
from loss_args import loss_spec
from rl_reference import AGGREGATIONS, F64, LOSSES, make_step, ref_head, ref_loss, rel_err

from rlcli.modules import HeadSpec, LossInputs, LossSpec, policy_loss, token_logprobs

N, H, V = 24, 16, 50


def _inputs(seed, n=N, h=H, v=V, dtype=torch.float32, scale=1.0, ignored=(3, 10, 11)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=F64)
    weight = torch.randn(v, h, generator=g, dtype=F64) * (scale / h**0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    for i, t in enumerate(ignored):
        labels[t] = -100 if i % 2 == 0 else -1
    return hidden.to(dtype), weight.to(dtype), labels


def _head_and_grads(hidden, weight, labels, coef_lp, coef_ent, **kw):
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    lp, ent = token_logprobs(hidden, weight, labels, HeadSpec(**kw), with_entropy=True)
    (lp.to(F64) @ coef_lp + ent.to(F64) @ coef_ent).backward()
    return lp.detach(), ent.detach(), hidden.grad, weight.grad


def _ref_head_and_grads(hidden, weight, labels, coef_lp, coef_ent, temperature=1.0):
    hidden = hidden.detach().to(F64).requires_grad_(True)
    weight = weight.detach().to(F64).requires_grad_(True)
    lp, ent = ref_head(hidden, weight, labels, temperature)
    (lp @ coef_lp + ent @ coef_ent).backward()
    return lp.detach(), ent.detach(), hidden.grad, weight.grad


def _coefs(seed, n=N):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(n, generator=g, dtype=F64), torch.randn(n, generator=g, dtype=F64)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_unchunked_and_reference(dtype, temperature):
    hidden, weight, labels = _inputs(0, dtype=dtype, scale=3.0)
    coef_lp, coef_ent = _coefs(0)
    ref = _ref_head_and_grads(hidden, weight, labels, coef_lp, coef_ent, temperature)
    full = _head_and_grads(hidden, weight, labels, coef_lp, coef_ent, temperature=temperature)
    out_dtype = F64 if dtype == F64 else torch.float32
    assert full[0].dtype == out_dtype and full[1].dtype == out_dtype
    assert full[2].dtype == dtype and full[3].dtype == dtype
    tol = 1e-12 if dtype == F64 else 1e-5
    names = ("logprobs", "entropy", "grad hidden", "grad weight")
    for name, got, want in zip(names, full, ref):
        assert rel_err(got, want) <= tol, name
    # N = 24: 8 and 1 divide it, 5 and 7 do not, 24 is exactly N, 100 is larger
    for chunk in (1, 5, 7, 8, 24, 100):
        chunked = _head_and_grads(hidden, weight, labels, coef_lp, coef_ent,
                                  temperature=temperature, chunk_tokens=chunk)
        for name, got, want in zip(names, chunked, full):
            assert got.dtype == want.dtype
            assert rel_err(got, want) <= (1e-13 if dtype == F64 else 2e-6), (chunk, name)


@pytest.mark.parametrize("chunk", [0, 5])
def test_ignored_labels_give_zero_and_no_gradient(chunk):
    ignored = (0, 3, 10, 11, 23)
    hidden, weight, labels = _inputs(1, dtype=F64, ignored=ignored)
    coef_lp, coef_ent = _coefs(1)
    lp, ent, g_hidden, g_weight = _head_and_grads(hidden, weight, labels, coef_lp, coef_ent, chunk_tokens=chunk)
    sel = torch.tensor(ignored)
    assert torch.all(lp[sel] == 0) and torch.all(ent[sel] == 0)
    assert torch.all(g_hidden[sel] == 0)
    assert torch.all(lp[labels >= 0] < 0) and torch.all(ent[labels >= 0] > 0)
    # the ignored positions' hidden states do not reach the weight gradient either
    other = hidden.clone()
    other[sel] = 1e3 * torch.randn(len(ignored), H, dtype=F64)
    _, _, g_hidden2, g_weight2 = _head_and_grads(other, weight, labels, coef_lp, coef_ent, chunk_tokens=chunk)
    assert torch.allclose(g_weight2, g_weight, rtol=1e-12, atol=1e-14)
    assert torch.allclose(g_hidden2, g_hidden, rtol=1e-12, atol=1e-14)


def test_all_labels_ignored():
    hidden, weight, labels = _inputs(2, n=6, dtype=torch.float32, ignored=range(6))
    coef_lp, coef_ent = _coefs(2, n=6)
    for chunk in (0, 4):
        lp, ent, g_hidden, g_weight = _head_and_grads(hidden, weight, labels, coef_lp, coef_ent, chunk_tokens=chunk)
        for t in (lp, ent, g_hidden, g_weight):
            assert torch.all(t == 0)


def test_without_entropy_returns_none_and_same_logprobs():
    hidden, weight, labels = _inputs(3)
    lp, ent = token_logprobs(hidden, weight, labels, HeadSpec(chunk_tokens=7))
    lp2, _ = token_logprobs(hidden, weight, labels, HeadSpec(chunk_tokens=7), with_entropy=True)
    assert ent is None
    assert torch.equal(lp, lp2)


# --------------------------------------------------------------------------------------------
# fp32 head with bfloat16 inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 7])
def test_fp32_head_is_closer_to_float64_than_bf16(chunk):
    hidden, weight, labels = _inputs(4, n=32, h=64, v=200, dtype=torch.bfloat16, scale=4.0)
    coef_lp, coef_ent = _coefs(4, n=32)
    ref = _ref_head_and_grads(hidden, weight, labels, coef_lp, coef_ent)
    errors = {}
    for fp32 in (True, False):
        out = _head_and_grads(hidden, weight, labels, coef_lp, coef_ent, fp32=fp32, chunk_tokens=chunk)
        assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
        assert out[2].dtype == torch.bfloat16 and out[3].dtype == torch.bfloat16
        errors[fp32] = [rel_err(got, want) for got, want in zip(out, ref)]
    names = ("logprobs", "entropy", "grad hidden", "grad weight")
    for name, with_fp32, without in zip(names, errors[True], errors[False]):
        assert with_fp32 < without, (name, with_fp32, without)
    # with the fp32 head the only bf16 rounding left is the final cast of the gradients
    assert errors[True][0] <= 1e-6 and errors[True][1] <= 1e-6
    assert errors[True][2] <= 8e-3 and errors[True][3] <= 8e-3


def test_fp32_flag_is_a_no_op_for_float32():
    hidden, weight, labels = _inputs(5)
    coef_lp, coef_ent = _coefs(5)
    a = _head_and_grads(hidden, weight, labels, coef_lp, coef_ent, fp32=True)
    b = _head_and_grads(hidden, weight, labels, coef_lp, coef_ent, fp32=False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# --------------------------------------------------------------------------------------------
# temperature: on-policy data scored at the sampler's temperature has ratio 1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_sampler_temperature_gives_ratio_one(loss, temperature):
    step = make_step(8, num_docs=6, max_len=8)
    n = step["mask"].numel()
    hidden, weight, labels = _inputs(8, n=n, dtype=F64, scale=3.0, ignored=())
    labels = torch.where(step["mask"] > 0, labels, torch.full_like(labels, -100))
    with torch.no_grad():
        old, _ = ref_head(hidden, weight, labels, temperature)  # the sampler's log-probs, float64
    old32 = old.float()
    ratios = {}
    for scored_at in (temperature, 1.0):
        lp, _ = token_logprobs(hidden.float(), weight.float(), labels, HeadSpec(temperature=scored_at, chunk_tokens=5))
        inputs = LossInputs(proximal_logprobs=old32, advantages=step["adv"].float(), mask=step["mask"],
                            document_index=step["doc"])
        _, m = policy_loss(lp, inputs, LossSpec(loss))
        ratios[scored_at] = (m["ratio_new_old"].item(), m["kl_new_old"].item())
    labelled_docs = len({d for d, m in zip(step["doc"].tolist(), step["mask"].tolist()) if m})
    expected_ratio = labelled_docs / len(set(step["doc"].tolist()))  # μ(1): documents with labels / D
    ratio, kl = ratios[temperature]
    assert ratio == pytest.approx(expected_ratio, abs=1e-6)
    assert abs(kl) <= 1e-6
    ratio1, kl1 = ratios[1.0]
    assert abs(ratio1 - expected_ratio) > 1e-3 and kl1 > 1e-4


# --------------------------------------------------------------------------------------------
# end to end: hidden/weight -> token_logprobs -> policy_loss, float32 vs float64 autograd
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_end_to_end_gradients_match_float64_reference(loss, aggregation, divisor, chunk):
    step = make_step(9, num_docs=10, max_len=7)
    n = step["mask"].numel()
    hidden, weight, labels = _inputs(9, n=n, dtype=torch.float32, scale=3.0, ignored=())
    # masked tokens: some carry a label (prompt tokens), some have none
    no_label = (step["mask"] == 0) & (torch.arange(n) % 2 == 0)
    labels = torch.where(no_label, torch.full_like(labels, -100), labels)
    with torch.no_grad():
        lp64, _ = ref_head(hidden.to(F64), weight.to(F64), labels)
    g = torch.Generator().manual_seed(99)
    old32 = (lp64 + 0.3 * torch.randn(n, generator=g, dtype=F64)).float()
    adv32 = step["adv"].float()
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor, eps_low=0.2, eps_high=0.28)

    h32 = hidden.clone().requires_grad_(True)
    w32 = weight.clone().requires_grad_(True)
    lp, _ = token_logprobs(h32, w32, labels, HeadSpec(chunk_tokens=chunk))
    inputs = LossInputs(proximal_logprobs=old32, advantages=adv32, mask=step["mask"], document_index=step["doc"],
                        group_index=step["group"])
    value, _ = policy_loss(lp, inputs, loss_spec(**kw))
    value.backward()

    h64 = hidden.to(F64).requires_grad_(True)
    w64 = weight.to(F64).requires_grad_(True)
    ref_lp, _ = ref_head(h64, w64, labels)
    ref_value = ref_loss(ref_lp, old32.to(F64), adv32.to(F64), step["mask"], step["doc"], step["group"], **kw)
    ref_value.backward()

    assert value.dtype == torch.float32
    assert h32.grad.dtype == torch.float32 and w32.grad.dtype == torch.float32
    assert rel_err(value, ref_value) <= 1e-5
    assert rel_err(h32.grad, h64.grad) <= 1e-5
    assert rel_err(w32.grad, w64.grad) <= 1e-5
    assert h64.grad.norm() > 0 and w64.grad.norm() > 0
