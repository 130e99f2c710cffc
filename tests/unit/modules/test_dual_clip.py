"""The dual clip of grpo and gspo_token (math.md#dual-clip, `loss.dual_clip`) against hand-derived values and
the float64 references of ``dual_clip_reference.py``: value, gradient and ``dual_clipped_fraction`` through
`policy_loss`, random splits into micro-batches and the fused head; its bounds; extreme ratios.

How they fail when the code is broken: a cap that is missing, applied to A >= 0, applied at the wrong
threshold or that lets a gradient through changes the hand-derived values and the reference's value or
gradient; a metric over documents instead of tokens, or over the wrong tokens, fails the metric checks
(the gspo_token hand example has a document with advantages of both signs).
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from dual_clip_reference import ref_dual_clip_loss, ref_dual_clip_metrics
from loss_args import loss_spec, step_inputs
from rl_reference import AGGREGATIONS, F64, documents, make_step, ref_head, rel_err
from test_invariance import _micro_batches, _random_pieces, _split_run
from test_loss_registry import _case

from rlcli.modules import (
    HeadSpec,
    LossInputs,
    LossSpec,
    finalize_metrics,
    fused_micro_batch_loss,
    make_loss,
    policy_loss,
)
from rlcli.modules.bounds import FLOAT32_MAX
from rlcli.modules.losses import GRPO, GSPOToken

TOL = 1e-10  # float64 against the reference
SPLIT_TOL = 1e-9  # float64, a split step against the whole one
LOSSES = ("grpo", "gspo_token")
# c where the cap acts on some negative-advantage tokens of these steps and not on all (checked below):
# token ratios spread wider than the document ratios R_d
OPTIONS = {"grpo": dict(dual_clip=1.3, eps_low=0.1, eps_high=0.15),
           "gspo_token": dict(dual_clip=1.08, eps_low=0.1, eps_high=0.05)}
CASES = [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS]
CASE_IDS = [f"{loss}-{agg}-{div}" for loss, agg, div in CASES]


def _run(step, lp, *, loss, aggregation="token_mean", divisor=None, entropy=None, metrics="basic", **options):
    """`policy_loss` on ``step`` with the log-probs ``lp``: value, gradient w.r.t. ``lp``, metrics."""
    leaf = lp.detach().clone().requires_grad_(True)
    spec = loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, metrics=metrics, **options)
    value, step_metrics = policy_loss(leaf, step_inputs(step, leaf.dtype), spec, entropy=entropy)
    value.backward()
    return value.detach(), leaf.grad, step_metrics


def _reference(step, lp, *, loss, aggregation="token_mean", divisor=None, **options):
    """The reference value and its gradient w.r.t. ``lp`` (float64)."""
    leaf = lp.detach().to(F64).clone().requires_grad_(True)
    value = ref_dual_clip_loss(leaf, step["old"], step["adv"], step["mask"], step["doc"], step["group"], loss=loss,
                               aggregation=aggregation, divisor=divisor, **options)
    value.backward()
    return value.detach(), leaf.grad


def _assert_metrics(metrics, expected, tol=TOL):
    assert set(metrics) - {"loss"} == set(expected)
    for name, want in expected.items():
        assert metrics[name].item() == pytest.approx(want, rel=tol, abs=1e-13), name


def _negative_fraction(step) -> float:
    """μ(1[A_t < 0]): the largest dual_clipped_fraction can be."""
    docs = documents(step["mask"], step["doc"])
    return sum(sum(step["adv"][t].item() < 0 for t in d.labelled) / max(len(d.labelled), 1) for d in docs) / len(docs)


# --------------------------------------------------------------------------------------------
# hand-derived examples
# --------------------------------------------------------------------------------------------


def _one_token_per_document(log_ratios, advantages):
    n = len(log_ratios)
    return LossInputs(proximal_logprobs=-torch.tensor(log_ratios, dtype=F64), advantages=torch.tensor(advantages,
                      dtype=F64), mask=torch.ones(n, dtype=F64), document_index=torch.arange(n))


def test_grpo_on_a_hand_derived_example():
    """A = −1, r = 5, c = 3: ℓ = min(5, 3) = 3 with gradient 0. The others are untouched: A = −1, r = 2 is under
    the cap (ℓ = 2, dℓ/dlp = r|A| = 2); A = +1, r = 5 is the clip's (−min(5, 1.2) = −1.2, gradient 0); A = −2,
    r = 0.5 takes the lower clip (−min(−1, −1.6) = 1.6 < 6). D = 4, divisor 1: L = (3 + 2 − 1.2 + 1.6)/4."""
    inputs = _one_token_per_document([math.log(5), math.log(2), math.log(5), math.log(0.5)], [-1.0, -1.0, 1.0, -2.0])
    leaf = torch.zeros(4, dtype=F64, requires_grad=True)  # lp = 0, old = −log r
    value, metrics = policy_loss(leaf, inputs, LossSpec(GRPO(dual_clip=3), aggregation="constant", divisor=1.0))
    value.backward()
    assert value.item() == pytest.approx(1.35, rel=1e-14)
    assert leaf.grad.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0], abs=1e-15)
    assert metrics["dual_clipped_fraction"].item() == 0.25  # the first document's one token
    # without the dual clip the first token's loss is 5, with gradient r|A| = 5: L = (5 + 2 − 1.2 + 1.6)/4
    leaf.grad = None
    value, metrics = policy_loss(leaf, inputs, LossSpec(GRPO(), aggregation="constant", divisor=1.0))
    value.backward()
    assert value.item() == pytest.approx(1.85, rel=1e-14) and leaf.grad[0].item() == pytest.approx(1.25, rel=1e-14)
    assert "dual_clipped_fraction" not in metrics


def test_gspo_token_on_a_hand_derived_example():
    """Document 0: two tokens with log-ratios log 5 ± 0.3, so R_d = 5, and A = (−1, +1): the first is capped,
    ℓ = min(5, 3) = 3, the second clipped, ℓ = −min(5, 1.2) = −1.2; both have gradient 0. Document 1: r = 2,
    A = −1, under the cap: ℓ = 2, dℓ/dlp = R_d |A| = 2. D = 2, divisor 1: L = (3 − 1.2 + 2)/2 = 1.9.
    dual_clipped_fraction = (1/2 + 0)/2: over tokens, half of document 0's."""
    inputs = LossInputs(proximal_logprobs=-torch.tensor([math.log(5) + 0.3, math.log(5) - 0.3, math.log(2)], dtype=F64),
                        advantages=torch.tensor([-1.0, 1.0, -1.0], dtype=F64), mask=torch.ones(3, dtype=F64),
                        document_index=torch.tensor([0, 0, 1]))
    leaf = torch.zeros(3, dtype=F64, requires_grad=True)
    value, metrics = policy_loss(leaf, inputs, LossSpec(GSPOToken(dual_clip=3), aggregation="constant", divisor=1.0))
    value.backward()
    assert value.item() == pytest.approx(1.9, rel=1e-14)
    assert leaf.grad.tolist() == pytest.approx([0.0, 0.0, 1.0], abs=1e-14)
    assert metrics["dual_clipped_fraction"].item() == 0.25
    assert metrics["clipped_ratio_fraction"].item() == 1.0  # over documents: both R_d outside [0.8, 1.2]


