"""The terms added to any policy loss (KL to a reference, entropy bonus, mismatch correction) through
`policy_loss`: value, gradients and metrics against the float64 references of ``rl_reference.py``,
the options and their errors, masked and extreme values."""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import (
    AGGREGATIONS,
    F64,
    LOSSES,
    METRIC_LOG_RATIO_MAX,
    documents,
    make_step,
    ref_importance_weights,
    ref_loss_with_terms,
    ref_metrics,
    ref_term_metrics,
    rel_err,
)

from rlcli.modules import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    KL_ESTIMATORS,
    Correction,
    KLPenalty,
    LossInputs,
    LossSpec,
    Segments,
    StepTotals,
    micro_batch_loss,
    policy_loss,
)

TOL = 1e-10
EPS_LOW, EPS_HIGH = 0.2, 0.28
LOW, HIGH = 0.6, 1.5  # ρ band of the correction in these tests

# term settings, in the reference's words
TERM_SETS = {
    "off": dict(),
    "kl": dict(kl_coef=0.3),
    "entropy": dict(entropy_coef=0.05),
    "correction": dict(mode="truncate", level="token"),
    "kl_ratio_weighted": dict(kl_coef=0.3, ratio_weighted=True),
    "all": dict(kl_coef=0.3, estimator="k2", entropy_coef=0.05, mode="mask", level="sequence"),
    "all_ratio_weighted": dict(kl_coef=0.3, ratio_weighted=True, entropy_coef=0.05, mode="mask", level="token"),
}


def library_terms(kl_coef=0.0, estimator="k3", ratio_weighted=False, entropy_coef=0.0, mode="none", level="token",
                  low=LOW, high=HIGH):
    """The entry points' keywords for a reference term setting."""
    return dict(kl=KLPenalty(coef=kl_coef, estimator=estimator, ratio_weighted=ratio_weighted),
                entropy_coef=entropy_coef, correction=Correction(mode=mode, level=level, low=low, high=high))


def reference_terms(**setting):
    return dict(kl_coef=0.0, estimator="k3", ratio_weighted=False, entropy_coef=0.0, mode="none", level="token",
                low=LOW, high=HIGH) | setting


def terms_step(seed, *, num_docs=12, max_len=9, empty_docs=2, behaviour_std=0.5):
    """A step (`make_step`) with reference and behaviour log-probs and entropies; every value under
    the mask is NaN or -inf (it must never be read)."""
    step = make_step(seed, num_docs=num_docs, max_len=max_len, num_groups=4, empty_docs=empty_docs,
                     log_ratio_std=0.3)
    g = torch.Generator().manual_seed(seed + 1000)
    n = step["mask"].numel()
    labelled = step["mask"] > 0
    step["ref"] = torch.where(labelled, step["lp"] + 0.4 * torch.randn(n, generator=g, dtype=F64), math.nan)
    step["behav"] = torch.where(labelled, step["old"] + behaviour_std * torch.randn(n, generator=g, dtype=F64),
                                -math.inf)
    step["entropy"] = torch.where(labelled, 3 * torch.rand(n, generator=g, dtype=F64), math.nan)
    step["lp"] = torch.where(labelled, step["lp"], math.nan)
    step["old"] = torch.where(labelled, step["old"], -math.inf)
    return step


def run_library(step, *, loss, aggregation, divisor, setting, metrics="with_entropy", with_inputs=True,
                dtype=F64):
    """`policy_loss` with the terms of ``setting``; gradients w.r.t. lp, entropy and old."""
    lp, entropy, old, behav = (step[k].detach().clone().to(dtype).requires_grad_(True)
                               for k in ("lp", "entropy", "old", "behav"))
    inputs = LossInputs(proximal_logprobs=old, advantages=step["adv"].to(dtype), mask=step["mask"],
                        document_index=step["doc"], group_index=step["group"],
                        reference_logprobs=step["ref"].to(dtype) if with_inputs else None,
                        sampler_logprobs=behav if with_inputs else None)
    spec = loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, metrics=metrics, eps_low=EPS_LOW,
                     eps_high=EPS_HIGH, **library_terms(**setting))
    value, out = policy_loss(lp, inputs, spec, entropy=entropy)
    value.backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (lp, entropy, old)]
    return value.detach(), out, *grads, behav.grad


