"""Losses are registered objects: a `LossSpec` resolves its ``loss`` with `make_loss` (a misspelt
name, an unknown option or one out of bounds raises ``ValueError`` naming it), and a loss defined
and registered here, outside rlcli, runs through `policy_loss`, `micro_batch_loss` and
`fused_micro_batch_loss` against its own float64 reference."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import AGGREGATIONS, F64, documents, make_step, ref_document_weights, ref_head, ref_metrics, rel_err
from test_invariance import _micro_batches, _random_pieces, _split_run

from rlcli.modules import (
    GRPO,
    GSPO,
    LOSSES,
    HeadSpec,
    LossSpec,
    PolicyLoss,
    RatioUnits,
    Segments,
    StepTotals,
    finalize_metrics,
    fused_micro_batch_loss,
    losses,
    make_loss,
    micro_batch_loss,
    policy_loss,
)
from rlcli.modules.registry import Registry

H, V = 8, 40


def _case(seed=0):
    """A packed step whose log-probs ``lp`` come from a random head (``hidden``, ``weight``, ``labels``)."""
    step = make_step(seed, num_docs=10, max_len=9, num_groups=3, empty_docs=2)
    n = step["mask"].numel()
    g = torch.Generator().manual_seed(seed + 1)
    step["hidden"] = torch.randn(n, H, generator=g, dtype=F64)
    step["weight"] = torch.randn(V, H, generator=g, dtype=F64) * (2 / H**0.5)
    step["labels"] = torch.where(step["mask"] > 0, torch.randint(0, V, (n,), generator=g), -100)
    lp, _ = ref_head(step["hidden"], step["weight"], step["labels"])
    labelled = step["mask"] > 0
    step["lp"] = torch.where(labelled, lp, step["lp"])
    step["old"] = torch.where(labelled, lp + 0.3 * torch.randn(n, generator=g, dtype=F64), step["old"])
    _, step["group_index"] = torch.unique(step["group"], return_inverse=True)
    step["totals"] = StepTotals.of_tokens(step["mask"], Segments.of(step["doc"]), step["group_index"],
                                          int(step["group_index"].max()) + 1)
    return step


def _policy(step, **kw):
    return policy_loss(step["lp"], step_inputs(step), loss_spec(**kw))


def _micro(step, **kw):
    return micro_batch_loss(step["lp"], step_inputs(step, group_index=step["group_index"]), step["totals"],
                            loss_spec(**kw))


def _fused(step, **kw):
    return fused_micro_batch_loss(step["hidden"], step["weight"], step["labels"],
                                  step_inputs(step, group_index=step["group_index"]), step["totals"], loss_spec(**kw),
                                  HeadSpec())


ENTRY_POINTS = [_policy, _micro, _fused]
ENTRY_IDS = ["policy_loss", "micro_batch_loss", "fused_micro_batch_loss"]


# --------------------------------------------------------------------------------------------
# names, options and their bounds
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("name", ["grp0", "GSPO", "", 3])
def test_a_misspelt_loss_name_raises_listing_the_known_names(entry, name):
    with pytest.raises(ValueError, match=r"^unknown loss .*; expected one of: grpo, gspo\b") as error:
        entry(_case(), loss=name)
    assert repr(name) in str(error.value) and all(known in str(error.value) for known in LOSSES)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize(("loss", "option", "known"), [("grpo", "eps", "eps_low, eps_high, dual_clip"),
                                                   ("gspo", "clip_ratio", "eps_low, eps_high"),
                                                   ("grpo", "coef", "eps_low, eps_high, dual_clip")])
def test_an_unknown_option_raises_naming_it_and_the_known_ones(entry, loss, option, known):
    with pytest.raises(ValueError, match=rf"^{option} is not an option of loss '{loss}'; it takes {known}$"):
        entry(_case(), loss=loss, **{option: 0.1})


BAD_OPTIONS = [
    (dict(eps_low=1), r"eps_low must be a number in \[0, 1\); got 1$"),
    (dict(eps_low=-0.1), r"eps_low must be a number in \[0, 1\); got -0.1$"),
    (dict(eps_low=math.nan), r"eps_low must be a number in \[0, 1\); got nan$"),
    (dict(eps_low=True), r"eps_low must be a number in \[0, 1\); got True$"),
    (dict(eps_high=-1), r"eps_high must be a number in \[0, 3.40282e\+38\]; got -1$"),
    (dict(eps_high=math.inf), r"eps_high must be a number in \[0, 3.40282e\+38\]; got inf$"),
    (dict(eps_high="0.2"), r"eps_high must be a number in \[0, 3.40282e\+38\]; got '0.2'$"),
    # 1 + eps_high bounds float32 ratios: past float32's largest number torch refuses it
    (dict(eps_high=1e308), r"eps_high must be a number in \[0, 3.40282e\+38\]; got 1e\+308$"),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("loss", ["grpo", "gspo"])
@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS, ids=[f"{o}" for o, _ in BAD_OPTIONS])
def test_an_option_out_of_its_bounds_raises_naming_it(entry, loss, options, message):
    with pytest.raises(ValueError, match=message):
        entry(_case(), loss=loss, **options)
    with pytest.raises(ValueError, match=message):
        LOSSES[loss](**options)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=ENTRY_IDS)
def test_an_instance_is_used_as_is_and_takes_no_options(entry):
    step = _case()
    by_instance, _ = entry(step, loss=GSPO(eps_low=0.1, eps_high=0.3))
    by_name, _ = entry(step, loss="gspo", eps_low=0.1, eps_high=0.3)
    default, _ = entry(step, loss="gspo")
    assert by_instance.item() == by_name.item() != default.item()
    with pytest.raises(ValueError, match=r"\beps_low\b.*instance"):
        entry(step, loss=GSPO(), eps_low=0.1)


def test_make_loss_and_the_registry():
    assert make_loss() == GRPO() and make_loss("gspo", eps_high=0.3) == GSPO(eps_low=0.2, eps_high=0.3)
    instance = GRPO(eps_low=0.1)
    assert make_loss(instance) is instance
    assert LOSSES["grpo"] is GRPO and LOSSES["gspo"] is GSPO
    assert GRPO.sequence_level is False and GSPO.sequence_level is True
    assert LOSSES.register()(GRPO) is GRPO  # the same class again: nothing changes

    @dataclass(frozen=True)
    class Impostor(GRPO):
        name = "grpo"

    with pytest.raises(ValueError, match="'grpo' is taken"):
        LOSSES.register()(Impostor)
    assert LOSSES["grpo"] is GRPO


def test_a_float_option_given_as_a_huge_int_is_a_float():
    """A config's ``loss.eps_high=18446744073709551616`` is an int beyond 64 bits, which torch cannot compare
    with a tensor: `make_loss` makes it the float it declares, and the loss computes (fails with the int kept)."""
    loss = make_loss("grpo", eps_high=2**64, dual_clip=2**64)
    assert type(loss.eps_high) is float and loss.eps_high == 2.0**64 and type(loss.dual_clip) is float
    ratio, advantages = torch.tensor([0.5, 3.0]), torch.tensor([-1.0, 1.0])  # [N]
    assert loss.clipped(ratio).tolist() == [True, False]  # 0.5 < 1 - eps_low; 3 <= 1 + 2**64
    assert loss.dual_capped(ratio.log(), advantages).tolist() == [False, False]


# --------------------------------------------------------------------------------------------
# a loss added by registration only
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenReinforce(PolicyLoss):
    """``ℓ_t = −c·A_t·lp_t``, with the token ratios for the metrics and no clip fraction."""

    name = "test_token_reinforce"
    sequence_level = False
    coef: float = field(default=1.0, metadata={"gt": 0})

    def per_token(self, logprobs, inputs):
        lp = torch.where(inputs.mask > 0, logprobs, 0.0)  # [N]
        return -self.coef * inputs.labelled_advantages * lp, RatioUnits.of_tokens(inputs.log_ratio(logprobs), inputs)


@dataclass(frozen=True)
class SequenceReinforce(PolicyLoss):
    """Every labelled token of document d gets ``λ_d = −c·mean_d(A)·mean_d(lp)``, with the documents'
    ratios ``exp(mean_d(lp − old_lp))`` for the metrics: correct only if a document's tokens stay together."""

    name = "test_sequence_reinforce"
    sequence_level = True
    coef: float = field(default=1.0, metadata={"gt": 0})

    def per_token(self, logprobs, inputs):
        segments = inputs.segments
        doc_tokens = segments.sum(inputs.mask)  # [S]
        doc_norm = doc_tokens.clamp(min=1)  # [S]
        mean_lp = segments.sum(torch.where(inputs.mask > 0, logprobs, 0.0)) / doc_norm  # [S]
        mean_adv = segments.sum(inputs.labelled_advantages) / doc_norm  # [S]
        losses = segments.broadcast(-self.coef * mean_adv * mean_lp) * inputs.mask  # [N]
        rho = segments.sum(inputs.log_ratio(logprobs)) / doc_norm  # [S]
        return losses, RatioUnits.of_documents(rho, doc_tokens)


