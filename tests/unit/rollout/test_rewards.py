"""Rewards on completion text: each built-in on hand-made completions, weighted sums, failures and
their statistics, ``_target_`` functions with options, bad specs, and the on-policy stats hook."""

from __future__ import annotations

import logging
import math
import sys
import textwrap
import threading

import pytest
from omegaconf import OmegaConf

from rlcli.errors import UserError
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.rollout.rewards import DEFAULT_REWARDS, REWARDS, build_rewards
from rlcli.rollout.sampler import Completion
from rlcli.rollout.tasks import Prompt, ReverseTask


def reward_of(name, completion, answer=None, **options):
    """The value of the built-in ``name`` with ``options`` on ``completion``."""
    return REWARDS[name](**options)(completion, answer=answer, prompt="Q")


def scored(rewards, completion, answer=None, **fields):
    """The `Score` of one completion of a prompt "Q" with ``answer`` and ``fields``."""
    (result,) = rewards.score_batch([completion], [Prompt(text="Q", ids=(1,), answer=answer, fields=fields)])
    return result


def score(rewards, completion, answer=None, **fields):
    return scored(rewards, completion, answer, **fields).reward


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("  The  Answer\n is\t42 ", "the answer is 42", 1.0),  # whitespace runs and case
        ("STRASSE", "straße", 1.0),  # case folding, not just lower()
        ("the answer is 42.", "the answer is 42", 0.0),
        ("", "", 1.0),
        ("4 2", "42", 0.0),
    ],
)
def test_exact_match_normalises_whitespace_and_case(completion, answer, expected):
    assert reward_of("exact_match", completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("6 * 7 =\n#### 42", 1.0),
        ("#### 41 then #### 42 ", 1.0),  # the text after the last marker
        ("#### 42 and more", 0.0),
        ("42", 0.0),  # no marker
    ],
)
def test_exact_match_after_a_marker(completion, expected):
    assert reward_of("exact_match", completion, "42", after="####") == expected


def test_exact_match_without_an_answer_raises():
    with pytest.raises(ValueError, match="no answer"):
        reward_of("exact_match", "42", None)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"so the result is \boxed{1/2}", "0.5", 1.0),
        (r"$\frac{1}{2}$", "0.5", 1.0),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
        ("I get 3, then 7", "7", 1.0),  # the last number
        ("I get 3, then 7", "3", 0.0),
        (r"\boxed{2}, but maybe 7", "2", 1.0),  # boxed before the last number
        (r"\boxed{2}. So the final answer is 7", "2", 1.0),  # and before any other anchor
        ("The total is 1,000 apples.", "1000", 1.0),
        ("<think>2 + 2</think><answer>4</answer>", "4", 1.0),  # tags do not hide the answer
        (r"\boxed{0.7}", "0.5", 0.0),  # a wrong number
        ("I cannot tell.", "0.5", 0.0),  # no answer at all
        ("", "0.5", 0.0),
        ("x = 3", "x+1", 0.0),
        (r"\boxed{1+x}", "x+1", 1.0),  # a gold answer that is LaTeX without $...$
    ],
)
def test_math_verify(completion, answer, expected):
    assert reward_of("math_verify", completion, answer) == expected


def test_math_verify_fails_on_a_gold_answer_it_cannot_parse():
    with pytest.raises(ValueError, match="no answer in the gold answer"):
        reward_of("math_verify", r"\boxed{1}", "")
    with pytest.raises(ValueError, match="no answer"):
        reward_of("math_verify", r"\boxed{1}", None)


