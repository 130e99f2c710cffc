"""`rlcli.rollout.evaluate`: the metrics against hand-derived values, pass@k against its definition,
the choice of prompts, batching and seeded determinism."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from factories import tiny_policy
from rlcli.errors import UserError
from rlcli.rollout.evaluate import EVAL_PROMPTS_SEED, METRICS, eval_prompts, evaluate, pass_at_k
from rlcli.rollout.sampler import Completion, HFSampler
from rlcli.rollout.tasks import CharTokenizer, Prompt, ReverseTask

EOS = CharTokenizer.eos_id


class LetterTask:
    """Prompt ``x`` -> answer ``x``: correct is the letter then eos (reward 1); a wrong completion that
    stopped gets 0.5, one that did not 0."""

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer("abc")

    def prompt(self, letter: str) -> Prompt:
        return Prompt(text=letter, ids=tuple(self.tokenizer.encode(letter)), answer=letter)

    def sample_prompts(self, rng, n):
        return [self.prompt(rng.choice("abc")) for _ in range(n)]

    def is_correct(self, prompt, completion_ids):
        return list(completion_ids) == self.tokenizer.encode(prompt.answer) + [EOS]

    def reward(self, prompt, completion_ids):
        return 1.0 if self.is_correct(prompt, completion_ids) else 0.5 if EOS in completion_ids else 0.0


def done(*ids):
    return Completion(ids=list(ids), logprobs=[-1.0] * len(ids), stopped=ids[-1] == EOS)


A, B, C = (CharTokenizer("abc").encode(x)[0] for x in "abc")
# prompt -> its 4 completions, handed out in this order, and their hand-derived statistics
SCRIPT = {
    "a": [done(A, EOS)] * 4,  # 4 correct: rewards 1, 1, 1, 1; lengths 2 each; all stopped
    "b": [done(B, EOS), done(A, EOS), done(EOS), done(C, C, C)],  # 1 correct: 1, .5, .5, 0; lengths 2 2 1 3
    "c": [done(A, EOS), done(A, A, A), done(B, EOS), done(EOS)],  # 0 correct: .5, 0, .5, .5; lengths 2 3 2 1
}
EXPECTED = {
    "reward": (1 + 0.5 + 0.375) / 3,
    "pass@1": (4 / 4 + 1 / 4 + 0 / 4) / 3,
    "pass@k": (1 + 1 + 0) / 3,  # k = n = 4: some completion is correct
    "length": (2 + 2 + 2) / 3,
    "stopped_fraction": (1 + 0.75 + 0.75) / 3,
}


class ScriptedSampler:
    """Answers each prompt with the next of its `SCRIPT` completions; records the prompts of each call."""

    temperature = 1.0
    vocab_size = 5
    sync_seconds = None

    def __init__(self, task: LetterTask) -> None:
        self.task = task
        self.handed = Counter()
        self.calls: list[list[str]] = []

    def sample(self, prompts, *, max_new_tokens, stop_ids, pad_id, generator):
        assert tuple(stop_ids) == (EOS,) and pad_id == CharTokenizer.pad_id and max_new_tokens == 3
        texts = [self.task.tokenizer.decode(p) for p in prompts]
        self.calls.append(texts)
        completions = []
        for text in texts:
            completions.append(SCRIPT[text][self.handed[text]])
            self.handed[text] += 1
        return completions


def scripted_eval(batch_size=None):
    task = LetterTask()
    sampler = ScriptedSampler(task)
    prompts = [task.prompt(x) for x in "abc"]
    return evaluate(task, sampler, prompts, samples=4, max_new_tokens=3, seed=0, batch_size=batch_size), sampler


def test_metrics_match_hand_derived_values():
    result, _ = scripted_eval()
    assert result.samples == 4
    assert result.metrics == pytest.approx(EXPECTED, abs=1e-12)
    assert list(result.metrics) == list(METRICS)
    assert [row["correct"] for row in result.rows] == [4, 1, 0]
    assert [row["prompt"] for row in result.rows] == ["a", "b", "c"]
    b = result.rows[1]
    assert b["reward"] == 0.5 and b["pass@1"] == 0.25 and b["pass@k"] == 1.0 and b["stopped_fraction"] == 0.75
    assert [c["text"] for c in b["completions"]] == ["b", "a", "", "ccc"]
    assert [(c["tokens"], c["stopped"], c["reward"], c["correct"]) for c in b["completions"]] == [
        (2, True, 1.0, True), (2, True, 0.5, False), (1, True, 0.5, False), (3, False, 0.0, False)]


def test_completions_of_a_prompt_share_a_sampler_call_of_at_most_batch_size_sequences():
    whole, sampler = scripted_eval()
    assert sampler.calls == [["a"] * 4 + ["b"] * 4 + ["c"] * 4]
    batched, sampler = scripted_eval(batch_size=9)  # two whole prompts of 4 fit in 9
    assert sampler.calls == [["a"] * 4 + ["b"] * 4, ["c"] * 4]
    assert batched.metrics == whole.metrics
    _, sampler = scripted_eval(batch_size=2)  # fewer than one prompt's samples: one prompt per call
    assert sampler.calls == [["a"] * 4, ["b"] * 4, ["c"] * 4]


def direct_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition: the fraction of the k-subsets of n completions (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = direct_pass_at_k(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
                assert expected == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200, abs=1e-15)  # k = 1 is the fraction correct
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-12)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_a_task_without_a_held_out_split_gives_prompts_drawn_with_the_fixed_seed():
    task = ReverseTask(min_len=1, max_len=3)
    prompts = eval_prompts(task, 10)
    assert prompts == task.sample_prompts(random.Random(EVAL_PROMPTS_SEED), 10) == eval_prompts(task, 10)
    assert len(prompts) == 10


def test_a_task_with_a_held_out_split_is_evaluated_on_all_of_it():
    class HeldOut(LetterTask):
        def __init__(self, letters):
            super().__init__()
            self.letters = letters

        def eval_prompts(self):
            return [self.prompt(x) for x in self.letters]

    assert [p.text for p in eval_prompts(HeldOut("abcab"), 2)] == list("abcab")
    with pytest.raises(UserError, match="task: HeldOut has no eval prompts"):
        eval_prompts(HeldOut(""), 2)


def test_the_task_reward_statistics_of_an_evaluation_are_taken():
    class Counting(LetterTask):
        scored = 0

        def reward(self, prompt, completion_ids):
            self.scored += 1
            return super().reward(prompt, completion_ids)

        def take_reward_stats(self):
            stats, self.scored = {"reward/counted": float(self.scored)}, 0
            return stats

    task = Counting()
    result = evaluate(task, ScriptedSampler(task), [task.prompt(x) for x in "abc"], samples=4, max_new_tokens=3,
                      seed=0)
    assert result.reward_stats == {"reward/counted": 12.0} and task.scored == 0
    assert scripted_eval()[0].reward_stats == {}


@pytest.mark.parametrize("bad", [dict(samples=0), dict(max_new_tokens=0), dict(prompts=[])])
def test_invalid_arguments_raise(bad):
    task = LetterTask()
    arguments = dict(prompts=[task.prompt("a")], samples=2, max_new_tokens=3, seed=0) | bad
    with pytest.raises(ValueError):
        evaluate(task, ScriptedSampler(task), **arguments)


def test_the_same_seed_gives_the_same_completions():
    task = ReverseTask(min_len=1, max_len=3)
    sampler = HFSampler(tiny_policy(task.tokenizer.vocab_size), temperature=1.0)
    prompts = eval_prompts(task, 12)

    def run(seed, batch_size=None):
        return evaluate(task, sampler, prompts, samples=3, max_new_tokens=4, seed=seed, batch_size=batch_size)

    first, again, other = run(7), run(7), run(8)
    assert first.rows == again.rows and first.metrics == again.metrics
    assert [r["completions"] for r in first.rows] != [r["completions"] for r in other.rows]
    assert run(7, batch_size=6).rows == run(7, batch_size=6).rows
    assert all(len(row["completions"]) == 3 for row in first.rows)
    for name in METRICS:
        assert first.metrics[name] == pytest.approx(sum(row[name] for row in first.rows) / len(first.rows))
