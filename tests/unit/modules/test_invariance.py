"""Invariance under the split of a step into micro-batches (math.md#aggregation, "Invariance", and #metrics).

Each micro-batch computes its own ``StepTotals``; the totals are summed (as the all-reduce would),
then every micro-batch calls ``micro_batch_loss`` with the summed totals. Summed losses, their
gradient and the combined metrics must equal the whole step's, whatever the split.
"""

from __future__ import annotations

import random

import pytest
import torch
from loss_args import loss_spec, step_inputs
from rl_reference import AGGREGATIONS, F64, LOSSES, documents, make_step, ref_loss, ref_metrics, rel_err

from rlcli.modules import (
    LossInputs,
    MetricPartials,
    Segments,
    StepTotals,
    finalize_metrics,
    micro_batch_loss,
    policy_loss,
)

TOL = 1e-9  # float64; the contract asks for 1e-6


def _micro_batches(step, pieces: list[list[int]]) -> list[torch.Tensor]:
    """Token positions of each micro-batch; ``pieces`` lists document ids (whole documents)."""
    docs = {d.id: d for d in documents(step["mask"], step["doc"])}
    return [torch.tensor([t for doc_id in piece for t in docs[doc_id].positions]) for piece in pieces]


def _random_pieces(step, num_micro_batches: int, rng: random.Random) -> list[list[int]]:
    ids = [d.id for d in documents(step["mask"], step["doc"])]
    rng.shuffle(ids)  # groups end up spread over micro-batches, in any order
    cuts = sorted(rng.sample(range(1, len(ids)), num_micro_batches - 1))
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]


def _split_run(step, lp, entropy, index_of_mb, *, all_reduce_flat=False, **kw):
    """Loss, metrics and everything else of a step computed micro-batch by micro-batch."""
    _, group_index = torch.unique(step["group"], return_inverse=True)  # step-global numbering
    num_groups = int(group_index.max()) + 1
    parts = []
    for idx in index_of_mb:
        segments = Segments.of(step["doc"][idx])
        parts.append(StepTotals.of_tokens(step["mask"][idx], segments, group_index[idx], num_groups))
    if all_reduce_flat:
        totals = StepTotals.unflatten(torch.stack([p.flatten() for p in parts]).sum(0))
    else:
        totals = parts[0]
        for p in parts[1:]:
            totals = totals + p
    total_loss = lp.sum() * 0
    partials = MetricPartials()
    for idx in index_of_mb:
        inputs = LossInputs(proximal_logprobs=step["old"][idx], advantages=step["adv"][idx], mask=step["mask"][idx],
                            document_index=step["doc"][idx], group_index=group_index[idx])
        value, part = micro_batch_loss(lp[idx], inputs, totals, loss_spec(**kw), entropy=entropy[idx])
        total_loss = total_loss + value
        partials = partials + part
    return total_loss, {"loss": total_loss.detach()} | finalize_metrics(partials, totals)


def _compare(step, pieces, *, loss, aggregation, divisor, all_reduce_flat=False, metrics="with_entropy"):
    kw = dict(loss=loss, aggregation=aggregation, divisor=divisor, eps_low=0.2, eps_high=0.28, metrics=metrics)
    g = torch.Generator().manual_seed(len(pieces))
    entropy = torch.rand(step["mask"].numel(), generator=g, dtype=F64) * 3

    lp_whole = step["lp"].clone().requires_grad_(True)
    whole, whole_metrics = policy_loss(lp_whole, step_inputs(step), loss_spec(**kw), entropy=entropy)
    whole.backward()

    lp_split = step["lp"].clone().requires_grad_(True)
    index_of_mb = _micro_batches(step, pieces)
    assert sorted(torch.cat(index_of_mb).tolist()) == list(range(step["mask"].numel()))
    split, split_metrics = _split_run(step, lp_split, entropy, index_of_mb, all_reduce_flat=all_reduce_flat, **kw)
    split.backward()

    assert rel_err(split, whole) <= TOL
    assert rel_err(lp_split.grad, lp_whole.grad) <= TOL
    assert split_metrics.keys() == whole_metrics.keys()
    for name in whole_metrics:
        assert torch.isfinite(split_metrics[name]), name
        assert split_metrics[name].item() == pytest.approx(whole_metrics[name].item(), rel=TOL, abs=1e-14), name

    # and both equal the reference
    ref = ref_loss(step["lp"], step["old"], step["adv"], step["mask"], step["doc"], step["group"],
                   loss=loss, aggregation=aggregation, divisor=divisor, eps_low=0.2, eps_high=0.28)
    assert split.item() == pytest.approx(ref.item(), rel=TOL, abs=1e-15)
    if metrics != "none":
        expected = ref_metrics(step["lp"], step["old"], step["adv"], step["mask"], step["doc"], loss=loss,
                               eps_low=0.2, eps_high=0.28, entropy=entropy)
        for name, value in expected.items():
            assert split_metrics[name].item() == pytest.approx(value, rel=TOL, abs=1e-14), name
    return split_metrics


