"""Several updates per batch: mini-batches of whole groups, reshuffled every epoch, nothing lost or repeated."""

from __future__ import annotations

import collections

import pytest

from rlcli.data.document_stream import pack_documents
from rlcli.data.schema import validate_record
from rlcli.errors import UserError
from rlcli.training.batches import BatchPlan, minibatch_of_groups


def documents(groups: int, per_group: int):
    docs = []
    for g in range(groups):
        for k in range(per_group):
            record = dict(prompt_ids=[1, 2], completion_ids=[3 + k, 4], old_logprobs=[-1.0, -2.0],
                          advantage=float(k), group_id=f"g{g}")
            docs.append(validate_record(record, source=f"f:{len(docs)}", index=len(docs), vocab_size=16))
    return docs


@pytest.mark.parametrize("groups, minibatches", [(7, 3), (8, 4), (5, 5), (9, 1)])
def test_groups_are_cut_into_runs_of_nearly_equal_size(groups, minibatches):
    runs = minibatch_of_groups(groups, minibatches, seed=3).tolist()
    sizes = collections.Counter(runs)
    assert sorted(sizes) == list(range(minibatches))
    assert max(sizes.values()) - min(sizes.values()) <= 1
    assert minibatch_of_groups(groups, minibatches, seed=3).tolist() == runs  # seeded
    if groups > minibatches > 1:
        assert any(minibatch_of_groups(groups, minibatches, seed=s).tolist() != runs for s in range(4, 9))


def test_each_epoch_trains_every_document_once_with_whole_groups_and_a_new_order():
    docs = documents(groups=6, per_group=3)
    plan = BatchPlan(list(pack_documents(docs, 20)), minibatches=3, epochs=2, seed=0, batch=5, max_tokens=20,
                     stats={"reward": 0.5}, carried_over=2)
    assert plan.remaining == 6
    epochs = []
    for epoch in range(2):
        parts = []
        for part in range(3):
            update = plan.next_update()
            assert update.stats == {"reward": 0.5} and update.carried_over == (2 if (epoch, part) == (0, 0) else 0)
            parts.append([doc for mb in update.micro_batches for doc in mb.documents])
            assert all(mb.num_tokens <= 20 for mb in update.micro_batches)
        assert sorted(doc.index for part in parts for doc in part) == list(range(len(docs)))  # once each
        groups_of_parts = [{doc.group_id for doc in part} for part in parts]
        assert all(len(g) == 2 for g in groups_of_parts)  # whole groups, 6 / 3 per update
        assert all(sum(doc.group_id == g for doc in part) == 3 for part in parts for g in {d.group_id for d in part})
        epochs.append(groups_of_parts)
    assert plan.remaining == 0 and epochs[0] != epochs[1]


def test_one_minibatch_keeps_the_batch_micro_batches_for_every_epoch():
    micro_batches = list(pack_documents(documents(groups=2, per_group=2), 12))
    plan = BatchPlan(micro_batches, minibatches=1, epochs=2, seed=0, batch=0, max_tokens=12)
    assert plan.next_update().micro_batches is micro_batches and plan.next_update().micro_batches is micro_batches


def test_a_plan_continues_from_its_state_exactly():
    docs = documents(groups=4, per_group=2)
    plan = BatchPlan(list(pack_documents(docs, 14)), minibatches=2, epochs=2, seed=1, batch=3, max_tokens=14)
    plan.next_update()
    state = plan.state_dict()
    resumed = BatchPlan.from_state(state, minibatches=2, epochs=2, seed=1, max_tokens=14)
    while plan.remaining:
        want, got = plan.next_update(), resumed.next_update()
        assert [[d for d in mb.documents] for mb in got.micro_batches] == \
            [[d for d in mb.documents] for mb in want.micro_batches]
    assert resumed.remaining == 0


def test_more_minibatches_than_groups_is_a_user_error():
    with pytest.raises(UserError, match="trainer.minibatches=3 is more than the 2 groups of batch 0"):
        BatchPlan(list(pack_documents(documents(groups=2, per_group=2), 12)), minibatches=3, epochs=1, seed=0,
                  batch=0, max_tokens=12)
