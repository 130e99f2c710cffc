"""Evaluation: sample ``k`` completions of every eval prompt and measure how often they are right.

Used by `rlcli eval` (a model directory) and by ``eval.every`` during training (the current policy).
Every metric (`METRICS`) is a mean over prompts of a per-prompt value (each prompt has the same ``k``
completions, so a mean over prompts is also a mean over completions). ``pass@k`` is the unbiased
estimator of Chen et al. (2021); `pass_at_k` computes it for any ``k <= n``, and with ``k = 1`` it is
``c / n``, ``pass@1``.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcli.errors import UserError
from rlcli.modules.metrics import Metric
from rlcli.rollout.sampler import Sampler
from rlcli.rollout.tasks import Prompt, Score, score_completions

__all__ = ["EVAL_PROMPTS_SEED", "METRICS", "EvalResult", "eval_prompts", "evaluate", "mean_metrics", "pass_at_k"]

# per prompt with k = eval.samples completions, c of them correct; then the mean over prompts
METRICS = {
    "reward": Metric("every evaluation", "the mean reward of the completions (the task's reward)"),
    "pass@1": Metric("every evaluation", "`c/k`: the fraction of the `k` completions that are correct "
                     "(`task.is_correct`)"),
    "pass@k": Metric("every evaluation", "`1 − C(n − c, k)/C(n, k)` with `n = k = eval.samples`: whether some "
                     "completion of the prompt is correct"),
    "length": Metric("every evaluation", "the mean number of completion tokens (the stop token included)"),
    "stopped_fraction": Metric("every evaluation", "the fraction of completions that ended with a stop token "
                               "rather than at `rollout.max_new_tokens`"),
}

# The seed of the prompts drawn from a task without a held-out split: fixed, so that every evaluation
# (of any run, at any step) sees the same prompts, and hashed from its own name, so that it is none of
# the seeds training draws its prompts with (`rlcli.rollout.onpolicy.step_seed`).
EVAL_PROMPTS_SEED = int.from_bytes(hashlib.sha256(b"rlcli-eval-prompts").digest()[:8], "little") >> 1


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` completions drawn without replacement from ``n``, of
    which ``c`` are correct, is correct: ``1 - C(n - c, k) / C(n, k)``, computed as the product
    ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k holds a correct one
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class EvalResult:
    """``metrics`` (`METRICS`, means over the prompts), one row per prompt, in order (its text and
    answer, ``correct`` (of ``samples``), its own value of each metric, and its completions), and the
    task's ``take_reward_stats()`` after scoring (e.g. ``reward/<name>``; empty if it has none)."""

    samples: int
    metrics: dict[str, float]
    rows: list[dict[str, Any]] = field(default_factory=list)
    reward_stats: dict[str, float] = field(default_factory=dict)


def mean_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The mean over ``rows`` (per-prompt rows of `evaluate`) of each metric of `METRICS`."""
    if not rows:
        raise ValueError("no prompts to average over")
    return {name: math.fsum(row[name] for row in rows) / len(rows) for name in METRICS}


def eval_prompts(task: Any, prompts: int) -> list[Prompt]:
    """The prompts to evaluate ``task`` on: its held-out split (``task.eval_prompts()``, all of it) if it
    has one, else ``prompts`` prompts from ``task.sample_prompts`` drawn with `EVAL_PROMPTS_SEED`.

    A task drawing from a small space (the built-in ``reverse`` and ``addition``) draws prompts that
    training also sees: its evaluation measures the skill, not generalisation to unseen prompts.
    """
    if hasattr(task, "eval_prompts"):
        chosen = list(task.eval_prompts())
        if not chosen:
            raise UserError(f"task: {type(task).__name__} has no eval prompts (its held-out split is empty)")
        return chosen
    return list(task.sample_prompts(random.Random(EVAL_PROMPTS_SEED), prompts))


def _row(task: Any, prompt: Prompt, completions: list, scores: list[Score], samples: int) -> dict[str, Any]:
    num_correct = sum(s.correct for s in scores)
    return {
        "prompt": prompt.text,
        "answer": prompt.answer,
        "correct": num_correct,
        "reward": math.fsum(s.reward for s in scores) / samples,
        "pass@1": pass_at_k(samples, num_correct, 1),
        "pass@k": pass_at_k(samples, num_correct, samples),
        "length": sum(len(comp.ids) for comp in completions) / samples,
        "stopped_fraction": sum(comp.stopped for comp in completions) / samples,
        "completions": [
            {"text": task.tokenizer.decode(comp.ids), "tokens": len(comp.ids), "stopped": comp.stopped,
             "reward": score.reward, "correct": score.correct}
            for comp, score in zip(completions, scores)
        ],
    }


def evaluate(
    task: Any,
    sampler: Sampler,
    prompts: Sequence[Prompt],
    *,
    samples: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int | None = None,
) -> EvalResult:
    """Sample ``samples`` completions of each of ``prompts`` from ``sampler`` and score them on ``task``.

    The completions of one prompt are sampled together; a sampler call takes as many whole prompts
    as fit in ``batch_size`` sequences (at least one prompt; None: all at once). Random draws come from
    one generator seeded with ``seed``: the same seed, prompts and batch size give the same completions.
    A task that keeps statistics of its rewards (``take_reward_stats``) has them taken afterwards, so
    that the evaluation's scores do not count among training's.
    """
    if samples < 1 or max_new_tokens < 1:
        raise ValueError(f"samples and max_new_tokens must be >= 1, got {samples}, {max_new_tokens}")
    if not prompts:
        raise ValueError("need at least one prompt to evaluate")
    per_call = len(prompts) if batch_size is None else max(1, batch_size // samples)
    tokenizer = task.tokenizer
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start : start + per_call]
        completions = sampler.sample(
            [list(p.ids) for p in chunk for _ in range(samples)],
            max_new_tokens=max_new_tokens,
            stop_ids=(tokenizer.eos_id,),
            pad_id=tokenizer.pad_id,
            generator=generator,
        )
        scores = score_completions(task, [p for p in chunk for _ in range(samples)], [c.ids for c in completions])
        for i, prompt in enumerate(chunk):
            mine = slice(i * samples, (i + 1) * samples)
            rows.append(_row(task, prompt, completions[mine], scores[mine], samples))
    reward_stats = task.take_reward_stats() if hasattr(task, "take_reward_stats") else {}
    return EvalResult(samples=samples, metrics=mean_metrics(rows), rows=rows, reward_stats=reward_stats)
