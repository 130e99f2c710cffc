"""On-policy rollouts: groups, advantages, reproducibility, valid records and the JSONL round trip."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from rlcli.data.readers import load_rollouts
from rlcli.data.writers import append_jsonl
from rlcli.rollout.advantages import group_advantages
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.rollout.tasks import Prompt, ReverseTask


def make_rollouts(task, **options):
    settings = dict(prompts_per_step=3, group_size=4, max_new_tokens=4, temperature=0.8, seed=0) | options
    return OnPolicyRollouts(task, **settings)


@pytest.fixture
def task():
    return ReverseTask(min_len=1, max_len=3)


@pytest.fixture
def model(task, tiny_model):
    return tiny_model(task.tokenizer.vocab_size)


def prompt_of(task, rollout):
    text = task.tokenizer.decode(rollout.prompt_ids)
    return Prompt(text=text, ids=rollout.prompt_ids, answer=text[:-1][::-1])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_groups_rewards_and_advantages(task, model, estimator):
    docs, _ = make_rollouts(task, estimator=estimator).generate(model, step=5)
    assert len(docs) == 12
    group_ids = [d.group_id for d in docs]
    assert group_ids == [f"s5-r0-p{i}" for i in range(3) for _ in range(4)]  # groups in order
    for d in docs:
        assert d.reward == task.reward(prompt_of(task, d), list(d.completion_ids))
        assert len(set(d.advantages)) == 1  # the document's advantage on every token
    for g in set(group_ids):
        assert len({d.prompt_ids for d in docs if d.group_id == g}) == 1
    expected = group_advantages([d.reward for d in docs], group_ids, estimator)
    assert [d.advantages[0] for d in docs] == pytest.approx(expected)
    for g in set(group_ids):
        assert math.fsum(d.advantages[0] for d in docs if d.group_id == g) == pytest.approx(0, abs=1e-9)


def test_records_follow_the_spec(task, model):
    docs, _ = make_rollouts(task, temperature=0.7).generate(model, step=2)
    for i, d in enumerate(docs):
        assert d.prompt_ids and d.completion_ids
        assert len(d.old_logprobs) == len(d.completion_ids) == len(d.advantages) == len(d.completion_mask)
        assert all(lp <= 0 and math.isfinite(lp) for lp in d.old_logprobs)
        assert all(0 <= t < task.tokenizer.vocab_size for t in d.prompt_ids + d.completion_ids)
        assert d.temperature == 0.7 and d.completion_mask == (1,) * len(d.completion_ids)
        assert d.source == f"rollout:step 2 rank 0 #{i}"


def test_statistics(task, model):
    docs, stats = make_rollouts(task, group_size=6).generate(model, step=0)
    eos = task.tokenizer.eos_id
    prompts = [prompt_of(task, d) for d in docs]
    assert stats["reward"] == pytest.approx(sum(d.reward for d in docs) / len(docs))
    correct = [task.is_correct(p, list(d.completion_ids)) for p, d in zip(prompts, docs)]
    assert stats["accuracy"] == pytest.approx(sum(correct) / len(docs))
    assert stats["completion_length"] == pytest.approx(sum(len(d.completion_ids) for d in docs) / len(docs))
    assert stats["stopped_fraction"] == pytest.approx(sum(d.completion_ids[-1] == eos for d in docs) / len(docs))


def test_reproducible_per_seed_step_and_rank(task, model):
    rollouts = make_rollouts(task)
    first, stats = rollouts.generate(model, step=1)
    assert rollouts.generate(model, step=1) == (first, stats)
    assert make_rollouts(task).generate(model, step=1)[0] == first  # a fresh object: nothing hidden in state
    prompts = lambda docs: [d.prompt_ids for d in docs]
    assert prompts(rollouts.generate(model, step=2)[0]) != prompts(first)
    assert prompts(make_rollouts(task, seed=1).generate(model, step=1)[0]) != prompts(first)
    other_rank = make_rollouts(task, rank=1, world_size=2).generate(model, step=1)[0]
    assert prompts(other_rank) != prompts(first)
    assert {d.group_id for d in other_rank}.isdisjoint(d.group_id for d in first)


def test_indices_are_unique_across_steps_and_ranks(task, model):
    indices = []
    for rank in range(2):
        rollouts = make_rollouts(task, prompts_per_step=2, group_size=2, rank=rank, world_size=2)
        for step in range(3):
            indices += [d.index for d in rollouts.generate(model, step)[0]]
    assert sorted(indices) == list(range(2 * 3 * 4))


def test_append_jsonl_round_trips_through_load_rollouts(task, model, tmp_path):
    rollouts = make_rollouts(task, temperature=0.9)
    docs = rollouts.generate(model, step=0)[0] + rollouts.generate(model, step=1)[0]
    masked = (0,) + (1,) * (len(docs[0].completion_ids) - 1)
    docs[0] = dataclasses.replace(docs[0], completion_mask=masked)  # e.g. a tool-output token
    path = tmp_path / "runs" / "rollouts.jsonl"
    append_jsonl(docs[:12], path)
    append_jsonl(docs[12:], path)  # appends
    loaded, rejected = load_rollouts([path], vocab_size=task.tokenizer.vocab_size)
    assert not rejected and len(loaded) == len(docs)
    fields = (
        "prompt_ids",
        "completion_ids",
        "old_logprobs",
        "advantages",
        "reward",
        "group_id",
        "completion_mask",
        "temperature",
    )
    for original, back in zip(docs, loaded):
        assert {f: getattr(back, f) for f in fields} == {f: getattr(original, f) for f in fields}


def test_every_group_has_group_size_documents(task, model):
    docs, _ = make_rollouts(task, prompts_per_step=5, group_size=3).generate(model, step=0)
    assert Counter(d.group_id for d in docs) == {f"s0-r0-p{i}": 3 for i in range(5)}


@pytest.mark.parametrize(
    "options",
    [
        dict(prompts_per_step=0),
        dict(group_size=0),
        dict(estimator="ppo"),
        dict(rank=2, world_size=2),
        dict(temperature=0.0),
        dict(max_new_tokens=0),
    ],
)
def test_bad_options(task, options):
    with pytest.raises(ValueError):
        make_rollouts(task, **options)
