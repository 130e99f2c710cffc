"""The registered losses cispo (MiniMax-M1), sapo (Soft Adaptive Policy Optimization) and gspo_token
(GSPO-token, GSPO paper §4.3) against their independent float64 references in ``rl_reference.py``:
through `policy_loss`, `micro_batch_loss` under random splits and `fused_micro_batch_loss`; and what
they must do with empty steps, garbage under the mask and extreme log-ratios."""

from __future__ import annotations

import math
import random

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import (
    AGGREGATIONS,
    F64,
    NEW_LOSSES,
    documents,
    make_step,
    ref_head,
    ref_new_loss,
    ref_new_metrics,
    rel_err,
)
from test_invariance import _micro_batches, _random_pieces, _split_run
from test_loss_registry import _case

from rlcli.modules import (
    LOSSES,
    HeadSpec,
    LossInputs,
    LossSpec,
    finalize_metrics,
    fused_micro_batch_loss,
    make_loss,
    policy_loss,
)
from rlcli.modules.bounds import FLOAT32_MAX, FLOAT32_TINY
from rlcli.modules.losses import CISPO, SAPO, GSPOToken

TOL = 1e-10  # float64 against the reference
SPLIT_TOL = 1e-9  # float64, a split step against the whole one

# options away from the defaults, so that truncation, both gates and both clip sides all act at the
# log-ratios of these steps (a test below checks that they do)
OPTIONS = {
    "cispo": dict(eps_high=0.25),
    "sapo": dict(tau_pos=0.6, tau_neg=2.5),
    "gspo_token": dict(eps_low=0.1, eps_high=0.15),
}
DEFAULTS = {"cispo": dict(eps_high=4.0), "sapo": dict(tau_pos=1.0, tau_neg=1.05),
            "gspo_token": dict(eps_low=0.2, eps_high=0.2)}
CASES = [(loss, agg, div) for loss in NEW_LOSSES for agg, div in AGGREGATIONS]
CASE_IDS = [f"{loss}-{agg}-{div}" for loss, agg, div in CASES]


def _eps(options):
    """The options the metrics reference takes."""
    return {k: v for k, v in options.items() if k.startswith("eps")}


def _reference(step, lp, *, loss, aggregation, divisor, options):
    """The reference value and its gradient w.r.t. ``lp`` (float64)."""
    leaf = lp.detach().to(F64).clone().requires_grad_(True)
    value = ref_new_loss(leaf, step["old"], step["adv"], step["mask"], step["doc"], step["group"],
                         loss=loss, aggregation=aggregation, divisor=divisor, **options)
    value.backward()
    return value.detach(), leaf.grad


def _run(step, lp, *, loss, aggregation, divisor, options, entropy=None, **kw):
    """`policy_loss` on ``step`` with the log-probs ``lp``: value, gradient w.r.t. ``lp``, metrics."""
    leaf = lp.detach().clone().requires_grad_(True)
    spec = loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, **options, **kw)
    value, metrics = policy_loss(leaf, step_inputs(step, leaf.dtype), spec, entropy=entropy)
    value.backward()
    return value.detach(), leaf.grad, metrics


def _assert_metrics(metrics, expected, tol=TOL):
    assert set(metrics) - {"loss"} == set(expected)
    for name, want in expected.items():
        assert metrics[name].item() == pytest.approx(want, rel=tol, abs=1e-13), name


# --------------------------------------------------------------------------------------------
# registration, options, bounds
# --------------------------------------------------------------------------------------------


def test_the_three_losses_are_registered_with_their_options():
    assert (LOSSES["cispo"], LOSSES["sapo"], LOSSES["gspo_token"]) == (CISPO, SAPO, GSPOToken)
    assert (CISPO.sequence_level, SAPO.sequence_level, GSPOToken.sequence_level) == (False, False, True)
    for name, defaults in DEFAULTS.items():
        assert make_loss(name) == LOSSES[name](**defaults)
        assert make_loss(name, **OPTIONS[name]) == LOSSES[name](**OPTIONS[name])


