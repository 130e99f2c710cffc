"""``data=generate``: every step samples fresh groups from the current policy (on-policy rollouts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlcli.conf import build_target
from rlcli.data.document_stream import pack_documents
from rlcli.data.writers import append_jsonl
from rlcli.errors import UserError
from rlcli.modules.metrics import Metric
from rlcli.rollout.advantages import computes_advantages, group_estimators
from rlcli.rollout.filtering import GroupFilter
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.rollout.overlong import Overlong
from rlcli.rollout.prompts import check_prompt_room
from rlcli.rollout.samplers import build_sampler
from rlcli.storage import keep_lines
from rlcli.training import distributed
from rlcli.training.collect import CollectedBatch
from rlcli.training.distill import reward_advantage
from rlcli.training.sources.base import DATA_KINDS, DataKind, StepSource

if TYPE_CHECKING:
    from rlcli.conf.schema import TrainConfig


METRICS = {
    "weight_sync_time": Metric("data=generate, rollout.engine=vllm", "seconds to copy the policy's weights into "
                               "the colocated vLLM engine before the step's sampling"),
}


class OnPolicySource(StepSource):
    """Each batch samples fresh groups from the current policy (all of them form the batch). With
    ``save_to`` the rollouts are also written there; the checkpoint holds how many, so a resumed run
    cuts the file back to them and a fresh one starts it anew: no record is written twice. Each batch
    also carries the lines of ``completions.jsonl`` for ``log_completions`` of its rollouts. A batch may
    hold no document (``rollout.mask_truncated`` and every completion truncated, or ``rollout.filter`` and no group
    kept): an empty step, not the end;
    ``max_empty`` such batches in a row on every rank stop the run with a `UserError`."""

    ends_when_empty = False

    def __init__(self, rollouts: OnPolicyRollouts, *, max_tokens: int, save_to: Path | None = None,
                 log_completions: int = 0, max_empty: int = 1):
        self.rollouts = rollouts
        self.max_empty = max_empty
        self.empty_in_a_row = 0
        self.max_tokens = max_tokens
        self.save_to = save_to
        self.log_completions = log_completions
        self.saved: int | None = None  # records written to save_to; None: not started yet

    def next_batch(self, index: int, device: torch.device) -> CollectedBatch:
        documents, stats, completions = self.rollouts.generate_logged(index, self.log_completions)
        if self.rollouts.overlong.mask_truncated or self.rollouts.group_filter.mode != "none":
            self._count_empty(len(documents), device)
        if self.rollouts.sampler.sync_seconds is not None:  # a colocated vLLM engine's
            stats["weight_sync_time"] = self.rollouts.sampler.sync_seconds
        if self.save_to is not None:
            if self.saved is None:  # a fresh run: whatever an earlier run left there goes
                self.save_to.unlink(missing_ok=True)
                self.saved = 0
            append_jsonl(documents, self.save_to)
            self.saved += len(documents)
        return CollectedBatch(list(pack_documents(documents, self.max_tokens)), stats=stats, completions=completions)
    # prompts and samples derive from (seed, batch index, rank): nothing else to keep

    def _count_empty(self, documents: int, device: torch.device) -> None:
        total = distributed.all_reduce(torch.tensor(documents, device=device), "sum")
        self.empty_in_a_row = self.empty_in_a_row + 1 if total == 0 else 0
        if self.empty_in_a_row >= self.max_empty:
            if self.rollouts.group_filter.mode != "none":
                raise UserError(
                    f"rollout.filter: {self.empty_in_a_row} steps in a row kept no document (every group sampled in "
                    f"rollout.max_sampling_rounds={self.rollouts.group_filter.max_rounds} rounds scored the same "
                    "across the group, or its completions were truncated under rollout.mask_truncated), so no step "
                    "trained anything (trainer.max_bad_steps bounds such steps too); raise "
                    "rollout.max_sampling_rounds, set rollout.filter_metric=reward, or rollout.filter=none")
            raise UserError(
                f"rollout.mask_truncated: every completion of {self.empty_in_a_row} steps in a row reached "
                f"rollout.max_new_tokens={self.rollouts.max_new_tokens} without a stop, so no step trained anything "
                "(trainer.max_bad_steps bounds such steps too); raise rollout.max_new_tokens, or set "
                "rollout.mask_truncated=false")

    def state_dict(self) -> dict:
        return {"saved": self.saved or 0}

    def load_state_dict(self, state: dict) -> None:
        if self.save_to is not None and "saved" in state:  # (a checkpoint of an older rlcli has no count)
            self.saved = state["saved"]
            keep_lines(self.save_to, self.saved)


@DATA_KINDS.register("generate")
class GenerateKind(DataKind):
    """Rollouts sampled from the policy itself on ``task``, with ``rollout.*`` sampling options."""

    groups = ("rollout", "task")
    checks_read = ("rollout", "task", "trainer", "advantage", "strategy")

    @staticmethod
    def check_config(cfg: TrainConfig, command: str) -> list[str]:
        problems = [f"{key}: required by data=generate" for key in GenerateKind.groups if getattr(cfg, key) is None]
        trainer = cfg.trainer
        if trainer.docs_per_step:
            problems.append("trainer.docs_per_step: with data=generate a step is the rollouts it sampled "
                            "(rollout.prompts_per_step x rollout.group_size per process); use it with data=rollouts")
        if not computes_advantages(cfg.advantage.estimator):
            problems.append("advantage.estimator: on-policy rollouts (data=generate) need "
                            f"{' or '.join(group_estimators())}")
        if cfg.strategy.name in ("fsdp", "fsdp2"):
            problems.append("strategy: on-policy generation (data=generate) runs with strategy=auto or ddp")
        if cfg.rollout is None:
            return problems
        prompts, processes = cfg.rollout.prompts_per_step, trainer.processes
        if trainer.minibatches > prompts * processes:
            problems.append(f"trainer.minibatches: {trainer.minibatches} is more than the {prompts * processes} "
                            "groups of a batch (rollout.prompts_per_step per process); a group is never split "
                            "between updates")
        if cfg.rollout.engine == "vllm" and processes > 1:
            problems.append(f"rollout.engine: a colocated vLLM engine samples in one process, not {processes}; "
                            "to sample with vLLM for more training processes, run `rlcli loop rollout.engine=vllm`")
        return problems

    def __init__(self, cfg, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.task = build_target(cfg.task, "task")
        check_prompt_room(self.task, max_tokens=cfg.data.max_tokens, max_new_tokens=cfg.rollout.max_new_tokens)

    @property
    def default_vocab_size(self) -> int:
        return self.task.tokenizer.vocab_size

    def source_factory(self, policy: torch.nn.Module) -> Callable[[int, int], StepSource]:
        cfg, r = self.cfg, self.cfg.rollout
        advantage = reward_advantage(cfg.advantage, cfg.distill)  # distill.rewards with advantage.estimator=distill

        def make_source(rank: int, world_size: int) -> OnPolicySource:
            sampler = build_sampler(policy, r, self.task.tokenizer)
            generator = OnPolicyRollouts(
                self.task, sampler, prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                max_new_tokens=r.max_new_tokens, estimator=advantage.estimator, eps=advantage.eps, k=advantage.k,
                seed=cfg.seed, rank=rank, world_size=world_size, overlong=Overlong.of(cfg.reward, r),
                group_filter=GroupFilter.of(r),
                gather=distributed.all_gather_objects,
            )
            name = "rollouts.jsonl" if world_size == 1 else f"rollouts.rank{rank}.jsonl"
            return OnPolicySource(generator, max_tokens=cfg.data.max_tokens,
                                  save_to=self.run_dir / name if r.save else None, log_completions=r.log_completions,
                                  max_empty=cfg.trainer.max_bad_steps)

        return make_source
