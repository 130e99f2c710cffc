"""``data=stream``: batches from rollouts that samplers push into a Redis stream while the trainer trains.

Each process reads through the trainer's consumer group (`rlcli.stream.reader.StreamReader`); a batch
is collected by `collect_batch` as for files (static, or ``docs_per_step``). The checkpoint holds the
entries trained since the last acknowledgement, and `checkpoint_durable` acknowledges them, so a
killed trainer resumed with ``resume=auto`` trains every record exactly once. The run holds the group's lease
(`rlcli.stream.lease`) from before its first read: a second trainer of the group is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rlcli.conf import build_target
from rlcli.data.toy import VOCAB_SIZE as TOY_VOCAB_SIZE
from rlcli.modules.metrics import Metric
from rlcli.processes import launcher
from rlcli.rollout.prompts import check_prompt_room
from rlcli.stream.connection import connect
from rlcli.stream.lease import GroupLease
from rlcli.stream.queue import COUNTED
from rlcli.stream.reader import ReaderOptions, StreamReader
from rlcli.training import distributed
from rlcli.training.collect import CollectedBatch, collect_batch
from rlcli.training.sources.base import DATA_KINDS, DataKind, StepSource

if TYPE_CHECKING:
    from rlcli.conf.schema import TrainConfig


METRICS = {
    "staleness_mean": Metric("data=stream", "`Σ_d (v − s_d) / D`: the mean staleness of the step's documents (all "
                             "processes), with the trainer at version `v` and document d sampled by version `s_d`"),
    "staleness_max": Metric("data=stream", "`max_d (v − s_d)`: the largest staleness of the step's documents"),
    "stale_dropped": Metric("data=stream", "records dropped so far for a staleness above `data.max_lag`"),
    "queue_depth": Metric("data=stream", "records pushed and not yet trained or dropped (unread by the group, "
                          f"counted up to {COUNTED}, plus read ahead by the processes)"),
    "wait_time": Metric("data=stream", "seconds the process waited on an empty stream while it built the step "
                        "(mean over processes)"),
    "reward": Metric("data=stream, records that carry a reward", "the mean reward of the step's records that "
                     "carry one"),
}


class StreamSource(StepSource):
    """This process's batches from the stream, and the staleness and queue statistics of each."""

    def __init__(self, reader: StreamReader, lease: GroupLease, *, accumulate_microbatches: int, docs_per_step: int,
                 exact: bool):
        self.reader = reader
        self.lease = lease
        self.accumulate_microbatches = accumulate_microbatches
        self.docs_per_step = docs_per_step
        self.exact = exact
        self._acknowledge_next: list[str] = []  # resolved entries in the checkpoint being written

    def next_batch(self, index: int, device: torch.device) -> CollectedBatch:
        reader = self.reader
        self.lease.check()
        collected = collect_batch(reader, accumulate_microbatches=self.accumulate_microbatches,
                                 docs_per_step=self.docs_per_step, exact=self.exact, device=device)
        documents = [doc for batch in collected.micro_batches for doc in batch.documents]
        reader.resolve(documents)
        staleness = [reader.staleness(doc) for doc in documents]
        rewards = [doc.reward for doc in documents if doc.reward is not None]
        # [6] summed and [1] maximised over ranks: every rank logs the same values
        sums = distributed.all_reduce(torch.tensor(
            [sum(staleness), len(staleness), reader.stale_dropped, reader.buffered, sum(rewards), len(rewards)],
            dtype=torch.float64, device=device), "sum")
        worst = distributed.all_reduce(torch.tensor(float(max(staleness, default=0)), device=device), "max")
        collected.stats = {
            "staleness_mean": float(sums[0] / max(sums[1], 1)), "staleness_max": float(worst),
            "stale_dropped": float(sums[2]), "queue_depth": float(reader.unread() + sums[3]),
            "wait_time": reader.take_wait_time(),
        }
        if sums[5] > 0:
            collected.stats["reward"] = float(sums[4] / sums[5])  # of the records that carry one
        return collected

    def after_update(self, step: int) -> None:
        self.reader.version = step

    def state_dict(self) -> dict:
        state = self.reader.state_dict()
        self._acknowledge_next = state["resolved"]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.reader.load_state_dict(state)

    def interrupt(self) -> None:
        self.reader.interrupted = True

    def checkpoint_durable(self) -> None:
        self.reader.acknowledge(self._acknowledge_next)
        self._acknowledge_next = []


@DATA_KINDS.register("stream")
class StreamKind(DataKind):
    """Rollouts read from a Redis stream (``data.url``, ``data.stream``) that samplers fill."""

    groups = ("rollout", "task", "publish", "sample")

    @staticmethod
    def check_config(cfg: TrainConfig, command: str) -> list[str]:
        if cfg.data.url is None and command != "loop":  # rlcli loop brings its own server
            return ["data.url: required by data=stream (redis://host:port/db); `rlcli loop` starts a local server "
                    "and sets it"]
        return []

    def __init__(self, cfg, run_dir) -> None:
        super().__init__(cfg, run_dir)
        self.task = build_target(cfg.task, "task") if cfg.task is not None else None
        if self.task is not None and cfg.rollout is not None:  # the samplers' prompts: their records would not fit
            check_prompt_room(self.task, max_tokens=cfg.data.max_tokens, max_new_tokens=cfg.rollout.max_new_tokens)

    @property
    def default_vocab_size(self) -> int:
        return TOY_VOCAB_SIZE if self.task is None else self.task.tokenizer.vocab_size

    def source_factory(self, policy: torch.nn.Module) -> Callable[[int, int], StepSource]:
        cfg, data = self.cfg, self.cfg.data
        conn = connect(data.url)  # fails before training starts when nothing answers
        # before the first read, and in the run's first process before it starts the others: only it renews
        lease = GroupLease(conn, data.stream, data.group, self.run_dir, renew=launcher() is None).take()
        options = ReaderOptions(
            stream=data.stream, group=data.group, max_tokens=data.max_tokens, vocab_size=policy.config.vocab_size,
            max_lag=data.max_lag, temperature=cfg.loss.temperature,
            allow_temperature_mismatch=data.allow_temperature_mismatch,
            need_ref_logprobs=cfg.kl.coef > 0 and cfg.kl.reference == "rollouts",
            wait_warning=data.wait_warning, idle_timeout=data.idle_timeout,
        )

        def make_source(rank: int, world_size: int) -> StreamSource:
            rejected = "rejected.jsonl" if world_size == 1 else f"rejected.rank{rank}.jsonl"
            reader = StreamReader(connect(data.url), options, f"rank{rank}", self.run_dir / rejected)
            return StreamSource(reader, lease, accumulate_microbatches=cfg.trainer.accumulate_microbatches,
                                docs_per_step=cfg.trainer.docs_per_step,
                                exact=cfg.trainer.docs_per_step_mode == "exact")

        return make_source
