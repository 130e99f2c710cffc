"""On-policy rollouts: sample groups of completions from the current policy, score them, and
turn them into validated `Rollout` documents with group advantages (rollout-record.md).

Stateless: the prompts and samples of a step come from seeds derived from ``(seed, step, rank)`` (and
the sampling round, under dynamic sampling), so a resumed run regenerates exactly what it would have,
given the same model weights.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlcli.data.readers import Rejection
from rlcli.data.schema import Rollout, validate_record
from rlcli.errors import UserError
from rlcli.modules.metrics import Metric
from rlcli.rollout.advantages import Gather, check_in_float32, group_advantages, group_estimators
from rlcli.rollout.completions import pick, text_row
from rlcli.rollout.filtering import NO_FILTER, GroupFilter, filter_metric_of, filtered_reason, zero_variance_groups
from rlcli.rollout.overlong import NO_SHAPING, Overlong, overlong_reward
from rlcli.rollout.sampler import Sampler
from rlcli.rollout.tasks import score_completions

__all__ = ["METRICS", "OnPolicyRollouts", "step_seed"]

# the statistics of `OnPolicyRollouts.generate`: means over every completion the step sampled (the kept and
# the filtered groups' alike), or counts of this process; each then averaged over processes
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
    "groups_kept": Metric("data=generate (and rlcli sample's log) with rollout.filter=zero_variance", "groups the "
                          "step trains, per process (at most rollout.prompts_per_step; mean over processes; "
                          "math.md#dynamic-sampling)"),
    "groups_filtered": Metric("data=generate (and rlcli sample's log) with rollout.filter=zero_variance", "groups "
                              "the step sampled and dropped for an equal rollout.filter_metric across the group, per "
                              "process (mean over processes)"),
    "sampling_rounds": Metric("data=generate (and rlcli sample's log) with rollout.filter=zero_variance", "rounds "
                              "of sampling the step took, per process (1 to rollout.max_sampling_rounds; mean over "
                              "processes)"),
}


def step_seed(seed: int, step: int, rank: int, round_: int = 0) -> int:
    """A 63-bit seed for one sampling round of one step of one rank, well mixed so that neighbouring steps
    differ (round 0 is the step's only round without dynamic sampling)."""
    name = f"rlcli-rollout/{seed}/{step}/{rank}" + (f"/{round_}" if round_ else "")
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class _Sampled:
    """One sampled completion, scored: its task reward, correctness, reward terms (`Score.terms`), overlong
    reward (None: no shaping) and shaped reward, with its group id and source."""

    prompt: Any
    completion: Any
    task_reward: float
    correct: bool
    terms: Mapping[str, float]
    overlong: float | None
    reward: float
    group_id: str
    source: str


class OnPolicyRollouts:
    """Generate one step of rollouts on ``task`` (see `rlcli.rollout.tasks` for the protocol) with
    ``sampler``, which holds the policy and its sampling options (see `rlcli.rollout.sampler.Sampler`).

    Every rank draws its own ``prompts_per_step`` prompts and samples ``group_size`` completions
    of each, at most ``max_new_tokens`` tokens long; a group is the completions of one prompt.
    ``estimator`` is one of `group_estimators()`, ``eps`` and ``k`` are ``advantage.eps`` and ``advantage.k``
    (see `group_advantages`; a completion's length is its number of tokens).
    ``overlong``: the overlong reward and the masking of truncated completions (`rlcli.rollout.overlong`);
    ``group_filter``: dynamic sampling (`rlcli.rollout.filtering`).
    ``gather``: one process's object to every process's (`rlcli.training.distributed.all_gather_objects`),
    so that a batch estimator's statistics are those of every process's rollouts of the step (None: this one's).
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
        group_filter: GroupFilter = NO_FILTER,
        gather: Gather | None = None,
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
        self.group_filter = group_filter
        self.gather = gather

    @property
    def documents_per_step(self) -> int:
        """Documents this rank generates per step."""
        return self.prompts_per_step * self.group_size

    def generate(self, step: int) -> tuple[list[Rollout], dict[str, float]]:
        """This rank's rollouts for ``step`` (grouped by prompt, in order; only the kept groups under
        ``group_filter``; without the truncated ones under ``overlong.mask_truncated``) and the statistics of
        all its sampled completions: mean ``reward``, ``accuracy`` (fraction exactly correct), mean
        ``completion_length`` and ``stopped_fraction`` (completions that ended with eos), ``reward/overlong``
        and ``truncated_fraction`` where the shaping is on, ``groups_kept``, ``groups_filtered`` and
        ``sampling_rounds`` where the filter is on, and the task's ``take_reward_stats()`` where it has one
        (``reward/<name>``, ``reward_errors``)."""
        rollouts, stats, _ = self.generate_logged(step, 0)
        return rollouts, stats

    def generate_logged(self, step: int, log_completions: int) -> tuple[list[Rollout], dict[str, float], list[dict]]:
        """`generate`, and the lines of ``completions.jsonl`` for ``log_completions`` of the rollouts
        (`rlcli.rollout.completions`): decoded text and, from a task whose scores have terms, each
        term's value."""
        rollouts, stats, lines, _ = self.generate_filtered(step, log_completions)
        return rollouts, stats, lines

    def generate_filtered(self, step: int, log_completions: int
                          ) -> tuple[list[Rollout], dict[str, float], list[dict], list[Rejection]]:
        """`generate_logged`, and a `Rejection` for each completion of a group that ``group_filter`` dropped.

        Round 0 samples ``prompts_per_step`` groups; under ``zero_variance`` each further round samples as many
        new groups as the kept ones still lack, until the step holds ``prompts_per_step`` kept groups or
        ``group_filter.max_rounds`` rounds were sampled (math.md#dynamic-sampling). Every round's prompts and
        samples come from ``(seed, step, rank, round)``."""
        sampled: list[_Sampled] = []  # every completion of the step's rounds
        kept: list[_Sampled] = []  # those of the kept groups
        metric = filter_metric_of(self.task, self.group_filter.metric)
        rounds = 0
        while rounds == 0 or (self.group_filter.mode == "zero_variance" and len(kept) < self.documents_per_step
                              and rounds < self.group_filter.max_rounds):
            missing = self.prompts_per_step - len(kept) // self.group_size
            batch = self._sample_round(step, rounds, missing, first_prompt=len(sampled) // self.group_size,
                                       first_completion=len(sampled))
            dropped = set() if self.group_filter.mode == "none" else zero_variance_groups(
                [float(c.correct) if metric == "accuracy" else c.task_reward for c in batch],
                [c.group_id for c in batch])
            sampled += batch
            kept += [c for c in batch if c.group_id not in dropped]
            rounds += 1

        completions = [c.completion for c in kept]
        rewards = [c.reward for c in kept]
        group_ids = [c.group_id for c in kept]
        sources = [c.source for c in kept]
        advantages = group_advantages(rewards, group_ids, self.estimator, eps=self.eps, k=self.k,
                                      lengths=[len(c.ids) for c in completions], names=sources, gather=self.gather)
        check_in_float32(advantages, sources, self.estimator)
        lines = [self._completion_line(kept[i], advantages[i]) for i in pick(group_ids, log_completions)]

        first_index = (step * self.world_size + self.rank) * self.documents_per_step
        rollouts = []
        for i, c in enumerate(kept):
            if self.overlong.mask_truncated and not c.completion.stopped:
                continue  # its group's advantages counted it; it is no document of the step
            record = self._record(c, [advantages[i]] * len(c.completion.ids))
            rollouts.append(validate_record(record, source=c.source, index=first_index + i,
                                            vocab_size=self.sampler.vocab_size))
        kept_groups = set(group_ids)
        filtered = self._rejections([c for c in sampled if c.group_id not in kept_groups], metric)
        return rollouts, self._stats(sampled, kept, rounds), lines, filtered

    def _sample_round(self, step: int, round_: int, prompts: int, *, first_prompt: int,
                      first_completion: int) -> list[_Sampled]:
        """``prompts`` groups of round ``round_`` of ``step``, scored (their rewards shaped); groups and
        completions numbered on from ``first_prompt`` and ``first_completion`` within the step."""
        round_rng = random.Random(step_seed(self.seed, step, self.rank, round_))
        drawn = self.task.sample_prompts(round_rng, prompts)
        generator = torch.Generator().manual_seed(round_rng.getrandbits(63))
        tokenizer = self.task.tokenizer
        owners = [p for p in drawn for _ in range(self.group_size)]  # the prompt of each completion
        completions = self.sampler.sample(
            [list(p.ids) for p in owners],
            max_new_tokens=self.max_new_tokens,
            stop_ids=(tokenizer.eos_id,),
            pad_id=tokenizer.pad_id,
            generator=generator,
        )
        scores = score_completions(self.task, owners, [c.ids for c in completions])
        batch = []
        for i, (prompt, completion, score) in enumerate(zip(owners, completions, scores)):
            overlong = None if self.overlong.buffer is None else overlong_reward(
                len(completion.ids), self.max_new_tokens, self.overlong.buffer)
            reward = score.reward if overlong is None else score.reward + self.overlong.penalty * overlong
            batch.append(_Sampled(
                prompt, completion, score.reward, score.correct, score.terms, overlong, reward,
                group_id=f"s{step}-r{self.rank}-p{first_prompt + i // self.group_size}",
                source=f"rollout:step {step} rank {self.rank} #{first_completion + i}"))
        return batch

    def _record(self, c: _Sampled, advantages: list[float]) -> dict:
        return {
            "prompt_ids": list(c.prompt.ids),
            "completion_ids": c.completion.ids,
            "old_logprobs": [min(lp, 0.0) for lp in c.completion.logprobs],  # float error above 0
            "advantages": advantages,
            "reward": c.reward,
            "group_id": c.group_id,
            "temperature": self.sampler.temperature,
        }

    def _rejections(self, dropped: list[_Sampled], metric: str) -> list[Rejection]:
        """A rejection for each completion of a dropped group, with its record (no advantages: none were computed)."""
        sizes: dict[str, int] = {}
        for c in dropped:
            sizes[c.group_id] = sizes.get(c.group_id, 0) + 1
        return [Rejection(c.source, metric, filtered_reason(
                    "rollout.filter", metric, c.group_id, sizes[c.group_id],
                    float(c.correct) if metric == "accuracy" else c.task_reward),
                    {k: v for k, v in self._record(c, []).items() if k != "advantages"})
                for c in dropped]

    def _stats(self, sampled: list[_Sampled], kept: list[_Sampled], rounds: int) -> dict[str, float]:
        """The statistics of every completion sampled in the step (kept or filtered), and the filter's counts."""
        n = len(sampled)
        stats = {
            "reward": sum(c.reward for c in sampled) / n,
            "accuracy": sum(c.correct for c in sampled) / n,
            "completion_length": sum(len(c.completion.ids) for c in sampled) / n,
            "stopped_fraction": sum(c.completion.stopped for c in sampled) / n,
        }
        if hasattr(self.task, "take_reward_stats"):  # per-term means of a task's RewardSet
            stats.update(self.task.take_reward_stats())
        if self.overlong.buffer is not None:
            if "reward/overlong" in stats:
                raise UserError("task.rewards: a term named 'overlong' would share the column reward/overlong with "
                                "reward.overlong_buffer's overlong reward; give the term another name")
            stats["reward/overlong"] = sum(c.overlong for c in sampled) / n
        if self.overlong.mask_truncated:
            stats["truncated_fraction"] = sum(not c.completion.stopped for c in sampled) / n
        if self.group_filter.mode != "none":
            stats["groups_kept"] = len(kept) / self.group_size
            stats["groups_filtered"] = (n - len(kept)) / self.group_size
            stats["sampling_rounds"] = float(rounds)
        return stats

    def _completion_line(self, c: _Sampled, advantage: float) -> dict:
        decode = self.task.tokenizer.decode
        terms = dict(c.terms) if c.overlong is None else {**c.terms, "overlong": c.overlong}
        return text_row(prompt=c.prompt.text, completion=decode(c.completion.ids), rewards=terms,
                        reward=c.reward, advantage=advantage, length=len(c.completion.ids),
                        stopped=c.completion.stopped, group_id=c.group_id)
