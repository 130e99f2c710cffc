"""``correction.mode=reject`` (math.md#mismatch-correction) through `policy_loss` and `micro_batch_loss`: the
rejected tokens and documents leave the mask and every count, checked by hand on a tiny step and against the
float64 reference of ``reject_reference.py`` (loss, gradients, counts, metrics) at each level and aggregation,
whole and under random splits into 1–8 micro-batches.

How they fail when broken: weighting the rejected tokens by 0 instead of taking them out of the mask (as `mask`
does) keeps them in T and n_d; counting a rejected document in D or P (as `StepTotals` does for a document with
no labelled token) changes sample_mean, prompt_mean and constant; a level that reads the wrong ratio rejects
other tokens than the reference."""

from __future__ import annotations

import random

import pytest
import torch
from loss_args import loss_spec
from reject_reference import ref_counts, ref_kept, ref_kept_mismatch_kl, ref_reject_loss
from rl_reference import AGGREGATIONS, F64, LOSSES, documents, rel_err
from test_invariance import _micro_batches, _random_pieces
from test_regularizers import terms_step

from rlcli.modules import (
    CORRECTION_MODES,
    Correction,
    KLPenalty,
    LossInputs,
    MetricPartials,
    StepTotals,
    finalize_metrics,
    micro_batch_loss,
    policy_loss,
    reject_tokens,
)

TOL = 1e-10
LEVELS = ("token", "sequence", "geometric")
# the bounds of each level on `terms_step` (behaviour std 0.5): some tokens or documents rejected, most kept
BOUNDS = {"token": (0.6, 1.5), "sequence": (0.3, 3.0), "geometric": (0.75, 1.3)}
TERMS = dict(kl=KLPenalty(coef=0.3, estimator="k2"), entropy_coef=0.05)


def _inputs(step, lp_leaf=None, old_leaf=None, rows=slice(None)):
    return LossInputs(proximal_logprobs=(step["old"] if old_leaf is None else old_leaf)[rows],
                      advantages=step["adv"][rows], mask=step["mask"][rows], document_index=step["doc"][rows],
                      group_index=step["group"][rows], reference_logprobs=step["ref"][rows],
                      sampler_logprobs=step["behav"][rows])


def _spec(loss, aggregation, divisor, level, metrics="basic"):
    low, high = BOUNDS[level]
    return loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, metrics=metrics, eps_low=0.2, eps_high=0.28,
                     correction=Correction(mode="reject", level=level, low=low, high=high), **TERMS)


def _reference(step, loss, aggregation, divisor, level):
    lp, old, entropy = (step[k].clone().requires_grad_(True) for k in ("lp", "old", "entropy"))
    low, high = BOUNDS[level]
    value = ref_reject_loss(lp, old, step["behav"], step["adv"], step["mask"], step["doc"], step["group"], loss=loss,
                            aggregation=aggregation, divisor=divisor, level=level, low=low, high=high, eps_low=0.2,
                            eps_high=0.28, ref=step["ref"], kl_coef=0.3, estimator="k2", entropy=entropy,
                            entropy_coef=0.05)
    value.backward()
    return value.detach(), [torch.zeros_like(t) if t.grad is None else t.grad for t in (lp, old, entropy)]


def test_reject_is_a_correction_mode():
    assert "reject" in CORRECTION_MODES.names()


@pytest.mark.parametrize(("level", "aggregation", "expected"), [
    # doc a: 3 labelled tokens, ρ = 1, 3, 1, A = 1; doc b: 1 token, ρ = 1, A = 2; ratio 1 everywhere, bounds [0.5, 2]
    ("token", "token_mean", -(1 + 1 + 2) / 3),  # T = 3, not 4: the ρ = 3 token leaves T
    ("token", "sample_mean", -(2 / 2 + 2 / 1) / 2),  # n_a = 2, not 3
    ("sequence", "token_mean", -2 / 1),  # ρ_a = 3: document a leaves T and D
    ("sequence", "sample_mean", -2 / 1),  # D = 1
    ("geometric", "token_mean", -(3 + 2) / 4),  # ρ_a = 3^(1/3) ≈ 1.44 is kept: nothing rejected
])
def test_reject_drops_the_rejected_tokens_from_T_and_n_d_by_hand(level, aggregation, expected):
    log3 = torch.log(torch.tensor(3.0, dtype=F64)).item()
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=F64, requires_grad=True)
    inputs = LossInputs(proximal_logprobs=lp.detach(), advantages=torch.tensor([1.0, 1.0, 1.0, 2.0], dtype=F64),
                        mask=torch.ones(4, dtype=F64), document_index=torch.tensor([0, 0, 0, 1]),
                        group_index=torch.tensor([0, 0, 0, 1]),
                        sampler_logprobs=torch.tensor([-1.0, -1.0 - log3, -1.0, -1.0], dtype=F64))
    spec = loss_spec(loss="grpo", aggregation=aggregation, correction=Correction(mode="reject", level=level))
    value, metrics = policy_loss(lp, inputs, spec)
    assert value.item() == pytest.approx(expected, rel=1e-12)
    counts = {("token", "token_mean"): (3, 2), ("token", "sample_mean"): (3, 2), ("sequence", "token_mean"): (1, 1),
              ("sequence", "sample_mean"): (1, 1), ("geometric", "token_mean"): (4, 2)}[level, aggregation]
    assert (metrics["num_tokens"].item(), metrics["num_documents"].item()) == counts
    # `mask` keeps the rejected token in T and weighs it by 0: -(1 + 1 + 2) / 4 at the token level
    masked = loss_spec(loss="grpo", aggregation="token_mean", correction=Correction(mode="mask", level="token"))
    assert policy_loss(lp, inputs, masked)[0].item() == pytest.approx(-1.0, rel=1e-12)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("loss", "aggregation", "divisor"),
                         [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS])
