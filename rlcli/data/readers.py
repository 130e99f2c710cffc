"""Read rollout files (JSON Lines, Parquet), validate every record and report the rejected ones."""

from __future__ import annotations

import glob
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.data.errors import DataError, RecordError, format_problem
from rlcli.data.schema import Rollout, validate_record
from rlcli.storage import replace_text

__all__ = [
    "DataError",
    "Rejection",
    "check_temperature",
    "collect_rollouts",
    "expand_paths",
    "load_rollouts",
    "read_records",
    "write_rejections",
]

JSON_LINES_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = JSON_LINES_SUFFIXES + PARQUET_SUFFIXES
MAX_LISTED_PROBLEMS = 20
# A JSON line nested deeper than this is rejected. Without a limit of our own, json's (the
# recursion limit) would decide, and that depends on how deep the caller's stack already is.
MAX_JSON_DEPTH = 100
_GLOB_CHARS = frozenset("*?[")


@dataclass
class Rejection:
    """A record that was not accepted: where it is, why, and the raw record (``None`` if unparsable)."""

    source: str
    field: str | None
    reason: str
    record: Mapping[str, Any] | None

    def __str__(self) -> str:
        return format_problem(self.source, self.field, self.reason)


def expand_paths(patterns: Sequence[str | Path]) -> list[Path]:
    """Turn file names and glob patterns into a list of rollout files.

    ``~`` is expanded. The matches of a glob are sorted; patterns keep their given order and a
    file named twice is read once. A pattern that matches no file, or a file whose extension
    is not one of ``.jsonl``, ``.json`` (JSON Lines) or ``.parquet``, raises ``DataError``.
    """
    if not patterns:
        raise DataError("no rollout files given")
    files: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        for path in _expand_one(str(pattern)):
            if path.suffix.lower() not in SUPPORTED_SUFFIXES:
                raise DataError(
                    f"{path}: unsupported file type '{path.suffix}' "
                    f"(expected one of {', '.join(SUPPORTED_SUFFIXES)})"
                )
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
    return files


def _expand_one(pattern: str) -> list[Path]:
    expanded = str(Path(pattern).expanduser())
    if _GLOB_CHARS.isdisjoint(expanded):
        path = Path(expanded)
        if path.is_dir():
            raise DataError(f"{pattern}: is a directory, give files or a glob such as '{pattern}/*.jsonl'")
        if not path.is_file():
            raise DataError(f"{pattern}: no such file")
        return [path]
    matches = [Path(p) for p in sorted(glob.glob(expanded, recursive=True)) if Path(p).is_file()]
    if not matches:
        raise DataError(f"{pattern}: matches no file")
    return matches


def read_records(path: Path) -> Iterator[tuple[str, Mapping[str, Any] | RecordError]]:
    """Yield ``(source, record)`` for every record of one file, unvalidated.

    A JSON line that cannot be parsed (not UTF-8, not JSON, a key given twice), or is not an
    object, and a Parquet row holding a value Python cannot represent, yield a ``RecordError`` in
    place of the record so that the caller can report it with the others. Blank lines are skipped.
    A file that cannot be opened, is not valid Parquet or has a column twice raises ``DataError``.
    """
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        yield from _read_parquet(path)
    else:
        yield from _read_json_lines(path)