def test_math_verify_works_outside_the_main_thread():
    fn = REWARDS["math_verify"]()
    results = []
    thread = threading.Thread(target=lambda: results.append(fn(r"\boxed{1/2}", answer="0.5", prompt="Q")))
    thread.start()
    thread.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    ("pattern", "completion", "expected"),
    [
        (r"\d{3}", "code 1234 here", 1.0),  # search, not match
        (r"^\d{3}$", "code 123", 0.0),
        ("answer", "ANSWER", 0.0),
        ("(?i)answer", "ANSWER", 1.0),
    ],
)
def test_regex(pattern, completion, expected):
    assert reward_of("regex", completion, pattern=pattern) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("\n <think>two\nlines</think>\n\n<answer>b</answer>\n", 1.0),  # whitespace around and between
        ("<think></think><answer></answer>", 1.0),  # empty contents
        ("<answer>b</answer>", 0.0),  # a missing block
        ("<think>a</think>", 0.0),
        ("<answer>b</answer><think>a</think>", 0.0),  # the wrong order
        ("<think>a</think> so <answer>b</answer>", 0.0),  # text between the blocks
        ("<think>a</think><answer>b</answer> done", 0.0),  # text after
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),  # a repeated block
        ("<think>a<answer>x</answer></think><answer>b</answer>", 0.0),  # a tag inside a block
        ("plain text", 0.0),
    ],
)
def test_format_with_the_default_tags(completion, expected):
    assert reward_of("format", completion) == expected


def test_format_with_chosen_tags():
    assert reward_of("format", "<reasoning>r</reasoning><final>1</final>", tags=["reasoning", "final"]) == 1.0
    assert reward_of("format", "<think>a</think><answer>b</answer>", tags=["reasoning", "final"]) == 0.0
    assert reward_of("format", "<answer>b</answer>", tags=["answer"]) == 1.0


@pytest.mark.parametrize(("length", "expected"), [(0, 0.0), (7, 0.0), (10, 0.0), (11, -0.25), (14, -1.0)])
def test_length_penalty(length, expected):
    assert reward_of("length_penalty", "x" * length, max_chars=10, per_char=0.25) == expected


def test_length_penalty_default_rate():
    assert reward_of("length_penalty", "x" * 1500, max_chars=1000) == pytest.approx(-0.5)  # 500 * 0.001


def test_weights_combine_as_a_weighted_sum():
    rewards = build_rewards([
        {"name": "exact_match", "weight": 2.0},
        {"name": "regex", "pattern": "^4", "weight": 0.5},
        {"name": "length_penalty", "max_chars": 1, "per_char": 0.25},  # weight 1
    ])
    assert score(rewards, "42", "42") == pytest.approx(2 * 1 + 0.5 * 1 + 1 * -0.25)
    assert score(rewards, "4", "42") == pytest.approx(2 * 0 + 0.5 * 1 + 1 * 0)
    assert score(rewards, "7777", "42") == pytest.approx(2 * 0 + 0.5 * 0 + 1 * -0.75)
    assert rewards.take_stats() == pytest.approx({
        "reward/exact_match": 1 / 3, "reward/regex": 2 / 3, "reward/length_penalty": (-0.25 + 0 - 0.75) / 3,
        "reward_errors": 0.0,
    })


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The module ``my_rewards`` written into ``tmp_path`` and importable."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def has_citation(completion, *, min_count=1):
            return float(completion.count("[") >= min_count)

        def fussy(completion, *, answer, prompt, **fields):
            if completion == "boom":
                raise RuntimeError("cannot score boom")
            return float("nan") if completion == "nan" else 1.0

        def with_field(completion, *, answer, source, bonus=0.0):
            return float(source == "book") + bonus

        def is_list(completion, *, items):
            return float(type(items) is list)

        def quits(completion):
            raise SystemExit(3)

        def batch_quits(completions):
            raise SystemExit("bye")

        def huge(completion):
            return 1e308

        def typed(completion):
            return {"str": "1.0", "bool": True, "none": None}.get(completion, 1)

        def batch_lengths(completions, *, answer, scale=1.0):
            return [scale * len(c) + (a is None) for c, a in zip(completions, answer)]

        def batch_of_wrong_size(completions):
            return [1.0]

        CALLS = []

        def counted(completion, **fields):
            CALLS.append(completion)
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_a_target_function_with_options(user_module):
    rewards = build_rewards([{"_target_": f"{user_module}.has_citation", "weight": 0.5, "min_count": 2}])
    assert [t.name for t in rewards.terms] == ["has_citation"]
    assert score(rewards, "see [1] and [2]", source="web") == 0.5  # a field it does not take is left out
    assert score(rewards, "see [1]") == 0.0
    assert rewards.take_stats() == {"reward/has_citation": 0.5, "reward_errors": 0.0}


