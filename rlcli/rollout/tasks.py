"""Built-in tasks for on-policy training: a character tokenizer, prompts and rewards.

A task is any object with (plug your own in with ``_target_``):

- ``tokenizer``: has ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``, ``eos_id``
  and ``pad_id`` (the sampler stops at ``eos_id``, and at the ids of an optional ``stop_ids``; the
  model's vocabulary must hold ``vocab_size`` ids; ``decode`` also finds ``rollout.stop`` strings);
- ``sample_prompts(rng: random.Random, n: int) -> list[Prompt]``: ``n`` prompts drawn with ``rng``
  only, so that a seeded ``rng`` gives the same prompts again;
- ``reward(prompt: Prompt, completion_ids: list[int]) -> float`` in ``[0, 1]``: the completion
  as sampled (ending with ``eos_id`` if the sampler stopped there, cut at the token budget if not);
- ``is_correct(prompt, completion_ids) -> bool``: the exact answer followed by ``eos_id``;

or, instead of those two, ``score_batch(prompts, completion_ids) -> list[Score]``: every completion of a
batch scored at once (its prompt at the same index), for tasks whose rewards run elsewhere (a worker pool, a
reward model); `score_completions` calls whichever the task has. And optionally:

- ``eval_prompts() -> list[Prompt]``: a held-out split to evaluate on (``rlcli eval``, ``eval.every``),
  in a fixed order; without it, evaluation draws prompts with ``sample_prompts`` and a fixed seed;
- ``take_reward_stats() -> dict[str, float]``: statistics of the rewards given since the last call
  (e.g. ``reward/<name>``), logged with each step's;
- ``has_accuracy_term: bool``: the reward has a term that alone decides ``is_correct`` (then
  ``rollout.filter=zero_variance`` judges groups by accuracy by default, not by the reward);
- ``OPTION_DOCS: dict[str, str]``, a class attribute: a one-line description of each keyword of its
  constructor (its ``task.*`` keys), which ``rlcli train --help`` and the config reference show.

The built-in tasks score a completion against ``answer`` + eos in token space (see
``sequence_reward``), so ids the tokenizer does not know (a model vocabulary larger than the
tokenizer's) simply count as wrong.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AdditionTask",
    "CharTokenizer",
    "Prompt",
    "ReverseTask",
    "Score",
    "score_completions",
    "sequence_reward",
]


class CharTokenizer:
    """One token per character of ``alphabet``, after the special tokens ``pad`` (0) and ``eos`` (1)."""

    pad_id = 0
    eos_id = 1
    num_special = 2

    def __init__(self, alphabet: str) -> None:
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet must be non-empty with distinct characters, got {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {char: i + self.num_special for i, char in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return self.num_special + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no eos); a character outside the alphabet raises ``ValueError``."""
        unknown = sorted(set(text) - self._ids.keys())
        if unknown:
            raise ValueError(f"characters {unknown} are not in the alphabet {self.alphabet!r}")
        return [self._ids[char] for char in text]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` up to the first eos; pad is skipped, an unknown id shows as ``?``."""
        chars = []
        for i in ids:
            if i == self.eos_id:
                break
            if i != self.pad_id:
                index = i - self.num_special
                chars.append(self.alphabet[index] if 0 <= index < len(self.alphabet) else "?")
        return "".join(chars)


@dataclass(frozen=True)
class Prompt:
    """A prompt's text, its token ids, the expected answer text (None if a dataset gives none) and
    the record's other fields, which rewards may read. ``fields`` (read-only by convention) takes
    part in equality but not in the hash, so a prompt with unhashable field values still hashes.
    ``source``: where a prompt read from a file or dataset is (``a.jsonl:3``, a dataset's row), for messages."""

    text: str
    ids: tuple[int, ...]
    answer: str | None
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)
    source: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Score:
    """One completion scored: its reward, whether it is correct, and the raw value of each term of the
    reward by name (shown in ``completions.jsonl``; empty for a task whose reward has no terms)."""

    reward: float
    correct: bool
    terms: Mapping[str, float] = field(default_factory=dict)


def score_completions(task: Any, prompts: Sequence[Prompt], completion_ids: Sequence[Sequence[int]]) -> list[Score]:
    """The `Score` of each completion (``completion_ids[i]`` answers ``prompts[i]``): the task's own
    ``score_batch`` where it has one, else its ``reward`` and ``is_correct`` on each completion."""
    if hasattr(task, "score_batch"):
        scores = list(task.score_batch(prompts, completion_ids))
        if len(scores) != len(completion_ids):
            raise ValueError(f"{type(task).__name__}.score_batch returned {len(scores)} scores for "
                             f"{len(completion_ids)} completions")
        return scores
    return [Score(float(task.reward(p, ids)), bool(task.is_correct(p, ids))) for p, ids in zip(prompts, completion_ids)]


def sequence_reward(
    completion_ids: Sequence[int], target_ids: Sequence[int], eos_id: int, *, align: str = "left"
) -> float:
    """Partial credit in ``[0, 1]`` for producing ``target_ids`` and then ``eos_id``.

    With ``content`` the completion before its first eos:
    ``0.6 * matches / max(len(content), len(target)) + 0.2 * [same length] + 0.2 * [eos produced]``,
    where ``matches`` counts the positions where content and target agree, compared from the
    start (``align="left"``) or from the end (``"right"``: digits of a number by place value).
    Extra junk lowers the match fraction; the exact target followed by eos scores 1.
    """
    if align not in ("left", "right"):
        raise ValueError(f"align must be 'left' or 'right', got {align!r}")
    stopped = eos_id in completion_ids
    content = list(completion_ids[: completion_ids.index(eos_id)] if stopped else completion_ids)
    target = list(target_ids)
    if align == "right":
        content, target = content[::-1], target[::-1]
    matches = sum(a == b for a, b in zip(content, target))
    match_fraction = matches / max(len(content), len(target), 1)
    return 0.6 * match_fraction + 0.2 * (len(content) == len(target)) + 0.2 * stopped


class _AnswerTask:
    """Scoring shared by the built-in tasks: the answer's ids followed by eos."""

    tokenizer: CharTokenizer
    align = "left"

    def _prompt(self, text: str, answer: str) -> Prompt:
        return Prompt(text=text, ids=tuple(self.tokenizer.encode(text)), answer=answer)

    def reward(self, prompt: Prompt, completion_ids: Sequence[int]) -> float:
        target = self.tokenizer.encode(prompt.answer)
        return sequence_reward(completion_ids, target, self.tokenizer.eos_id, align=self.align)

    def is_correct(self, prompt: Prompt, completion_ids: Sequence[int]) -> bool:
        return list(completion_ids) == self.tokenizer.encode(prompt.answer) + [self.tokenizer.eos_id]


class AdditionTask(_AnswerTask):
    """``"3+4="`` -> ``"7"``: the sum of two non-negative numbers of at most ``max_digits`` digits.

    Digits are credited by place value (``align="right"``): ``"17"`` for ``"7"`` gets the ones digit.
    """

    align = "right"
    OPTION_DOCS = {"max_digits": "the most digits of each of the two numbers"}

    def __init__(self, max_digits: int = 1) -> None:
        if max_digits < 1:
            raise ValueError(f"max_digits must be >= 1, got {max_digits}")
        self.max_digits = max_digits
        self.tokenizer = CharTokenizer("0123456789+=")

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        high = 10**self.max_digits - 1
        prompts = []
        for _ in range(n):
            a, b = rng.randint(0, high), rng.randint(0, high)
            prompts.append(self._prompt(f"{a}+{b}=", str(a + b)))
        return prompts


class ReverseTask(_AnswerTask):
    """``"abc>"`` -> ``"cba"``: a random string of ``min_len``..``max_len`` characters, reversed."""

    OPTION_DOCS = {
        "min_len": "the shortest string to reverse, in characters (at least 1)",
        "max_len": "the longest string to reverse, in characters",
        "alphabet": "the characters the strings are drawn from (distinct; no '>', the separator)",
    }

    def __init__(self, min_len: int = 1, max_len: int = 2, alphabet: str = "abcd") -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if not alphabet or ">" in alphabet:
            raise ValueError(f"alphabet must have letters and no '>', the separator; got {alphabet!r}")
        self.min_len = min_len
        self.max_len = max_len
        self.tokenizer = CharTokenizer(alphabet + ">")
        self.letters = alphabet

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        prompts = []
        for _ in range(n):
            length = rng.randint(self.min_len, self.max_len)
            text = "".join(rng.choice(self.letters) for _ in range(length))
            prompts.append(self._prompt(f"{text}>", text[::-1]))
        return prompts
