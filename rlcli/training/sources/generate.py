"""``data=generate``: every step samples fresh groups from the current policy (on-policy rollouts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from rlcli.conf import build_target
from rlcli.data.document_stream import pack_documents
from rlcli.data.writers import append_jsonl
from rlcli.rollout.advantages import ADVANTAGE_ESTIMATORS, computes_advantages, group_estimators
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.rollout.samplers import build_sampler
from rlcli.storage import keep_lines
from rlcli.training.collect import CollectedBatch
from rlcli.training.sources.base import DATA_KINDS, DataKind, StepSource


class OnPolicySource(StepSource):
    """Each batch samples fresh groups from the current policy (all of them form the batch). With
    ``save_to`` the rollouts are also written there; the checkpoint holds how many, so a resumed run
    cuts the file back to them and a fresh one starts it anew: no record is written twice."""

    def __init__(self, rollouts: OnPolicyRollouts, *, max_tokens: int, save_to: Path | None = None):
        self.rollouts = rollouts
        self.max_tokens = max_tokens
        self.save_to = save_to
        self.saved: int | None = None  # records written to save_to; None: not started yet

    def next_batch(self, index: int, device: torch.device) -> CollectedBatch:
        documents, stats = self.rollouts.generate(index)
        if self.rollouts.sampler.sync_seconds is not None:  # a colocated vLLM engine's
            stats["weight_sync_time"] = self.rollouts.sampler.sync_seconds
        if self.save_to is not None:
            if self.saved is None:  # a fresh run: whatever an earlier run left there goes
                self.save_to.unlink(missing_ok=True)
                self.saved = 0
            append_jsonl(documents, self.save_to)
            self.saved += len(documents)
        return CollectedBatch(list(pack_documents(documents, self.max_tokens)), stats=stats)
    # prompts and samples derive from (seed, batch index, rank): nothing else to keep

    def state_dict(self) -> dict:
        return {"saved": self.saved or 0}

    def load_state_dict(self, state: dict) -> None:
        if self.save_to is not None and "saved" in state:  # (a checkpoint of an older rlcli has no count)
            self.saved = state["saved"]
            keep_lines(self.save_to, self.saved)


def _number(node, key):
    value = node.get(key) if isinstance(node, DictConfig) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@DATA_KINDS.register("generate")
class GenerateKind(DataKind):
    """Rollouts sampled from the policy itself on ``task``, with ``rollout.*`` sampling options."""

    groups = ("rollout", "task")

    @staticmethod
    def check_config(cfg: DictConfig, problems: list[str]) -> None:
        for key in GenerateKind.groups:
            if cfg.get(key) is None:
                problems.append(f"{key}: required by data=generate")
        trainer, strategy, advantage = cfg.get("trainer"), cfg.get("strategy"), cfg.get("advantage")
        if isinstance(trainer, DictConfig) and trainer.get("docs_per_step"):
            problems.append("trainer.docs_per_step: with data=generate a step is the rollouts it sampled "
                            "(rollout.prompts_per_step x rollout.group_size per process); use it with data=rollouts")
        estimator = advantage.get("estimator") if isinstance(advantage, DictConfig) else None
        if estimator in ADVANTAGE_ESTIMATORS.names() and not computes_advantages(estimator):
            problems.append("advantage.estimator: on-policy rollouts (data=generate) need "
                            f"{' or '.join(group_estimators())}")
        if isinstance(strategy, DictConfig) and strategy.get("name") in ("fsdp", "fsdp2"):
            problems.append("strategy: on-policy generation (data=generate) runs with strategy=auto or ddp")
        prompts, minibatches = _number(cfg.get("rollout"), "prompts_per_step"), _number(trainer, "minibatches")
        processes = (_number(trainer, "devices") or 1) * (_number(trainer, "num_nodes") or 1)
        if prompts is not None and minibatches is not None and minibatches > prompts * processes:
            problems.append(f"trainer.minibatches: {minibatches} is more than the {prompts * processes} groups of a "
                            "batch (rollout.prompts_per_step per process); a group is never split between updates")
        rollout = cfg.get("rollout")
        if isinstance(rollout, DictConfig) and rollout.get("engine") == "vllm" and processes > 1:
            problems.append(f"rollout.engine: a colocated vLLM engine samples in one process, not {processes}; "
                            "to sample with vLLM for more training processes, run `rlcli loop rollout.engine=vllm`")
        sampled, scored = _number(cfg.get("rollout"), "temperature"), _number(cfg.get("loss"), "temperature")
        if sampled is not None and scored is not None and sampled != scored:
            problems.append(
                f"rollout.temperature: {sampled} differs from loss.temperature={scored}; the trainer must score "
                "tokens at the sampler's temperature (set loss.temperature alone: rollout.temperature follows it)"
            )

    def __init__(self, cfg, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.task = build_target(cfg.task, "task")

    @property
    def default_vocab_size(self) -> int:
        return self.task.tokenizer.vocab_size

    def source_factory(self, policy: torch.nn.Module) -> Callable[[int, int], StepSource]:
        cfg, r = self.cfg, self.cfg.rollout

        def make_source(rank: int, world_size: int) -> OnPolicySource:
            sampler = build_sampler(policy, r, self.task.tokenizer)
            generator = OnPolicyRollouts(
                self.task, sampler, prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                max_new_tokens=r.max_new_tokens, estimator=cfg.advantage.estimator, eps=cfg.advantage.eps,
                seed=cfg.seed, rank=rank, world_size=world_size,
            )
            name = "rollouts.jsonl" if world_size == 1 else f"rollouts.rank{rank}.jsonl"
            return OnPolicySource(generator, max_tokens=cfg.data.max_tokens,
                                  save_to=self.run_dir / name if r.save else None)

        return make_source