def run_reference(step, *, loss, aggregation, divisor, setting):
    lp = step["lp"].clone().requires_grad_(True)
    entropy = step["entropy"].clone().requires_grad_(True)
    old = step["old"].clone().requires_grad_(True)
    value = ref_loss_with_terms(
        lp, old, step["adv"], step["mask"], step["doc"], step["group"], loss=loss, aggregation=aggregation,
        divisor=divisor, eps_low=EPS_LOW, eps_high=EPS_HIGH, ref=step["ref"], entropy=entropy, behav=step["behav"],
        **reference_terms(**setting),
    )
    value.backward()
    grads = [torch.zeros_like(step["lp"]) if t.grad is None else t.grad for t in (lp, entropy, old)]
    return value.detach(), *grads


def reference_metrics(step, lp, *, loss, setting, entropy=None, with_inputs=True):
    ref = reference_terms(**setting)
    expected = ref_metrics(lp, step["old"], step["adv"], step["mask"], step["doc"], loss=loss, eps_low=EPS_LOW,
                           eps_high=EPS_HIGH, entropy=step["entropy"] if entropy is None else entropy)
    return expected | ref_term_metrics(lp, step["old"], step["mask"], step["doc"],
                                       ref=step["ref"] if with_inputs else None,
                                       behav=step["behav"] if with_inputs else None,
                                       mode=ref["mode"], level=ref["level"], low=ref["low"], high=ref["high"])


def assert_metrics(actual, expected, tol=TOL):
    assert set(actual) == set(expected) | {"loss"}
    for name, want in expected.items():
        assert torch.isfinite(actual[name]), name
        assert actual[name].item() == pytest.approx(want, rel=tol, abs=1e-13), name


def check_against_reference(step, *, loss, aggregation, divisor, setting):
    value, metrics, g_lp, g_ent, g_old, g_behav = run_library(step, loss=loss, aggregation=aggregation,
                                                              divisor=divisor, setting=setting)
    ref_value, ref_lp, ref_ent, ref_old = run_reference(step, loss=loss, aggregation=aggregation, divisor=divisor,
                                                        setting=setting)
    assert torch.isfinite(value) and rel_err(value, ref_value) <= TOL
    assert metrics["loss"].item() == value.item()
    assert rel_err(g_lp, ref_lp) <= TOL and g_lp.abs().max() > 0
    assert rel_err(g_ent, ref_ent) <= TOL
    # the correction weights carry no gradient: old (prox) gets only the policy term's, times w
    assert rel_err(g_old, ref_old) <= TOL
    assert g_behav is None
    labelled = step["mask"] > 0
    assert torch.all(g_lp[~labelled] == 0) and torch.all(g_ent[~labelled] == 0)
    assert_metrics(metrics, reference_metrics(step, step["lp"], loss=loss, setting=setting))
    return value, metrics


CASES = [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS]


@pytest.mark.parametrize("term_set", list(TERM_SETS))
@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES)
def test_each_term_alone_and_all_together_match_the_reference(loss, aggregation, divisor, term_set):
    step = terms_step(zlib.crc32(f"{loss}{aggregation}{divisor}{term_set}".encode()) % 1000)
    value, metrics = check_against_reference(step, loss=loss, aggregation=aggregation, divisor=divisor,
                                             setting=TERM_SETS[term_set])
    if term_set.startswith("all"):
        assert 0 < metrics["is_masked_fraction"].item() < 1  # the mask keeps some tokens, not all


@pytest.mark.parametrize("ratio_weighted", [False, True])
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(("aggregation", "divisor"), [("sample_mean", None), ("constant", 37.5)])
def test_every_kl_estimator(loss, estimator, ratio_weighted, aggregation, divisor):
    step = terms_step(7)
    setting = dict(kl_coef=0.7, estimator=estimator, ratio_weighted=ratio_weighted)
    _, metrics = check_against_reference(step, loss=loss, aggregation=aggregation, divisor=divisor, setting=setting)
    # kl_ref is k3's whatever the estimator of the loss, with or without the ratio
    assert metrics["kl_ref"].item() > 0
    plain = run_library(step, loss=loss, aggregation=aggregation, divisor=divisor,
                        setting=dict(kl_coef=0.7, estimator=estimator))[1]
    assert metrics["kl_ref"].item() == plain["kl_ref"].item()


