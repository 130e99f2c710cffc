"""The terms under any split of a step into micro-batches: summed losses, their gradients and the
combined metrics equal the whole step's (`policy_loss`) and the float64 reference."""

from __future__ import annotations

import random

import pytest
import torch
from loss_args import loss_spec
from rl_reference import AGGREGATIONS, LOSSES, documents, rel_err
from test_invariance import _micro_batches, _random_pieces
from test_regularizers import library_terms, reference_metrics, run_library, run_reference, terms_step

from rlcli.modules import LossInputs, MetricPartials, Segments, StepTotals, finalize_metrics, micro_batch_loss

TOL = 1e-9

SETTINGS = [
    dict(kl_coef=0.3, estimator="k3", entropy_coef=0.05, mode="truncate", level="token"),
    dict(kl_coef=0.2, estimator="k1", entropy_coef=0.02, mode="mask", level="sequence"),
    dict(kl_coef=0.1, estimator="k2", entropy_coef=0.1, mode="mask", level="geometric"),
    dict(kl_coef=0.5, estimator="k3", mode="truncate", level="geometric"),
    dict(entropy_coef=0.05, mode="truncate", level="sequence"),
    dict(kl_coef=0.3, estimator="k3", ratio_weighted=True, entropy_coef=0.05, mode="mask", level="token"),
]
assert {s["level"] for s in SETTINGS} == {"token", "sequence", "geometric"}


def split_run(step, pieces, *, loss, aggregation, divisor, setting):
    """The step micro-batch by micro-batch with summed totals; loss, metrics and gradients."""
    lp, entropy, old = (step[k].detach().clone().requires_grad_(True) for k in ("lp", "entropy", "old"))
    _, group_index = torch.unique(step["group"], return_inverse=True)
    num_groups = int(group_index.max()) + 1
    index_of_mb = _micro_batches(step, pieces)
    totals = StepTotals.zeros(num_groups)
    for idx in index_of_mb:
        totals = totals + StepTotals.of_tokens(step["mask"][idx], Segments.of(step["doc"][idx]), group_index[idx],
                                               num_groups)
    spec = loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, metrics="with_entropy", eps_low=0.2,
                     eps_high=0.28, **library_terms(**setting))
    total_loss, partials = 0.0, MetricPartials()
    for idx in index_of_mb:
        inputs = LossInputs(proximal_logprobs=old[idx], advantages=step["adv"][idx], mask=step["mask"][idx],
                            document_index=step["doc"][idx], group_index=group_index[idx],
                            reference_logprobs=step["ref"][idx], sampler_logprobs=step["behav"][idx])
        value, part = micro_batch_loss(lp[idx], inputs, totals, spec, entropy=entropy[idx])
        value.backward()  # each micro-batch's own backward, as the trainer does
        total_loss = total_loss + value.detach()
        partials = partials + part
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (lp, entropy, old)]
    return total_loss, finalize_metrics(partials, totals), grads


@pytest.mark.parametrize("setting", SETTINGS, ids=[str(s) for s in SETTINGS])
@pytest.mark.parametrize(("loss", "aggregation", "divisor"),
                         [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS])
def test_random_splits_reproduce_the_whole_step_and_the_reference(loss, aggregation, divisor, setting):
    rng = random.Random(f"{loss}{aggregation}{divisor}{setting}")
    for trial in range(4):
        step = terms_step(300 + trial, num_docs=14, empty_docs=3)
        pieces = _random_pieces(step, rng.randint(1, 8), rng)
        kw = dict(loss=loss, aggregation=aggregation, divisor=divisor, setting=setting)
        value, metrics, (g_lp, g_ent, g_old) = split_run(step, pieces, **kw)
        whole, whole_metrics, w_lp, w_ent, w_old, _ = run_library(step, **kw)
        ref_value, ref_lp, ref_ent, ref_old = run_reference(step, **kw)
        for got in ((value, whole, ref_value), (g_lp, w_lp, ref_lp), (g_ent, w_ent, ref_ent), (g_old, w_old, ref_old)):
            assert rel_err(got[0], got[1]) <= TOL and rel_err(got[0], got[2]) <= TOL
        expected = reference_metrics(step, step["lp"], loss=loss, setting=setting)
        assert set(metrics) == set(whole_metrics) - {"loss"} == set(expected)
        for name, want in expected.items():
            assert torch.isfinite(metrics[name]), name
            assert metrics[name].item() == pytest.approx(whole_metrics[name].item(), rel=TOL, abs=1e-14), name
            assert metrics[name].item() == pytest.approx(want, rel=TOL, abs=1e-13), name


@pytest.mark.parametrize("loss", LOSSES)
def test_a_micro_batch_without_labelled_tokens_leaves_is_weight_max_to_the_others(loss):
    step = terms_step(400, num_docs=10, empty_docs=3)
    docs = documents(step["mask"], step["doc"])
    empty = [d.id for d in docs if not d.labelled]
    rest = [d.id for d in docs if d.labelled]
    setting = SETTINGS[0]
    for pieces in ([empty, rest[:4], rest[4:]], [rest[:4], empty, rest[4:]]):
        _, metrics, _ = split_run(step, pieces, loss=loss, aggregation="sample_mean", divisor=None, setting=setting)
        expected = reference_metrics(step, step["lp"], loss=loss, setting=setting)
        assert metrics["is_weight_max"].item() == expected["is_weight_max"]
