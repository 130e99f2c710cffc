"""Dynamic sampling (math.md#dynamic-sampling): zero-variance groups, the on-policy sampling rounds (scripted
by hand, and with a real tiny model against an independent recount) and the filter metric. Rollout files, the
command line and the config rules: tests/e2e/test_dynamic_sampling_cli.py; the stream's samplers:
tests/e2e/stream/test_worker.py."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import defaultdict

import pytest

from factories import tiny_policy
from rlcli.rollout.filtering import GroupFilter, zero_variance_groups
from rlcli.rollout.onpolicy import OnPolicyRollouts, step_seed
from rlcli.rollout.overlong import Overlong
from rlcli.rollout.prompts import PromptsTask
from rlcli.rollout.sampler import Completion, HFSampler
from rlcli.rollout.tasks import CharTokenizer, ReverseTask

EPS = 1e-6
EOS = CharTokenizer.eos_id
ZERO_VARIANCE = GroupFilter("zero_variance", max_rounds=4)


def test_zero_variance_groups_by_hand():
    """Groups a (equal), b (differ), c (one value), d (0.0 and -0.0 are equal numbers)."""
    values = [1.0, 1.0, 0.5, 0.2, 3.0, 0.0, -0.0]
    groups = ["a", "a", "b", "b", "c", "d", "d"]
    assert zero_variance_groups(values, groups) == {"a", "c", "d"}


class PlannedSampler:
    """A `Sampler` that answers round ``j``'s groups by ``plan[j]``: per group a string of R (the right answer
    of the prompt, then eos: reward 1, correct) and W (eos alone: reward 0.2 on a 2-letter answer, wrong)."""

    temperature = 1.0
    vocab_size = 10
    sync_seconds = None

    def __init__(self, task, plan):
        self.task, self.plan, self.rounds = task, plan, []

    def sample(self, prompts, *, max_new_tokens, stop_ids, pad_id, generator):
        groups = self.plan[len(self.rounds)]
        size = len(groups[0])
        assert len(prompts) == len(groups) * size, "a round draws as many prompts as groups are missing"
        self.rounds.append(len(groups))
        decode, encode = self.task.tokenizer.decode, self.task.tokenizer.encode
        completions = []
        for i, prompt in enumerate(prompts):
            right = encode(decode(prompt)[:-1][::-1]) + [EOS]
            ids = right if groups[i // size][i % size] == "R" else [EOS]
            completions.append(Completion(ids=ids, logprobs=[-0.5] * len(ids), stopped=True))
        return completions


def planned(plan, group_filter=ZERO_VARIANCE, **options):
    task = ReverseTask(min_len=2, max_len=2)
    sampler = PlannedSampler(task, plan)
    settings = dict(prompts_per_step=3, group_size=2, max_new_tokens=5, eps=EPS, seed=7, group_filter=group_filter)
    return OnPolicyRollouts(task, sampler, **(settings | options)), sampler


def test_rounds_continue_until_the_step_holds_prompts_per_step_kept_groups():
    """P_s = 3, G = 2. Round 0: RR (equal), RW (kept), WW (equal) -> 1 kept, 2 missing; round 1 draws 2: WW, RR ->
    none kept; round 2 draws 2: WR, RW -> 3 kept, the step is full after 3 rounds. By hand: 3 kept groups
    (p1, p5, p6), 4 filtered, 14 sampled completions of which 7 are right. A loop that stops after one round,
    draws a full P_s each round, or keeps equal groups fails."""
    rollouts, sampler = planned([["RR", "RW", "WW"], ["WW", "RR"], ["WR", "RW"], ["RR"]])
    docs, stats, lines, filtered = rollouts.generate_filtered(2, 8)
    assert sampler.rounds == [3, 2, 2]
    assert [d.group_id for d in docs] == ["s2-r0-p1", "s2-r0-p1", "s2-r0-p5", "s2-r0-p5", "s2-r0-p6", "s2-r0-p6"]
    assert [d.reward for d in docs] == [1.0, 0.2, 0.2, 1.0, 1.0, 0.2]
    a = 0.4 / (0.4 + EPS)  # grpo of (1, 0.2): +-(0.4 / (0.4 + eps)), computed over the kept groups
    assert [d.advantages[0] for d in docs] == pytest.approx([a, -a, -a, a, a, -a], rel=1e-12)
    # every completion of the step is numbered in sampling order; the kept documents keep their numbers
    assert [d.source for d in docs] == [f"rollout:step 2 rank 0 #{i}" for i in (2, 3, 10, 11, 12, 13)]
    assert stats == {"groups_kept": 3.0, "groups_filtered": 4.0, "sampling_rounds": 3.0,
                     "reward": pytest.approx((7 * 1.0 + 7 * 0.2) / 14, rel=1e-12), "accuracy": 7 / 14,
                     "completion_length": (7 * 3 + 7 * 1) / 14, "stopped_fraction": 1.0}
    assert sorted({r.record["group_id"] for r in filtered}) == ["s2-r0-p0", "s2-r0-p2", "s2-r0-p3", "s2-r0-p4"]
    assert len(filtered) == 8 and all(r.field == "reward" for r in filtered)  # the reverse task: its reward
    assert {line["group_id"] for line in lines} == {"s2-r0-p1", "s2-r0-p5", "s2-r0-p6"}  # kept documents only


def test_the_step_stops_at_max_sampling_rounds_with_what_it_kept():
    """max_rounds = 2: round 0 keeps 1 of 3, round 1 (2 drawn) keeps none; the step trains 1 group and the third
    round of the plan is never sampled."""
    rollouts, sampler = planned([["RR", "RW", "WW"], ["WW", "RR"], ["RW", "RW"]],
                                GroupFilter("zero_variance", max_rounds=2))
    docs, stats, _ = rollouts.generate_logged(0, 0)
    assert sampler.rounds == [3, 2]
    assert [d.group_id for d in docs] == ["s0-r0-p1"] * 2
    assert (stats["groups_kept"], stats["groups_filtered"], stats["sampling_rounds"]) == (1.0, 4.0, 2.0)


def test_no_filter_samples_one_round_as_before():
    """Without the filter the equal groups stay and one round is sampled; no filter metric is logged."""
    rollouts, sampler = planned([["RR", "RW", "WW"]], GroupFilter())
    docs, stats, _ = rollouts.generate_logged(0, 0)
    assert sampler.rounds == [3] and len(docs) == 6
    assert not {"groups_kept", "groups_filtered", "sampling_rounds"} & set(stats)


# on a 2-letter answer: eos alone and four '>' then eos both get the task reward 0.2 (no letter matches, wrong
# length, stopped), but lengths 1 and 5: with L = 5, L_c = 4, R_len is 0 and -1, so shaped rewards 0.2 and -0.8
SHORT = Completion(ids=[EOS], logprobs=[-0.5], stopped=True)
LONG = Completion(ids=[6, 6, 6, 6, EOS], logprobs=[-0.5] * 5, stopped=True)


class ShortLongSampler:
    """Every group is (SHORT, LONG); counts the prompts of each round."""

    temperature = 1.0
    vocab_size = 10
    sync_seconds = None

    def __init__(self):
        self.rounds = []

    def sample(self, prompts, **_):
        self.rounds.append(len(prompts) // 2)
        return [SHORT, LONG] * (len(prompts) // 2)


@pytest.mark.parametrize("metric", [None, "reward", "accuracy"])
def test_the_overlong_shaping_never_lets_a_group_through(metric):
    """NeMo-RL #2431: (SHORT, LONG) has equal task rewards (0.2) and both are wrong, but shaped rewards 0.2 and
    -0.8. Judged on the task's reward (the default for the reverse task, which has no accuracy term) or on accuracy,
    every group is dropped, in every one of the 3 rounds; judging the shaped reward would keep them all."""
    sampler = ShortLongSampler()
    rollouts = OnPolicyRollouts(ReverseTask(min_len=2, max_len=2), sampler, prompts_per_step=2, group_size=2,
                                max_new_tokens=5, eps=EPS, overlong=Overlong(buffer=4, penalty=1.0),
                                group_filter=GroupFilter("zero_variance", metric=metric, max_rounds=3))
    docs, stats, _, filtered = rollouts.generate_filtered(0, 0)
    assert docs == [] and sampler.rounds == [2, 2, 2]  # nothing kept: each round draws both groups again
    assert [r.record["reward"] for r in filtered] == pytest.approx([0.2, -0.8] * 6, rel=1e-12)
    assert {r.field for r in filtered} == {metric or "reward"}
    value = "0.0" if metric == "accuracy" else "0.2"
    assert filtered[0].reason == (f"rollout.filter=zero_variance: all 2 documents of group 's0-r0-p0' have "
                                  f"{metric or 'reward'} {value}")
    assert (stats["groups_kept"], stats["groups_filtered"], stats["sampling_rounds"]) == (0.0, 6.0, 3.0)
    assert stats["reward/overlong"] == -0.5 and stats["reward"] == pytest.approx(-0.3, rel=1e-12)


def test_a_task_with_an_accuracy_term_is_judged_by_accuracy(tmp_path):
    """The default metric: accuracy for task=prompts with exact_match (a term that decides correctness),
    the reward for one with only a format reward, and for the built-in tasks (no accuracy term)."""
    from factories import make_tokenizer, write_jsonl
    from rlcli.rollout.filtering import filter_metric_of

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "3+4=", "answer": "7"}])

    def task(rewards):
        return PromptsTask(paths=[str(path)], tokenizer=str(tokenizer), rewards=rewards)

    assert filter_metric_of(task([{"name": "exact_match"}, {"name": "format"}]), None) == "accuracy"
    assert filter_metric_of(task([{"name": "format"}]), None) == "reward"
    assert filter_metric_of(ReverseTask(), None) == "reward"
    assert filter_metric_of(ReverseTask(), "accuracy") == "accuracy"


def test_rounds_with_a_real_model_against_a_recount():
    """A real tiny model on the reverse task (filter on the task's reward): the test recounts from the returned
    documents and rejections: every dropped group is equal, every kept one is not, the metrics are their counts,
    each round's prompts are those drawn from (seed, step, rank, round), and round 0's kept documents are those
    of the same step without the filter. Run twice, the step is the same (exact resume)."""
    task = ReverseTask(min_len=1, max_len=2)
    model = tiny_policy(task.tokenizer.vocab_size)

    def make(group_filter):
        sampler = HFSampler(model, temperature=1.0)
        return OnPolicyRollouts(task, sampler, prompts_per_step=6, group_size=3, max_new_tokens=3, eps=EPS, seed=5,
                                group_filter=group_filter)

    docs, stats, _, filtered = make(GroupFilter("zero_variance", max_rounds=5)).generate_filtered(4, 0)
    assert make(GroupFilter("zero_variance", max_rounds=5)).generate_filtered(4, 0)[:2] == (docs, stats)
    rewards = defaultdict(list)
    for d in docs:
        rewards[d.group_id].append(d.reward)
    dropped = defaultdict(list)
    for r in filtered:
        dropped[r.record["group_id"]].append(r.record["reward"])
    assert all(len(set(v)) > 1 for v in rewards.values()) and all(len(set(v)) == 1 for v in dropped.values())
    assert stats["groups_kept"] == len(rewards) and stats["groups_filtered"] == len(dropped)
    assert dropped, "the seed is chosen so that some group is dropped"
    # rounds: round 0 draws 6 prompts, round j the groups still missing; recount them from the group numbers
    numbers = sorted(int(g.rsplit("p", 1)[1]) for g in [*rewards, *dropped])
    assert numbers == list(range(len(numbers)))
    kept_numbers = {int(g.rsplit("p", 1)[1]) for g in rewards}
    start, size, rounds, prompts = 0, 6, 0, []
    while True:
        rng = random.Random(step_seed(5, 4, 0, rounds))
        prompts += [p.ids for p in task.sample_prompts(rng, size)]
        kept = len(kept_numbers & set(range(start + size)))
        start, size, rounds = start + size, 6 - kept, rounds + 1
        if kept == 6 or rounds == 5:
            break
    assert stats["sampling_rounds"] == rounds and len(prompts) == len(numbers)
    prompt_of = {d.group_id: d.prompt_ids for d in docs} | {r.record["group_id"]: tuple(r.record["prompt_ids"])
                                                           for r in filtered}
    assert [prompt_of[f"s4-r0-p{n}"] for n in numbers] == prompts
    plain, _ = make(GroupFilter()).generate(4)
    def unnumbered(rollouts):  # a document's index counts the step's kept documents, so it may differ
        return [dataclasses.replace(d, index=0) for d in rollouts]

    assert unnumbered(d for d in docs if int(d.group_id.rsplit("p", 1)[1]) < 6) == unnumbered(
        d for d in plain if d.group_id in rewards)
    assert stats["reward"] == pytest.approx(math.fsum([*[d.reward for d in docs], *[r.record["reward"] for r in
                                                                                      filtered]]) /
                                            (len(docs) + len(filtered)), rel=1e-12)
