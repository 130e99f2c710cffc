"""A sampler of the live loop: sample groups with the trainer's newest published weights, push them.

`SamplerWorker.run` loops over rounds. Before each round it re-reads the trainer's announcement
(`rlcli.stream.queue.newest_weights`), loads the announced version when it is not the one it
holds, and waits while the trainer is too far behind (back-pressure). A round samples
``rollout.prompts_per_step`` prompts x ``rollout.group_size`` completions, scores them, computes
group advantages (under ``rollout.filter``: of the groups it keeps, sampling more rounds for the
missing ones; the others go to ``rejected``) and pushes the records in one batch, each with a unique ``id`` and the
``policy_version`` it was sampled with; ``rollout.log_completions`` of them, with their text, are
appended to ``completions`` (the sampler's ``completions.jsonl``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlcli.conf.schema import AdvantageConfig, RewardConfig, RolloutConfig, SampleConfig, StreamDataConfig
from rlcli.data.readers import Rejection, write_rejections
from rlcli.data.writers import to_record
from rlcli.errors import UserError
from rlcli.rollout.filtering import GroupFilter
from rlcli.rollout.onpolicy import OnPolicyRollouts, step_seed
from rlcli.rollout.overlong import Overlong
from rlcli.rollout.samplers import Samplers
from rlcli.stream.connection import RedisConnection
from rlcli.stream.queue import newest_weights, unread
from rlcli.stream.records import weights_key
from rlcli.stream.writer import StreamWriter

log = logging.getLogger("rlcli")

POLL = 0.2  # seconds between looks at the announcement and the queue while waiting
COUNTS = ("groups_kept", "groups_filtered", "sampling_rounds")  # rollout.filter's, in a round's log line


class SamplerWorker:
    """Sampler ``worker`` (0 <= worker < ``sample.workers``) of the stream ``data.stream`` at ``conn``.

    ``task`` is built from the ``task`` group; ``stop()`` is checked between rounds and while waiting.
    Every process draws a random token: its record ids, group ids and sampling seed include it, so a
    restarted sampler never repeats the records of the one before it. ``completions``: the file that
    each round's lines of ``completions.jsonl`` are appended to (None: none written). ``rejected``: the file
    that the records of the groups ``rollout.filter`` drops are appended to, with the reason (``rejected.jsonl``;
    None: none written).
    """

    def __init__(
        self,
        conn: RedisConnection,
        task: Any,
        *,
        rollout: RolloutConfig,
        advantage: AdvantageConfig,
        reward: RewardConfig,
        data: StreamDataConfig,
        sample: SampleConfig,
        seed: int,
        worker: int,
        stop: Callable[[], bool] = lambda: False,
        trust_remote_code: bool = False,
        completions: Path | None = None,
        rejected: Path | None = None,
    ) -> None:
        self.conn = conn
        self.task = task
        self.rollout = rollout
        self.advantage = advantage
        self.overlong = Overlong.of(reward, rollout)
        self.data = data
        self.sample = sample
        self.worker = worker
        self.stop = stop
        self.completions = completions
        self.rejected = rejected
        self.token = secrets.token_hex(4)
        self.seed = step_seed(seed, int(self.token, 16), worker)  # `seed` mixed with the process's token
        self.writer = StreamWriter(conn.url, data.stream, key="data.url")
        self.version: int | None = None  # of the weights loaded
        self.rollouts: OnPolicyRollouts | None = None
        self.samplers = Samplers(rollout, task.tokenizer, trust_remote_code=trust_remote_code)
        self.rounds = 0  # pushed by this process: the next round's number

    def run(self, max_rounds: int | None = None) -> str:
        """Push rounds until the trainer announces its final weights (returns ``"final"``), ``stop()``
        holds (``"stopped"``) or ``max_rounds`` more rounds are pushed (``"rounds"``)."""
        last = None if max_rounds is None else self.rounds + max_rounds
        while last is None or self.rounds < last:
            outcome = self._wait_for_room()
            if outcome is not None:
                return outcome
            self._push_round()
        return "rounds"

    def close(self) -> None:
        self.writer.close()
        self.samplers.close()

    def _wait_for_room(self) -> str | None:
        """Wait until a round may be pushed (None), the trainer is done (``"final"``) or ``stop()``."""
        said = False
        while not self.stop():
            announcement = newest_weights(self.conn, self.data.stream)
            if announcement is None:
                reason = f"waiting for the trainer's first published weights at {weights_key(self.data.stream)}"
            elif announcement.get("final"):
                return "final"
            else:
                if announcement["version"] != self.version:  # newer, or older from a resumed trainer
                    self._load(announcement)
                    if announcement["version"] != self.version:
                        continue  # pruned while it loaded: a newer version is announced
                reason = self._back_pressure(announcement)
                if reason is None:
                    return None
            if not said:
                log.info("sampler %d: %s", self.worker, reason)
                said = True
            time.sleep(POLL)
        return "stopped"

    def _back_pressure(self, announcement: dict) -> str | None:
        """Why a round pushed now would be too many or too stale for the trainer; None when it is not."""
        queued = self._unread()
        if queued > self.sample.max_queue:
            return f"waiting: more than sample.max_queue={self.sample.max_queue} unread records"
        trained, seen = announcement["version"], announcement.get("documents_seen", 0)
        if trained <= 0 or seen <= 0:
            return None  # no training rate known yet
        reached = trained + queued / (seen / trained)  # the trainer's version when it reaches a record pushed now
        if reached - self.version > self.data.max_lag:
            return (f"waiting: records sampled with v{self.version} would reach the trainer at about v{reached:.1f} "
                    f"({queued} unread), more than data.max_lag={self.data.max_lag} versions later")
        return None

    def _load(self, announcement: dict) -> None:
        """Sample with the announced weights from now on."""
        version, path = announcement["version"], announcement["path"]
        try:
            sampler = self.samplers.of_checkpoint(path)
        except (OSError, ValueError) as err:
            newer = newest_weights(self.conn, self.data.stream)
            if newer is not None and newer["version"] != version:
                return  # pruned while it loaded: the next look loads the one announced now
            raise UserError(f"sampler {self.worker}: cannot load the trainer's weights v{version} "
                            f"from {path}: {err}") from None
        r = self.rollout
        self.rollouts = OnPolicyRollouts(
            self.task, sampler, prompts_per_step=r.prompts_per_step, group_size=r.group_size,
            max_new_tokens=r.max_new_tokens, estimator=self.advantage.estimator, eps=self.advantage.eps,
            k=self.advantage.k,
            seed=self.seed, rank=self.worker, world_size=self.sample.workers, overlong=self.overlong,
            group_filter=GroupFilter.of(r),
        )
        self.version = version
        log.info("sampler %d: sampling with the weights v%d from %s", self.worker, version, path)

    def _push_round(self) -> None:
        round_ = self.rounds
        log_completions = self.rollout.log_completions if self.completions is not None else 0
        rollouts, stats, lines, filtered = self.rollouts.generate_filtered(round_, log_completions)
        prefix = f"{self.worker}-{self.token}-{round_}"
        records = []
        for i, rollout in enumerate(rollouts):
            record = to_record(rollout)
            record.update(id=f"{prefix}-{i}", group_id=f"{self.token}-{record['group_id']}",
                          policy_version=self.version)
            records.append(record)
        self.writer.push_many(records)
        self._log_completions(round_, lines)
        self._log_filtered(prefix, filtered)
        shaped = "".join(f", {name} {stats[name]:g}" if name in COUNTS else f", {name} {stats[name]:.3f}"
                         for name in ("reward/overlong", "truncated_fraction", *COUNTS) if name in stats)
        queued = self._unread()
        log.info("sampler %d: round %d: v%d, reward %.3f%s, pushed %d records, %s unread", self.worker, round_,
                 self.version, stats["reward"], shaped, len(records),
                 f"over {self.sample.max_queue}" if queued > self.sample.max_queue else queued)
        self.rounds += 1

    def _unread(self) -> int:
        """The records the trainer has still to read, counted up to ``sample.max_queue + 1`` (all that a sampler
        decides on): the count costs the same whatever the backlog."""
        return unread(self.conn, self.data.stream, self.data.group, at_most=self.sample.max_queue + 1)

    def _log_filtered(self, prefix: str, filtered: list[Rejection]) -> None:
        """Append the records of the round's dropped groups to ``rejected``, each with an id of its own (``x``
        after the round's prefix) and the group id it would have been pushed with."""
        if not filtered or self.rejected is None:
            return
        write_rejections([replace(r, record={**r.record, "id": f"{prefix}-x{i}", "policy_version": self.version,
                                              "group_id": f"{self.token}-{r.record['group_id']}"})
                          for i, r in enumerate(filtered)], self.rejected, append=True)

    def _log_completions(self, round_: int, lines: list[dict]) -> None:
        """Append the round's lines, with the weights' version and the group ids of the pushed records."""
        if not lines:
            return
        with self.completions.open("a", encoding="utf-8") as handle:
            for line in lines:
                line = {"round": round_, "policy_version": self.version, **line,
                        "group_id": f"{self.token}-{line['group_id']}"}
                handle.write(json.dumps(line) + "\n")
