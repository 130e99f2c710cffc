"""On-policy rollouts: the injected sampler, groups, advantages, reproducibility, valid records and
the JSONL round trip."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from factories import tiny_policy
from rlcli.data.errors import DataError
from rlcli.data.readers import load_rollouts
from rlcli.data.writers import append_jsonl
from rlcli.rollout.advantages import group_advantages
from rlcli.rollout.onpolicy import OnPolicyRollouts, step_seed
from rlcli.rollout.sampler import Completion, HFSampler, sample_completions
from rlcli.rollout.tasks import CharTokenizer, Prompt, ReverseTask

EPS = 1e-6
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k")


def make_rollouts(task, model, **options):
    """`OnPolicyRollouts` with an `HFSampler` of ``model``; ``options`` go to either."""
    settings = dict(prompts_per_step=3, group_size=4, max_new_tokens=4, temperature=0.8, eps=EPS, seed=0) | options
    sampler = HFSampler(model, **{key: settings.pop(key) for key in SAMPLING_OPTIONS if key in settings})
    return OnPolicyRollouts(task, sampler, **settings)


@pytest.fixture
def task():
    return ReverseTask(min_len=1, max_len=3)


@pytest.fixture
def model(task):
    return tiny_policy(task.tokenizer.vocab_size)


def prompt_of(task, rollout):
    text = task.tokenizer.decode(rollout.prompt_ids)
    return Prompt(text=text, ids=rollout.prompt_ids, answer=text[:-1][::-1])


EOS, JUNK = CharTokenizer.eos_id, 9  # JUNK: an id of the model's vocabulary that the tokenizer lacks


class FixedSampler:
    """A `Sampler` that answers every prompt of a group with ``GROUP``, and records its calls."""

    temperature = 0.6
    vocab_size = 10
    sync_seconds = None
    # rewards on a 2-character answer whatever the prompt: right length and eos, eos only, neither
    GROUP = [
        Completion(ids=[JUNK, JUNK, EOS], logprobs=[-0.5, -1.5, 1e-7], stopped=True),  # reward 0.4
        Completion(ids=[EOS], logprobs=[-0.25], stopped=True),  # 0.2
        Completion(ids=[JUNK] * 4, logprobs=[-2.0, -0.5, -1.0, -3.0], stopped=False),  # 0.0
    ]

    def __init__(self):
        self.calls = []

    def sample(self, prompts, *, max_new_tokens, stop_ids, pad_id, generator):
        self.calls.append(dict(prompts=prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id))
        return self.GROUP * (len(prompts) // len(self.GROUP))


def fixed_rollouts(**options):
    task = ReverseTask(min_len=2, max_len=2)
    settings = dict(prompts_per_step=2, group_size=3, max_new_tokens=5, eps=EPS) | options
    return OnPolicyRollouts(task, FixedSampler(), **settings)


def grpo_reference(rewards, eps):
    """``(r - mean) / (std + eps)`` of one group, with the population std, in float64."""
    mean = math.fsum(rewards) / len(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def test_the_injected_sampler_generates():
    rollouts = fixed_rollouts()
    docs, stats = rollouts.generate(step=3)
    (call,) = rollouts.sampler.calls
    group_prompts = [docs[0].prompt_ids, docs[3].prompt_ids]
    assert call["prompts"] == [list(p) for p in group_prompts for _ in range(3)]  # each prompt 3 times, in order
    assert [d.prompt_ids for d in docs] == [p for p in group_prompts for _ in range(3)]
    assert (call["max_new_tokens"], tuple(call["stop_ids"]), call["pad_id"]) == (5, (EOS,), CharTokenizer.pad_id)
    assert [list(d.completion_ids) for d in docs] == [c.ids for c in FixedSampler.GROUP] * 2
    assert [d.old_logprobs for d in docs] == [(-0.5, -1.5, 0.0), (-0.25,), (-2.0, -0.5, -1.0, -3.0)] * 2
    assert all(d.temperature == 0.6 for d in docs)
    assert [d.reward for d in docs] == pytest.approx([0.4, 0.2, 0.0] * 2)
    expected = grpo_reference([0.4, 0.2, 0.0], EPS) * 2
    assert [d.advantages for d in docs] == [pytest.approx((a,) * len(d.completion_ids)) for a, d in zip(expected, docs)]
    assert stats == pytest.approx(dict(reward=0.2, accuracy=0.0, completion_length=8 / 3, stopped_fraction=2 / 3))


class ChatLikeTask(ReverseTask):
    """Prompts whose ids hold the eos id before their end, as a chat template's end of turn does."""

    def sample_prompts(self, rng, n):
        return [dataclasses.replace(p, text=f"[system]<eos>{p.text}", ids=(EOS, *p.ids))
                for p in super().sample_prompts(rng, n)]


