"""`rlcli stream push`: rollout files into a Redis stream, all checked before the first is pushed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from rlcli.data.errors import DataError, RecordError
from rlcli.data.readers import expand_paths, read_records
from rlcli.stream.writer import StreamWriter, check_record, group_advantages_for

BATCH = 500  # records per round trip
EPS = 1e-6  # advantage.eps of `rlcli train`


def push_files(patterns: Sequence[str], url: str, stream: str, advantage: str, out: TextIO) -> None:
    """Push every record of the files ``patterns`` name into ``stream`` at ``url``; print a summary.

    A record without ``id`` gets its source (``path:line``, ``path:row N``), one without
    ``policy_version`` gets 0, and those without ``advantage``/``advantages`` get one from ``reward``
    per ``group_id`` over all the files with estimator ``advantage`` (``none``: they are an error).
    Any problem (a malformed line, a duplicate id, ...) is a `DataError` naming the record, raised
    before anything is pushed; an unreachable ``url`` is a `UserError` too.
    """
    sources, records = _read(patterns)
    if advantage == "none":
        missing = [s for s, r in zip(sources, records) if r.get("advantage") is None and r.get("advantages") is None]
        if missing:
            raise DataError(f"{missing[0]}: no 'advantage' or 'advantages' and --advantage none ({len(missing)} "
                            "records lack one); --advantage grpo or dr_grpo computes them from 'reward' per 'group_id'")
    try:
        if advantage != "none":
            records = group_advantages_for(records, advantage, eps=EPS, names=sources)
        for source, record in zip(sources, records):
            check_record(record, source)
    except ValueError as err:
        raise DataError(str(err)) from None
    first_source: dict[str, str] = {}
    for source, record in zip(sources, records):
        earlier = first_source.setdefault(record["id"], source)
        if earlier != source:
            raise DataError(f"{source}: field 'id': {record['id']!r} is also the id of {earlier}")

    with StreamWriter(url, stream, key="--url") as writer:
        for start in range(0, len(records), BATCH):
            writer.push_many(records[start:start + BATCH])
        length = writer.length()
    print(f"pushed {len(records)} records to stream {stream!r} at {url} (stream length {length})", file=out)


def _read(patterns: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """The sources and records of the files, with ``id`` and ``policy_version`` filled in."""
    sources, records = [], []
    for path in expand_paths(patterns):
        for source, raw in read_records(path):
            if isinstance(raw, RecordError):
                raise DataError(str(raw))
            record = dict(raw)
            if record.get("id") is None:
                record["id"] = source
            if record.get("policy_version") is None:
                record["policy_version"] = 0
            sources.append(source)
            records.append(record)
    if not records:
        raise DataError(f"no records in {', '.join(patterns)}")
    return sources, records