# --------------------------------------------------------------------------------------------
# options and bounds
# --------------------------------------------------------------------------------------------


def test_the_option_is_off_by_default_and_of_grpo_and_gspo_token_only():
    assert make_loss("grpo") == GRPO(dual_clip=None) and make_loss("gspo_token") == GSPOToken(dual_clip=None)
    assert make_loss("gspo_token", dual_clip=2.5).dual_clip == 2.5
    for loss in ("gspo", "cispo", "sapo"):
        with pytest.raises(ValueError, match=rf"^dual_clip is not an option of loss '{loss}'; it takes "):
            make_loss(loss, dual_clip=3)


@pytest.mark.parametrize("value", [1, 1.0, 0.5, 0, -3, math.inf, math.nan, 1e39, True, "3"])
@pytest.mark.parametrize("loss", LOSSES)
def test_dual_clip_out_of_bounds_raises_naming_it(loss, value):
    message = r"^dual_clip must be a number in \(1, 3.40282e\+38\]; got " + re.escape(repr(value)) + "$"
    with pytest.raises(ValueError, match=message):
        make_loss(loss, dual_clip=value)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_cap_that_never_acts_changes_nothing(loss):
    """With c above every ratio the loss and its gradient are the plain loss's, bit for bit, and the fraction is 0."""
    step = make_step(4, log_ratio_std=0.4)
    value, grad, metrics = _run(step, step["lp"], loss=loss)
    capped_value, capped_grad, capped_metrics = _run(step, step["lp"], loss=loss, dual_clip=FLOAT32_MAX)
    assert torch.equal(value, capped_value) and torch.equal(grad, capped_grad)
    assert capped_metrics.pop("dual_clipped_fraction").item() == 0.0
    assert capped_metrics.keys() == metrics.keys()


