"""Every invalid argument raises ``ValueError`` naming it; the valid edge values do not raise."""

from __future__ import annotations

import math

import pytest
import torch
from loss_args import loss_spec

from rlcli.modules import (
    HeadSpec,
    LossInputs,
    LossSpec,
    Segments,
    StepTotals,
    micro_batch_loss,
    policy_loss,
    token_logprobs,
)

N = 5


def _step(**override):
    step = dict(
        logprobs=-torch.rand(N, dtype=torch.float64),
        proximal_logprobs=-torch.rand(N, dtype=torch.float64),
        advantages=torch.randn(N, dtype=torch.float64),
        mask=torch.tensor([0, 1, 1, 0, 1], dtype=torch.float64),
        document_index=torch.tensor([0, 0, 0, 1, 1]),
        group_index=torch.tensor([4, 4, 4, 9, 9]),
    )
    step.update(override)
    return step


def _inputs(step):
    names = ("proximal_logprobs", "advantages", "mask", "document_index", "group_index")
    return LossInputs(**{name: step[name] for name in names})


def _call(options=None, **override):
    options = dict(options or {})
    entropy = options.pop("entropy", None)
    step = _step(**override)
    return policy_loss(step["logprobs"], _inputs(step), loss_spec(**options), entropy=entropy)


OPTION_ERRORS = [
    (dict(loss="ppo"), "loss"),
    (dict(loss="GRPO"), "loss"),
    (dict(aggregation="mean"), "aggregation"),
    (dict(aggregation="seq_mean_token_sum"), "aggregation"),
    (dict(metrics="all"), "metrics"),
    (dict(metrics=None), "metrics"),
    (dict(aggregation="constant"), "divisor"),
    (dict(aggregation="constant", divisor=None), "divisor"),
    (dict(aggregation="constant", divisor=0), "divisor"),
    (dict(aggregation="constant", divisor=0.0), "divisor"),
    (dict(aggregation="constant", divisor=-3.0), "divisor"),
    (dict(aggregation="constant", divisor=math.nan), "divisor"),
    (dict(aggregation="constant", divisor=math.inf), "divisor"),
    (dict(aggregation="constant", divisor=-math.inf), "divisor"),
    (dict(aggregation="constant", divisor="512"), "divisor"),
    (dict(aggregation="constant", divisor=5e-324), "divisor"),  # 0 in float32: the weights 1 / (divisor·D) are inf
    (dict(aggregation="token_mean", divisor=1.0), "divisor"),
    (dict(aggregation="sample_mean", divisor=512), "divisor"),
    (dict(aggregation="prompt_mean", divisor=1.0), "divisor"),
    (dict(eps_low=-0.1), "eps_low"),
    (dict(eps_low=1.0), "eps_low"),
    (dict(eps_low=1.5), "eps_low"),
    (dict(eps_low=math.nan), "eps_low"),
    (dict(eps_high=-0.1), "eps_high"),
    (dict(eps_high=-1e-9), "eps_high"),
    (dict(eps_high=1e39), "eps_high"),
    (dict(eps_high=math.nan), "eps_high"),
    (dict(eps_high=math.inf), "eps_high"),
]


