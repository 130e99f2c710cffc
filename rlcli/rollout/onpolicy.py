"""On-policy rollouts: sample groups of completions from the current policy, score them, and
turn them into validated `Rollout` documents with group advantages (rollout-record.md).

Stateless: the prompts and samples of a step come from a seed derived from ``(seed, step, rank)``,
so a resumed run regenerates exactly what it would have, given the same model weights.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

from rlcli.data.schema import Rollout, validate_record
from rlcli.errors import UserError
from rlcli.modules.metrics import Metric
from rlcli.rollout.advantages import check_in_float32, group_advantages, group_estimators
from rlcli.rollout.completions import pick, text_row
from rlcli.rollout.overlong import NO_SHAPING, Overlong, overlong_reward
from rlcli.rollout.sampler import Sampler

__all__ = ["METRICS", "OnPolicyRollouts", "step_seed"]

# the statistics of `OnPolicyRollouts.generate`, means over the step's rollouts (and over processes)
METRICS = {
    "reward": Metric("data=generate", "the mean reward of the step's completions"),
    "accuracy": Metric("data=generate", "the fraction of the step's completions that are correct (`task.is_correct`)"),
    "completion_length": Metric("data=generate", "the mean number of completion tokens (the stop token included)"),
    "stopped_fraction": Metric("data=generate", "the fraction of completions that ended with a stop token rather "
                               "than at `rollout.max_new_tokens`"),
    "reward/overlong": Metric("data=generate (and rlcli sample's log) with reward.overlong_buffer", "the mean "
                              "overlong reward `R_len` (unweighted, in [-1, 0]) of the step's completions "
                              "(math.md#overlong-shaping)"),
    "truncated_fraction": Metric("data=generate (and rlcli sample's log) with rollout.mask_truncated=true", "the "
                                 "fraction of the step's sampled completions that were truncated (no stop within "
                                 "`rollout.max_new_tokens`), which the step does not train"),
}


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for one step of one rank, well mixed so that neighbouring steps differ."""
    digest = hashlib.sha256(f"rlcli-rollout/{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class OnPolicyRollouts:
    """Generate one step of rollouts on ``task`` (see `rlcli.rollout.tasks` for the protocol) with
    ``sampler``, which holds the policy and its sampling options (see `rlcli.rollout.sampler.Sampler`).

    Every rank draws its own ``prompts_per_step`` prompts and samples ``group_size`` completions
    of each, at most ``max_new_tokens`` tokens long; a group is the completions of one prompt.
    ``estimator`` is one of `group_estimators()`, ``eps`` and ``k`` are ``advantage.eps`` and ``advantage.k``
    (see `group_advantages`; a completion's length is its number of tokens).
    ``overlong``: the overlong reward and the masking of truncated completions (`rlcli.rollout.overlong`).
    """

    def __init__(
        self,
        task: Any,
        sampler: Sampler,
        *,
        prompts_per_step: int,
        group_size: int,
        max_new_tokens: int,
        estimator: str = "grpo",
        eps: float,
        k: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        overlong: Overlong = NO_SHAPING,
    ) -> None:
        if prompts_per_step < 1 or group_size < 1:
            raise ValueError(f"prompts_per_step and group_size must be >= 1, got {prompts_per_step}, {group_size}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if overlong.buffer is not None and overlong.buffer > max_new_tokens:
            raise ValueError(f"the overlong buffer {overlong.buffer} is longer than max_new_tokens={max_new_tokens}")
        if estimator not in group_estimators():
            raise ValueError(f"estimator must be one of {', '.join(group_estimators())}, got {estimator!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.task = task
        self.sampler = sampler
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.estimator = estimator
        self.eps = eps
        self.k = k
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.overlong = overlong

    @property
    def documents_per_step(self) -> int:
        """Documents this rank generates per step."""
        return self.prompts_per_step * self.group_size

    def generate(self, step: int) -> tuple[list[Rollout], dict[str, float]]:
        """This rank's rollouts for ``step`` (grouped by prompt, in order; without the truncated ones under
        ``overlong.mask_truncated``) and the statistics of all its sampled completions: mean ``reward``,
        ``accuracy`` (fraction exactly correct), mean ``completion_length`` and ``stopped_fraction``
        (completions that ended with eos), ``reward/overlong`` and ``truncated_fraction`` where the
        shaping is on, and the task's ``take_reward_stats()`` where it has one (``reward/<name>``,
        ``reward_errors``)."""
        rollouts, stats, _ = self.generate_logged(step, 0)
        return rollouts, stats

    def generate_logged(self, step: int, log_completions: int) -> tuple[list[Rollout], dict[str, float], list[dict]]:
        """`generate`, and the lines of ``completions.jsonl`` for ``log_completions`` of the rollouts
        (`rlcli.rollout.completions`): decoded text and, from a task with ``reward_terms``, each
        term's value."""
        step_rng = random.Random(step_seed(self.seed, step, self.rank))
        prompts = self.task.sample_prompts(step_rng, self.prompts_per_step)
        generator = torch.Generator().manual_seed(step_rng.getrandbits(63))
        tokenizer = self.task.tokenizer
        owners = [p for p in prompts for _ in range(self.group_size)]  # the prompt of each completion
        completions = self.sampler.sample(
            [list(p.ids) for p in owners],
            max_new_tokens=self.max_new_tokens,
            stop_ids=(tokenizer.eos_id,),
            pad_id=tokenizer.pad_id,
            generator=generator,
        )
        rewards = [float(self.task.reward(p, c.ids)) for p, c in zip(owners, completions)]
        shaping = self.overlong
        overlong = None if shaping.buffer is None else [
            overlong_reward(len(c.ids), self.max_new_tokens, shaping.buffer) for c in completions]
        if overlong is not None:
            rewards = [r + shaping.penalty * o for r, o in zip(rewards, overlong)]
        group_ids = [f"s{step}-r{self.rank}-p{i // self.group_size}" for i in range(len(completions))]
        sources = [f"rollout:step {step} rank {self.rank} #{i}" for i in range(len(completions))]
        advantages = group_advantages(rewards, group_ids, self.estimator, eps=self.eps, k=self.k,
                                      lengths=[len(c.ids) for c in completions], names=sources)
        check_in_float32(advantages, sources, self.estimator)
        lines = [self._completion_line(owners[i], completions[i], rewards[i], advantages[i], group_ids[i],
                                       None if overlong is None else overlong[i])
                 for i in pick(group_ids, log_completions)]  # before `take_reward_stats` forgets the terms

        first_index = (step * self.world_size + self.rank) * self.documents_per_step
        vocab_size = self.sampler.vocab_size
        rollouts = []
        for i, (prompt, completion) in enumerate(zip(owners, completions)):
            if shaping.mask_truncated and not completion.stopped:
                continue  # its group's advantages counted it; it is no document of the step
            record = {
                "prompt_ids": list(prompt.ids),
                "completion_ids": completion.ids,
                "old_logprobs": [min(lp, 0.0) for lp in completion.logprobs],  # float error above 0
                "advantages": [advantages[i]] * len(completion.ids),
                "reward": rewards[i],
                "group_id": group_ids[i],
                "temperature": self.sampler.temperature,
            }
            rollouts.append(validate_record(record, source=sources[i], index=first_index + i, vocab_size=vocab_size))

        n = len(completions)
        stats = {
            "reward": sum(rewards) / n,
            "accuracy": sum(self.task.is_correct(p, c.ids) for p, c in zip(owners, completions)) / n,
            "completion_length": sum(len(c.ids) for c in completions) / n,
            "stopped_fraction": sum(c.stopped for c in completions) / n,
        }
        if hasattr(self.task, "take_reward_stats"):  # per-term means of a task's RewardSet
            stats.update(self.task.take_reward_stats())
        if overlong is not None:
            if "reward/overlong" in stats:
                raise UserError("task.rewards: a term named 'overlong' would share the column reward/overlong with "
                                "reward.overlong_buffer's overlong reward; give the term another name")
            stats["reward/overlong"] = sum(overlong) / n
        if shaping.mask_truncated:
            stats["truncated_fraction"] = sum(not c.stopped for c in completions) / n
        return rollouts, stats, lines

    def _completion_line(self, prompt: Any, completion: Any, reward: float, advantage: float,
                         group_id: str, overlong: float | None) -> dict:
        decode = self.task.tokenizer.decode
        terms = self.task.reward_terms(prompt, completion.ids) if hasattr(self.task, "reward_terms") else {}
        if overlong is not None:
            terms = {**terms, "overlong": overlong}
        return text_row(prompt=decode(prompt.ids), completion=decode(completion.ids), rewards=terms, reward=reward,
                        advantage=advantage, length=len(completion.ids), stopped=completion.stopped,
                        group_id=group_id)