def test_completion_lines_show_the_prompt_text_whole():
    """Decoding the prompt's ids stops at their eos, so the line showed only the turns before it."""
    rollouts = OnPolicyRollouts(ChatLikeTask(min_len=2, max_len=2), FixedSampler(), prompts_per_step=2, group_size=3,
                                max_new_tokens=5, eps=EPS)
    docs, _, lines = rollouts.generate_logged(step=0, log_completions=2)
    decode = rollouts.task.tokenizer.decode
    assert [line["prompt"] for line in lines] == [f"[system]<eos>{decode(docs[i].prompt_ids[1:])}" for i in (0, 3)]


def test_advantages_use_the_given_eps():
    docs, _ = fixed_rollouts(eps=0.5).generate(step=0)
    assert [d.advantages[0] for d in docs] == pytest.approx(grpo_reference([0.4, 0.2, 0.0], 0.5) * 2, rel=1e-12)


def test_a_dr_grpo_advantage_beyond_float32_is_a_data_error():
    rollouts = fixed_rollouts(estimator="dr_grpo")
    rollouts.task.reward = lambda prompt, ids: 1e40 * ReverseTask.reward(rollouts.task, prompt, ids)
    # rewards 4e39, 2e39, 0 per group: dr_grpo's 2e39, 0, -2e39 are infinite as float32; grpo's are not
    with pytest.raises(DataError, match=r"^rollout:step 0 rank 0 #0: field 'reward': advantage.estimator=dr_grpo "
                                        r"makes it the advantage 2\.0*\d*e\+39 .*outside the float32 range"):
        rollouts.generate(step=0)
    rollouts.estimator = "grpo"
    docs, _ = rollouts.generate(step=0)
    assert [d.advantages[0] for d in docs] == pytest.approx(grpo_reference([0.4, 0.2, 0.0], 0.0) * 2, rel=1e-12)


def test_hf_sampler_samples_what_sample_completions_samples(task, model):
    """Through `OnPolicyRollouts`, `HFSampler` draws the completions `sample_completions` draws with
    the step's seeded generator: the same rollouts as before samplers were injected."""
    options = dict(temperature=0.8, top_p=0.9, top_k=5)
    docs, _ = make_rollouts(task, model, seed=3, **options).generate(step=2)
    step_rng = random.Random(step_seed(3, 2, 0))
    prompts = task.sample_prompts(step_rng, 3)
    generator = torch.Generator().manual_seed(step_rng.getrandbits(63))
    expected = sample_completions(
        model,
        [list(p.ids) for p in prompts for _ in range(4)],
        max_new_tokens=4,
        stop_ids=(EOS,),
        pad_id=CharTokenizer.pad_id,
        generator=generator,
        **options,
    )
    assert [list(d.completion_ids) for d in docs] == [c.ids for c in expected]
    assert [d.old_logprobs for d in docs] == [tuple(min(lp, 0.0) for lp in c.logprobs) for c in expected]
    assert all(d.temperature == 0.8 for d in docs)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_groups_rewards_and_advantages(task, model, estimator):
    docs, _ = make_rollouts(task, model, estimator=estimator).generate(step=5)
    assert len(docs) == 12
    group_ids = [d.group_id for d in docs]
    assert group_ids == [f"s5-r0-p{i}" for i in range(3) for _ in range(4)]  # groups in order
    for d in docs:
        assert d.reward == task.reward(prompt_of(task, d), list(d.completion_ids))
        assert len(set(d.advantages)) == 1  # the document's advantage on every token
    for g in set(group_ids):
        assert len({d.prompt_ids for d in docs if d.group_id == g}) == 1
    expected = group_advantages([d.reward for d in docs], group_ids, estimator, eps=EPS)
    assert [d.advantages[0] for d in docs] == pytest.approx(expected)
    for g in set(group_ids):
        assert math.fsum(d.advantages[0] for d in docs if d.group_id == g) == pytest.approx(0, abs=1e-9)


