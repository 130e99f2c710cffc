"""GRPO/GSPO × aggregation: loss and gradient w.r.t. the log-probs (math.md#policy-losses, #aggregation).

Each case is checked against the independent float64 reference of ``rl_reference.py``, against
central finite differences, and against numbers derived on paper.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import AGGREGATIONS, F64, LOSSES, documents, make_step, ref_loss, rel_err

from rlcli.modules import LossInputs, LossSpec, policy_loss

CASES = [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS]
CASE_IDS = [f"{loss}-{agg}-{div}" for loss, agg, div in CASES]


def _run(step, lp, *, loss, aggregation, divisor, group=True, entropy=None, **kw):
    return policy_loss(lp, step_inputs(step, lp.dtype, group=group),
                       loss_spec(loss=loss, aggregation=aggregation, divisor=divisor, **kw), entropy=entropy)


def _one_document(old, adv):
    """The inputs of one document whose tokens are all labelled."""
    n = old.numel()
    return LossInputs(proximal_logprobs=old, advantages=adv, mask=torch.ones(n, dtype=F64),
                      document_index=torch.zeros(n, dtype=torch.long))


def _grad(step, lp_values, **kw):
    lp = lp_values.detach().clone().requires_grad_(True)
    value, metrics = _run(step, lp, **kw)
    value.backward()
    return value.detach(), lp.grad, metrics


def _ref_grad(step, **kw):
    lp = step["lp"].detach().clone().requires_grad_(True)
    value = ref_loss(lp, step["old"], step["adv"], step["mask"], step["doc"], step["group"], **kw)
    value.backward()
    return value.detach(), lp.grad


# --------------------------------------------------------------------------------------------
# against the float64 reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_loss_and_grad_match_reference_float64(loss, aggregation, divisor, seed):
    step = make_step(seed, log_ratio_std=0.3 if seed != 2 else 0.05)
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor, eps_low=0.2, eps_high=0.28)
    ref_value, ref_g = _ref_grad(step, **kw)
    value, g, metrics = _grad(step, step["lp"], **kw)
    assert value.dtype == F64
    assert rel_err(value, ref_value) <= 1e-12
    assert rel_err(g, ref_g) <= 1e-12
    assert metrics["loss"].item() == pytest.approx(ref_value.item(), rel=1e-12, abs=1e-15)
    # masked tokens never receive gradient
    assert torch.all(g[step["mask"] == 0] == 0)
    # group_index is optional except for prompt_mean, and does not change the other modes
    if aggregation != "prompt_mean":
        value2, g2, _ = _grad(step, step["lp"], group=False, **kw)
        assert rel_err(value2, ref_value) <= 1e-12 and rel_err(g2, ref_g) <= 1e-12


@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_loss_and_grad_match_reference_float32(loss, aggregation, divisor):
    step = make_step(7)
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor)
    # the reference sees exactly the float32 inputs
    step32 = {k: (v.float().to(F64) if v.is_floating_point() else v) for k, v in step.items()}
    ref_value, ref_g = _ref_grad(step32, **kw)
    value, g, _ = _grad(step32, step32["lp"].float(), **kw)
    assert value.dtype == torch.float32 and g.dtype == torch.float32
    assert rel_err(value, ref_value) <= 1e-5
    assert rel_err(g, ref_g) <= 1e-5


def _clip_margin(step, eps_low, eps_high):
    """Smallest distance of any ratio (token or sequence) to a clip boundary."""
    r_tok = torch.exp(step["lp"] - step["old"])[step["mask"] > 0]
    margins = [torch.min(torch.abs(r_tok - b)).item() for b in (1 - eps_low, 1 + eps_high)]
    for d in documents(step["mask"], step["doc"]):
        if d.labelled:
            sel = torch.tensor(d.labelled)
            big_r = math.exp((step["lp"][sel] - step["old"][sel]).mean().item())
            margins += [abs(big_r - (1 - eps_low)), abs(big_r - (1 + eps_high))]
    return min(margins)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_gradient_matches_central_finite_differences(loss, aggregation, divisor):
    step = make_step(11, num_docs=8, max_len=6, log_ratio_std=0.4)
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor, eps_low=0.2, eps_high=0.25)
    h = 1e-6
    assert _clip_margin(step, 0.2, 0.25) > 100 * h, "the data must keep away from the kinks"
    _, g, _ = _grad(step, step["lp"], **kw)

    def f(lp):
        with torch.no_grad():
            return _run(step, lp, metrics="none", **kw)[0].item()

    fd = torch.zeros_like(step["lp"])
    for t in range(step["lp"].numel()):
        plus, minus = step["lp"].clone(), step["lp"].clone()
        plus[t] += h
        minus[t] -= h
        fd[t] = (f(plus) - f(minus)) / (2 * h)
    assert torch.count_nonzero(g) > 0
    assert torch.allclose(g, fd, rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------------------------
# numbers derived on paper
# --------------------------------------------------------------------------------------------

# GRPO, eps_low = eps_high = 0.2. Three documents (ids 10, 20, 30), groups 1, 2, 1:
#   t  doc grp m   r     A     min(rA, clip(r)A)        ℓ_t    dℓ/dlp (= −A·r unless clipped)
#   0  10  1   1   1.1   1     min(1.1, 1.1)            −1.1   −1.1
#   1  10  1   1   1.5   1     min(1.5, 1.2)  clipped   −1.2    0
#   2  20  2   1   0.5   −2    min(−1.0, −1.6) clipped   1.6    0
#   3  20  2   1   0.9   −2    min(−1.8, −1.8)           1.8    1.8
#   4  20  2   1   1.0   0.5   min(0.5, 0.5)            −0.5   −0.5
#   5  20  2   0   (garbage)                              0      0
#   6  30  1   0   (garbage: document without labels)     0      0
# D = 3, T = 5, n = (2, 3, 0), P = 2, T_1 = 2 (docs 10 and 30), T_2 = 3. Σ ℓ = 0.6.
#   token_mean  w = 1/5:          L = 0.6/5 = 0.12;                 g = (−0.22, 0, 0, 0.36, −0.1)
#   sample_mean w = 1/(n_d·3):    L = (−2.3/2 + 2.9/3)/3 = −11/180; g = (−1.1/6, 0, 0, 0.2, −0.5/9)
#   prompt_mean w = 1/(T_g·2):    L = −2.3/4 + 2.9/6 = −11/120;     g = (−0.275, 0, 0, 0.3, −0.5/6)
#   constant 4  w = 1/(4·3):      L = 0.6/12 = 0.05;                g = (−1.1/12, 0, 0, 0.15, −0.5/12)
HAND_GRPO = dict(
    log_ratio=[math.log(1.1), math.log(1.5), math.log(0.5), math.log(0.9), 0.0, 3.0, -4.0],
    adv=[1.0, 1.0, -2.0, -2.0, 0.5, 9.0, -9.0],
    mask=[1, 1, 1, 1, 1, 0, 0],
    doc=[10, 10, 20, 20, 20, 20, 30],
    group=[1, 1, 2, 2, 2, 2, 1],
)
HAND_GRPO_EXPECTED = {
    ("token_mean", None): (0.12, [-0.22, 0, 0, 0.36, -0.1, 0, 0]),
    ("sample_mean", None): (-11 / 180, [-1.1 / 6, 0, 0, 0.2, -0.5 / 9, 0, 0]),
    ("prompt_mean", None): (-11 / 120, [-0.275, 0, 0, 0.3, -0.5 / 6, 0, 0]),
    ("constant", 4.0): (0.05, [-1.1 / 12, 0, 0, 0.15, -0.5 / 12, 0, 0]),
}

# GSPO, eps 0.2. Two documents in different groups:
#   doc 10: two labelled tokens, log-ratios (log 2, log 0.5) -> both token ratios outside the band,
#           ρ = 0, R = 1 (inside); A = (1, 3) -> Ā = 2; λ = −min(2, 2) = −2; dλ/dρ = −Ā·R = −2.
#   doc 20: one labelled token, log-ratio log 1.1 -> R = 1.1; A = −1; λ = −min(−1.1, −1.1) = 1.1;
#           dλ/dρ = −Ā·R = 1.1; plus one masked token.
# dL/dlp_t = w_t·n_d·dλ/dρ·(1/n_d) = w_t·dλ/dρ.   D = 2, T = 3.
#   token_mean  L = (2·(−2) + 1.1)/3 = −2.9/3;  g = (−2/3, −2/3, 1.1/3, 0)
#   sample_mean L = (−2 + 1.1)/2 = −0.45;       g = (−2/4, −2/4, 1.1/2, 0)
#   constant 1  L = (2·(−2) + 1.1)/2 = −1.45;   g = (−2/2, −2/2, 1.1/2, 0)
HAND_GSPO = dict(
    log_ratio=[math.log(2.0), math.log(0.5), math.log(1.1), 5.0],
    adv=[1.0, 3.0, -1.0, 7.0],
    mask=[1, 1, 1, 0],
    doc=[10, 10, 20, 20],
    group=[1, 1, 2, 2],
)
HAND_GSPO_EXPECTED = {
    ("token_mean", None): (-2.9 / 3, [-2 / 3, -2 / 3, 1.1 / 3, 0]),
    ("sample_mean", None): (-0.45, [-0.5, -0.5, 0.55, 0]),
    ("constant", 1.0): (-1.45, [-1.0, -1.0, 0.55, 0]),
}


def _hand_step(spec):
    old = torch.linspace(-2.0, -0.5, len(spec["mask"]), dtype=F64)
    return dict(
        old=old,
        lp=old + torch.tensor(spec["log_ratio"], dtype=F64),
        adv=torch.tensor(spec["adv"], dtype=F64),
        mask=torch.tensor(spec["mask"], dtype=F64),
        doc=torch.tensor(spec["doc"]),
        group=torch.tensor(spec["group"]),
    )


@pytest.mark.parametrize(("loss", "table", "expected"), [
    ("grpo", HAND_GRPO, HAND_GRPO_EXPECTED),
    ("gspo", HAND_GSPO, HAND_GSPO_EXPECTED),
])
def test_hand_derived_values(loss, table, expected):
    step = _hand_step(table)
    for (aggregation, divisor), (value, grad) in expected.items():
        got, g, _ = _grad(step, step["lp"], loss=loss, aggregation=aggregation, divisor=divisor)
        assert got.item() == pytest.approx(value, rel=1e-12), aggregation
        assert g.tolist() == pytest.approx(grad, rel=1e-12, abs=1e-15), aggregation


def test_hand_derived_metrics():
    step = _hand_step(HAND_GRPO)
    lp = step["lp"]
    _, m = policy_loss(lp, step_inputs(step), LossSpec())
    # μ(r) = ((1.1 + 1.5)/2 + (0.5 + 0.9 + 1)/3 + 0)/3 = (1.3 + 0.8)/3
    assert m["ratio_new_old"].item() == pytest.approx(0.7, rel=1e-12)
    assert m["ratio_new_old_sum"].item() == pytest.approx(5.0, rel=1e-12)
    assert m["ratio_new_old_squared_sum"].item() == pytest.approx(1.21 + 2.25 + 0.25 + 0.81 + 1, rel=1e-12)
    # outside the band: token 1 (1.5) of doc 10 and token 2 (0.5) of doc 20 -> (1/2 + 1/3)/3
    assert m["clipped_ratio_fraction"].item() == pytest.approx(5 / 18, rel=1e-12)
    # μ(A) = (1 + (−2 − 2 + 0.5)/3 + 0)/3 = −1/18; max and min ignore the masked ±9
    assert m["advantage"].item() == pytest.approx(-1 / 18, rel=1e-12)
    assert m["max_advantage"].item() == 1.0 and m["min_advantage"].item() == -2.0

    def k(r):
        return r - 1 - math.log(r)

    assert m["kl_new_old"].item() == pytest.approx(((k(1.1) + k(1.5)) / 2 + (k(0.5) + k(0.9)) / 3) / 3, rel=1e-12)
    assert m["num_documents"].item() == 3 and m["num_tokens"].item() == 5
    old = step["old"].tolist()
    assert m["old_logprobs"].item() == pytest.approx(((old[0] + old[1]) / 2 + sum(old[2:5]) / 3) / 3, rel=1e-12)

    step = _hand_step(HAND_GSPO)
    _, m = policy_loss(step["lp"], step_inputs(step, group=False), LossSpec("gspo"))
    assert m["ratio_new_old"].item() == pytest.approx(1.05, rel=1e-12)  # (1 + 1.1)/2
    assert m["ratio_new_old_sum"].item() == pytest.approx(2.1, rel=1e-12)
    assert m["ratio_new_old_squared_sum"].item() == pytest.approx(2.21, rel=1e-12)
    assert m["kl_new_old"].item() == pytest.approx(k(1.1) / 2, rel=1e-12)
    assert m["clipped_ratio_fraction"].item() == 0.0  # token ratios 2 and 0.5 do not count
    assert m["num_segments"].item() == 2
    assert m["advantage"].item() == pytest.approx(0.5, rel=1e-12)  # (2 + (−1))/2
    assert m["max_advantage"].item() == 3.0 and m["min_advantage"].item() == -1.0


# --------------------------------------------------------------------------------------------
# clip boundaries (math.md#policy-losses: clip(x) = min(max(x, 1 − eps_low), 1 + eps_high))
# --------------------------------------------------------------------------------------------

EPS_LOW, EPS_HIGH, DELTA = 0.2, 0.3, 1e-3
# (advantage, ratio, clipped): with A > 0 only r > 1 + eps_high is clipped, with A < 0 only
# r < 1 − eps_low; just inside the band nothing is clipped.
CLIP_CASES = [
    (2.0, 1 + EPS_HIGH - DELTA, False),
    (2.0, 1 + EPS_HIGH + DELTA, True),
    (2.0, 1 - EPS_LOW + DELTA, False),
    (2.0, 1 - EPS_LOW - DELTA, False),
    (-2.0, 1 - EPS_LOW + DELTA, False),
    (-2.0, 1 - EPS_LOW - DELTA, True),
    (-2.0, 1 + EPS_HIGH - DELTA, False),
    (-2.0, 1 + EPS_HIGH + DELTA, False),
]


@pytest.mark.parametrize(("adv", "ratio", "clipped"), CLIP_CASES)
def test_grpo_clip_boundaries(adv, ratio, clipped):
    # one labelled token, token_mean: L = ℓ and dL/dlp = dℓ/dlp = −A·r (unclipped) or 0
    old = torch.tensor([-1.0], dtype=F64)
    lp = (old + math.log(ratio)).requires_grad_(True)
    value, m = policy_loss(lp, _one_document(old, torch.tensor([adv], dtype=F64)),
                           loss_spec(eps_low=EPS_LOW, eps_high=EPS_HIGH))
    value.backward()
    bound = min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
    if clipped:
        assert value.item() == pytest.approx(-bound * adv, rel=1e-12)
        assert lp.grad.item() == 0.0
    else:
        assert value.item() == pytest.approx(-ratio * adv, rel=1e-12)
        assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-12)
    outside = ratio < 1 - EPS_LOW or ratio > 1 + EPS_HIGH
    assert m["clipped_ratio_fraction"].item() == float(outside)


@pytest.mark.parametrize(("adv", "seq_ratio", "clipped"), CLIP_CASES)
def test_gspo_clip_boundaries_follow_the_sequence_ratio(adv, seq_ratio, clipped):
    # three labelled tokens whose log-ratios average to log R: two of them lie far outside the band
    rho = math.log(seq_ratio)
    old = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
    lp = (old + torch.tensor([rho + 0.6, rho - 0.6, rho], dtype=F64)).requires_grad_(True)
    advs = torch.tensor([adv + 1.0, adv - 0.5, adv - 0.5], dtype=F64)  # Ā = adv
    value, m = policy_loss(lp, _one_document(old, advs),
                           loss_spec(loss="gspo", aggregation="sample_mean", eps_low=EPS_LOW, eps_high=EPS_HIGH))
    value.backward()
    bound = min(max(seq_ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
    if clipped:
        assert value.item() == pytest.approx(-bound * adv, rel=1e-12)
        assert torch.all(lp.grad == 0)
    else:
        # L = λ, dλ/dlp_t = −Ā·R/n for every token
        assert value.item() == pytest.approx(-seq_ratio * adv, rel=1e-12)
        assert lp.grad.tolist() == pytest.approx([-adv * seq_ratio / 3] * 3, rel=1e-12)
    outside = seq_ratio < 1 - EPS_LOW or seq_ratio > 1 + EPS_HIGH
    assert m["clipped_ratio_fraction"].item() == float(outside)


def test_gspo_token_ratios_outside_but_sequence_inside_is_not_clipped():
    # token ratios e^{±0.5} = 1.65, 0.61 are both outside [0.8, 1.2]; R = e^0 = 1 is inside.
    old = torch.tensor([-1.0, -1.0], dtype=F64)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    for loss in LOSSES:
        lp = (old + torch.tensor([0.5, -0.5], dtype=F64)).requires_grad_(True)
        value, _ = policy_loss(lp, _one_document(old, adv), LossSpec(loss))
        value.backward()
        if loss == "gspo":
            # λ = −R·Ā = −1, dL/dlp_t = −Ā·R/n = −0.5 on both tokens
            assert value.item() == pytest.approx(-1.0, rel=1e-12)
            assert lp.grad.tolist() == pytest.approx([-0.5, -0.5], rel=1e-12)
        else:
            # GRPO clips token 0 (r > 1.2, A > 0) but not token 1 (r < 0.8, A > 0)
            assert lp.grad[0].item() == 0.0 and lp.grad[1].item() != 0.0


def test_gspo_sequence_ratio_outside_clips_tokens_whose_own_ratio_is_inside():
    # ρ is the mean of the token log-ratios, so when every token ratio is inside the band R is too;
    # here two of three tokens are inside (r = 1.1) and the third (r = 3) drags R outside:
    # R = (1.1·1.1·3)^(1/3) = 1.537 > 1.2 with Ā = 1 > 0 -> clipped: λ = −1.2, zero gradient on
    # every token, although GRPO would train the two tokens with r = 1.1.
    old = torch.tensor([-1.0, -1.5, -2.0], dtype=F64)
    log_r = torch.tensor([math.log(1.1), math.log(1.1), math.log(3.0)], dtype=F64)
    adv = torch.ones(3, dtype=F64)
    out = {}
    for loss in LOSSES:
        lp = (old + log_r).requires_grad_(True)
        value, _ = policy_loss(lp, _one_document(old, adv), LossSpec(loss, aggregation="sample_mean"))
        value.backward()
        out[loss] = (value.item(), lp.grad)
    assert out["gspo"][0] == pytest.approx(-1.2, rel=1e-12)
    assert torch.all(out["gspo"][1] == 0)
    assert out["grpo"][1].tolist() == pytest.approx([-1.1 / 3, -1.1 / 3, 0.0], rel=1e-12)


# --------------------------------------------------------------------------------------------
# masked tokens, empty documents, empty steps
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_masked_tokens_contribute_nothing(loss, aggregation, divisor):
    step = make_step(3, empty_docs=3)
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor)
    value, g, metrics = _grad(step, step["lp"], **kw)
    masked = step["mask"] == 0
    other = dict(step)
    # extreme (finite) values where m_t = 0: a ratio of e^{±1e4}, an advantage of 1e6
    other["lp"] = torch.where(masked, torch.full_like(step["lp"], -1e4), step["lp"])
    other["old"] = torch.where(masked, torch.full_like(step["old"], 1e-3), step["old"])
    other["adv"] = torch.where(masked, torch.full_like(step["adv"], 1e6), step["adv"])
    value2, g2, metrics2 = _grad(other, other["lp"], **kw)
    assert torch.isfinite(value2) and torch.all(torch.isfinite(g2))
    assert value2.item() == pytest.approx(value.item(), rel=1e-14, abs=1e-16)
    assert torch.all(g2[masked] == 0) and torch.allclose(g2, g, rtol=1e-14, atol=0)
    assert metrics2.keys() == metrics.keys()
    for name in metrics:
        assert torch.isfinite(metrics2[name]), name
        assert metrics2[name].item() == pytest.approx(metrics[name].item(), rel=1e-13, abs=1e-15), name


@pytest.mark.parametrize("loss", LOSSES)
def test_non_finite_values_under_the_mask_are_ignored(loss):
    step = make_step(3)
    masked = step["mask"] == 0
    value, g, _ = _grad(step, step["lp"], loss=loss, aggregation="token_mean", divisor=None)
    other = dict(step)
    other["old"] = torch.where(masked, torch.full_like(step["old"], -math.inf), step["old"])
    other["adv"] = torch.where(masked, torch.full_like(step["adv"], math.nan), step["adv"])
    value2, g2, metrics2 = _grad(other, other["lp"], loss=loss, aggregation="token_mean", divisor=None)
    assert value2.item() == pytest.approx(value.item(), rel=1e-14)
    assert torch.equal(g2, g)
    assert all(torch.isfinite(v) for v in metrics2.values())


@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
def test_documents_without_labels_only_count_in_D(loss, aggregation, divisor):
    # adding a document without labelled tokens to a new group changes D (and P) but adds nothing
    step = make_step(4, empty_docs=0)
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor)
    value, g, _ = _grad(step, step["lp"], **kw)
    extra = {k: torch.cat([v, v[:3]]) for k, v in step.items()}
    extra["mask"][-3:] = 0
    extra["doc"][-3:] = 123_456
    extra["group"][-3:] = 654_321
    value2, g2, m2 = _grad(extra, extra["lp"], **kw)
    num_docs = len(documents(step["mask"], step["doc"]))
    factor = {"token_mean": 1.0, "sample_mean": num_docs / (num_docs + 1),
              "prompt_mean": None, "constant": num_docs / (num_docs + 1)}[aggregation]
    if factor is None:
        num_groups = step["group"].unique().numel()
        factor = num_groups / (num_groups + 1)
    assert value2.item() == pytest.approx(value.item() * factor, rel=1e-12)
    assert torch.allclose(g2[:-3], g * factor, rtol=1e-12, atol=1e-16)
    assert torch.all(g2[-3:] == 0)
    assert m2["num_documents"].item() == num_docs + 1


@pytest.mark.parametrize(("loss", "aggregation", "divisor"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_step_without_labelled_tokens(loss, aggregation, divisor, dtype):
    step = make_step(5)
    step["mask"] = torch.zeros_like(step["mask"])
    entropy = 3 * torch.rand(len(step["lp"]), generator=torch.Generator().manual_seed(5), dtype=dtype)
    value, g, metrics = _grad(step, step["lp"].to(dtype), loss=loss, aggregation=aggregation,
                              divisor=divisor, metrics="with_entropy", entropy=entropy)
    assert value.item() == 0.0
    assert torch.all(g == 0)
    assert metrics["loss"].item() == 0.0 and metrics["num_tokens"].item() == 0
    assert metrics["num_documents"].item() == len(documents(step["mask"], step["doc"]))
    for name, v in metrics.items():
        assert torch.isfinite(v).all(), name
    # no labelled advantage: no max/min to report (and never a 0 placeholder)
    assert "max_advantage" not in metrics and "min_advantage" not in metrics


# --------------------------------------------------------------------------------------------
# old = new
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_on_policy_grpo_equals_gspo(aggregation, divisor):
    # r_t = R_d = 1: ℓ_t = −A_t (grpo) and λ_d = −Ā_d (gspo); the weights are constant inside a
    # document, so both losses are −Σ_t w_t A_t and the gradients agree summed over a document.
    step = make_step(6)
    step["old"] = step["lp"].clone()
    out = {}
    for loss in LOSSES:
        out[loss] = _grad(step, step["lp"], loss=loss, aggregation=aggregation, divisor=divisor)
    assert out["grpo"][0].item() == pytest.approx(out["gspo"][0].item(), rel=1e-12, abs=1e-15)
    ref = ref_loss(step["lp"], step["old"], step["adv"], step["mask"], step["doc"], step["group"],
                   loss="grpo", aggregation=aggregation, divisor=divisor)
    assert out["grpo"][0].item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-15)
    for d in documents(step["mask"], step["doc"]):
        sel = torch.tensor(d.positions)
        assert out["grpo"][1][sel].sum().item() == pytest.approx(out["gspo"][1][sel].sum().item(), rel=1e-10, abs=1e-15)
    for loss in LOSSES:
        m = out[loss][2]
        assert m["ratio_new_old"].item() == pytest.approx(
            sum(1 for d in documents(step["mask"], step["doc"]) if d.labelled) / m["num_documents"].item())
        assert m["kl_new_old"].item() == 0.0 and m["clipped_ratio_fraction"].item() == 0.0