def _read_json_lines(path: Path) -> Iterator[tuple[str, Mapping[str, Any] | RecordError]]:
    try:
        handle = path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open ({err.strerror})") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            source = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                # JSON Lines is UTF-8 (a byte-order mark is allowed). Decoding bytes ourselves:
                # json.loads(bytes) lets UTF-8-encoded surrogates through ('surrogatepass').
                text = line.decode("utf-8-sig")
            except UnicodeDecodeError as err:
                yield source, RecordError(source, None, f"invalid JSON: not UTF-8 ({err})")
                continue
            try:
                # NaN and Infinity parse; validation rejects them.
                record = json.loads(text, object_pairs_hook=_unique_keys)
                too_deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(record) > MAX_JSON_DEPTH
            except RecursionError:
                too_deep = True
            except ValueError as err:  # malformed, a key given twice, an int of more than 4300 digits
                yield source, RecordError(source, None, f"invalid JSON: {err}")
                continue
            if too_deep:
                yield source, RecordError(source, None, f"invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels")
                continue
            if not isinstance(record, dict):
                kind = type(record).__name__ if record is not None else "null"
                yield source, RecordError(source, None, f"expected a JSON object per line, got {kind}")
                continue
            yield source, record


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: a key given twice would silently keep the last value."""
    record: dict[str, Any] = {}
    for key, value in pairs:
        if key in record:
            raise ValueError(f"key {key!r} is given more than once")
        record[key] = value
    return record


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (1 for ``[1, 2]``), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _read_parquet(path: Path) -> Iterator[tuple[str, Mapping[str, Any] | RecordError]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise DataError(f"{path}: column '{repeated[0]}' appears more than once (a row keeps only one value)")
        row = 0
        for batch in parquet.iter_batches():
            try:
                records = batch.to_pylist()
            except (ValueError, OverflowError, pa.ArrowException):
                # A value Python cannot hold (a timestamp with nanoseconds, a date past year 9999,
                # a string that is not UTF-8): find the rows that hold one and reject only those.
                records = [_parquet_row(batch, i, f"{path}:row {row + i}") for i in range(batch.num_rows)]
            for record in records:
                yield f"{path}:row {row}", record
                row += 1
    except (OSError, ValueError, pa.ArrowException) as err:  # ValueError: e.g. a column name that is not UTF-8
        raise DataError(f"{path}: cannot read Parquet file ({err})") from None


def _parquet_row(batch: Any, index: int, source: str) -> dict[str, Any] | RecordError:
    import pyarrow as pa

    record = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            record[name] = column[index].as_py()
        except (ValueError, OverflowError, pa.ArrowException) as err:
            return RecordError(source, name, f"cannot be read as a Python value ({err})")
    return record


def collect_rollouts(
    files: Sequence[Path], *, vocab_size: int | None, max_tokens: int | None = None
) -> tuple[list[Rollout], list[Rejection]]:
    """Validate every record of ``files`` in order: the valid documents and the rejections.

    Valid documents get ``index`` 0, 1, 2, ... in reading order. Never raises for a bad record.
    """
    rollouts: list[Rollout] = []
    rejections: list[Rejection] = []
    for path in files:
        for source, record in read_records(path):
            if isinstance(record, RecordError):
                rejections.append(Rejection(source, record.field, record.reason, None))
                continue
            try:
                rollout = validate_record(
                    record, source=source, index=len(rollouts), vocab_size=vocab_size, max_tokens=max_tokens
                )
            except RecordError as err:
                rejections.append(Rejection(source, err.field, err.reason, record))
                continue
            rollouts.append(rollout)
    return rollouts, rejections


def load_rollouts(
    patterns: Sequence[str | Path],
    *,
    vocab_size: int,
    max_tokens: int | None = None,
    on_invalid: str = "error",
) -> tuple[list[Rollout], list[Rejection]]:
    """Read and validate all rollout files named by ``patterns`` (see ``expand_paths``).

    ``on_invalid="error"`` raises ``DataError`` listing every invalid record;
    ``on_invalid="skip"`` returns the valid documents and the rejections (the caller writes and
    counts them). No valid document at all is a ``DataError`` in both modes.
    """
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    files = expand_paths(patterns)
    rollouts, rejections = collect_rollouts(files, vocab_size=vocab_size, max_tokens=max_tokens)
    if rejections and on_invalid == "error":
        raise DataError(_rejections_message(rejections, num_valid=len(rollouts)))
    if not rollouts:
        names = ", ".join(str(f) for f in files)
        raise DataError(f"no valid documents in {names} ({len(rejections)} invalid records)")
    return rollouts, rejections


def _rejections_message(rejections: Sequence[Rejection], num_valid: int) -> str:
    lines = [f"{len(rejections)} invalid records (data.on_invalid=error):"]
    for rejection in rejections[:MAX_LISTED_PROBLEMS]:
        lines.append(f"  {rejection}")
    if len(rejections) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(rejections) - MAX_LISTED_PROBLEMS} more")
    lines.append(
        f"Fix them, or set data.on_invalid=skip to train on the {num_valid} valid records "
        "and write the rejected ones to the run directory."
    )
    return "\n".join(lines)


def write_rejections(rejections: Sequence[Rejection], path: str | Path, *, append: bool = False) -> None:
    """Write (replacing the file atomically) or ``append`` one JSON line per rejection: ``source``, ``field``,
    ``reason`` and the raw ``record``.

    Records may hold NaN or Infinity (written as JSON's ``NaN``/``Infinity``, which ``json.loads``
    reads back) and, from Parquet, values JSON cannot hold (written as strings). A record nested
    too deeply to write is replaced by a note saying so; its line still names source and reason.
    """
    lines = []
    for rejection in rejections:
        # Not dataclasses.asdict: it deep-copies the record, recursing once per nesting level.
        entry = {"source": rejection.source, "field": rejection.field, "reason": rejection.reason,
                 "record": rejection.record}
        try:
            line = json.dumps(entry, allow_nan=True, default=str)
        except (RecursionError, ValueError) as err:
            entry["record"] = f"<record not written: {type(err).__name__}: {err}>"
            line = json.dumps(entry, allow_nan=True, default=str)
        lines.append(line + "\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if append:
        with path.open("a", encoding="utf-8") as handle:
            handle.write("".join(lines))
    else:
        replace_text(path, "".join(lines))


def sampled_at_other_temperature(rollout: Rollout, temperature: float) -> bool:
    """The record names a sampler temperature that is not ``temperature`` (``loss.temperature``)."""
    return rollout.temperature is not None and not math.isclose(rollout.temperature, temperature, rel_tol=0,
                                                                abs_tol=1e-6)


def check_temperature(
    rollouts: Sequence[Rollout], temperature: float, *, allow_mismatch: bool = False
) -> int:
    """Check that rollouts carrying a sampler ``temperature`` match ``loss.temperature``.

    Returns the number of mismatching rollouts. Unless ``allow_mismatch``, a mismatch raises
    ``DataError``: the importance ratio would compare distributions at different temperatures.
    """
    mismatched = [r for r in rollouts if sampled_at_other_temperature(r, temperature)]
    if mismatched and not allow_mismatch:
        first = mismatched[0]
        raise DataError(
            f"{first.source}: sampled at temperature {first.temperature} but loss.temperature={temperature} "
            f"({len(mismatched)} rollouts differ). Set loss.temperature={first.temperature} to match "
            "the sampler, or data.allow_temperature_mismatch=true to train anyway."
        )
    return len(mismatched)