def test_records_follow_the_spec(task, model):
    docs, _ = make_rollouts(task, model, temperature=0.7).generate(step=2)
    for i, d in enumerate(docs):
        assert d.prompt_ids and d.completion_ids
        assert len(d.old_logprobs) == len(d.completion_ids) == len(d.advantages) == len(d.completion_mask)
        assert all(lp <= 0 and math.isfinite(lp) for lp in d.old_logprobs)
        assert all(0 <= t < task.tokenizer.vocab_size for t in d.prompt_ids + d.completion_ids)
        assert d.temperature == 0.7 and d.completion_mask == (1,) * len(d.completion_ids)
        assert d.source == f"rollout:step 2 rank 0 #{i}"


def test_statistics(task, model):
    docs, stats = make_rollouts(task, model, group_size=6).generate(step=0)
    eos = task.tokenizer.eos_id
    prompts = [prompt_of(task, d) for d in docs]
    assert stats["reward"] == pytest.approx(sum(d.reward for d in docs) / len(docs))
    correct = [task.is_correct(p, list(d.completion_ids)) for p, d in zip(prompts, docs)]
    assert stats["accuracy"] == pytest.approx(sum(correct) / len(docs))
    assert stats["completion_length"] == pytest.approx(sum(len(d.completion_ids) for d in docs) / len(docs))
    assert stats["stopped_fraction"] == pytest.approx(sum(d.completion_ids[-1] == eos for d in docs) / len(docs))


def test_reproducible_per_seed_step_and_rank(task, model):
    rollouts = make_rollouts(task, model)
    first, stats = rollouts.generate(step=1)
    assert rollouts.generate(step=1) == (first, stats)
    assert make_rollouts(task, model).generate(step=1)[0] == first  # a fresh object: nothing hidden in state
    prompts = lambda docs: [d.prompt_ids for d in docs]
    assert prompts(rollouts.generate(step=2)[0]) != prompts(first)
    assert prompts(make_rollouts(task, model, seed=1).generate(step=1)[0]) != prompts(first)
    other_rank = make_rollouts(task, model, rank=1, world_size=2).generate(step=1)[0]
    assert prompts(other_rank) != prompts(first)
    assert {d.group_id for d in other_rank}.isdisjoint(d.group_id for d in first)


def test_indices_are_unique_across_steps_and_ranks(task, model):
    indices = []
    for rank in range(2):
        rollouts = make_rollouts(task, model, prompts_per_step=2, group_size=2, rank=rank, world_size=2)
        for step in range(3):
            indices += [d.index for d in rollouts.generate(step)[0]]
    assert sorted(indices) == list(range(2 * 3 * 4))


def test_append_jsonl_round_trips_through_load_rollouts(task, model, tmp_path):
    rollouts = make_rollouts(task, model, temperature=0.9)
    docs = rollouts.generate(step=0)[0] + rollouts.generate(step=1)[0]
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
    docs, _ = make_rollouts(task, model, prompts_per_step=5, group_size=3).generate(step=0)
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
def test_bad_options(task, model, options):
    with pytest.raises(ValueError):
        make_rollouts(task, model, **options)
