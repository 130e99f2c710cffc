"""``correction.mode=reject`` at the trainer's batch stage (`reject_batch`, math.md#mismatch-correction): the
documents' masks, the update totals of `plan_update` and ``is_rejected_fraction`` equal the float64 reference of
``reject_reference.py`` whatever the packing into 1–8 micro-batches and the mini-batches, and a checkpointed
batch resumes with the same rejection.

How they fail when broken: a rejection per update instead of per batch, or one that leaves the masks alone,
gives other masks and T; a rejected document counted by `plan_update` changes D and P; a resumed batch that
lost the ``rejected`` flag counts its rejected documents in D again."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from rlcli.data.document_stream import pack_documents
from rlcli.data.schema import validate_record
from rlcli.errors import UserError
from rlcli.modules import Correction
from rlcli.training.batches import BatchPlan
from rlcli.training.plan import plan_update
from rlcli.training.rejection import BatchRejection

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from reject_reference import ref_counts, ref_kept, ref_rejected_fraction  # noqa: E402

CPU = torch.device("cpu")
F64 = torch.float64
BOUNDS = {"token": (0.6, 1.5), "sequence": (0.3, 3.0), "geometric": (0.75, 1.3)}


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))  # the packed tensors hold float32


def batch_documents(seed: int, count: int = 16):
    """Documents of 4 groups with the trainer's proximal log-probs set; two have no labelled token."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        n = rng.randint(1, 6)
        mask = [0] * n if i in (3, 11) else [int(rng.random() < 0.8) for _ in range(n)]
        if i not in (3, 11) and not any(mask):
            mask[0] = 1
        record = dict(prompt_ids=[1] * rng.randint(1, 3), completion_ids=[rng.randint(2, 15) for _ in range(n)],
                      old_logprobs=[_f32(-rng.uniform(0.1, 3)) for _ in range(n)], advantage=rng.gauss(0, 1),
                      group_id=f"g{rng.randint(0, 3)}", completion_mask=mask)
        doc = validate_record(record, source=f"f:{i}", index=i, vocab_size=16)
        proximal = tuple(_f32(lp + rng.gauss(0, 0.5)) for lp in doc.old_logprobs)
        docs.append(dataclasses.replace(doc, proximal_logprobs=proximal))
    return docs


def flat(docs):
    """The reference's flat tensors over the completion tokens: prox, behav, mask, document, group."""
    prox, behav, mask, doc, group = [], [], [], [], []
    groups = {g: k for k, g in enumerate(dict.fromkeys(d.group_id for d in docs))}
    for d in docs:
        prox += d.proximal_logprobs
        behav += d.old_logprobs
        mask += d.completion_mask
        doc += [d.index] * len(d.completion_ids)
        group += [groups[d.group_id]] * len(d.completion_ids)
    return (torch.tensor(prox, dtype=F64), torch.tensor(behav, dtype=F64), torch.tensor(mask, dtype=F64),
            torch.tensor(doc), torch.tensor(group))


def rejected_plan(docs, level, max_tokens, minibatches=1):
    low, high = BOUNDS[level]
    plan = BatchPlan(list(pack_documents(docs, max_tokens)), minibatches=minibatches, epochs=1, seed=0, batch=0,
                     max_tokens=max_tokens, stats={"reward": 0.5})
    BatchRejection(Correction(mode="reject", level=level, low=low, high=high), max_empty=3)(plan, CPU)
    return plan


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_the_batch_stage_rejects_as_the_reference_whatever_the_packing(level):
    docs = batch_documents(seed=7)
    prox, behav, mask, doc, group = flat(docs)
    low, high = BOUNDS[level]
    kept, rejected = ref_kept(prox, behav, mask, doc, level=level, low=low, high=high)
    counts = ref_counts(kept, rejected, doc, group)
    assert 0 < counts["T"] < mask.sum() and (level == "token" or rejected)  # the case rejects, and keeps
    packings = {}  # micro-batches -> the first max_tokens that packs the batch into that many
    for max_tokens in range(max(d.num_tokens for d in docs), sum(d.num_tokens for d in docs) + 1):
        packings.setdefault(len(list(pack_documents(docs, max_tokens))), max_tokens)
    assert len({1, 2, 3, 4, 5, 6, 7, 8} & set(packings)) >= 6
    for count in range(1, 9):
        if count not in packings:
            continue
        plan = rejected_plan(docs, level, max_tokens=packings[count])
        assert len(plan.micro_batches) == count
        assert flat(plan.documents)[2].equal(kept)  # the documents' masks are the kept tokens
        assert {d.index for d in plan.documents if d.rejected} == rejected
        update = plan.next_update()
        totals = plan_update(update.micro_batches, CPU).totals
        assert (totals.tokens.item(), totals.documents.item(), totals.groups.item()) == \
            (counts["T"], counts["D"], counts["P"])
        assert update.stats == {"reward": 0.5, "is_rejected_fraction": pytest.approx(
            ref_rejected_fraction(prox, behav, mask, doc, level=level, low=low, high=high), rel=1e-12)}