def test_a_target_gets_the_fields_it_declares_and_options_win(user_module):
    rewards = build_rewards([
        {"_target_": f"{user_module}.with_field", "name": "sourced"},
        {"_target_": f"{user_module}.with_field", "bonus": 0.25},
    ])
    assert [t.name for t in rewards.terms] == ["sourced", "with_field"]
    assert score(rewards, "x", "a", source="book", extra=1) == 1.0 + 1.25
    assert score(rewards, "x", "a", source="book", bonus=5.0) == 6.0 + 1.25  # the option, not the field
    assert score(rewards, "x", "a", source="web") == 0.0 + 0.25


def test_a_failing_reward_scores_zero_and_is_counted_once_per_step(user_module, caplog):
    rewards = build_rewards([{"name": "regex", "pattern": "o"}, {"_target_": f"{user_module}.fussy", "weight": 2.0}])
    with caplog.at_level(logging.WARNING, logger="rlcli"):
        assert score(rewards, "boom") == 1.0  # regex 1, fussy failed: 0
        assert score(rewards, "nan") == 0.0  # a non-finite value is a failure too
        assert score(rewards, "fine") == 2.0
        assert rewards.take_stats() == pytest.approx(
            {"reward/regex": 1 / 3, "reward/fussy": 1 / 3, "reward_errors": 2.0}
        )
    (record,) = [r for r in caplog.records if "fussy" in r.getMessage()]
    assert "failed on 2 of 3" in record.getMessage() and "cannot score boom" in record.getMessage()
    assert score(rewards, "fine") == 2.0
    assert rewards.take_stats() == {"reward/regex": 0.0, "reward/fussy": 1.0, "reward_errors": 0.0}  # reset
    assert rewards.take_stats() == {}


def test_only_finite_real_numbers_are_values(user_module):
    """A string "1.0" or True converted to 1.0 would make this fail: they are failures scoring 0."""
    rewards = build_rewards([{"_target_": f"{user_module}.typed"}])
    assert [score(rewards, c) for c in ("str", "bool", "none", "int")] == [0.0, 0.0, 0.0, 1.0]
    assert rewards.take_stats() == {"reward/typed": 0.25, "reward_errors": 3.0}


def test_a_reward_raising_system_exit_in_the_training_process_is_a_failure_not_the_end(user_module):
    """With task.reward_workers=0 (build_rewards' default) the terms run here: a SystemExit that escaped
    would end this test (and a run, silently, with the reward's code)."""
    rewards = build_rewards([{"name": "regex", "pattern": "o"}, {"_target_": f"{user_module}.quits"},
                             {"_target_": f"{user_module}.batch_quits", "batched": True}], workers=0)
    assert [s.terms for s in rewards.score_batch(["ok", "no"], [Prompt(text="Q", ids=(1,), answer=None)] * 2)] == \
        [{"regex": 1.0, "quits": 0.0, "batch_quits": 0.0}] * 2
    assert rewards.take_stats()["reward_errors"] == 4.0


def test_a_weighted_sum_that_overflows_is_one_user_error(user_module):
    """1e308 x weight 10 is inf, though each value and weight is finite; without the check the step would
    get an infinite reward (and NaN advantages)."""
    rewards = build_rewards([{"_target_": f"{user_module}.huge", "weight": 10.0}])
    with pytest.raises(UserError, match=r"^task\.rewards: the weighted sum of the rewards of a completion is inf "
                                        r"\(huge 1e\+308 x weight 10\); it must be a finite number"):
        score(rewards, "x")


