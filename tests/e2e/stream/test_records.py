"""One stream record contract: the writer refuses and the trainer's reader rejects the same records,
for the same field and with the same reason (`rlcli.stream.records.check_record`)."""

from __future__ import annotations

import json
import math

import pytest

from rlcli.data.errors import RecordError
from rlcli.stream import StreamWriter
from rlcli.stream.connection import connect
from rlcli.stream.reader import ReaderOptions, StreamReader
from rlcli.stream.records import check_record, decode, rejected_key

STREAM = "test:contract"


def record(**fields) -> dict:
    base = {"id": "r1", "policy_version": 2, "prompt_ids": [1, 2], "completion_ids": [3, 4],
            "old_logprobs": [-0.5, -0.25], "advantage": 0.5}
    return {k: v for k, v in (base | fields).items() if v is not None}


MALFORMED = [  # (record, the field named)
    ([1, 2], None),
    (record(id=None), "id"),
    (record(id=""), "id"),
    (record(policy_version=-1), "policy_version"),
    (record(policy_version=True), "policy_version"),
    (record(advantage=None), "advantages"),
    (record(old_logprobs=[-0.5, math.nan]), "old_logprobs"),
    (record(extra=math.inf), "extra"),
    (record(completion_ids=None), "completion_ids"),
    (record(old_logprobs=[-0.5, 0.5]), "old_logprobs"),
    (record(advantage=-1e39), "advantage"),
    (record(advantages=[1.0, 2.0]), "advantage"),
    (record(extra=json.loads("[" * 40 + "]" * 40)), None),  # deeper than MAX_DEPTH (32): issue 32
]


def reader_rejection(url: str, raw, tmp_path) -> dict:
    """What a trainer's reader says of the entry carrying ``raw`` (NaN and infinity written as JSON allows not)."""
    conn = connect(url)
    conn.call("xadd", STREAM, {"record": json.dumps(raw)})
    options = ReaderOptions(stream=STREAM, group="trainer", max_tokens=100, vocab_size=100, max_lag=10,
                            temperature=1.0, allow_temperature_mismatch=False, need_ref_logprobs=False,
                            wait_warning=30.0, idle_timeout=None)
    reader = StreamReader(conn, options, "rank0", tmp_path / "rejected.jsonl")
    assert reader.next_document(first=False) is None
    [(_, fields)] = conn.call("xrange", rejected_key(STREAM))
    conn.close()
    return decode(fields)


@pytest.mark.parametrize(("raw", "field"), MALFORMED)
def test_the_writer_and_the_reader_reject_a_record_alike(redis_url, tmp_path, raw, field):
    with StreamWriter(redis_url, STREAM) as writer, pytest.raises(RecordError) as refused:
        writer.push_many([record(id="r0"), raw])
    message = str(refused.value)
    assert refused.value.field == field and message.startswith("record 1")
    assert field is None or f"field '{field}': " in message
    rejected = reader_rejection(redis_url, raw, tmp_path)
    assert (rejected["field"], rejected["reason"]) == (refused.value.field, refused.value.reason)


def test_an_error_after_the_id_names_it_and_a_good_record_keeps_id_and_version():
    with pytest.raises(RecordError, match=r"^b\.jsonl:3 \(id r1\): field 'old_logprobs': element 1 is 0\.5"):
        check_record(record(old_logprobs=[-0.5, 0.5]), "b.jsonl:3")
    with pytest.raises(RecordError, match=r"^r1: field 'old_logprobs'"):  # `rlcli stream push`: the id is the source
        check_record(record(old_logprobs=[-0.5, 0.5]), "r1")
    doc = check_record(record(), "b.jsonl:3", index=4)
    assert (doc.id, doc.policy_version, doc.index, doc.advantages) == ("r1", 2, 4, (0.5, 0.5))


def test_the_trainer_alone_checks_its_vocabulary_and_max_tokens():
    check_record(record(completion_ids=[3, 99]), "record 0")  # the writer knows no model
    with pytest.raises(RecordError, match=r"field 'completion_ids': element 1 is 99, outside the vocabulary"):
        check_record(record(completion_ids=[3, 99]), "record 0", vocab_size=50)
    with pytest.raises(RecordError, match=r"field 'completion_ids': prompt \+ completion is 4 tokens"):
        check_record(record(), "record 0", max_tokens=3)