COEF = 0.7


def _ref_document_loss(cls, lp, adv):
    """``Σ_{t∈d} ℓ_t`` of one document's labelled tokens, float64."""
    if cls is TokenReinforce:
        return (-COEF * adv * lp).sum()
    return -COEF * adv.mean() * lp.mean() * lp.numel()


def _ref_loss(cls, step, lp, aggregation, divisor):
    docs = documents(step["mask"], step["doc"], step["group"])
    total = lp.sum() * 0.0
    for d, w in zip(docs, ref_document_weights(docs, aggregation=aggregation, divisor=divisor)):
        if d.labelled:
            sel = torch.tensor(d.labelled)
            total = total + w * _ref_document_loss(cls, lp[sel], step["adv"][sel])
    return total


def _ref_metrics(cls, step, lp, entropy):
    """The shared metrics over the loss's units: those of grpo (tokens) or gspo (documents), less the
    clip fraction and gspo's own ``num_segments``."""
    expected = ref_metrics(lp, step["old"], step["adv"], step["mask"], step["doc"], entropy=entropy,
                           loss="grpo" if cls is TokenReinforce else "gspo")
    return {k: v for k, v in expected.items() if k not in ("clipped_ratio_fraction", "num_segments")}


def _assert_metrics(metrics, expected):
    assert set(metrics) - {"loss"} == set(expected)
    for name, want in expected.items():
        assert metrics[name].item() == pytest.approx(want, rel=1e-10, abs=1e-13), name