@pytest.mark.parametrize(("loss", "options", "message"), [
    ("cispo", dict(eps_high=-0.1), r"^eps_high must be a number in \[0, 3.40282e\+38\]; got -0.1$"),
    ("cispo", dict(eps_high=math.inf), r"^eps_high must be a number in \[0, 3.40282e\+38\]; got inf$"),
    ("cispo", dict(eps_high=1e39), r"^eps_high must be a number in \[0, 3.40282e\+38\]; got 1e\+39$"),
    ("cispo", dict(eps_low=0.1), r"^eps_low is not an option of loss 'cispo'; it takes eps_high$"),
    ("sapo", dict(tau_pos=0), r"^tau_pos must be a number in \[1.17549e-38, 3.40282e\+38\]; got 0$"),
    ("sapo", dict(tau_neg=-1.0), r"^tau_neg must be a number in \[1.17549e-38, 3.40282e\+38\]; got -1.0$"),
    # τ and the gate's height 4/τ must be float32 numbers
    ("sapo", dict(tau_pos=1e-38), r"^tau_pos must be a number in \[1.17549e-38, 3.40282e\+38\]; got 1e-38$"),
    ("sapo", dict(tau_neg=1e39), r"^tau_neg must be a number in \[1.17549e-38, 3.40282e\+38\]; got 1e\+39$"),
    ("sapo", dict(tau=1.0), r"^tau is not an option of loss 'sapo'; it takes tau_pos, tau_neg$"),
    ("gspo_token", dict(eps_low=1), r"^eps_low must be a number in \[0, 1\); got 1$"),
    ("gspo_token", dict(eps_high=math.nan), r"^eps_high must be a number in \[0, 3.40282e\+38\]; got nan$"),
])
def test_options_out_of_bounds_raise_naming_them(loss, options, message):
    step = make_step(0)
    with pytest.raises(ValueError, match=message):
        policy_loss(step["lp"], step_inputs(step), loss_spec(loss=loss, **options))


# --------------------------------------------------------------------------------------------
# policy_loss against the reference: value, gradient, every metric
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["options", "defaults"])
@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_policy_loss_matches_the_reference(loss, aggregation, divisor, which):
    options = (OPTIONS if which == "options" else DEFAULTS)[loss]
    for seed in (0, 1):
        step = make_step(seed, log_ratio_std=0.4)
        entropy = 3 * torch.rand(step["mask"].numel(), generator=torch.Generator().manual_seed(seed), dtype=F64)
        value, grad, metrics = _run(step, step["lp"], loss=loss, aggregation=aggregation, divisor=divisor,
                                    options=options, metrics="with_entropy", entropy=entropy)
        ref_value, ref_grad = _reference(step, step["lp"], loss=loss, aggregation=aggregation, divisor=divisor,
                                         options=options)
        assert value.dtype == F64
        assert rel_err(value, ref_value) <= TOL and rel_err(grad, ref_grad) <= TOL
        assert ref_grad.abs().max() > 0 and torch.all(grad[step["mask"] == 0] == 0)
        assert metrics["loss"].item() == pytest.approx(ref_value.item(), rel=TOL)
        _assert_metrics(metrics, ref_new_metrics(step["lp"], step["old"], step["adv"], step["mask"], step["doc"],
                                                 loss=loss, entropy=entropy, **_eps(options)))
        if which == "options" and loss != "sapo":  # the truncation / clip acts on some units, not on all
            docs = documents(step["mask"], step["doc"])
            all_clipped = sum(1 for d in docs if d.labelled) / len(docs)
            assert 0 < metrics["clipped_ratio_fraction"].item() < all_clipped


def test_the_options_act():
    # the reference with other options gives other values: the tests above see the options
    step = make_step(0, log_ratio_std=0.4)
    for loss in NEW_LOSSES:
        kw = dict(loss=loss, aggregation="token_mean", divisor=None)
        base, _ = _reference(step, step["lp"], options=OPTIONS[loss], **kw)
        for name, value in OPTIONS[loss].items():
            other, _ = _reference(step, step["lp"], options=OPTIONS[loss] | {name: value * 1.5}, **kw)
            assert abs(other.item() - base.item()) > 1e-6 * abs(base.item()), (loss, name)