def _one_token_step(old, adv=1.0, **tensors):
    """One document of one labelled token (and a prompt token, NaN under the mask)."""
    return LossInputs(proximal_logprobs=torch.tensor([math.nan, old], dtype=F64),
                      advantages=torch.tensor([math.nan, adv], dtype=F64), mask=torch.tensor([0.0, 1.0]),
                      document_index=torch.tensor([0, 0]),
                      **{name: torch.tensor([math.nan, value], dtype=F64) for name, value in tensors.items()})


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
def test_mask_weighs_a_kept_token_by_rho_the_icepop_example(level):
    """Issue 28's example, by hand: A = 1, ratio 1 (lp = old), ρ = 1.5 in [0.5, 2]: grpo's ℓ = −1,
    times u = ρ = 1.5, over T = 1: L = −1.5 and dL/dlp = −1.5 (the old mask gave −1 and −1; a mask
    that weighted by 1 or by anything but ρ fails here)."""
    old = -1.0
    lp = torch.tensor([math.nan, old], dtype=F64, requires_grad=True)
    inputs = _one_token_step(old, sampler_logprobs=old - math.log(1.5))
    value, metrics = policy_loss(lp, inputs, LossSpec(correction=Correction(mode="mask", level=level, low=0.5,
                                                                             high=2.0)))
    value.backward()
    assert value.item() == pytest.approx(-1.5, rel=1e-15)
    assert lp.grad.tolist()[1] == pytest.approx(-1.5, rel=1e-15) and lp.grad.tolist()[0] == 0
    assert metrics["is_weight_mean"].item() == pytest.approx(1.5, rel=1e-15)
    assert metrics["is_masked_fraction"].item() == 0


def test_mask_rejects_outside_the_band_and_keeps_the_denominators():
    """Two one-token documents, A = 1, ratio 1, ρ = 1.5 (kept) and ρ = 3 (rejected, > 2): by hand,
    token_mean L = (−1.5 + 0) / T with T = 2 (the rejected token still counts): −0.75; gradients
    −1.5/2 and 0. Fails if a rejected token left the denominator (−1.5) or kept weight 1 (−0.5)."""
    old = torch.tensor([-0.7, -2.0], dtype=F64)
    lp = old.clone().requires_grad_(True)
    behav = old - torch.tensor([math.log(1.5), math.log(3.0)], dtype=F64)
    inputs = LossInputs(proximal_logprobs=old, advantages=torch.ones(2, dtype=F64), mask=torch.ones(2),
                        document_index=torch.tensor([0, 1]), sampler_logprobs=behav)
    value, metrics = policy_loss(lp, inputs, LossSpec(correction=Correction(mode="mask", low=0.5, high=2.0)))
    value.backward()
    assert value.item() == pytest.approx(-0.75, rel=1e-15)
    assert lp.grad.tolist() == pytest.approx([-0.75, 0.0], rel=1e-15)
    assert metrics["is_masked_fraction"].item() == 0.5 and metrics["is_weight_max"].item() == pytest.approx(1.5)


def test_the_ratio_weighted_kl_term_by_hand():
    """One token, A = 0 (grpo's own term is 0), lp = −1, old = −1.2, ref = −1.5, β = 0.4: r = e^0.2,
    δ = −0.5, L = β r k3(δ) and, by hand, dL/dlp = β (r k3 + r (1 − e^δ)) = −β r δ; dL/dold = −β r k3.
    Fails if the ratio is missing, detached, or has another denominator."""
    beta, r, delta = 0.4, math.exp(0.2), -0.5
    k3 = math.exp(delta) - delta - 1
    lp = torch.tensor([math.nan, -1.0], dtype=F64, requires_grad=True)
    old = torch.tensor([math.nan, -1.2], dtype=F64, requires_grad=True)
    inputs = replace(_one_token_step(-1.2, adv=0.0, reference_logprobs=-1.5), proximal_logprobs=old)
    value, metrics = policy_loss(lp, inputs, LossSpec(kl=KLPenalty(coef=beta, ratio_weighted=True)))
    value.backward()
    assert value.item() == pytest.approx(beta * r * k3, rel=1e-14)
    assert lp.grad[1].item() == pytest.approx(-beta * r * delta, rel=1e-14)
    assert old.grad[1].item() == pytest.approx(-beta * r * k3, rel=1e-14)
    assert metrics["kl_ref"].item() == pytest.approx(k3, rel=1e-14)  # the metric has no ratio


EXPECTED_KL_GRADIENTS = {  # (estimator, ratio_weighted) -> the KL whose gradient the term follows on-policy
    ("k1", False): None, ("k2", False): "reverse", ("k3", False): "forward",
    ("k3", True): "reverse", ("k1", True): "reverse",
}