def test_the_mini_batches_of_a_batch_share_its_rejection():
    docs = batch_documents(seed=3)
    plan = rejected_plan(docs, "sequence", max_tokens=30, minibatches=2)
    kept, rejected = ref_kept(*flat(docs)[:4], level="sequence", low=0.3, high=3.0)
    counts = ref_counts(kept, rejected, flat(docs)[3], flat(docs)[4])
    totals = [plan_update(plan.next_update().micro_batches, CPU).totals for _ in range(2)]
    assert sum(t.tokens.item() for t in totals) == counts["T"]
    assert sum(t.documents.item() for t in totals) == counts["D"]


def test_a_resumed_batch_keeps_its_rejection():
    docs = batch_documents(seed=5)
    plan = rejected_plan(docs, "geometric", max_tokens=25, minibatches=2)
    plan.next_update()
    resumed = BatchPlan.from_state(plan.state_dict(), minibatches=2, epochs=1, seed=0, max_tokens=25)
    assert resumed.documents == plan.documents and any(d.rejected for d in resumed.documents)
    want, got = plan.next_update(), resumed.next_update()
    assert got.stats == want.stats and "is_rejected_fraction" in got.stats
    assert plan_update(got.micro_batches, CPU).totals.flatten().equal(plan_update(want.micro_batches, CPU)
                                                                      .totals.flatten())


def test_other_modes_leave_the_batch_alone():
    docs = batch_documents(seed=1)
    plan = BatchPlan(list(pack_documents(docs, 40)), minibatches=1, epochs=1, seed=0, batch=0, max_tokens=40)
    for correction in (None, Correction(mode="mask"), Correction(mode="truncate")):
        BatchRejection(correction, max_empty=1)(plan, CPU)
        assert plan.documents == docs and plan.stats == {}


def test_batches_in_a_row_with_every_token_rejected_stop_the_run():
    """trainer.max_bad_steps = 2, bounds [5, 6] around no ratio of `batch_documents`; a batch whose ratios are
    5.5 keeps its tokens and starts the count again."""
    rejection = BatchRejection(Correction(mode="reject", low=5.0, high=6.0), max_empty=2)

    def plan(log_ratio=None):
        docs = batch_documents(seed=2)
        if log_ratio is not None:
            docs = [dataclasses.replace(d, proximal_logprobs=tuple(_f32(lp + log_ratio) for lp in d.old_logprobs))
                    for d in docs]
        return BatchPlan(list(pack_documents(docs, 40)), minibatches=1, epochs=1, seed=0, batch=0, max_tokens=40)

    all_rejected, all_kept = plan(), plan(math.log(5.5))
    rejection(all_rejected, CPU)
    rejection(all_kept, CPU)
    assert (all_rejected.stats, all_kept.stats) == ({"is_rejected_fraction": 1.0}, {"is_rejected_fraction": 0.0})
    rejection(plan(), CPU)
    with pytest.raises(UserError, match=r"every labelled token of 2 batches in a row .* \[5, 6\]"):
        rejection(plan(), CPU)
