"""The character tokenizer and the built-in tasks' prompts and rewards."""

from __future__ import annotations

import random

import pytest

from rlcli.rollout.tasks import AdditionTask, CharTokenizer, Prompt, ReverseTask, sequence_reward

EOS = CharTokenizer.eos_id


def test_tokenizer_round_trip_and_special_tokens():
    tok = CharTokenizer("abc>")
    assert (tok.pad_id, tok.eos_id, tok.vocab_size) == (0, 1, 6)
    ids = tok.encode("cab>a")
    assert ids == [4, 2, 3, 5, 2]
    assert tok.decode(ids) == "cab>a"
    assert tok.decode([tok.pad_id, 2, tok.pad_id, 3, tok.eos_id, 4]) == "ab"  # pad skipped, stops at eos
    assert tok.decode([2, 99]) == "a?"


@pytest.mark.parametrize("alphabet", ["", "aa"])
def test_tokenizer_rejects_bad_alphabets(alphabet):
    with pytest.raises(ValueError):
        CharTokenizer(alphabet)


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"\['x'\]"):
        CharTokenizer("ab").encode("abx")


@pytest.mark.parametrize(
    ("completion", "target", "align", "expected"),
    [
        ([5, 6, EOS], [5, 6], "left", 1.0),  # exact answer then eos
        ([5, 6], [5, 6], "left", 0.8),  # right answer but no eos (cut at the budget)
        ([5, 7, EOS], [5, 6], "left", 0.6 * 1 / 2 + 0.2 + 0.2),  # one position right
        ([5, EOS], [5, 6], "left", 0.6 * 1 / 2 + 0.2),  # too short
        ([5, 6, 9, 9, EOS], [5, 6], "left", 0.6 * 2 / 4 + 0.2),  # junk after the answer
        ([EOS], [5, 6], "left", 0.2),  # stops at once
        ([9, 9, 9, 9], [5, 6], "left", 0.0),  # junk, no eos
        ([6, EOS], [5, 6], "left", 0.2),  # the last digit only, compared from the left
        ([6, EOS], [5, 6], "right", 0.6 * 1 / 2 + 0.2),  # ... and by place value
        ([5, 6, EOS, 9], [5, 6], "left", 1.0),  # tokens after eos are ignored
    ],
)
def test_sequence_reward_cases(completion, target, align, expected):
    assert sequence_reward(completion, target, EOS, align=align) == pytest.approx(expected)


def test_rewards_stay_in_unit_interval():
    rng = random.Random(0)
    task = ReverseTask(min_len=1, max_len=4)
    for prompt in task.sample_prompts(rng, 200):
        completion = [rng.randrange(0, 12) for _ in range(rng.randint(1, 6))]  # ids beyond the vocab too
        assert 0.0 <= task.reward(prompt, completion) <= 1.0


def test_addition_prompts_and_rewards():
    task = AdditionTask(max_digits=1)
    tok = task.tokenizer
    prompts = task.sample_prompts(random.Random(0), 50)
    for p in prompts:
        a, b = p.text[:-1].split("+")
        assert p.text.endswith("=") and p.answer == str(int(a) + int(b)) and 0 <= int(a) <= 9
        assert p.ids == tuple(tok.encode(p.text))
    prompt = Prompt(text="3+4=", ids=tuple(tok.encode("3+4=")), answer="7")
    eos = [tok.eos_id]
    assert task.reward(prompt, tok.encode("7") + eos) == 1.0
    assert task.is_correct(prompt, tok.encode("7") + eos)
    assert not task.is_correct(prompt, tok.encode("7"))  # no eos
    assert task.reward(prompt, tok.encode("7")) == pytest.approx(0.8)
    assert task.reward(prompt, tok.encode("17") + eos) == pytest.approx(0.5)  # ones digit right
    assert task.reward(prompt, tok.encode("8") + eos) == pytest.approx(0.4)  # right length, wrong digit
    assert task.reward(prompt, tok.encode("+=+=")) == 0.0  # junk


def test_addition_two_digits_reaches_two_digit_numbers():
    prompts = AdditionTask(max_digits=2).sample_prompts(random.Random(1), 100)
    assert max(int(p.answer) for p in prompts) >= 100
    assert all(len(p.text) <= len("99+99=") for p in prompts)


def test_reverse_prompts_and_rewards():
    task = ReverseTask(min_len=2, max_len=3, alphabet="abcd")
    tok = task.tokenizer
    for p in task.sample_prompts(random.Random(0), 50):
        text = p.text[:-1]
        assert p.text.endswith(">") and p.answer == text[::-1] and 2 <= len(text) <= 3
        assert set(text) <= set("abcd")
    prompt = Prompt(text="abc>", ids=tuple(tok.encode("abc>")), answer="cba")
    eos = [tok.eos_id]
    assert task.reward(prompt, tok.encode("cba") + eos) == 1.0
    assert task.is_correct(prompt, tok.encode("cba") + eos)
    assert task.reward(prompt, tok.encode("cbb") + eos) == pytest.approx(0.6 * 2 / 3 + 0.4)
    assert task.reward(prompt, tok.encode("cb") + eos) == pytest.approx(0.6 * 2 / 3 + 0.2)
    assert task.reward(prompt, tok.encode("abc") + eos) == pytest.approx(0.6 * 1 / 3 + 0.4)  # the middle
    assert task.reward(prompt, tok.encode("dddd")) == 0.0


def test_prompts_depend_only_on_the_rng():
    task = ReverseTask()
    first = task.sample_prompts(random.Random(7), 20)
    assert task.sample_prompts(random.Random(7), 20) == first
    assert task.sample_prompts(random.Random(8), 20) != first


@pytest.mark.parametrize(
    ("task_class", "options"),
    [(AdditionTask, dict(max_digits=0)), (ReverseTask, dict(min_len=3, max_len=2)), (ReverseTask, dict(alphabet="a>")),
     (ReverseTask, dict(alphabet=""))],
)
def test_bad_task_options(task_class, options):
    with pytest.raises(ValueError):
        task_class(**options)