@pytest.mark.parametrize(("estimator", "ratio_weighted"), list(EXPECTED_KL_GRADIENTS))
def test_each_kl_term_follows_its_documented_gradient_in_expectation(estimator, ratio_weighted):
    """math.md#kl-to-a-reference, exactly: a softmax policy π over 7 tokens (logits θ), one
    one-token document per token y (old = lp, on-policy), A = 0; the library's dL/dlp_y, weighted by
    π(y), chained to θ, is E_{y∼π}[∇_θ β k(y)]. It must equal β ∇_θ of the KL the page names,
    computed by autograd from its definition (0 for k1). Fails if an estimator or the ratio changed."""
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(7, generator=g, dtype=F64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(7, generator=g, dtype=F64), 0)
    log_pi = torch.log_softmax(theta, 0)
    lp = log_pi.detach().clone().requires_grad_(True)
    beta, n = 0.3, 7
    inputs = LossInputs(proximal_logprobs=log_pi.detach(), advantages=torch.zeros(n, dtype=F64),
                        mask=torch.ones(n), document_index=torch.arange(n), reference_logprobs=log_ref)
    spec = LossSpec(aggregation="constant", divisor=1.0,  # L = Σ_y β k(y) / n
                    kl=KLPenalty(coef=beta, estimator=estimator, ratio_weighted=ratio_weighted))
    value, _ = policy_loss(lp, inputs, spec)
    (per_token,) = torch.autograd.grad(value, lp)  # [n] β/n dk(y)/dlp_y
    pi = log_pi.exp().detach()
    (expected_gradient,) = torch.autograd.grad(log_pi, theta, grad_outputs=pi * n * per_token, retain_graph=True)
    which = EXPECTED_KL_GRADIENTS[estimator, ratio_weighted]
    if which is None:
        assert expected_gradient.abs().max() < 1e-15
        return
    p, q = (log_pi, log_ref) if which == "reverse" else (log_ref, log_pi)
    (kl_gradient,) = torch.autograd.grad(beta * (p.exp() * (p - q)).sum(), theta)
    assert kl_gradient.abs().max() > 1e-3
    assert rel_err(expected_gradient, kl_gradient) <= 1e-12


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_the_kl_term_is_added_with_the_aggregation_weights(estimator):
    # advantages 0: grpo's own term is 0, and L = β Σ_t w_t k_t by hand
    step = terms_step(8)
    step["adv"] = torch.zeros_like(step["adv"])
    labelled = step["mask"] > 0
    delta = (step["ref"] - step["lp"])[labelled]
    k = {"k1": -delta, "k2": delta**2 / 2, "k3": torch.exp(delta) - delta - 1}[estimator]
    beta = 0.45
    for aggregation, divisor in AGGREGATIONS:
        value, _ = policy_loss(step["lp"], step_inputs(step, reference_logprobs=step["ref"]),
                               LossSpec(aggregation=aggregation, divisor=divisor,
                                        kl=KLPenalty(coef=beta, estimator=estimator)))
        docs = documents(step["mask"], step["doc"], step["group"])
        positions = torch.nonzero(labelled).flatten().tolist()
        weight_of = {}
        for d in docs:
            n = len(d.labelled)
            for t in d.labelled:
                weight_of[t] = {
                    "token_mean": 1 / len(positions),
                    "sample_mean": 1 / (n * len(docs)),
                    "constant": 1 / ((divisor or 1) * len(docs)),
                    "prompt_mean": 1 / (sum(len(e.labelled) for e in docs if e.group == d.group)
                                        * len({e.group for e in docs})),
                }[aggregation]
        expected = beta * sum(weight_of[t] * float(k[i]) for i, t in enumerate(positions))
        assert value.item() == pytest.approx(expected, rel=1e-12), aggregation


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("mode", [m for m in CORRECTION_MODES if m not in ("none", "reject")])  # reject: test_reject
@pytest.mark.parametrize("loss", LOSSES)
def test_every_correction_mode_and_level(loss, mode, level):
    step = terms_step(9, num_docs=16, behaviour_std=0.5 if level != "geometric" else 1.0)
    setting = dict(mode=mode, level=level)
    _, metrics = check_against_reference(step, loss=loss, aggregation="token_mean", divisor=None, setting=setting)
    weight, rejected = ref_importance_weights(step["old"], step["behav"], step["mask"], step["doc"], mode=mode,
                                              level=level, low=LOW, high=HIGH)
    labelled = torch.nonzero(step["mask"] > 0).flatten().tolist()
    if mode == "truncate":
        assert metrics["is_masked_fraction"].item() == 0
        assert any(weight[t] == HIGH for t in labelled) and any(weight[t] < 1 for t in labelled)
        assert metrics["is_weight_max"].item() == HIGH
    else:
        assert 0 < sum(rejected[t] for t in labelled) < len(labelled)  # the data exercises the mask
        kept = [weight[t] for t in labelled if not rejected[t]]
        assert all(LOW <= w <= HIGH for w in kept) and any(w != 1 for w in kept)  # IcePop: w = ρ
        assert metrics["is_weight_max"].item() == max(kept) <= HIGH


