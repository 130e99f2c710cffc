"""Rewards on a completion's text: built-in reward functions, user functions by ``_target_``, and
`RewardSet`, their weighted sum with per-term statistics (``task.rewards``).

A reward function is ``fn(completion: str, *, answer: str | None, prompt: str, **fields) -> float``:
the decoded completion, the prompt record's ``answer`` and prompt text, and its extra fields.

``task.rewards`` lists terms, each ``{name: <built-in>, weight: 1.0, ...options}`` or
``{_target_: dotted.path.to.function, weight: 1.0, name: optional, ...options}``:

- a built-in's options go to its factory in `REWARDS`, which checks them and returns the function
  (adding a built-in is one factory registered with ``@REWARDS.register(name)``);
- a ``_target_`` function is called as ``fn(completion, answer=..., prompt=..., **fields, **options)``,
  keeping only the keywords it declares unless it takes ``**kwargs`` (an option wins over a field);
  with ``batched: true`` it takes the whole batch instead: ``fn(completions: list[str], answer=[...],
  prompt=[...], **fields as lists)``, returning one value per completion. An ``async def`` function
  (batched or not) is run to its end in an event loop of its own.

The terms run in a pool of worker processes, each call with a timeout (`rlcli.rollout.reward_pool`;
``workers`` and ``timeout`` of `build_rewards`), except ``in_process`` ones (a reward model).

A value must be a finite real number: a raise, a string (even ``"1.0"``), a bool, NaN or infinity is a
failure, which scores 0 and is counted (`RewardSet`).

A term's name (``name``, else the target's last component) must be unique; its raw value is logged
as ``reward/<name>``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from rlcli.errors import UserError
from rlcli.modules.metrics import Metric
from rlcli.modules.registry import Registry
from rlcli.rollout.tasks import Prompt, Score
from rlcli.signals import interruptible

if TYPE_CHECKING:
    from rlcli.rollout.reward_pool import RewardPool

__all__ = ["DEFAULT_REWARDS", "METRICS", "REWARDS", "RewardSet", "RewardTerm", "build_rewards"]

log = logging.getLogger("rlcli")

RewardFn = Callable[..., float]

# `RewardSet.take_stats`: the task's statistics of the completions scored since the last call
METRICS = {
    "reward/<name>": Metric("task=prompts (a task with `take_reward_stats`)", "each reward term's mean raw value "
                            "(unweighted, a failure as 0) over the step's completions; one column per term"),
    "reward_errors": Metric("task=prompts (a task with `take_reward_stats`)", "failures of reward terms (a raise, "
                            "a value that is not a finite number, a call past task.reward_timeout or whose worker "
                            "died; scored 0) on the step's completions"),
}

DEFAULT_REWARDS: tuple[dict[str, Any], ...] = ({"name": "math_verify"},)
"""The rewards of a prompts task without ``task.rewards``."""

REWARDS: Registry[Callable[..., RewardFn]] = Registry("reward")
"""Built-in rewards by name: factories that take the term's options and return the function."""