def test_a_batched_target_gets_the_batch_as_lists(user_module):
    rewards = build_rewards([{"_target_": f"{user_module}.batch_lengths", "batched": True, "scale": 2.0},
                             {"_target_": f"{user_module}.batch_of_wrong_size", "batched": True}])
    prompts = [Prompt(text="Q", ids=(1,), answer=a) for a in ("x", None, "y")]
    scores = rewards.score_batch(["ab", "c", ""], prompts)
    assert [s.terms["batch_lengths"] for s in scores] == [4.0, 3.0, 0.0]
    assert [s.terms["batch_of_wrong_size"] for s in scores] == [0.0] * 3  # 1 value for 3: all fail
    assert rewards.take_stats()["reward_errors"] == 3.0
    with pytest.raises(UserError, match=r"^task\.rewards\[0\]\.batched: must be true or false"):
        build_rewards([{"_target_": f"{user_module}.batch_lengths", "batched": "yes"}])


def test_correct_by_the_correctness_terms():
    rewards = build_rewards([{"name": "math_verify"}, {"name": "format"}])
    right = scored(rewards, r"\boxed{4}", "4")
    assert right.correct and right.terms == {"math_verify": 1.0, "format": 0.0}  # format does not decide
    assert not scored(rewards, "<think>a</think><answer>5</answer>", "4").correct


def test_correct_without_a_correctness_term_needs_every_best_value():
    rewards = build_rewards([{"name": "regex", "pattern": "ok"}, {"name": "length_penalty", "max_chars": 4}])
    assert scored(rewards, "ok").correct
    assert not scored(rewards, "ok, longer").correct
    assert not scored(rewards, "no").correct


def test_a_batch_calls_each_term_once_per_completion_in_order(user_module):
    """Failing this means a completion was scored twice, skipped or paired with another's prompt."""
    rewards = build_rewards([{"_target_": f"{user_module}.counted"}, {"_target_": f"{user_module}.with_field"}])
    calls = sys.modules[user_module].CALLS
    prompts = [Prompt(text="Q", ids=(1,), answer="a", fields={"source": s}) for s in ("book", "web", "book")]
    scores = rewards.score_batch(["[1]", "[2]", "[3]"], prompts)
    assert calls == ["[1]", "[2]", "[3]"]
    assert [s.reward for s in scores] == [2.0, 1.0, 2.0] and [s.terms["with_field"] for s in scores] == [1, 0, 1]
    assert rewards.take_stats() == {"reward/counted": 1.0, "reward/with_field": 2 / 3, "reward_errors": 0.0}


def test_specs_may_be_omegaconf_nodes(user_module):
    specs = [{"name": "format", "tags": ["a", "b"], "weight": 2}, {"_target_": f"{user_module}.is_list", "items": [1]}]
    rewards = build_rewards(OmegaConf.create(specs))
    assert score(rewards, "<a>1</a><b>2</b>") == 2.0 + 1.0  # a target's options are plain Python values


def test_the_default_rewards_are_math_verify():
    rewards = build_rewards(DEFAULT_REWARDS)
    assert [(t.name, t.weight) for t in rewards.terms] == [("math_verify", 1.0)]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], "task.rewards: must be a non-empty list"),
        ({"name": "regex"}, "task.rewards: must be a non-empty list"),
        ([{"name": "exact"}], "task.rewards[0].name: unknown reward 'exact'; built in: exact_match, math_verify, "
                              "regex, format, length_penalty"),
        ([{"weight": 1.0}], "task.rewards[0]: give a name"),
        ([{"name": ["regex"]}], "task.rewards[0].name: unknown reward ['regex']"),
        (["exact_match"], "task.rewards[0]: must be a mapping"),
        ([{"name": "format"}, {"name": "regex", "patern": "x"}],
         "task.rewards[1].patern: regex takes no option 'patern' (its options: pattern)"),
        ([{"name": "regex"}], "task.rewards[0]: regex needs the option 'pattern'"),
        ([{"name": "format"}, {"name": "regex", "pattern": "(unclosed"}],
         "task.rewards[1].pattern: not a regular expression"),
        ([{"name": "format", "tags": []}], "task.rewards[0].tags: must be a non-empty list"),
        ([{"name": "length_penalty", "max_chars": -1}], "task.rewards[0].max_chars: must be an integer >= 0"),
        ([{"name": "length_penalty", "max_chars": 5, "per_char": math.inf}], "task.rewards[0].per_char: must be"),
        ([{"name": "math_verify", "timeout_s": 1.5}], "task.rewards[0].timeout_s: must be an integer >= 0"),
        ([{"name": "exact_match", "after": ""}], "task.rewards[0].after: must be a non-empty string"),
        ([{"name": "exact_match", "weight": math.nan}], "task.rewards[0].weight: must be a finite number"),
        ([{"name": "exact_match", "weight": -math.inf}], "task.rewards[0].weight: must be a finite number"),
        ([{"name": "exact_match", "weight": "1"}], "task.rewards[0].weight: must be a finite number"),
        ([{"name": "exact_match"}, {"name": "exact_match", "after": "#"}],
         "task.rewards[1]: the name 'exact_match' is already used by task.rewards[0]"),
        ([{"_target_": "no_such_module_here.f"}], "task.rewards[0]._target_: cannot import 'no_such_module_here.f'"),
    ],
)
def test_a_bad_spec_is_one_user_error_naming_its_key(specs, message):
    with pytest.raises(UserError) as err:
        build_rewards(specs)
    assert str(err.value).startswith(message)