def test_the_correction_weighs_the_policy_term_only():
    # with every document masked out, only the KL and entropy terms remain, unweighted
    step = terms_step(10)
    inputs = step_inputs(step, group=False, reference_logprobs=step["ref"])
    terms = dict(kl=KLPenalty(coef=0.2), entropy_coef=0.1)
    rejected_all, _ = policy_loss(step["lp"], replace(inputs, sampler_logprobs=step["old"] + 50.0),
                                  LossSpec(correction=Correction(mode="mask"), **terms), entropy=step["entropy"])
    no_policy, _ = policy_loss(step["lp"], replace(inputs, advantages=torch.zeros_like(step["adv"])),
                               LossSpec(**terms), entropy=step["entropy"])
    assert rejected_all.item() == pytest.approx(no_policy.item(), rel=1e-14)


def test_the_defaults_are_bitwise_the_loss_without_terms():
    step = make_step(11)
    for loss in LOSSES:
        runs = []
        for kwargs in (dict(), dict(kl=KLPenalty(), entropy_coef=0.0, correction=Correction()),
                       dict(kl=None, correction=Correction(mode="none", level="sequence"))):
            lp = step["lp"].clone().requires_grad_(True)
            value, metrics = policy_loss(lp, step_inputs(step), LossSpec(loss, aggregation="sample_mean", **kwargs))
            value.backward()
            runs.append((value, lp.grad, metrics))
        for value, grad, metrics in runs[1:]:
            assert torch.equal(value, runs[0][0]) and torch.equal(grad, runs[0][1])
            assert metrics.keys() == runs[0][2].keys()
            assert all(torch.equal(metrics[k], runs[0][2][k]) for k in metrics)


def test_reference_and_behaviour_log_probs_alone_add_their_metrics_and_nothing_else():
    step = terms_step(12)
    base, base_metrics = policy_loss(step["lp"], step_inputs(step, group=False), LossSpec())
    with_both = step_inputs(step, group=False, reference_logprobs=step["ref"], sampler_logprobs=step["behav"])
    value, metrics = policy_loss(step["lp"], with_both, LossSpec())
    assert torch.equal(value, base)
    assert set(metrics) - set(base_metrics) == {"kl_ref", "mismatch_kl"}
    expected = ref_term_metrics(step["lp"], step["old"], step["mask"], step["doc"], ref=step["ref"],
                                behav=step["behav"])
    for name in ("kl_ref", "mismatch_kl"):
        assert metrics[name].item() == pytest.approx(expected[name], rel=TOL)
    _, none = policy_loss(step["lp"], with_both, LossSpec(metrics="none", correction=Correction(mode="truncate")))
    assert set(none) == {"loss", "num_documents", "num_tokens"}


@pytest.mark.parametrize("loss", LOSSES)
def test_a_step_without_labelled_tokens_gives_zero_and_no_nan(loss):
    step = terms_step(13)
    step["mask"] = torch.zeros_like(step["mask"])
    setting = TERM_SETS["all"] | dict(mode="truncate")
    value, metrics, g_lp, g_ent, _, _ = run_library(step, loss=loss, aggregation="sample_mean", divisor=None,
                                                    setting=setting)
    assert value.item() == 0 and torch.all(g_lp == 0) and torch.all(g_ent == 0)
    assert all(torch.isfinite(v) for v in metrics.values())
    assert "is_weight_max" not in metrics and metrics["is_weight_mean"].item() == 0