def test_sapo_uses_tau_pos_for_positive_advantages_and_tau_neg_otherwise():
    # one token each: ℓ = −σ(τ(r − 1))·(4/τ)·A, on paper
    lp = torch.tensor([-1.0, -2.0], dtype=F64)
    old = torch.tensor([-1.5, -1.7], dtype=F64)
    adv = torch.tensor([0.8, -1.3], dtype=F64)
    leaf = lp.clone().requires_grad_(True)
    inputs = LossInputs(proximal_logprobs=old, advantages=adv, mask=torch.ones(2, dtype=F64),
                        document_index=torch.tensor([0, 1]))
    value, _ = policy_loss(leaf, inputs, LossSpec(SAPO(tau_pos=0.6, tau_neg=2.5), aggregation="constant", divisor=1.0))
    value.backward()

    def f(r, tau):
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))

    r1, r2 = math.exp(0.5), math.exp(-0.3)
    expected = (-f(r1, 0.6) * 0.8 + f(r2, 2.5) * 1.3) / 2  # D = 2, divisor 1
    assert value.item() == pytest.approx(expected, rel=1e-14)
    # d f/d lp = 4 σ (1 − σ) r
    sig1, sig2 = 1 / (1 + math.exp(-0.6 * (r1 - 1))), 1 / (1 + math.exp(-2.5 * (r2 - 1)))
    expected_grad = [-4 * sig1 * (1 - sig1) * r1 * 0.8 / 2, 4 * sig2 * (1 - sig2) * r2 * 1.3 / 2]
    assert leaf.grad.tolist() == pytest.approx(expected_grad, rel=1e-13)


@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_on_policy_every_new_loss_has_the_plain_policy_gradient(aggregation, divisor):
    # r_t = R_d = 1: the IS weight, the gate's slope and s_t are all 1, so dL/dlp_t = −w_t A_t for all three
    # losses, the same as grpo's
    step = make_step(8)
    step["old"] = torch.where(step["mask"] > 0, step["lp"], step["old"])
    kw = dict(aggregation=aggregation, divisor=divisor)
    _, grpo_grad, _ = _run(step, step["lp"], loss="grpo", options={}, **kw)
    for loss in NEW_LOSSES:
        _, grad, metrics = _run(step, step["lp"], loss=loss, options=OPTIONS[loss], **kw)
        assert rel_err(grad, grpo_grad) <= 1e-13, loss
        assert metrics["kl_new_old"].item() == 0.0 and metrics.get("clipped_ratio_fraction", 0.0) == 0.0


@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_gspo_token_with_the_document_mean_advantage_is_gspo(aggregation, divisor):
    # GSPO paper §4.3: with A_t = Ā_d for every token of d, GSPO-token and GSPO have the same value and gradient
    step = make_step(9, log_ratio_std=0.4)
    adv = step["adv"].clone()
    for d in documents(step["mask"], step["doc"]):
        if d.labelled:
            sel = torch.tensor(d.labelled)
            adv[sel] = adv[sel].mean()
    step["adv"] = adv
    options = OPTIONS["gspo_token"]
    kw = dict(aggregation=aggregation, divisor=divisor, options=options)
    token_value, token_grad, token_metrics = _run(step, step["lp"], loss="gspo_token", **kw)
    value, grad, metrics = _run(step, step["lp"], loss="gspo", **kw)
    assert token_value.item() == pytest.approx(value.item(), rel=1e-12)
    assert rel_err(token_grad, grad) <= 1e-12
    assert token_metrics.keys() == metrics.keys()
    for name in metrics:
        assert token_metrics[name].item() == pytest.approx(metrics[name].item(), rel=1e-12, abs=1e-15), name


# --------------------------------------------------------------------------------------------
# micro-batches: random splits equal the whole step
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_random_splits_reproduce_the_whole_step(loss, aggregation, divisor):
    rng = random.Random(f"new{loss}{aggregation}{divisor}")
    options = OPTIONS[loss]
    for trial in range(4):
        step = make_step(700 + trial, num_docs=14, num_groups=4, empty_docs=2, log_ratio_std=0.4)
        entropy = torch.rand(step["mask"].numel(), generator=torch.Generator().manual_seed(trial), dtype=F64)
        kw = dict(loss=loss, aggregation=aggregation, divisor=divisor, metrics="with_entropy", **options)
        whole, whole_grad, whole_metrics = _run(step, step["lp"], loss=loss, aggregation=aggregation,
                                                divisor=divisor, options=options, metrics="with_entropy",
                                                entropy=entropy)
        index_of_mb = _micro_batches(step, _random_pieces(step, rng.randint(1, 8), rng))
        lp = step["lp"].clone().requires_grad_(True)
        split, split_metrics = _split_run(step, lp, entropy, index_of_mb, all_reduce_flat=trial % 2 == 1, **kw)
        split.backward()
        assert rel_err(split, whole) <= SPLIT_TOL and rel_err(lp.grad, whole_grad) <= SPLIT_TOL
        assert split_metrics.keys() == whole_metrics.keys()
        for name in whole_metrics:
            assert split_metrics[name].item() == pytest.approx(whole_metrics[name].item(), rel=SPLIT_TOL,
                                                               abs=1e-14), name
        ref_value, _ = _reference(step, step["lp"], loss=loss, aggregation=aggregation, divisor=divisor,
                                  options=options)
        assert split.item() == pytest.approx(ref_value.item(), rel=SPLIT_TOL)


