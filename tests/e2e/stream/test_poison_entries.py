"""Poison entries: an entry of the stream that cannot be decoded (not UTF-8, JSON nested 100,000 deep)
or that claims a policy version above the trainer's is rejected with its entry ID and reason,
acknowledged with the next checkpoint like a trained one, and never read again; the trainer goes on."""

from __future__ import annotations

import json

import pytest
import redis

from factories import rollout_record
from rlcli.commands.train import train
from rlcli.stream.connection import connect
from rlcli.stream.reader import ReaderOptions, StreamReader
from rlcli.stream.records import rejected_key
from train_helpers import compose_train_config

STREAM, GROUP = "test:poison", "trainer"
VOCAB = 7


def good(i: int, version: int = 0) -> dict:
    return rollout_record(i, vocab=VOCAB, advantage=1.0, id=f"r{i}", policy_version=version)


def reader(url: str, path, version: int = 0) -> StreamReader:
    options = ReaderOptions(stream=STREAM, group=GROUP, max_tokens=100, vocab_size=VOCAB, max_lag=10,
                            temperature=1.0, allow_temperature_mismatch=False, need_ref_logprobs=False,
                            wait_warning=30.0, idle_timeout=None)
    made = StreamReader(connect(url), options, "rank0", path)
    made.version = version
    return made


def handed_out(stream_reader: StreamReader) -> list[str]:
    """The ids of every document the reader hands out now, without waiting."""
    ids = []
    while (doc := stream_reader.next_document(first=False)) is not None:
        ids.append(doc.id)
    return ids


def rejections(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def raw(redis_url):
    """A client that writes bytes as they are, as any Redis client may."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_entries_that_cannot_be_decoded_are_rejected_acknowledged_and_never_read_again(redis_url, raw, tmp_path):
    """Before the fix the reader decoded every reply as UTF-8 (the whole read fails on one entry, at every
    resume) and let `json.loads` raise RecursionError; a 400-digit version was trained (staleness −10^399)."""
    bad_utf8 = raw.xadd(STREAM, {"record": b'{"id": "x\xff\xfe", "policy_version": 0}'}).decode()
    deep = raw.xadd(STREAM, {"record": "[" * 100_000 + "]" * 100_000}).decode()
    huge = raw.xadd(STREAM, {"record": json.dumps(good(1, version=int("9" * 400)))}).decode()
    raw.xadd(STREAM, {"record": json.dumps(good(2))})
    path = tmp_path / "rejected.jsonl"
    first = reader(redis_url, path)

    assert handed_out(first) == ["r2"]
    lines = rejections(path)
    sources = [f"{STREAM} {bad_utf8}", f"{STREAM} {deep}", f"{STREAM} {huge} (id r1)"]
    assert [line["source"] for line in lines] == sources
    assert "'record' field is not UTF-8 text" in lines[0]["reason"]
    assert "'record' field is JSON nested more than 32 levels deep" in lines[1]["reason"]
    assert lines[2]["field"] == "policy_version"
    assert lines[2]["reason"].startswith("from the future: sampled by policy version 9999999999...(400 digits), "
                                         "above the trainer's 0")
    in_redis = [json.loads(fields[b"record"]) for _, fields in raw.xrange(rejected_key(STREAM))]
    assert [entry["entry"] for entry in in_redis] == [bad_utf8, deep, huge]

    # a checkpoint taken now holds the rejected entries as resolved; a run resumed from it acknowledges them
    state = first.state_dict()
    assert set(state["resolved"]) == {bad_utf8, deep, huge}
    resumed = reader(redis_url, path)
    resumed.load_state_dict(state)
    assert handed_out(resumed) == ["r2"]  # pending and not in the checkpoint: read again, as after a crash
    assert len(rejections(path)) == 3  # the poison entries were not judged again
    assert raw.xpending(STREAM, GROUP)["pending"] == 1


def test_a_policy_version_above_the_trainers_is_rejected_not_trained(redis_url, raw, tmp_path):
    """Before the fix a version from the future passed the staleness check (staleness −1 <= max_lag)."""
    for record in (good(0, version=2), good(1, version=3), good(2, version=1)):
        raw.xadd(STREAM, {"record": json.dumps(record)})
    path = tmp_path / "rejected.jsonl"

    assert handed_out(reader(redis_url, path, version=2)) == ["r0", "r2"]
    [line] = rejections(path)
    assert (line["record"]["id"], line["field"]) == ("r1", "policy_version")
    assert line["reason"].startswith("from the future: sampled by policy version 3, above the trainer's 2")


def test_the_trainer_trains_past_poison_entries_and_leaves_none_pending(redis_url, raw, tmp_path):
    """The same entries in front of a trainer's stream: before the fix `rlcli train` died on the first read
    (UnicodeDecodeError), and again on every resume, as the entry stayed pending."""
    stream = "rlcli:rollouts"
    raw.xadd(stream, {"record": b"\xff"})
    raw.xadd(stream, {"record": "[" * 100_000 + "]" * 100_000})
    raw.xadd(stream, {"record": json.dumps(good(1, version=10**400))})
    raw.xadd(stream, {"record": json.dumps(good(2))})
    train(compose_train_config(["data=stream", f"data.url={redis_url}", "data.idle_timeout=1", "data.max_tokens=10",
                                "logger=none", "trainer.accumulate_microbatches=1", "trainer.max_steps=5"]), tmp_path)

    trained = [json.loads(line)["ids"] for line in (tmp_path / "documents.jsonl").read_text().splitlines()]
    assert trained == [["r2"]]
    assert [line["field"] for line in rejections(tmp_path / "rejected.jsonl")] == [None, None, "policy_version"]
    assert raw.xpending(stream, "rlcli-trainer")["pending"] == 0  # acknowledged with the final checkpoint