@pytest.fixture(params=[TokenReinforce, SequenceReinforce], ids=lambda cls: cls.name)
def custom_loss(request, monkeypatch):
    """The loss class, registered for the test only: in a copy of the registry that `make_loss` reads."""
    registry = Registry(LOSSES.kind)
    for name, cls in LOSSES.items():
        registry.register(name)(cls)
    monkeypatch.setattr(losses, "LOSSES", registry)
    return registry.register()(request.param)


@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_a_registered_loss_runs_through_policy_loss(custom_loss, aggregation, divisor):
    step = _case(1)
    entropy = torch.rand(step["mask"].numel(), generator=torch.Generator().manual_seed(1), dtype=F64)
    lp = step["lp"].clone().requires_grad_(True)
    spec = LossSpec(custom_loss(coef=COEF), aggregation=aggregation, divisor=divisor, metrics="with_entropy")
    value, metrics = policy_loss(lp, step_inputs(step), spec, entropy=entropy)
    value.backward()
    ref_lp = step["lp"].clone().requires_grad_(True)
    ref_value = _ref_loss(custom_loss, step, ref_lp, aggregation, divisor)
    ref_value.backward()
    assert rel_err(value, ref_value) <= 1e-12 and rel_err(lp.grad, ref_lp.grad) <= 1e-12
    assert ref_lp.grad.abs().max() > 0
    _assert_metrics(metrics, _ref_metrics(custom_loss, step, step["lp"], entropy))
    with pytest.raises(ValueError, match=r"coef must be a finite number > 0; got 0$"):
        policy_loss(lp, step_inputs(step), loss_spec(loss=custom_loss.name, coef=0))


@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_a_registered_loss_runs_through_micro_batch_loss_under_random_splits(custom_loss, aggregation, divisor):
    rng = random.Random(f"{custom_loss.name}{aggregation}{divisor}")
    for trial in range(4):
        step = make_step(600 + trial, num_docs=12, num_groups=4, empty_docs=2)
        entropy = torch.rand(step["mask"].numel(), generator=torch.Generator().manual_seed(trial), dtype=F64)
        index_of_mb = _micro_batches(step, _random_pieces(step, rng.randint(1, 6), rng))
        lp = step["lp"].clone().requires_grad_(True)
        value, metrics = _split_run(step, lp, entropy, index_of_mb, all_reduce_flat=trial % 2 == 1,
                                    loss=custom_loss.name, coef=COEF, aggregation=aggregation, divisor=divisor,
                                    metrics="with_entropy")
        value.backward()
        ref_lp = step["lp"].clone().requires_grad_(True)
        ref_value = _ref_loss(custom_loss, step, ref_lp, aggregation, divisor)
        ref_value.backward()
        assert rel_err(value, ref_value) <= 1e-12 and rel_err(lp.grad, ref_lp.grad) <= 1e-12
        _assert_metrics(metrics, _ref_metrics(custom_loss, step, step["lp"], entropy))


@pytest.mark.parametrize("chunk_tokens", [0, 1, 2, 5])
@pytest.mark.parametrize(("aggregation", "divisor"), [("token_mean", None), ("constant", 37.5)])
def test_a_registered_loss_runs_through_the_fused_head(custom_loss, aggregation, divisor, chunk_tokens):
    # chunks of 1 or 2 tokens cut documents: a sequence-level loss is right only if the head keeps them whole
    step = _case(2)
    hidden = step["hidden"].clone().requires_grad_(True)
    weight = step["weight"].clone().requires_grad_(True)
    spec = loss_spec(loss=custom_loss.name, coef=COEF, aggregation=aggregation, divisor=divisor, metrics="with_entropy")
    value, partials = fused_micro_batch_loss(hidden, weight, step["labels"],
                                             step_inputs(step, group_index=step["group_index"]), step["totals"], spec,
                                             HeadSpec(temperature=0.7, chunk_tokens=chunk_tokens))
    value.backward()
    h = step["hidden"].clone().requires_grad_(True)
    w = step["weight"].clone().requires_grad_(True)
    ref_lp, ref_entropy = ref_head(h, w, step["labels"], 0.7)
    ref_value = _ref_loss(custom_loss, step, ref_lp, aggregation, divisor)
    ref_value.backward()
    assert rel_err(value, ref_value) <= 1e-12
    assert rel_err(hidden.grad, h.grad) <= 1e-10 and rel_err(weight.grad, w.grad) <= 1e-10
    assert h.grad.abs().max() > 0
    _assert_metrics(finalize_metrics(partials, step["totals"]), _ref_metrics(custom_loss, step, ref_lp, ref_entropy))