EXTREME_SETTINGS = [dict(kl_coef=0.5, estimator=est, entropy_coef=0.1, mode=mode, level=level)
                    for est in KL_ESTIMATORS for mode in ("truncate", "mask") for level in CORRECTION_LEVELS]
EXTREME_SETTINGS += [dict(kl_coef=0.5, ratio_weighted=True, entropy_coef=0.1, mode=mode, level="token")
                     for mode in ("truncate", "mask")]


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("setting", EXTREME_SETTINGS, ids=[str(s) for s in EXTREME_SETTINGS])
def test_extreme_log_ratios_give_finite_loss_gradients_and_metrics(setting, dtype):
    step = terms_step(14)
    labelled = torch.nonzero(step["mask"] > 0).flatten()
    # prox - behav = +800 / -800 and ref - lp = +80 / -80 on some labelled tokens
    for i, (mismatch, kl_delta) in enumerate([(800.0, 80.0), (-800.0, -80.0), (800.0, -80.0), (-800.0, 80.0)]):
        t = labelled[3 * i]
        step["behav"][t] = step["old"][t] - mismatch
        step["ref"][t] = step["lp"][t] + kl_delta
    for loss in LOSSES:
        value, metrics, g_lp, g_ent, g_old, _ = run_library(step, loss=loss, aggregation="token_mean", divisor=None,
                                                            setting=setting, dtype=dtype)
        assert torch.isfinite(value), loss
        assert torch.isfinite(g_lp).all() and torch.isfinite(g_ent).all() and torch.isfinite(g_old).all()
        assert all(torch.isfinite(v) for v in metrics.values()), loss
        if dtype == F64:
            ref_value, ref_lp, _, _ = run_reference(step, loss=loss, aggregation="token_mean", divisor=None,
                                                    setting=setting)
            assert rel_err(value, ref_value) <= TOL and rel_err(g_lp, ref_lp) <= TOL
            assert_metrics(metrics, reference_metrics(step, step["lp"], loss=loss, setting=setting))
            if setting["level"] == "token":
                if setting["mode"] == "truncate":
                    assert metrics["is_weight_max"].item() == HIGH
                else:
                    assert metrics["is_masked_fraction"].item() > 0
    # the metrics' k3 saturates: mismatch_kl is huge but finite
    assert 1e200 < metrics["mismatch_kl"].item() < math.exp(METRIC_LOG_RATIO_MAX)


def test_float32_kl_beyond_its_range_is_inf_never_nan():
    # ref - lp = 100 > log(float32 max) ~ 88.7: k3 overflows to +inf in float32, the loss is +inf
    # (the trainer skips a step whose loss is not finite) and nothing is NaN
    step = terms_step(15)
    t = int(torch.nonzero(step["mask"] > 0)[0])
    step["ref"][t] = step["lp"][t] + 100.0
    value, metrics, g_lp, _, _, _ = run_library(step, loss="grpo", aggregation="token_mean", divisor=None,
                                                setting=dict(kl_coef=0.5), dtype=torch.float32)
    assert value.item() == math.inf
    assert not torch.isnan(g_lp).any() and g_lp[t] == -math.inf
    assert math.isfinite(metrics["kl_ref"].item())  # the metrics are float64


def test_a_gradient_with_the_entropy_bonus_pushes_the_entropy_up():
    step = terms_step(16)
    _, _, _, g_ent, _, _ = run_library(step, loss="grpo", aggregation="token_mean", divisor=None,
                                       setting=dict(entropy_coef=0.1))
    labelled = step["mask"] > 0
    assert torch.allclose(g_ent[labelled], torch.full_like(g_ent[labelled], -0.1 / int(labelled.sum())))


# --------------------------------------------------------------------------------------------
# options and their errors
# --------------------------------------------------------------------------------------------