# --------------------------------------------------------------------------------------------
# the fused head
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [0, 1, 2, 3, 5])
@pytest.mark.parametrize(("aggregation", "divisor"), [("sample_mean", None), ("prompt_mean", None),
                                                      ("constant", 37.5)])
@pytest.mark.parametrize("loss", NEW_LOSSES)
def test_the_fused_head_matches_the_reference(loss, aggregation, divisor, chunk_tokens):
    step = _case(3)
    options = OPTIONS[loss]
    longest = max(len(d.labelled) for d in documents(step["mask"], step["doc"]))
    assert chunk_tokens == 0 or longest > chunk_tokens  # documents longer than a chunk (gspo_token's case)
    hidden = step["hidden"].clone().requires_grad_(True)
    weight = step["weight"].clone().requires_grad_(True)
    spec = loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, metrics="with_entropy", **options)
    value, partials = fused_micro_batch_loss(hidden, weight, step["labels"],
                                             step_inputs(step, group_index=step["group_index"]), step["totals"], spec,
                                             HeadSpec(temperature=0.7, chunk_tokens=chunk_tokens))
    value.backward()
    h = step["hidden"].clone().requires_grad_(True)
    w = step["weight"].clone().requires_grad_(True)
    ref_lp, ref_entropy = ref_head(h, w, step["labels"], 0.7)
    ref_value = ref_new_loss(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], step["group"],
                             loss=loss, aggregation=aggregation, divisor=divisor, **options)
    ref_value.backward()
    assert rel_err(value, ref_value) <= TOL
    assert rel_err(hidden.grad, h.grad) <= TOL and rel_err(weight.grad, w.grad) <= TOL
    assert h.grad.abs().max() > 0
    expected = ref_new_metrics(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], loss=loss,
                               entropy=ref_entropy, **_eps(options))
    _assert_metrics(finalize_metrics(partials, step["totals"]), expected)


# --------------------------------------------------------------------------------------------
# empty steps, garbage under the mask, extreme log-ratios
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_a_step_without_labelled_tokens_gives_zero(loss, aggregation, divisor, dtype):
    step = make_step(5)
    step["mask"] = torch.zeros_like(step["mask"])
    entropy = 3 * torch.rand(len(step["lp"]), generator=torch.Generator().manual_seed(5), dtype=dtype)
    value, grad, metrics = _run(step, step["lp"].to(dtype), loss=loss, aggregation=aggregation, divisor=divisor,
                                options=OPTIONS[loss], metrics="with_entropy", entropy=entropy)
    assert value.item() == 0.0 and torch.all(grad == 0)
    assert metrics["num_tokens"].item() == 0 and metrics["loss"].item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())
    assert "max_advantage" not in metrics and "min_advantage" not in metrics


@pytest.mark.parametrize("loss", NEW_LOSSES)
def test_values_under_the_mask_are_never_read(loss):
    step = make_step(3, log_ratio_std=0.4)
    masked = step["mask"] == 0
    kw = dict(loss=loss, aggregation="sample_mean", divisor=None, options=OPTIONS[loss])
    value, grad, metrics = _run(step, step["lp"], **kw)
    for lp_fill, old_fill, adv_fill in [(-math.inf, -math.inf, math.nan), (math.nan, math.inf, math.inf),
                                        (1e4, -1e4, -1e6)]:
        other = dict(step)
        other["old"] = torch.where(masked, old_fill, step["old"])
        other["adv"] = torch.where(masked, adv_fill, step["adv"])
        value2, grad2, metrics2 = _run(other, torch.where(masked, lp_fill, step["lp"]), **kw)
        assert value2.item() == pytest.approx(value.item(), rel=1e-14)
        assert torch.equal(grad2, grad) and torch.all(grad2[masked] == 0)
        assert metrics2.keys() == metrics.keys()
        for name in metrics:
            assert metrics2[name].item() == pytest.approx(metrics[name].item(), rel=1e-13, abs=1e-15), name


