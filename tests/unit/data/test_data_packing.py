"""Packing whole documents into micro-batches: every tensor of a hand-made batch, boundaries, order."""

import random

import pytest
import torch

from rlcli.data.document_stream import pack_documents
from rlcli.data.errors import DataError
from rlcli.data.packing import fill_micro_batch, make_micro_batch
from rlcli.data.schema import Rollout


def doc(prompt, completion, old=None, adv=None, mask=None, group_id=None, index=0):
    n = len(completion)
    return Rollout(
        prompt_ids=tuple(prompt),
        completion_ids=tuple(completion),
        old_logprobs=tuple(old if old is not None else [-1.0] * n),
        advantages=tuple(adv if adv is not None else [1.0] * n),
        reward=None,
        group_id=group_id,
        completion_mask=tuple(mask if mask is not None else [1] * n),
        temperature=None,
        source=f"d.jsonl:{index + 1}",
        index=index,
    )


DOC_A = doc([11, 12, 13], [21, 22], old=[-0.1, -0.2], adv=[1.0, 2.0], group_id="g1", index=0)
DOC_B = doc([31], [41, 42, 43], old=[-0.3, -0.4, -0.5], adv=[3.0, 4.0, 5.0], mask=[1, 0, 1], group_id=7, index=1)
NO = -100


def test_micro_batch_tensors_exactly():
    batch = make_micro_batch([DOC_A, DOC_B])
    #                                        A: prompt    completion | B: prompt completion
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22, 31, 41, 42, 43]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # The last prompt position predicts the first completion token; a document's last token predicts nothing;
    # 42 is masked out.
    assert batch.labels.tolist() == [NO, NO, 21, 22, NO, 41, NO, 43, NO]
    assert batch.sampler_logprobs.tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, -0.3, 0, -0.5, 0])
    assert batch.advantages.tolist() == [0, 0, 1, 2, 0, 3, 0, 5, 0]
    assert batch.mask.tolist() == [0, 0, 1, 1, 0, 1, 0, 1, 0]
    assert batch.document_index.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.documents == [DOC_A, DOC_B]
    assert (batch.num_documents, batch.num_tokens, batch.num_labelled) == (2, 9, 4)


def test_micro_batch_dtypes_and_shapes():
    batch = make_micro_batch([DOC_A, DOC_B])
    for name in ("input_ids", "position_ids", "labels", "document_index"):
        assert getattr(batch, name).dtype == torch.long
    for name in ("sampler_logprobs", "advantages", "mask"):
        assert getattr(batch, name).dtype == torch.float32
    for name in ("input_ids", "position_ids", "labels", "sampler_logprobs", "advantages", "mask", "document_index"):
        assert getattr(batch, name).shape == (9,)


def test_single_token_prompt_and_completion():
    batch = make_micro_batch([doc([5], [6], old=[-0.5], adv=[-2.0])])
    assert batch.labels.tolist() == [6, NO]
    assert batch.sampler_logprobs.tolist() == [-0.5, 0.0]
    assert batch.advantages.tolist() == [-2.0, 0.0]


def random_doc(rng, index):
    completion = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
    return doc(
        [rng.randrange(100) for _ in range(rng.randint(1, 6))],
        completion,
        old=[-rng.random() for _ in completion],
        adv=[rng.uniform(-1, 1) for _ in completion],
        mask=[rng.randint(0, 1) for _ in completion],
        index=index,
    )


def test_labels_are_the_next_completion_token_of_random_documents():
    rng = random.Random(0)
    docs = [random_doc(rng, i) for i in range(20)]
    batch = make_micro_batch(docs)
    labelled = batch.mask.bool()
    here = labelled[:-1].nonzero().squeeze(1)  # labelled positions; the row's last one never is
    assert not labelled[-1]
    assert torch.equal(batch.labels[here], batch.input_ids[here + 1])
    assert torch.equal(batch.document_index[here], batch.document_index[here + 1])
    kept = [(old, adv) for d in docs for keep, old, adv in zip(d.completion_mask, d.old_logprobs, d.advantages) if keep]
    assert batch.sampler_logprobs[labelled].tolist() == pytest.approx([old for old, _ in kept])
    assert batch.advantages[labelled].tolist() == pytest.approx([adv for _, adv in kept])
    assert batch.num_labelled == sum(d.num_labelled for d in docs) == len(kept)
    assert torch.all(batch.sampler_logprobs[~labelled] == 0) and torch.all(batch.advantages[~labelled] == 0)