def test_reject_loss_gradients_and_counts_equal_the_reference(loss, aggregation, divisor, level):
    for seed in range(3):
        step = terms_step(seed)
        low, high = BOUNDS[level]
        kept, rejected = ref_kept(step["old"], step["behav"], step["mask"], step["doc"], level=level, low=low,
                                  high=high)
        labelled = int((step["mask"] > 0).sum())
        assert 0 < labelled - int(kept.sum()) < labelled / 2  # the case rejects some tokens, keeps most
        if level != "token":
            assert rejected  # and whole documents
        lp, old, entropy = (step[k].clone().requires_grad_(True) for k in ("lp", "old", "entropy"))
        value, metrics = policy_loss(lp, _inputs(step, old_leaf=old), _spec(loss, aggregation, divisor, level),
                                     entropy=entropy)
        value.backward()
        expected, grads = _reference(step, loss, aggregation, divisor, level)
        assert rel_err(value, expected) < TOL
        for got, want in zip((lp.grad, old.grad, entropy.grad), grads):
            assert rel_err(torch.nan_to_num(got), want) < TOL
        counts = ref_counts(kept, rejected, step["doc"], step["group"])
        assert (metrics["num_tokens"].item(), metrics["num_documents"].item()) == (counts["T"], counts["D"])
        assert metrics["mismatch_kl"].item() == pytest.approx(
            ref_kept_mismatch_kl(step["old"], step["behav"], step["mask"], step["doc"], level=level, low=low,
                                 high=high), rel=1e-12)
        assert not {"is_weight_mean", "is_weight_max", "is_masked_fraction"} & set(metrics)  # weight 1: none


@pytest.mark.parametrize("level", LEVELS)
def test_a_group_whose_documents_are_all_rejected_leaves_P(level):
    """prompt_mean's P: with the bounds shut around no ratio every labelled document is rejected but the step's
    documents without a labelled token, which still count (math.md#aggregation)."""
    step = terms_step(0)
    inputs = _inputs(step)
    correction = Correction(mode="reject", level=level, low=5.0, high=6.0)
    kept, rejected = reject_tokens(correction, inputs)
    assert kept.mask.sum() == 0
    totals = StepTotals.of_tokens(kept.mask, kept.segments, inputs.group_index, int(inputs.group_index.max()) + 1,
                                  rejected)
    empty = [d for d in documents(step["mask"], step["doc"], step["group"]) if not d.labelled]
    assert totals.documents.item() == len(empty) == 2
    assert totals.groups.item() == len({d.group for d in empty})
    assert reject_tokens(correction, kept)[0].mask.equal(kept.mask)  # applying it again changes nothing


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("loss", "aggregation", "divisor"),
                         [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS])
def test_random_splits_into_1_to_8_micro_batches_equal_the_reference(loss, aggregation, divisor, level):
    """Each micro-batch rejects its own whole documents and counts its totals; the summed totals and losses
    are the whole step's, as the trainer's batch stage and `plan_update` do."""
    rng = random.Random(f"{loss}{aggregation}{divisor}{level}")
    step = terms_step(1)
    expected, grads = _reference(step, loss, aggregation, divisor, level)
    whole = policy_loss(step["lp"], _inputs(step), _spec(loss, aggregation, divisor, level, "with_entropy"),
                        entropy=step["entropy"])[1]
    del whole["loss"]
    spec = _spec(loss, aggregation, divisor, level, "with_entropy")
    num_groups = int(step["group"].max()) + 1
    for pieces in range(1, 9):
        lp, old, entropy = (step[k].clone().requires_grad_(True) for k in ("lp", "old", "entropy"))
        rows = _micro_batches(step, _random_pieces(step, pieces, rng))
        parts = [reject_tokens(spec.correction, _inputs(step, old_leaf=old, rows=idx)) for idx in rows]
        totals = StepTotals.zeros(num_groups)
        for inputs, rejected in parts:
            totals = totals + StepTotals.of_tokens(inputs.mask, inputs.segments, inputs.group_index, num_groups,
                                                   rejected)
        total, partials = 0.0, MetricPartials()
        for idx, (inputs, _) in zip(rows, parts):
            value, part = micro_batch_loss(lp[idx], inputs, totals, spec, entropy=entropy[idx])
            value.backward()
            total, partials = total + value.detach(), partials + part
        assert rel_err(total, expected) < TOL, pieces
        for got, want in zip((lp.grad, old.grad, entropy.grad), grads):
            assert rel_err(torch.nan_to_num(got), want) < TOL, pieces
        split = finalize_metrics(partials, totals)
        assert split.keys() == whole.keys()
        for name in whole:
            assert split[name].item() == pytest.approx(whole[name].item(), rel=1e-9, abs=1e-12), (pieces, name)
