"""One trainer process's reader of the rollout stream: a consumer of the trainer's consumer group.

It hands out validated documents packed into micro-batches like `DocumentStream` (a
`MicroBatchSource`, so `collect_batch` builds static and ``docs_per_step`` batches from it unchanged)
and keeps the books that make training exactly-once across crashes:

- an entry read from Redis stays *pending* in the group until `acknowledge` is called for it, which
  the trainer does only once a checkpoint holding the update that trained it is durable;
- `resolve` marks entries whose documents went into a step; a rejected or stale record is resolved
  at once (staleness is judged when a document is handed out, at the trainer's version then).
  `state_dict` lists the resolved, unacknowledged entries; a resumed reader acknowledges those and
  reads the rest of its pending entries again, in stream order, before any new one.

Rejected records (entries that `decode` cannot read: not UTF-8, not JSON, nested too deep; records that
fail `check_record`, the writer's check too, or this trainer's temperature and reference log-probs), stale
ones (sampled more than ``max_lag`` versions before the trainer's) and ones from the future (a
``policy_version`` above the trainer's) are written to this process's rejections file (``rejected.jsonl``)
and to the ``<stream>:rejected`` stream with their reason; nothing is dropped silently. Like a trained
entry, a rejected one is acknowledged with the next durable checkpoint, and never read again. A record
rejected after the checkpoint a run resumes from is read and judged again, so before its first read a
reader cuts its file back to the checkpoint's count of lines (to none when starting afresh) and deletes its
own ``<stream>:rejected`` entries of records still pending.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from rlcli.data.errors import RecordError
from rlcli.data.packing import MicroBatch, fill_micro_batch
from rlcli.data.readers import Rejection, sampled_at_other_temperature, write_rejections
from rlcli.data.schema import Rollout
from rlcli.data.writers import to_record
from rlcli.storage import keep_lines
from rlcli.stream.connection import RedisConnection
from rlcli.stream.ids import claim
from rlcli.stream.queue import unread
from rlcli.stream.records import check_record, decode, encode, rejected_key

log = logging.getLogger("rlcli")

READ_COUNT = 8  # entries per read: small, so that the processes of one trainer share the stream evenly
BLOCK_MS = 500  # how long one blocking read waits for new entries


@dataclass(frozen=True)
class ReaderOptions:
    """What a reader checks records against and how long it waits (see ``conf/data/stream.yaml``)."""

    stream: str
    group: str
    max_tokens: int
    vocab_size: int
    max_lag: int
    temperature: float
    allow_temperature_mismatch: bool
    need_ref_logprobs: bool
    wait_warning: float
    idle_timeout: float | None


class StreamReader:
    """Consumer ``consumer`` of the group; `next_micro_batch` blocks until a record comes (or the idle
    timeout passes), and `version` is the trainer's version that staleness is measured against."""

    def __init__(self, conn: RedisConnection, options: ReaderOptions, consumer: str, rejected_path: Path) -> None:
        self.conn = conn
        self.options = options
        self.consumer = consumer
        self.rejected_path = rejected_path
        self.version = 0
        self.carried: deque[Rollout] = deque()  # given back or read past a full micro-batch; served first
        self.fetched: deque[tuple[str, dict]] = deque()  # entries read from Redis, not yet looked at
        self.entry_of: dict[int, str] = {}  # document index -> its entry ID, until resolved
        self.seen: set[str] = set()  # entry IDs read and not yet acknowledged
        self.resolved: list[str] = []  # entry IDs done with (trained, rejected or dropped), not yet acknowledged
        self.stale_dropped = 0  # records dropped for staleness, in all
        self.rejections = 0  # lines in rejected_path (a resumed reader starts from its checkpoint's count)
        self._started = False  # the rejections of unacknowledged entries are cleared before the first read
        self.wait_time = 0.0  # seconds blocked on an empty stream since `take_wait_time`
        self.interrupted = False  # a signal stops the run: wait no more
        self._count = 0  # documents read: their index
        self._backlog: str | None = "0"  # where to read this consumer's pending entries from; None: read new ones
        self._reconnects = conn.reconnects
        try:
            conn.call("xgroup_create", options.stream, options.group, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    # -- the DocumentStream interface used by collect_batch

    def next_micro_batch(self) -> MicroBatch | None:
        """The next documents that fit in ``max_tokens`` (`fill_micro_batch`); waits for the first one (None
        after the idle timeout)."""
        return fill_micro_batch(self, self.options.max_tokens)

    def next_document(self, first: bool) -> Rollout | None:
        """The next document not too stale to train at the current version: a given-back one, else one read
        from Redis (see `_read`), waiting for it when it is the ``first`` of a micro-batch."""
        while (doc := self.carried.popleft() if self.carried else self._read(wait=first)) is not None:
            staleness = self.staleness(doc)
            if 0 <= staleness <= self.options.max_lag:
                return doc
            if staleness < 0:
                reason = (f"from the future: sampled by policy version {_shown(doc.policy_version)}, above the "
                          f"trainer's {self.version} (weights of another run, or published before a crash that "
                          "the trainer resumed from an earlier step)")
            else:
                self.stale_dropped += 1
                reason = (f"stale: sampled by policy version {doc.policy_version}, {staleness} versions before the "
                          f"trainer's {self.version} (data.max_lag={self.options.max_lag})")
            entry = self.entry_of.pop(doc.index)
            record = to_record(doc) | {"id": doc.id, "policy_version": doc.policy_version}
            self._reject(entry, Rejection(doc.source, "policy_version", reason, record))
        return None

    def give_back(self, documents: Sequence[Rollout]) -> None:
        """Put ``documents`` back at the front, in order: they are served next."""
        self.carried.extendleft(reversed(documents))

    # -- exactly-once bookkeeping

    def staleness(self, doc: Rollout) -> int:
        """Versions between the policy that sampled ``doc`` and the trainer's now."""
        return self.version - doc.policy_version

    def resolve(self, documents: Sequence[Rollout]) -> None:
        """``documents`` went into a step: their entries are acknowledged with the next durable checkpoint."""
        self.resolved += [self.entry_of.pop(doc.index) for doc in documents]

    def state_dict(self) -> dict:
        return {"version": self.version, "resolved": list(self.resolved), "stale_dropped": self.stale_dropped,
                "rejections": self.rejections}

    def load_state_dict(self, state: dict) -> None:
        """Continue after a checkpoint: its resolved entries were trained, so they are acknowledged; every
        other pending entry of this consumer is read again."""
        self.version, self.stale_dropped = state["version"], state["stale_dropped"]
        self.rejections = state["rejections"]
        self.resolved = []
        self.acknowledge(state["resolved"])

    def acknowledge(self, entries: Sequence[str]) -> None:
        """Acknowledge ``entries`` (trained by a durable checkpoint) and trim what no group needs any more."""
        if not entries:
            return
        done = set(entries)
        self.conn.call("xack", self.options.stream, self.options.group, *entries)
        self.seen -= done
        self.resolved = [e for e in self.resolved if e not in done]
        self._trim()

    def unread(self) -> int:
        """Entries of the stream that no process of the trainer has read yet."""
        return unread(self.conn, self.options.stream, self.options.group)

    @property
    def buffered(self) -> int:
        """Entries this process has read but not yet put into a step."""
        return len(self.fetched) + len(self.carried)

    def take_wait_time(self) -> float:
        """Seconds blocked on an empty stream since the last call."""
        waited, self.wait_time = self.wait_time, 0.0
        return waited

    # -- reading

    def _read(self, wait: bool) -> Rollout | None:
        """The next valid document from Redis; with ``wait``, blocks until one comes (None after the idle timeout)."""
        started = warned = time.monotonic()
        waited = False
        try:
            while True:
                while self.fetched:
                    doc = self._accept(*self.fetched.popleft())
                    if doc is not None:
                        return doc
                if self._fetch(block=wait):
                    continue
                if not wait or self.interrupted:
                    return None
                waited, now = True, time.monotonic()
                if now - warned >= self.options.wait_warning:
                    log.warning("stream: no rollouts for %.0f s on %s; is a sampler running?", now - started,
                                self.options.stream)
                    warned = now
                if self.options.idle_timeout is not None and now - started >= self.options.idle_timeout:
                    log.warning("stream: no rollouts for %.0f s (data.idle_timeout); ending the run", now - started)
                    return None
        finally:
            if waited:
                self.wait_time += time.monotonic() - started

    def _forget_rejections_to_repeat(self) -> None:
        """Undo the rejections that will be made again: the lines after the checkpoint's count in
        ``rejected_path``, and this consumer's ``<stream>:rejected`` entries of records still pending."""
        keep_lines(self.rejected_path, self.rejections)
        o = self.options
        pending = {p["message_id"] for p in self.conn.call("xpending_range", o.stream, o.group, min="-", max="+",
                                                           count=2**31 - 1, consumername=self.consumer)}

        def to_repeat(fields) -> bool:
            try:
                reject = decode(fields)
            except ValueError:  # not an entry of ours
                return False
            mine = isinstance(reject, dict) and reject.get("consumer") == self.consumer
            return mine and reject.get("entry") in pending

        rejected = rejected_key(o.stream)
        repeated = [rejection for rejection, fields in self.conn.call("xrange", rejected) if to_repeat(fields)]
        if repeated:
            self.conn.call("xdel", rejected, *repeated)

    def _fetch(self, block: bool) -> bool:
        """Read entries into ``fetched``: this consumer's pending ones first (after a start or a reconnect,
        when a reply may have been lost), then new ones. False when there was nothing to read."""
        if not self._started:
            self._forget_rejections_to_repeat()
            self._started = True
        if self.conn.reconnects != self._reconnects:
            self._reconnects, self._backlog = self.conn.reconnects, "0"
        if self._backlog is not None:
            entries = self._read_group(self._backlog, block=False)
            if entries:
                self._backlog = entries[-1][0]
                self.fetched.extend((entry, fields) for entry, fields in entries if entry not in self.seen)
                return True
            self._backlog = None
        entries = self._read_group(">", block=block)
        self.fetched.extend(entries)
        return bool(entries)

    def _read_group(self, after: str, block: bool) -> list[tuple[str, dict[str, bytes]]]:
        """XREADGROUP of up to `READ_COUNT` entries after ``after`` ("0": this consumer's pending ones, ">": new
        ones). Their fields come as bytes, so that an entry that is not UTF-8 is rejected by `decode`, not
        fatal to the whole reply."""
        o = self.options
        wait = ["BLOCK", BLOCK_MS] if block else []
        reply = self.conn.call("execute_command", "XREADGROUP", "GROUP", o.group, self.consumer, "COUNT", READ_COUNT,
                               *wait, "STREAMS", o.stream, after, NEVER_DECODE=True)
        entries = reply[0][1] if reply else []
        return [(entry.decode(), {name.decode(errors="replace"): value for name, value in fields.items()})
                for entry, fields in entries]

    def _accept(self, entry: str, fields: dict | None) -> Rollout | None:
        """The entry's document, or None when it is rejected (a duplicate too: an earlier entry had its id,
        `rlcli.stream.ids`) or deleted (then it is resolved)."""
        self.seen.add(entry)
        if not fields:  # trimmed or deleted while pending: nothing to train
            self.resolved.append(entry)
            return None
        source = f"{self.options.stream} {entry}"
        raw = None
        try:
            raw = decode(fields)
            doc = self._check(raw, source)
        except (ValueError, RecordError) as err:
            field, reason = (err.field, err.reason) if isinstance(err, RecordError) else (None, str(err))
            self._reject(entry, Rejection(source, field, reason, raw if isinstance(raw, dict) else None))
            return None
        first = claim(self.conn, self.options.stream, self.options.group, doc.id, entry)
        if first != entry:
            self._reject(entry, Rejection(source, "id", f"duplicate: {doc.id!r} is the id of entry {first} too, "
                                          "read first (a stream id trains once per run)", raw))
            return None
        self.entry_of[doc.index] = entry
        return doc

    def _check(self, raw, source: str) -> Rollout:
        """The stream contract (`check_record`) and what this trainer's config asks of a record."""
        o = self.options
        doc = check_record(raw, source, index=self._count, vocab_size=o.vocab_size, max_tokens=o.max_tokens)
        if o.need_ref_logprobs and doc.ref_logprobs is None:
            raise RecordError(doc.source, "ref_logprobs", "missing, and kl.reference=rollouts needs them")
        if not o.allow_temperature_mismatch and sampled_at_other_temperature(doc, o.temperature):
            raise RecordError(doc.source, "temperature", f"sampled at {doc.temperature} but loss.temperature="
                              f"{o.temperature} (data.allow_temperature_mismatch=true trains on it anyway)")
        self._count += 1
        return doc

    def _reject(self, entry: str, rejection: Rejection) -> None:
        write_rejections([rejection], self.rejected_path, append=True)
        self.rejections += 1
        reject = {"entry": entry, "consumer": self.consumer, "field": rejection.field, "reason": rejection.reason}
        self.conn.call("xadd", rejected_key(self.options.stream),
                       encode({**reject, "record": json.dumps(rejection.record, default=str)}))
        log.warning("stream: rejected %s", rejection)
        self.resolved.append(entry)

    def _trim(self) -> None:
        """Delete the entries older than every group's oldest pending or undelivered one."""
        stream = self.options.stream
        needed = []
        for info in self.conn.call("xinfo_groups", stream):
            if info["pending"]:
                needed.append(self.conn.call("xpending", stream, info["name"])["min"])
            else:
                ms, seq = info["last-delivered-id"].split("-")
                needed.append(f"{ms}-{int(seq) + 1}")
        if needed:
            oldest = min(needed, key=lambda e: tuple(int(p) for p in e.split("-")))
            self.conn.call("xtrim", stream, minid=oldest, approximate=False)


def _shown(number: int) -> str:
    """``number`` as text, its digits elided past 20 (a record may carry any int)."""
    text = str(number)
    return text if len(text) <= 20 else f"{text[:10]}...({len(text)} digits)"