OPTION_ERRORS = [
    (lambda: KLPenalty(coef=-0.1), r"^coef must be a number in \[0, 3.40282e\+38\]; got -0.1$"),
    (lambda: KLPenalty(coef=1e39), r"^coef must be a number in \[0, 3.40282e\+38\]; got 1e\+39$"),  # inf x 0 = NaN
    (lambda: KLPenalty(coef=math.nan), r"^coef must be"),
    (lambda: KLPenalty(coef=math.inf), r"^coef must be"),
    (lambda: KLPenalty(coef=True), r"^coef must be"),
    (lambda: KLPenalty(estimator="k4"), r"^unknown KL estimator 'k4'; expected one of: k1, k2, k3$"),
    (lambda: KLPenalty(estimator="K3"), r"^unknown KL estimator"),
    (lambda: KLPenalty(ratio_weighted="true"), r"^ratio_weighted must be a bool; got 'true'$"),
    (lambda: KLPenalty(ratio_weighted=1), r"^ratio_weighted must be a bool; got 1$"),
    (lambda: Correction(mode="clip"),
     r"^unknown correction mode 'clip'; expected one of: none, truncate, mask, reject$"),
    (lambda: Correction(level="batch"),
     r"^unknown correction level 'batch'; expected one of: token, sequence, geometric$"),
    (lambda: Correction(low=0.0), r"^low must be a finite number > 0; got 0.0$"),
    (lambda: Correction(low=-1.0), r"^low must be"),
    (lambda: Correction(high=0.0), r"^high must be"),
    (lambda: Correction(high=math.inf), r"^high must be"),
    (lambda: Correction(low=3.0, high=2.0), r"^low must be <= high; got low=3.0, high=2.0$"),
    (lambda: LossSpec(entropy_coef=-0.01), r"^entropy_coef must be a number in \[0, 3.40282e\+38\]; got -0.01$"),
    (lambda: LossSpec(entropy_coef=1e39), r"^entropy_coef must be a number in \[0, 3.40282e\+38\]; got 1e\+39$"),
    (lambda: LossSpec(entropy_coef=math.nan), r"^entropy_coef must be"),
    (lambda: LossSpec(entropy_coef="0.1"), r"^entropy_coef must be"),
    (lambda: LossSpec(kl=0.1), r"^kl must be a KLPenalty or None"),
    (lambda: LossSpec(correction="mask"), r"^correction must be a Correction or None"),
]


@pytest.mark.parametrize(("make", "message"), OPTION_ERRORS, ids=[m for _, m in OPTION_ERRORS])
def test_invalid_options_raise_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_valid_edge_options():
    assert Correction(mode="mask", low=1.0, high=1.0).low == 1.0
    assert KLPenalty(coef=0.0).coef == 0.0
    assert LossSpec(entropy_coef=0).entropy_coef == 0.0
    assert not (LossSpec().kl_on or LossSpec().entropy_on or LossSpec().correction_on)


def _entry_points(step):
    totals = StepTotals.of_tokens(step["mask"], Segments.of(step["doc"]))

    def bundles(kw):
        """The inputs (with the log-probs ``kw`` names) and the spec of the rest of ``kw``."""
        tensors = {name: kw.pop(name) for name in ("reference_logprobs", "sampler_logprobs") if name in kw}
        return step_inputs(step, group=False, **tensors), LossSpec(**kw)

    def policy(**kw):
        return policy_loss(step["lp"], *bundles(kw))

    def micro(**kw):
        inputs, spec = bundles(kw)
        return micro_batch_loss(step["lp"], inputs, totals, spec)

    return [policy, micro]


MISSING = [
    (dict(kl=KLPenalty(coef=0.1)), r"^kl.coef = 0.1 > 0 needs reference_logprobs$"),
    (dict(correction=Correction(mode="truncate")), r"^correction mode 'truncate' needs sampler_logprobs$"),
    (dict(correction=Correction(mode="mask", level="sequence")), r"needs sampler_logprobs"),
    (dict(entropy_coef=0.01), r"^entropy_coef = 0.01 > 0 needs entropy"),
    (dict(entropy_coef=-1.0), r"^entropy_coef must be"),
    (dict(kl="k3"), r"^kl must be"),
    (dict(correction=dict(mode="mask")), r"^correction must be"),
]


@pytest.mark.parametrize(("kwargs", "message"), MISSING, ids=[m for _, m in MISSING])
def test_a_term_without_its_input_raises_naming_it(kwargs, message):
    step = terms_step(17)
    for entry in _entry_points(step):
        with pytest.raises(ValueError, match=message):
            entry(**kwargs)


def test_term_inputs_of_the_wrong_shape_raise_naming_them():
    step = terms_step(18)
    for entry in _entry_points(step):
        for name in ("reference_logprobs", "sampler_logprobs"):
            with pytest.raises(ValueError, match=rf"^{name} must have the shape of proximal_logprobs"):
                entry(**{name: step["ref"][:-1]})
    # off terms need nothing
    for entry in _entry_points(step):
        entry(kl=KLPenalty(coef=0.0), correction=Correction(mode="none"), entropy_coef=0.0)
