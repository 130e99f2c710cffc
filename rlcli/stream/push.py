"""`rlcli stream push`: rollout files into a Redis stream, all checked before the first is pushed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from omegaconf import DictConfig

from rlcli.data.errors import DataError, RecordError
from rlcli.data.readers import expand_paths, read_records
from rlcli.errors import UserError
from rlcli.redis_password import masked
from rlcli.rollout.advantages import computes_advantages, group_estimators
from rlcli.stream.records import check_record
from rlcli.stream.writer import StreamWriter, group_advantages_for

BATCH = 500  # records per round trip


def train_advantage() -> DictConfig:
    """`rlcli train`'s ``advantage`` config (``estimator``, ``eps``, ``k``), composed as `rlcli train` composes it
    (with a local ``rlcli_local/`` config): what `rlcli stream push` computes advantages with by default."""
    from hydra import compose, initialize_config_module

    from rlcli.conf import quiet_local_config_folder

    quiet_local_config_folder()
    with initialize_config_module("rlcli.conf", version_base=None):
        return compose(config_name="config").advantage


def push_files(patterns: Sequence[str], url: str, stream: str, advantage: str, eps: float, out: TextIO, *,
               k: int | None = None) -> None:
    """Push every record of the files ``patterns`` name into ``stream`` at ``url``; print a summary.

    A record without ``id`` gets its source (``path:line``, ``path:row N``), one without
    ``policy_version`` gets 0, and those without ``advantage``/``advantages`` get one from ``reward``
    per ``group_id`` over all the files with estimator ``advantage``, ``eps`` and ``k`` (as ``advantage.*``
    of `rlcli train`; estimator ``none``: they are an error; ``passk`` needs ``k``). Any problem (a
    malformed line, a duplicate id, ...) is a `DataError` naming the record, raised before anything is
    pushed; an unreachable ``url`` is a `UserError` too.
    """
    if not eps > 0:
        raise UserError(f"--eps: must be > 0, got {eps}")
    if (advantage == "passk") != (k is not None) or (k is not None and k < 1):
        raise UserError(f"--k: the k of pass@k, an int >= 1 with --advantage passk and only with it; got {k} "
                        f"with --advantage {advantage}")
    sources, records = _read(patterns)
    if not computes_advantages(advantage):
        missing = [s for s, r in zip(sources, records) if r.get("advantage") is None and r.get("advantages") is None]
        if missing:
            raise DataError(f"{missing[0]}: no 'advantage' or 'advantages' and --advantage {advantage} ({len(missing)} "
                            f"records lack one); --advantage {' or '.join(group_estimators())} computes them from "
                            "'reward' per 'group_id'")
    try:
        if computes_advantages(advantage):
            records = group_advantages_for(records, advantage, eps=eps, k=k, names=sources)
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
    print(f"pushed {len(records)} records to stream {stream!r} at {masked(url)} (stream length {length})", file=out)


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