class _BadOption(ValueError):
    """A built-in reward's option has a wrong value."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def _require(ok: bool, option: str, message: str) -> None:
    if not ok:
        raise _BadOption(option, message)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _gold(answer: Any) -> str:
    if answer is None:
        raise ValueError("the prompt has no answer to compare with")
    return str(answer)


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


@REWARDS.register("exact_match")
def exact_match_reward(*, after: str | None = None) -> RewardFn:
    """1.0 when the completion equals ``answer`` once both are normalised (whitespace runs become
    one space, ends stripped, case folded), else 0.0. With ``after`` (e.g. ``"####"``), only the
    text after the last occurrence of that marker is compared; a completion without it scores 0."""
    _require(after is None or (isinstance(after, str) and after != ""), "after", "must be a non-empty string")

    def reward(completion: str, *, answer: Any, **_: Any) -> float:
        if after is not None:
            _, marker, completion = completion.rpartition(after)
            if not marker:
                return 0.0
        return float(_normalise(completion) == _normalise(_gold(answer)))

    return reward


_TAG = re.compile(r"</?[A-Za-z][\w-]*>")


@lru_cache(maxsize=1)
def _math_config() -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # one config for gold and completion: math-verify caches the regexes of a single config only
    return (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


@lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout_s: int | None) -> list:
    from math_verify import parse

    found = parse(answer, _math_config(), parsing_timeout=timeout_s) or parse(
        f"${answer}$", _math_config(), parsing_timeout=timeout_s
    )
    if not found:
        raise ValueError(f"math-verify finds no answer in the gold answer {answer!r}")
    return found


@REWARDS.register("math_verify")
def math_verify_reward(*, timeout_s: int = 5) -> RewardFn:
    """1.0 when math-verify finds the completion's final answer equal to ``answer``, else 0.0.

    The completion's answer is math-verify's extraction, tags like ``<answer>`` replaced by spaces
    first: the last ``\\boxed{}``; else one after "final answer is" or "answer"; else the last
    LaTeX expression or plain number or expression (``1/2``, ``0.5``, ``1,000``). Nothing found
    scores 0. The gold ``answer`` is parsed alike (as LaTeX in ``$...$`` when that finds nothing);
    a gold answer that does not parse is a failure. ``verify`` compares them as sympy values, so
    ``\\boxed{1/2}`` matches ``0.5``. ``timeout_s`` bounds each parse and comparison (math-verify
    uses ``SIGALRM``, so only in the main thread; elsewhere there is no limit; 0: none).
    """
    _require(_is_count(timeout_s), "timeout_s", f"must be an integer >= 0, got {timeout_s!r}")
    from math_verify import parse, verify

    def reward(completion: str, *, answer: Any, **_: Any) -> float:
        limit = timeout_s if threading.current_thread() is threading.main_thread() else None
        gold = _parse_gold(_gold(answer), limit)
        found = parse(_TAG.sub(" ", completion), _math_config(), parsing_timeout=limit)
        return float(verify(gold, found, timeout_seconds=limit))

    return reward


@REWARDS.register("regex")
def regex_reward(*, pattern: str) -> RewardFn:
    """1.0 when ``pattern`` (a Python regular expression) matches somewhere in the completion
    (``re.search``), else 0.0. Flags go inline, e.g. ``(?is)``."""
    try:
        compiled = re.compile(pattern)
    except (re.error, TypeError) as err:
        raise _BadOption("pattern", f"not a regular expression: {err}") from None
    return lambda completion, **_: float(compiled.search(completion) is not None)


@REWARDS.register("format")
def format_reward(*, tags: Sequence[str] = ("think", "answer")) -> RewardFn:
    """1.0 when the completion is, apart from whitespace around and between the blocks, exactly
    ``<t1>...</t1><t2>...</t2>...`` for the ``tags`` in order, where no block's content holds an
    opening or closing tag of ``tags``; else 0.0. Contents may be empty and span lines."""
    ok = isinstance(tags, Sequence) and not isinstance(tags, str) and len(tags) > 0
    ok = ok and all(isinstance(t, str) and t for t in tags) and len(set(tags)) == len(tags)
    _require(ok, "tags", f"must be a non-empty list of distinct tag names, got {tags!r}")
    any_tag = "|".join(re.escape(f"<{t}>") + "|" + re.escape(f"</{t}>") for t in tags)
    content = f"(?:(?!{any_tag}).)*"
    blocks = r"\s*".join(re.escape(f"<{t}>") + content + re.escape(f"</{t}>") for t in tags)
    compiled = re.compile(rf"\s*{blocks}\s*", re.DOTALL)
    return lambda completion, **_: float(compiled.fullmatch(completion) is not None)


@REWARDS.register("length_penalty")
def length_penalty_reward(*, max_chars: int, per_char: float = 0.001) -> RewardFn:
    """``-per_char * (len(completion) - max_chars)`` beyond ``max_chars`` characters of the decoded
    text (Python ``str`` length, not tokens), 0.0 up to and at the limit."""
    _require(_is_count(max_chars), "max_chars", f"must be an integer >= 0, got {max_chars!r}")
    _require(_is_number(per_char) and math.isfinite(per_char) and per_char >= 0,
             "per_char", f"must be a finite number >= 0, got {per_char!r}")
    return lambda completion, **_: per_char * min(0, max_chars - len(completion))


@REWARDS.register("model")
def model_reward(*, path: str, batch_size: int = 8, max_length: int | None = None, dtype: str | None = None,
                 device: str | None = None, label: int | None = None, suffix: str = "",
                 trust_remote_code: bool = False) -> RewardFn:
    """A reward model's logit for prompt + completion: the Hugging Face sequence-classification model of the
    directory ``path``, on the whole batch in the training process (`rlcli.rollout.reward_model`)."""
    from rlcli.rollout.reward_model import RewardModel

    return RewardModel(path, batch_size=batch_size, max_length=max_length, dtype=dtype, device=device, label=label,
                       suffix=suffix, trust_remote_code=trust_remote_code)


CORRECTNESS_REWARDS = frozenset({"exact_match", "math_verify"})
_BEST = {"length_penalty": 0.0, "model": math.inf}  # a term's best value where it is not 1.0 (a model's: none)
BATCHED_REWARDS = frozenset({"model"})  # built-ins whose function takes the whole batch
IN_PROCESS_REWARDS = frozenset({"model"})  # built-ins that run in the training process (on its device)


@dataclass(frozen=True)
class RewardTerm:
    """One term of a `RewardSet`: ``weight * fn(...)``; ``best`` is its best value and ``decides``
    says whether it alone decides correctness (see `RewardSet.score_batch`). A ``batched`` term's ``fn``
    takes the whole batch (the list of completions, and a list for each keyword) and returns a list of
    values; an ``in_process`` one runs in the training process (a reward model on the trainer's device)."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    best: float = 1.0
    decides: bool = False
    batched: bool = False
    in_process: bool = False


def checked_value(value: Any) -> float:
    """A reward function's value as a float; `ValueError` naming it when it is not a finite real number
    (a string such as ``"1.0"`` and a bool are refused, not converted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"returned {value!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return float(value)


def term_values(term: RewardTerm, completions: Sequence[str], contexts: Sequence[Mapping[str, Any]]
                ) -> list[tuple[float, str | None]]:
    """``term``'s value on each completion with its context (the keywords of its call), and the reason where
    it failed (the value is then 0): a raise, or a value that is not a finite number. A ``batched`` term is
    called once with every keyword as a list (None where a context lacks it); its failure fails every
    completion of the batch."""
    if not term.batched:
        return [_call(term.fn, completion, context) for completion, context in zip(completions, contexts)]
    keys = dict.fromkeys(key for context in contexts for key in context)
    try:
        values = term.fn(list(completions), **{key: [c.get(key) for c in contexts] for key in keys})
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) != len(completions):
            raise ValueError(f"returned {values!r:.80}, not a list of {len(completions)} values")
    except (Exception, SystemExit) as err:  # a reward's sys.exit() is its failure, not the run's end
        return [(0.0, _reason(err))] * len(completions)
    return [_checked(value) for value in values]


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _checked(value: Any) -> tuple[float, str | None]:
    try:
        return checked_value(value), None
    except ValueError as err:
        return 0.0, _reason(err)


def _call(fn: RewardFn, completion: str, context: Mapping[str, Any]) -> tuple[float, str | None]:
    try:
        value = fn(completion, **context)
    except (Exception, SystemExit) as err:  # a reward's sys.exit() is its failure, not the run's end
        return 0.0, _reason(err)
    return _checked(value)


class RewardSet:
    """The weighted sum of reward terms, with their means and failures since the last `take_stats`.

    A term that raises, or returns a value that is not a finite number, is a failure: it scores 0
    for that completion, is counted in ``reward_errors`` and logged once per `take_stats` with its
    first reason; the run goes on. With a ``pool``, it runs the terms that are not ``in_process`` (a call
    that times out or ends its worker fails the same way) while the others run here.
    """

    def __init__(self, terms: Sequence[RewardTerm], pool: RewardPool | None = None) -> None:
        if not terms:
            raise ValueError("a RewardSet needs at least one term")
        self.terms = tuple(terms)
        self.pool = pool  # runs the terms that are not in_process, in their order
        self._reset()

    def _reset(self) -> None:
        self._count = 0
        self._sums = [0.0] * len(self.terms)
        self._failures: dict[str, tuple[int, str]] = {}  # name -> (count, first reason)

    def _is_correct(self, values: Sequence[float]) -> bool:
        """Whether every correctness term (``exact_match``, ``math_verify``) scores 1; without one,
        whether every term reaches its best value (1, or 0 for ``length_penalty``): then, with
        positive weights, the sum is its maximum."""
        judged = [(t, v) for t, v in zip(self.terms, values) if t.decides] or list(zip(self.terms, values))
        return all(value >= term.best for term, value in judged)

    def score_batch(self, completions: Sequence[str], prompts: Sequence[Prompt]) -> list[Score]:
        """The `Score` of each completion's text against its prompt (``prompts[i]``: its ``answer``,
        ``text`` and ``fields`` go to the terms as ``answer``, ``prompt`` and keywords): the weighted sum
        of the terms, whether it is correct, and each term's raw value (a failure as 0), recorded for
        `take_stats`."""
        if len(completions) != len(prompts):
            raise ValueError(f"{len(completions)} completions for {len(prompts)} prompts")
        contexts = [{**p.fields, "answer": p.answer, "prompt": p.text} for p in prompts]
        with interruptible():  # a signal ends a reward that hangs, or the wait for the pool
            pooled = self.pool.submit(completions, contexts) if self.pool is not None else None
            columns = [term_values(term, completions, contexts) for term in self.terms
                       if pooled is None or term.in_process]
            if pooled is not None:  # the pool's columns back in the terms' order
                inline, from_pool = iter(columns), iter(pooled())
                columns = [next(inline) if term.in_process else next(from_pool) for term in self.terms]
        scores = []
        for results in zip(*columns):  # one completion's (value, reason) of each term
            values = [value for value, _ in results]
            self._count += 1
            self._sums = [total + value for total, value in zip(self._sums, values)]
            for term, (_, reason) in zip(self.terms, results):
                if reason is not None:
                    count, first = self._failures.get(term.name, (0, reason))
                    self._failures[term.name] = (count + 1, first)
            reward = sum(term.weight * value for term, value in zip(self.terms, values))
            if not math.isfinite(reward):  # finite values whose weighted sum overflows
                terms = ", ".join(f"{t.name} {v:g} x weight {t.weight:g}" for t, v in zip(self.terms, values))
                raise UserError(f"task.rewards: the weighted sum of the rewards of a completion is {reward} ({terms}); "
                                "it must be a finite number: lower the weights or the values")
            scores.append(Score(reward=reward, correct=self._is_correct(values),
                                terms={term.name: value for term, value in zip(self.terms, values)}))
        return scores

    def take_stats(self) -> dict[str, float]:
        """``reward/<name>``: each term's mean raw value (unweighted, failures as 0) over the
        completions scored since the last call, and ``reward_errors``: their failures; then
        reset. Empty when nothing was scored."""
        if self._count == 0:
            return {}
        stats = {f"reward/{t.name}": total / self._count for t, total in zip(self.terms, self._sums)}
        stats["reward_errors"] = float(sum(count for count, _ in self._failures.values()))
        for name, (count, reason) in self._failures.items():
            log.warning("reward %s failed on %d of %d completions (scored 0), first: %s",
                        name, count, self._count, reason)
        self._reset()
        return stats


def _parameters(fn: Callable, is_target: bool) -> tuple[list[inspect.Parameter], bool]:
    """The keyword parameters of ``fn`` (a target's first one takes the completion) and whether it
    takes ``**kwargs``."""
    params = list(inspect.signature(fn).parameters.values())
    if is_target:
        params = params[1:]
    keywords = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return keywords, any(p.kind is p.VAR_KEYWORD for p in params)


def _check_options(fn: Callable, options: Mapping, path: str, what: str, *, is_target: bool) -> list[str] | None:
    """The keywords ``fn`` takes (None: any); `UserError` for an option it does not take, or one a
    factory needs and lacks (a target's other parameters may come from the record's fields)."""
    keywords, takes_any = _parameters(fn, is_target)
    names = [p.name for p in keywords]
    for option in options:
        if not takes_any and option not in names:
            known = ", ".join(n for n in names if n not in ("answer", "prompt")) or "none"
            raise UserError(f"{path}.{option}: {what} takes no option {option!r} (its options: {known})")
    if not is_target:
        missing = [p.name for p in keywords if p.default is p.empty and p.name not in options]
        if missing:
            raise UserError(f"{path}: {what} needs the option {missing[0]!r}")
    return None if takes_any else names


def _builtin_term(name: Any, options: dict, path: str, weight: float) -> RewardTerm:
    if not isinstance(name, str) or name not in REWARDS:
        raise UserError(f"{path}.name: unknown reward {name!r}; built in: {', '.join(REWARDS)} (or give a _target_)")
    factory = REWARDS[name]
    _check_options(factory, options, path, name, is_target=False)
    try:
        fn = factory(**options)
    except _BadOption as err:
        raise UserError(f"{path}.{err.option}: {err}") from None
    return RewardTerm(name, fn, weight, best=_BEST.get(name, 1.0), decides=name in CORRECTNESS_REWARDS,
                      batched=name in BATCHED_REWARDS, in_process=name in IN_PROCESS_REWARDS)


def _bind_target(fn: Callable, options: dict, accepted: list[str] | None) -> RewardFn:
    """``fn`` called with ``options`` and, of the context, only the keywords it declares; an ``async def``
    one run to its end in an event loop of its own."""
    is_async = inspect.iscoroutinefunction(fn)

    def reward(completion: str, **context: Any) -> float:
        if accepted is not None:
            context = {key: value for key, value in context.items() if key in accepted}
        value = fn(completion, **{**context, **options})
        return asyncio.run(value) if is_async else value

    return reward


def _target_term(target: Any, name: Any, options: dict, path: str, weight: float) -> RewardTerm:
    import hydra.utils

    try:
        fn = hydra.utils.get_object(str(target))
    except Exception as err:
        raise UserError(f"{path}._target_: cannot import {target!r}: {err}") from None
    if not callable(fn):
        raise UserError(f"{path}._target_: {target!r} is not callable")
    passed = {"answer", "prompt"} & options.keys()
    if passed:
        raise UserError(f"{path}.{sorted(passed)[0]}: is passed by the task, not an option")
    try:
        accepted = _check_options(fn, options, path, target, is_target=True)
    except ValueError:  # no signature (a builtin): pass everything
        accepted = None
    if name is not None and not (isinstance(name, str) and name):
        raise UserError(f"{path}.name: must be a non-empty string, got {name!r}")
    return RewardTerm(name or str(target).rsplit(".", 1)[-1], _bind_target(fn, options, accepted), weight)


def _build_term(spec: Any, path: str) -> RewardTerm:
    if not isinstance(spec, Mapping):
        raise UserError(f"{path}: must be a mapping with a name or a _target_, got {spec!r}")
    options = dict(spec)
    weight = options.pop("weight", 1.0)
    if not (_is_number(weight) and math.isfinite(weight)):
        raise UserError(f"{path}.weight: must be a finite number, got {weight!r}")
    name, target = options.pop("name", None), options.pop("_target_", None)
    if target is not None:
        batched = options.pop("batched", False)
        if not isinstance(batched, bool):
            raise UserError(f"{path}.batched: must be true or false, got {batched!r}")
        return replace(_target_term(target, name, options, path, float(weight)), batched=batched)
    if name is None:
        raise UserError(f"{path}: give a name (one of {', '.join(REWARDS)}) or a _target_")
    return _builtin_term(name, options, path, float(weight))


def build_rewards(specs: Any, key: str = "task.rewards", *, workers: Any = 0, timeout: Any = 10.0) -> RewardSet:
    """The `RewardSet` of ``specs`` (a list of term mappings, see the module's docstring; OmegaConf
    nodes are fine). Every problem is reported in one `UserError` naming its key path under ``key``.

    The terms that are not ``in_process`` run in a pool of ``workers`` processes (``task.reward_workers``;
    None: `rlcli.rollout.reward_pool.default_workers`), each call stopped after ``timeout`` seconds
    (``task.reward_timeout``) and scored 0 (`rlcli.rollout.reward_pool`); ``workers=0``: in this process,
    without a timeout."""
    if workers is not None and not _is_count(workers):
        raise UserError(f"task.reward_workers: must be an integer >= 0 (0: rewards run in the training process) "
                        f"or null (the cores), got {workers!r}")
    if not (_is_number(timeout) and math.isfinite(timeout) and timeout > 0):
        raise UserError(f"task.reward_timeout: must be a number of seconds > 0, got {timeout!r}")
    if OmegaConf.is_config(specs):
        specs = OmegaConf.to_container(specs, resolve=True)
    if not isinstance(specs, Sequence) or isinstance(specs, str) or not specs:
        raise UserError(f"{key}: must be a non-empty list of rewards, got {specs!r}")
    terms, problems, seen = [], [], {}
    for i, spec in enumerate(specs):
        path = f"{key}[{i}]"
        try:
            term = _build_term(spec, path)
        except UserError as err:
            problems.append(str(err))
            continue
        if term.name in seen:
            problems.append(f"{path}: the name {term.name!r} is already used by {seen[term.name]}; names must be "
                            "unique (a _target_ reward takes another with `name`)")
        seen.setdefault(term.name, path)
        terms.append(term)
    if problems:
        if len(problems) > 1:
            problems = [f"{key}: {len(problems)} problems:", *(f"  - {p}" for p in problems)]
        raise UserError("\n".join(problems))
    pooled = [(spec, term.batched) for spec, term in zip(specs, terms) if not term.in_process]
    if workers == 0 or not pooled:
        return RewardSet(terms)
    from rlcli.rollout.reward_pool import RewardPool  # it builds its terms with this module

    pool = RewardPool([spec for spec, _ in pooled], [batched for _, batched in pooled], workers=workers,
                      timeout=float(timeout))
    return RewardSet(terms, pool)