# --------------------------------------------------------------------------------------------
# policy_loss against the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_policy_loss_matches_the_reference(loss, aggregation, divisor):
    options = OPTIONS[loss]
    for seed in (0, 1, 2):
        step = make_step(seed, log_ratio_std=0.4)
        entropy = 3 * torch.rand(step["mask"].numel(), generator=torch.Generator().manual_seed(seed), dtype=F64)
        kw = dict(loss=loss, aggregation=aggregation, divisor=divisor)
        value, grad, metrics = _run(step, step["lp"], **kw, metrics="with_entropy", entropy=entropy, **options)
        ref_value, ref_grad = _reference(step, step["lp"], **kw, **options)
        assert rel_err(value, ref_value) <= TOL and rel_err(grad, ref_grad) <= TOL
        assert ref_grad.abs().max() > 0 and torch.all(grad[step["mask"] == 0] == 0)
        expected = ref_dual_clip_metrics(step["lp"], step["old"], step["adv"], step["mask"], step["doc"], loss=loss,
                                         entropy=entropy, **options)
        _assert_metrics(metrics, expected)
        # the cap acts on some negative-advantage tokens, not on all, and changes the loss
        assert 0 < expected["dual_clipped_fraction"] < _negative_fraction(step)
        plain, _ = _reference(step, step["lp"], **kw, **options | {"dual_clip": None})
        assert ref_value.item() < plain.item() - 1e-6


# --------------------------------------------------------------------------------------------
# micro-batches and the fused head
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_random_splits_reproduce_the_whole_step(loss, aggregation, divisor):
    rng = random.Random(f"dual{loss}{aggregation}{divisor}")
    options = OPTIONS[loss]
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor)
    for trial in range(4):
        step = make_step(900 + trial, num_docs=14, num_groups=4, empty_docs=2, log_ratio_std=0.4)
        entropy = torch.rand(step["mask"].numel(), generator=torch.Generator().manual_seed(trial), dtype=F64)
        whole, whole_grad, whole_metrics = _run(step, step["lp"], **kw, metrics="with_entropy", entropy=entropy,
                                                **options)
        assert whole_metrics["dual_clipped_fraction"] > 0
        index_of_mb = _micro_batches(step, _random_pieces(step, rng.randint(1, 8), rng))
        lp = step["lp"].clone().requires_grad_(True)
        split, split_metrics = _split_run(step, lp, entropy, index_of_mb, all_reduce_flat=trial % 2 == 1, **kw,
                                          metrics="with_entropy", **options)
        split.backward()
        assert rel_err(split, whole) <= SPLIT_TOL and rel_err(lp.grad, whole_grad) <= SPLIT_TOL
        assert split_metrics.keys() == whole_metrics.keys()
        for name in whole_metrics:
            assert split_metrics[name].item() == pytest.approx(whole_metrics[name].item(), rel=SPLIT_TOL,
                                                               abs=1e-14), name
        ref_value, _ = _reference(step, step["lp"], **kw, **options)
        assert split.item() == pytest.approx(ref_value.item(), rel=SPLIT_TOL)