def _extreme_step(loss, magnitude):
    """A step where every other labelled token has a log-ratio of ±``magnitude``. For gspo_token a document
    whose mean log-ratio is positive gets non-negative advantages: with A_t < 0 its loss is R_d·|A_t|, as
    large as e^ρ, and only finite while e^ρ is."""
    step = make_step(11, num_docs=10, empty_docs=1)
    labelled = torch.nonzero(step["mask"] > 0).flatten()
    signs = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=F64).repeat(labelled.numel())[: labelled.numel()]
    old = step["old"].clone()
    old[labelled] = step["lp"][labelled] - magnitude * signs  # log-ratio ±magnitude or the step's own
    step["old"] = old
    if loss == "gspo_token":
        adv = step["adv"].clone()
        for d in documents(step["mask"], step["doc"]):
            sel = torch.tensor(d.labelled, dtype=torch.long)
            if d.labelled and (step["lp"][sel] - old[sel]).mean() > 0:
                adv[sel] = adv[sel].abs()
        step["adv"] = adv
    return step


@pytest.mark.parametrize("magnitude", [80.0, 800.0])
@pytest.mark.parametrize("loss", NEW_LOSSES)
def test_extreme_log_ratios_give_a_finite_loss_and_gradient(loss, magnitude):
    step = _extreme_step(loss, magnitude)
    kw = dict(loss=loss, aggregation="token_mean", divisor=None, options=OPTIONS[loss])
    results = {}
    for dtype in (torch.float32, F64):
        value, grad, metrics = _run(step, step["lp"].to(dtype), **kw)
        assert torch.isfinite(value) and torch.all(torch.isfinite(grad)), dtype
        assert not any(torch.isnan(v) for v in metrics.values()), dtype
        assert torch.all(grad[step["mask"] == 0] == 0)
        results[dtype] = (value, grad)
    # float32 agrees with float64 (to the rounding of log-ratios of ±800 in float32)
    assert rel_err(results[torch.float32][0], results[F64][0]) <= 1e-3
    assert rel_err(results[torch.float32][1], results[F64][1]) <= 1e-3
    ref_value, ref_grad = _reference(step, step["lp"], loss=loss, aggregation="token_mean", divisor=None,
                                     options=OPTIONS[loss])
    assert torch.isfinite(ref_value) and rel_err(results[F64][0], ref_value) <= TOL
    if magnitude == 80.0:  # e^800 is inf: there autograd of the plain formula gives inf·0 = NaN
        assert rel_err(results[F64][1], ref_grad) <= TOL


F32_EDGES = [  # (loss, options at the edge of their bounds, one option just past it)
    ("grpo", dict(eps_high=FLOAT32_MAX), ("eps_high", 1e39)),
    ("gspo", dict(eps_high=FLOAT32_MAX), ("eps_high", 1e39)),
    ("gspo_token", dict(eps_high=FLOAT32_MAX), ("eps_high", 1e39)),
    ("cispo", dict(eps_high=FLOAT32_MAX), ("eps_high", 1e39)),
    ("sapo", dict(tau_pos=4 / FLOAT32_MAX, tau_neg=FLOAT32_MAX), ("tau_pos", FLOAT32_TINY)),
    ("sapo", dict(tau_pos=FLOAT32_MAX, tau_neg=4 / FLOAT32_MAX), ("tau_pos", 1e39)),
]


@pytest.mark.parametrize(("loss", "options", "past"), F32_EDGES, ids=[f"{n}-{p[0]}={p[1]:g}" for n, _, p in F32_EDGES])
def test_the_float32_bounds_of_the_options_are_where_a_float32_loss_breaks(loss, options, past):
    """At its bound an option still gives a finite float32 loss and gradient; just past it (set on the
    frozen object, past the check) the same step fails or turns non-finite, so the bound is no stricter
    than it must be."""
    torch.manual_seed(0)
    lp = -3 * torch.rand(16)  # [16]
    old, adv = lp + torch.randn(16), 2 * torch.rand(16) - 1  # log-ratios around ±1, advantages in [-1, 1]
    mask, doc = torch.ones(16), torch.arange(16) // 4

    def run(objective):
        leaf = lp.clone().requires_grad_(True)
        value, _ = policy_loss(leaf, LossInputs(proximal_logprobs=old, advantages=adv, mask=mask, document_index=doc),
                               LossSpec(objective))
        value.backward()
        return torch.isfinite(value).item() and torch.isfinite(leaf.grad).all().item()

    at_edge = make_loss(loss, **options)
    assert run(at_edge)
    object.__setattr__(at_edge, *past)
    try:
        assert not run(at_edge)
    except RuntimeError as err:  # torch refuses a clamp bound beyond float32
        assert "overflow" in str(err)