def test_group_index_maps_each_position_through_its_document():
    no_group = doc([1, 2], [3])
    batch = make_micro_batch([DOC_A, no_group, DOC_B])
    index = batch.group_index({"g1": 4, None: 0, 7: 2})
    assert index.dtype == torch.long
    assert index.tolist() == [4] * 5 + [0] * 3 + [2] * 4
    with pytest.raises(KeyError):
        batch.group_index({"g1": 0, 7: 1})


def test_max_tokens_exactly_fits_or_one_over():
    # DOC_A has 5 tokens, DOC_B 4
    assert [b.num_documents for b in pack_documents([DOC_A, DOC_B], max_tokens=9)] == [2]
    assert [b.num_documents for b in pack_documents([DOC_A, DOC_B], max_tokens=8)] == [1, 1]
    assert [b.num_tokens for b in pack_documents([DOC_A], max_tokens=5)] == [5]
    with pytest.raises(DataError, match=r"d\.jsonl:1: document has 5 tokens, more than max_tokens=4"):
        list(pack_documents([DOC_A], max_tokens=4))


def test_greedy_order_and_every_document_exactly_once():
    rng = random.Random(1)
    docs = [doc([1] * rng.randint(1, 8), [2] * rng.randint(1, 8), index=i) for i in range(200)]
    batches = list(pack_documents(iter(docs), max_tokens=20))  # accepts a one-shot stream
    packed = [d.index for b in batches for d in b.documents]
    assert packed == list(range(200))
    assert all(b.num_tokens <= 20 for b in batches)
    assert all(b.num_tokens == sum(d.num_tokens for d in b.documents) for b in batches)
    # sequential greedy: a batch is closed only when the next document does not fit
    for current, following in zip(batches, batches[1:]):
        assert current.num_tokens + following.documents[0].num_tokens > 20
    assert 1 < len(batches) < 200


def test_invalid_max_tokens_fails_before_iterating():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        pack_documents([DOC_A], max_tokens=0)


def test_documents_need_advantages():
    lacking = Rollout(**{**DOC_B.__dict__, "advantages": None, "source": "x.parquet:row 9"})
    with pytest.raises(ValueError, match=r"x\.parquet:row 9: rollout has no advantages"):
        list(pack_documents([DOC_A, lacking], max_tokens=100))


def test_empty_input():
    assert list(pack_documents([], max_tokens=10)) == []
    with pytest.raises(ValueError, match="at least one document"):
        make_micro_batch([])


def test_completion_values_invert_the_label_layout():
    from rlcli.data.packing import make_micro_batch
    from rlcli.data.schema import validate_record

    records = [dict(prompt_ids=[1, 2], completion_ids=[3, 4, 5], old_logprobs=[-0.5, -0.25, -2.0],
                    completion_mask=[1, 0, 1], advantage=1.0),
               dict(prompt_ids=[6], completion_ids=[7], old_logprobs=[-3.0], advantage=1.0)]
    docs = [validate_record(r, source=f"x:{i}", index=i, vocab_size=10) for i, r in enumerate(records)]
    batch = make_micro_batch(docs)
    assert batch.completion_values(batch.sampler_logprobs.tolist()) == [(-0.5, 0.0, -2.0), (-3.0,)]


class ListQueue:
    """A `DocumentQueue` over a list that records the ``first`` flag of every request."""

    def __init__(self, docs):
        self.docs = list(docs)
        self.firsts = []

    def next_document(self, first):
        self.firsts.append(first)
        return self.docs.pop(0) if self.docs else None

    def give_back(self, documents):
        self.docs[:0] = documents


def test_fill_micro_batch_packs_in_order_and_gives_back_the_document_that_does_not_fit():
    # DOC_A has 5 tokens, DOC_B 4, c 3
    c = doc([5], [6, 7], index=2)
    queue = ListQueue([DOC_A, DOC_B, c])
    first = fill_micro_batch(queue, max_tokens=8)
    assert first.documents == [DOC_A] and queue.docs == [DOC_B, c]  # B would make 9 tokens: given back
    assert queue.firsts == [True, False]  # only the first document of a micro-batch is waited for
    assert fill_micro_batch(queue, max_tokens=8).documents == [DOC_B, c]  # exactly 7, then the queue is empty
    assert fill_micro_batch(queue, max_tokens=8) is None
    assert queue.firsts == [True, False, True, False, False, True]


def test_fill_micro_batch_refuses_a_document_longer_than_max_tokens_and_keeps_it():
    queue = ListQueue([DOC_A, DOC_B])
    with pytest.raises(DataError, match=r"d\.jsonl:1: document has 5 tokens, more than max_tokens=4"):
        fill_micro_batch(queue, max_tokens=4)
    assert queue.docs == [DOC_A, DOC_B]
