"""``data=rollouts``: batches from rollout files (rollout-record.md), a number of micro-batches or documents each."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rlcli.data.document_stream import DocumentStream
from rlcli.data.errors import DataError
from rlcli.data.readers import check_temperature, load_rollouts, write_rejections
from rlcli.data.schema import Rollout
from rlcli.data.toy import VOCAB_SIZE as TOY_VOCAB_SIZE
from rlcli.rollout.advantages import apply_advantage_estimator
from rlcli.rollout.completions import ids_row, pick
from rlcli.rollout.filtering import count_groups, filter_rollouts
from rlcli.training.collect import CollectedBatch, collect_batch
from rlcli.training.distill import reward_advantage
from rlcli.training.reward_kl import subtract_kl_at_read
from rlcli.training.sources.base import DATA_KINDS, DataKind, StepSource

log = logging.getLogger("rlcli")


class RolloutFileSource(StepSource):
    """This rank's share of the rollout files; a batch is a number of micro-batches or documents, and
    carries the lines of ``completions.jsonl`` (token ids) for ``log_completions`` of them."""

    def __init__(self, stream: DocumentStream, *, accumulate_microbatches: int, docs_per_step: int, exact: bool,
                 log_completions: int = 0):
        self.stream = stream
        self.accumulate_microbatches = accumulate_microbatches
        self.docs_per_step = docs_per_step
        self.exact = exact
        self.log_completions = log_completions

    def next_batch(self, index: int, device: torch.device) -> CollectedBatch:
        collected = collect_batch(
            self.stream, accumulate_microbatches=self.accumulate_microbatches,
            docs_per_step=self.docs_per_step, exact=self.exact, device=device,
        )
        documents = [doc for batch in collected.micro_batches for doc in batch.documents]
        collected.completions = [ids_row(documents[i])
                                 for i in pick([doc.group_id for doc in documents], self.log_completions)]
        return collected

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


@DATA_KINDS.register("rollouts")
class RolloutsKind(DataKind):
    """Rollout files read and validated once; each rank trains on its share of the documents."""

    @property
    def default_vocab_size(self) -> int:
        return TOY_VOCAB_SIZE  # the shipped example's

    def read(self, vocab_size: int) -> list[Rollout]:
        """Read, validate and complete (advantages) the rollout files of ``data.paths``."""
        cfg = self.cfg
        rollouts, rejections = load_rollouts(
            list(cfg.data.paths), vocab_size=vocab_size, max_tokens=cfg.data.max_tokens,
            on_invalid=cfg.data.on_invalid,
        )
        invalid = len(rejections)
        if cfg.data.filter == "zero_variance":
            groups = count_groups(rollouts)
            rollouts, filtered = filter_rollouts(rollouts)
            rejections += filtered
        if rejections:
            from lightning.fabric.utilities.rank_zero import rank_zero_only  # not at the top: config checks import this

            path = self.run_dir / "rejected.jsonl"
            if rank_zero_only.rank == 0:  # every process reads every file: one writes what they all found
                write_rejections(rejections, path)
            if invalid:
                log.warning("data: %d invalid records skipped (data.on_invalid=skip), listed in %s", invalid, path)
        if cfg.data.filter == "zero_variance":
            kept = count_groups(rollouts)
            log.info("data: data.filter=zero_variance kept %d of %d groups; dropped the %d records of the %d groups "
                     "whose rewards are all equal, listed in %s", kept, groups, len(filtered), groups - kept,
                     self.run_dir / "rejected.jsonl")
            if not rollouts:
                raise DataError(f"data.filter=zero_variance: every group of {', '.join(cfg.data.paths)} has equal "
                                "rewards, so no record is left to train on; set data.filter=none")
        mismatches = check_temperature(
            rollouts, cfg.loss.temperature, allow_mismatch=cfg.data.allow_temperature_mismatch
        )
        if mismatches:
            log.warning("data: %d records were sampled at a temperature other than loss.temperature=%s",
                        mismatches, cfg.loss.temperature)
        if cfg.kl.coef > 0 and cfg.kl.reference == "rollouts":
            lacking = [r for r in rollouts if r.ref_logprobs is None]
            if lacking:
                raise DataError(f"{lacking[0].source}: no 'ref_logprobs', and kl.reference=rollouts reads the "
                                f"reference's log-probs from every record ({len(lacking)} records lack them)")
        rollouts = subtract_kl_at_read(rollouts, cfg)  # kl.placement=reward: before the advantages
        advantage = reward_advantage(cfg.advantage, cfg.distill)  # distill.rewards with advantage.estimator=distill
        rollouts = apply_advantage_estimator(rollouts, advantage.estimator, eps=advantage.eps, k=advantage.k)
        log.info("data: %d documents for training", len(rollouts))
        return rollouts

    def source_factory(self, policy: torch.nn.Module) -> Callable[[int, int], StepSource]:
        rollouts = self.read(policy.config.vocab_size)
        cfg = self.cfg

        def make_source(rank: int, world_size: int) -> RolloutFileSource:
            stream = DocumentStream(
                rollouts, max_tokens=cfg.data.max_tokens, shuffle=cfg.data.shuffle, seed=cfg.seed,
                epochs=cfg.data.epochs, rank=rank, world_size=world_size,
            )
            return RolloutFileSource(
                stream, accumulate_microbatches=cfg.trainer.accumulate_microbatches,
                docs_per_step=cfg.trainer.docs_per_step, exact=cfg.trainer.docs_per_step_mode == "exact",
                log_completions=cfg.data.log_completions,
            )

        return make_source