@pytest.mark.parametrize(("loss", "aggregation", "divisor"),
                         [(loss, agg, div) for loss in LOSSES for agg, div in AGGREGATIONS])
def test_random_splits_reproduce_the_whole_step(loss, aggregation, divisor):
    rng = random.Random(f"{loss}{aggregation}{divisor}")
    for trial in range(6):
        step = make_step(100 + trial, num_docs=14, num_groups=4, empty_docs=3)
        pieces = _random_pieces(step, rng.randint(1, 8), rng)
        _compare(step, pieces, loss=loss, aggregation=aggregation, divisor=divisor, all_reduce_flat=trial % 2 == 1)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(("aggregation", "divisor"), AGGREGATIONS)
def test_split_with_a_micro_batch_without_labelled_tokens(loss, aggregation, divisor):
    step = make_step(200, num_docs=10, num_groups=3, empty_docs=2)
    # every advantage negative: a 0 placeholder of the empty micro-batch would win the max
    step["adv"] = step["adv"] - 10.0
    docs = documents(step["mask"], step["doc"])
    empty = [d.id for d in docs if not d.labelled]
    rest = [d.id for d in docs if d.labelled]
    assert len(empty) == 2
    pieces = [rest[:4], empty, rest[4:]]
    metrics = _compare(step, pieces, loss=loss, aggregation=aggregation, divisor=divisor)
    labelled = step["mask"] > 0
    assert metrics["max_advantage"].item() == step["adv"][labelled].max().item() < -5
    assert metrics["min_advantage"].item() == step["adv"][labelled].min().item()
    # and the mirror case: every advantage positive, the empty micro-batch first
    step["adv"] = step["adv"] + 20.0
    metrics = _compare(step, [empty, rest[:4], rest[4:]], loss=loss, aggregation=aggregation, divisor=divisor)
    assert metrics["min_advantage"].item() == step["adv"][labelled].min().item() > 5


@pytest.mark.parametrize("loss", LOSSES)
def test_one_document_per_micro_batch(loss):
    step = make_step(300, num_docs=9, num_groups=3, empty_docs=1)
    pieces = [[d.id] for d in documents(step["mask"], step["doc"])]
    for aggregation, divisor in AGGREGATIONS:
        _compare(step, pieces, loss=loss, aggregation=aggregation, divisor=divisor)


def test_metrics_none_split():
    step = make_step(400)
    rng = random.Random(4)
    metrics = _compare(step, _random_pieces(step, 5, rng), loss="gspo", aggregation="sample_mean",
                       divisor=None, metrics="none")
    assert set(metrics) == {"loss", "num_documents", "num_tokens"}


def test_step_totals_count_the_step():
    step = make_step(500, num_docs=7, num_groups=3, empty_docs=2)
    ids, group_index = torch.unique(step["group"], return_inverse=True)
    totals = StepTotals.of_tokens(step["mask"], Segments.of(step["doc"]), group_index, ids.numel())
    docs = documents(step["mask"], step["doc"], step["group"])
    assert totals.documents.item() == len(docs)
    assert totals.tokens.item() == step["mask"].sum().item()
    for k, gid in enumerate(ids.tolist()):
        in_group = [d for d in docs if d.group == gid]
        assert totals.group_documents[k].item() == len(in_group)
        assert totals.group_tokens[k].item() == sum(len(d.labelled) for d in in_group)
    assert totals.groups.item() == len({d.group for d in docs})