def test_target_problems_name_their_keys(user_module):
    with pytest.raises(UserError, match=r"^x\.rewards\[0\]\.min: my_rewards.has_citation takes no option 'min' "
                                        r"\(its options: min_count\)$"):
        build_rewards([{"_target_": f"{user_module}.has_citation", "min": 2}], key="x.rewards")
    with pytest.raises(UserError, match=r"^task\.rewards\[0\]\.answer: is passed by the task"):
        build_rewards([{"_target_": f"{user_module}.fussy", "answer": "4"}])
    with pytest.raises(UserError, match=r"^task\.rewards\[1\]: the name 'has_citation' is already used"):
        build_rewards([{"_target_": f"{user_module}.has_citation"}, {"_target_": f"{user_module}.has_citation"}])


def test_every_problem_is_reported_in_one_error():
    with pytest.raises(UserError) as err:
        build_rewards([{"name": "nope"}, {"name": "regex", "pattern": "("}, {"name": "format", "weight": math.nan}])
    lines = str(err.value).splitlines()
    assert lines[0] == "task.rewards: 3 problems:"
    assert [line.split(":")[0] for line in lines[1:]] == [
        "  - task.rewards[0].name", "  - task.rewards[1].pattern", "  - task.rewards[2].weight",
    ]


class TextTask(ReverseTask):
    """A reverse task scored by a `RewardSet` on the decoded text, as the prompts task does."""

    def __init__(self, specs):
        super().__init__(min_len=2, max_len=2)
        self.rewards = build_rewards(specs)

    def score_batch(self, prompts, completion_ids):
        return self.rewards.score_batch([self.tokenizer.decode(ids) for ids in completion_ids], prompts)

    def take_reward_stats(self):
        return self.rewards.take_stats()


class AnswerSampler:
    """Answers every prompt with ``a`` then eos, then with ``aaaa`` (no eos), in turn."""

    temperature = 1.0
    vocab_size = 7

    def sample(self, prompts, *, max_new_tokens, stop_ids, pad_id, generator):
        a, eos = 2, stop_ids[0]
        group = [Completion([a, eos], [-0.1, -0.1], True), Completion([a] * 4, [-0.1] * 4, False)]
        return group * (len(prompts) // 2)


def test_generate_merges_the_task_reward_stats():
    task = TextTask([{"name": "regex", "pattern": "^a$"}, {"name": "length_penalty", "max_chars": 2, "per_char": 0.5}])
    rollouts = OnPolicyRollouts(task, AnswerSampler(), prompts_per_step=2, group_size=2, max_new_tokens=4, eps=1e-6)
    docs, stats = rollouts.generate(step=0)
    assert [d.reward for d in docs] == [1.0, -1.0] * 2  # "a": regex 1; "aaaa": 2 chars over the limit
    assert stats == pytest.approx({
        "reward": 0.0, "accuracy": 0.5, "completion_length": 3.0, "stopped_fraction": 0.5,
        "reward/regex": 0.5, "reward/length_penalty": -0.5, "reward_errors": 0.0,
    })
