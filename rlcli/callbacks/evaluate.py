"""``eval.every=N``: evaluate the policy during training, into the same rows of ``metrics.csv``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch

from rlcli.conf.schema import RolloutConfig, TrainConfig
from rlcli.modules.metrics import Metric
from rlcli.rollout.evaluate import METRICS as EVAL_METRICS
from rlcli.rollout.evaluate import eval_prompts, evaluate
from rlcli.rollout.samplers import build_sampler
from rlcli.rollout.tasks import Prompt
from rlcli.training import distributed

METRICS = {f"eval/{name}": Metric("eval.every=N > 0, on steps N, 2N, …", metric.description)
           for name, metric in EVAL_METRICS.items()}


class PeriodicEval(L.Callback):
    """Every ``every`` steps (not at step 0), `rlcli.rollout.evaluate.evaluate` of the current policy on
    ``prompts``: ``samples`` completions of each, sampled as ``rollout`` says (its options, stops and
    ``max_new_tokens``; ``prompts_per_step x group_size`` sequences per sampler call) with
    ``rollout.engine``'s sampler (`rlcli.rollout.samplers.build_sampler`: with vLLM, the engine training's
    rollouts sample with, if they do). The metrics join that step's row as ``eval/<metric>``: the module
    asks for them (`step_metrics`, a `rlcli.callbacks.metrics.StepMetricsCallback`) after the step's
    update and before it returns the row, so a step keeps one row.

    The sampler reads the policy without gradients (the built-in one in eval mode, then gives it its mode
    back). Every rank holds the whole policy (strategy=auto or ddp; sharded strategies are refused by the config):
    rank ``r`` evaluates prompts ``r, r + world_size, ...`` with seed ``seed + r``, and the per-prompt
    sums are all-reduced, so every rank logs the same means. Each evaluation uses the same seeds,
    so the steps are compared on the same random draws; a single process draws what `rlcli eval`
    would of the same weights and settings. The task's reward statistics (``take_reward_stats``) of
    an evaluation are kept out of training's and not logged.
    """

    def __init__(
        self,
        task: Any,
        prompts: Sequence[Prompt],
        *,
        every: int,
        samples: int,
        rollout: RolloutConfig,
        seed: int,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.task = task
        self.prompts = list(prompts)
        self.every = every
        self.samples = samples
        self.rollout = rollout
        self.seed = seed

    def step_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """``eval/<metric>`` of the policy after this step's update on a step that is due, else ``{}``
        (called on every rank)."""
        step = pl_module.steps_done
        if step == 0 or step % self.every:
            return {}
        rank, world_size = distributed.rank(), distributed.world_size()
        mine = self.prompts[rank::world_size]
        sums = torch.zeros(len(EVAL_METRICS) + 1, dtype=torch.float64, device=pl_module.device)  # [M + 1]: sums, count
        if mine:
            r = self.rollout
            sampler = build_sampler(pl_module.policy, r, self.task.tokenizer)
            result = evaluate(self.task, sampler, mine, samples=self.samples, max_new_tokens=r.max_new_tokens,
                              seed=self.seed + rank, batch_size=r.prompts_per_step * r.group_size)
            sums[:-1] = torch.tensor([sum(row[name] for row in result.rows) for name in EVAL_METRICS],
                                     dtype=torch.float64)
            sums[-1] = len(mine)
        sums = distributed.all_reduce(sums, "sum").tolist()
        return {name: total / sums[-1] for name, total in zip(METRICS, sums)}  # in EVAL_METRICS' order


def build_periodic_eval(cfg: TrainConfig, task: Any) -> PeriodicEval | None:
    """The ``eval.every`` callback of a validated config (`rlcli.conf.rules.periodic_eval`: a task, an
    unsharded strategy) on ``task``, the data kind's, with the ``rollout.*`` sampling options; None
    when ``eval.every=0``."""
    e = cfg.eval
    if e.every == 0:
        return None
    return PeriodicEval(task, eval_prompts(task, e.prompts), every=e.every, samples=e.samples, rollout=cfg.rollout,
                        seed=cfg.seed)