@pytest.mark.parametrize(("options", "name"), OPTION_ERRORS, ids=[f"{o}" for o, _ in OPTION_ERRORS])
def test_invalid_option_raises_naming_it(options, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _call(options)
    full = dict(loss="grpo", aggregation="token_mean", divisor=None, eps_low=0.2, eps_high=0.2, metrics="basic")
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        loss_spec(**(full | options))


@pytest.mark.parametrize("options", [
    dict(eps_low=0.0, eps_high=0.0),
    dict(eps_low=0.999, eps_high=10.0),
    dict(aggregation="constant", divisor=1),
    dict(aggregation="constant", divisor=1e-6),
    dict(aggregation="constant", divisor=4096.0),
    dict(loss="gspo", aggregation="prompt_mean"),
    dict(metrics="none"),
])
def test_valid_edge_options_do_not_raise(options):
    value, metrics = _call(options)
    assert torch.isfinite(value) and all(torch.isfinite(v) for v in metrics.values())


def test_prompt_mean_needs_group_index():
    with pytest.raises(ValueError, match=r"\bgroup_index\b"):
        _call(dict(aggregation="prompt_mean"), group_index=None)
    step = _step()
    totals = StepTotals.of_tokens(step["mask"], Segments.of(step["document_index"]))
    with pytest.raises(ValueError, match=r"\bgroup_index\b"):
        micro_batch_loss(step["logprobs"], _inputs(step | {"group_index": None}), totals,
                         LossSpec(aggregation="prompt_mean"))


SHAPE_ERRORS = [
    ("proximal_logprobs", torch.zeros(N - 1, dtype=torch.float64)),
    ("advantages", torch.zeros(N + 1, dtype=torch.float64)),
    ("mask", torch.ones(N, 1, dtype=torch.float64)),
    ("document_index", torch.zeros(N - 2, dtype=torch.long)),
    ("group_index", torch.zeros(1, dtype=torch.long)),
    ("logprobs", torch.zeros(1, N, dtype=torch.float64)),
]


@pytest.mark.parametrize(("name", "bad"), SHAPE_ERRORS, ids=[n for n, _ in SHAPE_ERRORS])
def test_mismatched_shapes_raise_naming_the_tensor(name, bad):
    # policy_loss must check the shapes before anything uses the tensors: StepTotals.of_tokens runs
    # first and a mask or group_index of the wrong shape would otherwise end in a RuntimeError
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _call(**{name: bad})


@pytest.mark.parametrize(("name", "bad"), SHAPE_ERRORS, ids=[n for n, _ in SHAPE_ERRORS])
def test_micro_batch_loss_mismatched_shapes(name, bad):
    step = _step()
    totals = StepTotals.of_tokens(step["mask"], Segments.of(step["document_index"]), torch.tensor([0, 0, 0, 1, 1]), 2)
    step["group_index"] = torch.tensor([0, 0, 0, 1, 1])
    step[name] = bad
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        micro_batch_loss(step["logprobs"], _inputs(step), totals, LossSpec())


def test_entropy_shape_and_presence():
    with pytest.raises(ValueError, match=r"\bentropy\b"):
        _call(dict(metrics="with_entropy"))
    with pytest.raises(ValueError, match=r"\bentropy\b"):
        _call(dict(metrics="with_entropy", entropy=torch.zeros(N + 3, dtype=torch.float64)))


HEAD_ERRORS = [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(chunk_tokens=-1), "chunk_tokens"),
    (dict(chunk_tokens=2.5), "chunk_tokens"),
    (dict(chunk_tokens=True), "chunk_tokens"),
    (dict(hidden=torch.zeros(N, 7)), "hidden"),
    (dict(hidden=torch.zeros(1, N, 8)), "hidden"),
    (dict(weight=torch.zeros(11, 8, 1)), "weight"),
    (dict(labels=torch.zeros(N + 1, dtype=torch.long)), "labels"),
    (dict(labels=torch.zeros(N, 1, dtype=torch.long)), "labels"),
    (dict(labels=torch.tensor([0, 1, 2, 3, 11])), "labels"),
]


@pytest.mark.parametrize(("override", "name"), HEAD_ERRORS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(HEAD_ERRORS)])
def test_token_logprobs_invalid_arguments(override, name):
    args = dict(hidden=torch.zeros(N, 8), weight=torch.zeros(11, 8), labels=torch.tensor([0, -100, 2, 3, 10]))
    args |= override
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        token_logprobs(hidden, weight, labels, HeadSpec(**args))


def test_token_logprobs_valid_edges():
    hidden, weight = torch.randn(N, 8), torch.randn(11, 8)
    labels = torch.tensor([0, -100, 2, 3, 10])
    for kw in (dict(temperature=1e-3), dict(temperature=50.0), dict(chunk_tokens=0), dict(chunk_tokens=1)):
        lp, _ = token_logprobs(hidden, weight, labels, HeadSpec(**kw))
        assert torch.all(torch.isfinite(lp)) and lp[1] == 0
