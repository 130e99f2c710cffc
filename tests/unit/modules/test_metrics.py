"""The metrics of math.md#metrics against the float64 reference, for every level."""

from __future__ import annotations

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import F64, LOSSES, make_step, ref_head, ref_metrics

from rlcli.modules import HeadSpec, LossInputs, LossSpec, policy_loss, token_logprobs

BASIC = {
    "loss", "num_documents", "num_tokens",
    "old_logprobs", "new_logprobs", "ratio_new_old", "ratio_new_old_sum", "ratio_new_old_squared_sum",
    "kl_new_old", "clipped_ratio_fraction", "advantage", "max_advantage", "min_advantage",
}


def _expected_names(loss, level):
    if level == "none":
        return {"loss", "num_documents", "num_tokens"}
    names = set(BASIC)
    if loss == "gspo":
        names.add("num_segments")
    if level == "with_entropy":
        names.add("entropy")
    return names


@pytest.mark.parametrize("seed", [20, 21])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("level", ["none", "basic", "with_entropy"])
def test_metric_values_match_reference(loss, level, seed):
    # wide ratios so that some tokens and some documents are outside the clip band
    step = make_step(seed, num_docs=15, log_ratio_std=0.5, empty_docs=3)
    entropy = torch.rand(step["mask"].numel(), dtype=F64) if level == "with_entropy" else None
    _, metrics = policy_loss(step["lp"], step_inputs(step, group=False),
                             loss_spec(loss=loss, eps_low=0.15, eps_high=0.25, metrics=level), entropy=entropy)
    assert set(metrics) == _expected_names(loss, level)
    expected = ref_metrics(step["lp"], step["old"], step["adv"], step["mask"], step["doc"], loss=loss,
                           eps_low=0.15, eps_high=0.25, entropy=entropy)
    if level == "basic":
        # the data must exercise the clip metric
        assert 0 < expected["clipped_ratio_fraction"] < 1
    for name, value in metrics.items():
        assert value.dtype == F64 and value.dim() == 0 and not value.requires_grad, name
        if name != "loss":
            assert value.item() == pytest.approx(expected[name], rel=1e-12, abs=1e-14), name


@pytest.mark.parametrize("loss", LOSSES)
def test_entropy_metric_against_full_float64_logits(loss):
    step = make_step(22, num_docs=8, max_len=8)
    n = step["mask"].numel()
    g = torch.Generator().manual_seed(22)
    hidden = torch.randn(n, 16, generator=g, dtype=F64)
    weight = torch.randn(40, 16, generator=g, dtype=F64) * 0.7
    labels = torch.randint(0, 40, (n,), generator=g)
    labels = torch.where(step["mask"] > 0, labels, torch.full_like(labels, -100))
    temperature = 0.8
    with torch.no_grad():
        old, ref_entropy = ref_head(hidden, weight, labels, temperature)
    lp, entropy = token_logprobs(hidden.float(), weight.float(), labels,
                                 HeadSpec(temperature=temperature, chunk_tokens=6), with_entropy=True)
    inputs = LossInputs(proximal_logprobs=old.float(), advantages=step["adv"].float(), mask=step["mask"],
                        document_index=step["doc"])
    _, metrics = policy_loss(lp, inputs, LossSpec(loss, metrics="with_entropy"), entropy=entropy)
    expected = ref_metrics(old, old, step["adv"], step["mask"], step["doc"], loss=loss, entropy=ref_entropy)
    assert metrics["entropy"].item() == pytest.approx(expected["entropy"], rel=1e-6)
    assert metrics["new_logprobs"].item() == pytest.approx(expected["new_logprobs"], rel=1e-6)
    assert metrics["ratio_new_old"].item() == pytest.approx(expected["ratio_new_old"], rel=1e-6)


def test_metrics_do_not_depend_on_aggregation():
    step = make_step(23)
    results = []
    for aggregation, divisor in [("token_mean", None), ("sample_mean", None), ("prompt_mean", None), ("constant", 3.0)]:
        _, m = policy_loss(step["lp"], step_inputs(step), LossSpec("gspo", aggregation=aggregation, divisor=divisor))
        results.append({k: v.item() for k, v in m.items() if k != "loss"})
    assert all(r == results[0] for r in results)
