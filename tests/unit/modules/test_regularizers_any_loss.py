"""The terms are loss-agnostic: for every registered loss (whatever registered it), the KL and entropy
terms add exactly their reference part to the loss's own value and gradient, a mask that keeps every
token weighs it by ρ (and changes nothing at ρ = 1), one that drops every token leaves only those terms,
and the fused head with every term equals `token_logprobs` + `policy_loss`."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from loss_args import step_inputs
from rl_reference import AGGREGATIONS, F64, documents, ref_document_weights, ref_kl_term, rel_err
from test_loss_registry import _case
from test_regularizers import terms_step

from rlcli.modules import (
    LOSSES,
    Correction,
    HeadSpec,
    KLPenalty,
    LossSpec,
    finalize_metrics,
    fused_micro_batch_loss,
    policy_loss,
    token_logprobs,
)

ALL_LOSSES = sorted(LOSSES)
TOL = 1e-10


def _loss_and_grads(step, *, loss, aggregation, divisor, **terms):
    lp, entropy = (step[k].detach().clone().requires_grad_(True) for k in ("lp", "entropy"))
    inputs = step_inputs(step, reference_logprobs=step["ref"], sampler_logprobs=step["behav"])
    spec = LossSpec(loss, aggregation=aggregation, divisor=divisor, metrics="with_entropy", **terms)
    value, metrics = policy_loss(lp, inputs, spec, entropy=entropy)
    value.backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (lp, entropy)]
    return value.detach(), metrics, *grads


def _kl_and_entropy_reference(step, *, aggregation, divisor, beta, estimator, coef):
    """``Σ_t w_t (β k_t − c H_t)`` and its gradients w.r.t. lp and entropy."""
    lp, entropy = (step[k].detach().clone().requires_grad_(True) for k in ("lp", "entropy"))
    docs = documents(step["mask"], step["doc"], step["group"])
    total = torch.where(step["mask"] > 0, lp, 0.0).sum() * 0.0
    for d, w in zip(docs, ref_document_weights(docs, aggregation=aggregation, divisor=divisor)):
        for t in d.labelled:
            total = total + w * (beta * ref_kl_term(step["ref"][t] - lp[t], estimator) - coef * entropy[t])
    total.backward()
    return total.detach(), lp.grad, entropy.grad


@pytest.mark.parametrize("loss", ALL_LOSSES)
@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_the_kl_and_entropy_terms_add_their_reference_part_to_any_loss(loss, aggregation, divisor):
    step = terms_step(50)
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor)
    base, base_metrics, base_lp, _ = _loss_and_grads(step, **kw)
    for estimator in ("k1", "k2", "k3"):
        value, metrics, g_lp, g_ent = _loss_and_grads(step, kl=KLPenalty(coef=0.3, estimator=estimator),
                                                      entropy_coef=0.07, **kw)
        part, part_lp, part_ent = _kl_and_entropy_reference(step, aggregation=aggregation, divisor=divisor,
                                                            beta=0.3, estimator=estimator, coef=0.07)
        assert rel_err(value - base, part) <= TOL
        assert rel_err(g_lp - base_lp, part_lp) <= 1e-9 and rel_err(g_ent, part_ent) <= TOL
        assert {k: v for k, v in metrics.items() if k != "loss"} == {k: v for k, v in base_metrics.items()
                                                                     if k != "loss"}


@pytest.mark.parametrize("loss", ALL_LOSSES)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_a_correction_that_keeps_or_drops_every_token_for_any_loss(loss, level):
    step = terms_step(51)
    kw = dict(loss=loss, aggregation="sample_mean", divisor=None, kl=KLPenalty(coef=0.2), entropy_coef=0.05)
    off, _, off_lp, off_ent = _loss_and_grads(step, **kw)
    # ρ = 1 for every token (behav = prox): the IcePop mask keeps them all with weight ρ = 1
    on_policy = dict(step, behav=torch.where(step["mask"] > 0, step["old"], -math.inf))
    keep = Correction(mode="mask", level=level, low=0.5, high=2.0)
    kept, metrics, kept_lp, kept_ent = _loss_and_grads(on_policy, correction=keep, **kw)
    assert torch.equal(kept, off) and torch.equal(kept_lp, off_lp) and torch.equal(kept_ent, off_ent)
    assert metrics["is_masked_fraction"].item() == 0 and metrics["is_weight_max"].item() == 1
    # a band that keeps every token weighs each by ρ, as truncate does below its (unreached) cap
    wide, metrics, wide_lp, _ = _loss_and_grads(step, correction=replace(keep, low=1e-300, high=1e300), **kw)
    capped, _, capped_lp, _ = _loss_and_grads(step, correction=Correction(mode="truncate", level=level, high=1e300),
                                              **kw)
    assert torch.equal(wide, capped) and torch.equal(wide_lp, capped_lp) and not torch.equal(wide, off)
    assert metrics["is_masked_fraction"].item() == 0 and metrics["is_weight_max"].item() != 1
    step["behav"] = step["old"] + 1000.0  # ρ = e^-1000 for every token: all dropped
    dropped, metrics, drop_lp, _ = _loss_and_grads(step, correction=Correction(mode="mask", level=level), **kw)
    part, part_lp, _ = _kl_and_entropy_reference(step, aggregation="sample_mean", divisor=None, beta=0.2,
                                                 estimator="k3", coef=0.05)
    assert rel_err(dropped, part) <= TOL and rel_err(drop_lp, part_lp) <= TOL
    assert metrics["is_weight_mean"].item() == 0 and math.isfinite(metrics["mismatch_kl"].item())
    labelled_docs = sum(1 for d in documents(step["mask"], step["doc"]) if d.labelled)
    assert metrics["is_masked_fraction"].item() == pytest.approx(labelled_docs / metrics["num_documents"].item())


@pytest.mark.parametrize("loss", ALL_LOSSES)
@pytest.mark.parametrize("chunk_tokens", [0, 3])
def test_the_fused_head_with_every_term_equals_token_logprobs_and_policy_loss_for_any_loss(loss, chunk_tokens):
    step = _case(52)
    n = step["mask"].numel()
    g = torch.Generator().manual_seed(52)
    labelled = step["mask"] > 0
    ref = torch.where(labelled, step["lp"] + 0.3 * torch.randn(n, generator=g, dtype=F64), math.nan)
    behav = torch.where(labelled, step["old"] + 0.4 * torch.randn(n, generator=g, dtype=F64), -math.inf)
    spec = LossSpec(loss, metrics="with_entropy", kl=KLPenalty(coef=0.25), entropy_coef=0.08,
                    correction=Correction(mode="truncate", level="geometric", high=1.2))
    head = HeadSpec(temperature=0.8, chunk_tokens=chunk_tokens)
    inputs = step_inputs(step, group_index=step["group_index"], reference_logprobs=ref, sampler_logprobs=behav)

    h, w = (step[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
    value, partials = fused_micro_batch_loss(h, w, step["labels"], inputs, step["totals"], spec, head)
    value.backward()

    h2, w2 = (step[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
    lp, entropy = token_logprobs(h2, w2, step["labels"], head, with_entropy=True)
    expected, metrics = policy_loss(lp, replace(inputs, group_index=step["group"]), spec, entropy=entropy)
    expected.backward()
    assert rel_err(value, expected) <= 1e-12
    assert rel_err(h.grad, h2.grad) <= TOL and rel_err(w.grad, w2.grad) <= TOL
    fused_metrics = finalize_metrics(partials, step["totals"])
    assert set(fused_metrics) == set(metrics) - {"loss"}
    for name, want in metrics.items():
        if name != "loss":
            assert fused_metrics[name].item() == pytest.approx(want.item(), rel=TOL, abs=1e-13), name