@pytest.mark.parametrize("chunk_tokens", [0, 1, 3])
@pytest.mark.parametrize(("aggregation", "divisor"), [("sample_mean", None), ("constant", 37.5)])
@pytest.mark.parametrize("loss", LOSSES)
def test_the_fused_head_matches_the_reference(loss, aggregation, divisor, chunk_tokens):
    step = _case(3)
    # the old log-probs around the head's at temperature 0.7, so that ratios spread around 1
    head_lp, _ = ref_head(step["hidden"], step["weight"], step["labels"], 0.7)
    noise = 0.4 * torch.randn(head_lp.shape, generator=torch.Generator().manual_seed(chunk_tokens), dtype=F64)
    step["old"] = torch.where(step["mask"] > 0, head_lp + noise, step["old"])
    options = OPTIONS[loss]
    hidden = step["hidden"].clone().requires_grad_(True)
    weight = step["weight"].clone().requires_grad_(True)
    spec = loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, **options)
    value, partials = fused_micro_batch_loss(hidden, weight, step["labels"],
                                             step_inputs(step, group_index=step["group_index"]), step["totals"], spec,
                                             HeadSpec(temperature=0.7, chunk_tokens=chunk_tokens))
    value.backward()
    h = step["hidden"].clone().requires_grad_(True)
    w = step["weight"].clone().requires_grad_(True)
    ref_lp, _ = ref_head(h, w, step["labels"], 0.7)
    ref_value = ref_dual_clip_loss(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], step["group"],
                                   loss=loss, aggregation=aggregation, divisor=divisor, **options)
    ref_value.backward()
    assert rel_err(value, ref_value) <= TOL
    assert rel_err(hidden.grad, h.grad) <= TOL and rel_err(weight.grad, w.grad) <= TOL
    expected = ref_dual_clip_metrics(ref_lp, step["old"], step["adv"], step["mask"], step["doc"], loss=loss, **options)
    assert expected["dual_clipped_fraction"] > 0
    _assert_metrics(finalize_metrics(partials, step["totals"]), expected)


# --------------------------------------------------------------------------------------------
# extreme ratios
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("magnitude", [80.0, 800.0])
@pytest.mark.parametrize("loss", LOSSES)
def test_huge_ratios_with_negative_advantages_are_capped_finite_without_gradient(loss, magnitude):
    """Every labelled token gets a log-ratio of +magnitude and a negative advantage: e^800 overflows even in
    float64, and without the cap the loss is inf (or, for e^80, huge). With it every token's loss is c|A_t|,
    and its gradient exactly 0, in float32 and float64 alike."""
    step = make_step(12, num_docs=8, empty_docs=1)
    labelled = step["mask"] > 0
    step["old"] = torch.where(labelled, step["lp"] - magnitude, step["old"])
    step["adv"] = torch.where(labelled, -step["adv"].abs() - 0.1, step["adv"])
    for dtype in (torch.float32, F64):
        value, grad, metrics = _run(step, step["lp"].to(dtype), loss=loss, dual_clip=3.0)
        assert torch.all(grad == 0), dtype
        # token_mean: L = 3·Σ|A_t| / T
        expected = 3.0 * step["adv"][labelled].abs().sum().item() / labelled.sum().item()
        assert value.item() == pytest.approx(expected, rel=1e-6 if dtype == torch.float32 else 1e-14), dtype
        assert metrics["dual_clipped_fraction"].item() == pytest.approx(_negative_fraction(step), rel=1e-12)
        ref_value, _ = _reference(step, step["lp"], loss=loss, dual_clip=3.0)
        assert value.item() == pytest.approx(ref_value.item(), rel=1e-6)


def test_the_float32_bound_of_dual_clip_is_where_a_float32_loss_breaks():
    """At c = 3.4e38 a float32 token with an overflowing ratio and |A| <= 1 has a finite capped loss; just past
    the bound (set on the frozen object, past the check) the same step gives inf."""
    lp = torch.zeros(4)
    inputs = LossInputs(proximal_logprobs=torch.full((4,), -100.0), advantages=torch.tensor([-1.0, -0.5, 0.5, -1.0]),
                        mask=torch.ones(4), document_index=torch.arange(4))
    loss = GRPO(dual_clip=FLOAT32_MAX)
    value, _ = policy_loss(lp, inputs, LossSpec(loss, aggregation="constant", divisor=4.0))
    assert torch.isfinite(value)
    object.__setattr__(loss, "dual_clip", 1e39)
    value, _ = policy_loss(lp, inputs, LossSpec(loss, aggregation="constant", divisor=4.0))
    assert not torch.isfinite(value)
