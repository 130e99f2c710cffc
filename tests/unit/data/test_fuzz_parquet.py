"""Fuzz the Parquet reader with hostile input (issue 7, item 5).

Tables with wrong column types (strings or floats for ids, lists of the wrong depth, scalars for
lists, nulls, booleans, binary), bookkeeping columns Python cannot hold (timestamps with
nanoseconds, dates past year 9999, long durations), and damaged files (empty, not Parquet at all,
truncated, bytes flipped). The expected value of every row is read from the table in memory,
before it is written, and judged by ``rollout_oracle`` (an independent reading of rollout-record.md).
"""

from __future__ import annotations

import io
import json
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from rollout_oracle import ADVANTAGE_KINDS, Expected, advantage_fields, check_load, expect_record

from rlcli.data.readers import DataError, collect_rollouts

FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=5),  # one example takes milliseconds: this only catches a hang
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
VOCABS = st.sampled_from([1, 2, 50, 2**31 - 1])
MAX_TOKENS = st.one_of(st.none(), st.integers(1, 12))
INT64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.sampled_from(["", "g0", "\u202egroup", "a\u200bb", "👩‍👩‍👧", "\x00", "0", "1.5", "-1"])

# How a column of each kind of field may be stored: the right types and wrong ones.
ID_TYPES = ["int64", "int32", "int16", "uint32", "uint64", "large_int64", "float64", "string", "nested", "scalar"]
FLOAT_LIST_TYPES = ["float64", "float32", "int64", "string", "nested", "large_float64", "scalar"]
SCALAR_TYPES = ["float64", "float32", "int64", "string", "list", "bool"]
GROUP_TYPES = ["string", "large_string", "int64", "uint64", "binary", "float64", "dictionary", "bool"]
MASK_TYPES = ["int64", "bool", "int8", "float64", "string"]
COLUMN_TYPES = {
    "prompt_ids": ID_TYPES,
    "completion_ids": ID_TYPES,
    "old_logprobs": FLOAT_LIST_TYPES,
    "advantages": FLOAT_LIST_TYPES,
    "advantage": SCALAR_TYPES,
    "reward": SCALAR_TYPES,
    "temperature": SCALAR_TYPES,
    "group_id": GROUP_TYPES,
    "completion_mask": MASK_TYPES,
    "ref_logprobs": FLOAT_LIST_TYPES,
}
FLOAT_LISTS = ("old_logprobs", "advantages", "ref_logprobs")
# The largest float32, the next float64 beyond it, and a value that is infinite as a float32.
FLOAT32_EDGES = [3.4028234663852886e38, 3.402823466385289e38, 3.4028235677973366e38, 1e39]
FLOAT32_EDGES += [-v for v in FLOAT32_EDGES]
LIST_TYPES = {
    "int64": pa.list_(pa.int64()),
    "int32": pa.list_(pa.int32()),
    "int16": pa.list_(pa.int16()),
    "int8": pa.list_(pa.int8()),
    "uint32": pa.list_(pa.uint32()),
    "uint64": pa.list_(pa.uint64()),
    "large_int64": pa.large_list(pa.int64()),
    "float64": pa.list_(pa.float64()),
    "float32": pa.list_(pa.float32()),
    "large_float64": pa.large_list(pa.float64()),
    "string": pa.list_(pa.string()),
    "bool": pa.list_(pa.bool_()),
}
SCALAR_ARROW = {
    "float64": pa.float64(),
    "float32": pa.float32(),
    "int64": pa.int64(),
    "uint64": pa.uint64(),
    "string": pa.string(),
    "large_string": pa.large_string(),
    "binary": pa.binary(),
    "bool": pa.bool_(),
}

# Bookkeeping columns a sampler may add; some hold values Python's datetime cannot.
EXTRA_COLUMNS = {
    "timestamp_ns": (pa.timestamp("ns"), INT64),
    "timestamp_us": (pa.timestamp("us"), st.integers(-(10**15), 10**15)),
    "date32": (pa.date32(), st.integers(-(2**31), 2**31 - 1)),
    "duration_s": (pa.duration("s"), INT64),
    "time_us": (pa.time64("us"), st.integers(0, 86_400_000_000 - 1)),
    "struct": (pa.struct([("a", pa.int64()), ("b", pa.string())]), st.fixed_dictionaries({"a": INT64, "b": TEXT})),
    "map": (pa.map_(pa.string(), pa.int64()), st.lists(st.tuples(TEXT, INT64), max_size=2)),
    "binary": (pa.binary(), st.binary(max_size=8)),
    "null": (pa.null(), st.none()),
    "float64": (pa.float64(), st.floats()),
    "nested": (pa.list_(pa.list_(pa.string())), st.lists(st.lists(TEXT, max_size=2), max_size=2)),
}


def _cell(value: Any, how: str) -> Any:
    """``value`` (a valid cell, or a hostile edit of one) reshaped for a column stored as ``how``."""
    if value is None:
        return None
    if how == "string":
        return [None if v is None else str(v) for v in value] if isinstance(value, list) else str(value)
    if how == "nested":
        return [[v] for v in value] if isinstance(value, list) else [[value]]
    if how == "scalar":
        return value[0] if isinstance(value, list) and value else None
    if how == "list":
        return [value]
    if how == "binary":
        return str(value).encode("utf-8")
    if how == "bool":
        return [bool(v) for v in value] if isinstance(value, list) else bool(value)
    if how.startswith("float") and isinstance(value, list):
        return [None if v is None else float(v) for v in value]
    return value


def _arrow_type(field: str, how: str) -> pa.DataType | None:
    if how == "dictionary":
        return None
    if how == "nested":
        inner = pa.float64() if field in FLOAT_LISTS else pa.int64()
        return pa.list_(pa.list_(inner))
    if how == "scalar":
        return pa.float64() if field in FLOAT_LISTS else pa.int64()
    if how == "list":
        return pa.list_(pa.float64())
    if field in ("prompt_ids", "completion_ids", "completion_mask", *FLOAT_LISTS):
        return LIST_TYPES[how]
    return SCALAR_ARROW[how]


def _column(values: list[Any], field: str, how: str) -> pa.Array:
    """The column as asked for; when the values do not fit that type (a negative id in uint64, a
    float in int64, NaN in int64...), the type Arrow infers, and strings as a last resort."""
    cells = [_cell(v, how) for v in values]
    try:
        if how == "dictionary":
            return pa.array([None if c is None else str(c) for c in cells]).dictionary_encode()
        return pa.array(cells, type=_arrow_type(field, how))
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        pass
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return pa.array([json.dumps(v, allow_nan=True) for v in values])


@st.composite
def rows_and_columns(draw) -> tuple[int, int | None, pa.Table]:
    """A table of rollouts: valid rows with hostile edits, each field stored in a drawn type."""
    vocab = draw(VOCABS)
    num_rows = draw(st.integers(0, 6))
    ids = st.integers(0, vocab - 1)
    advantage_kind = draw(st.sampled_from(ADVANTAGE_KINDS))
    optional = draw(st.sets(st.sampled_from(["group_id", "completion_mask", "temperature", "ref_logprobs"])))
    logprobs = st.floats(min_value=-3.4028234663852886e38, max_value=0.0, width=32)
    finite = st.floats(-1e6, 1e6)
    rows = []
    for _ in range(num_rows):
        length = draw(st.integers(1, 4))
        row = {
            "prompt_ids": draw(st.lists(ids, min_size=1, max_size=4)),
            "completion_ids": draw(st.lists(ids, min_size=length, max_size=length)),
            "old_logprobs": draw(st.lists(logprobs, min_size=length, max_size=length)),
        }
        row |= advantage_fields(draw, advantage_kind, finite, length)
        if "group_id" in optional:
            row["group_id"] = draw(TEXT | st.integers(0, 2**63 - 1))
        if "completion_mask" in optional:
            row["completion_mask"] = draw(st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length))
        if "temperature" in optional:
            row["temperature"] = draw(st.floats(0.1, 2.0))
        if "ref_logprobs" in optional:
            row["ref_logprobs"] = draw(st.lists(logprobs, min_size=length, max_size=length))
        for _ in range(draw(st.integers(0, 2))):  # hostile edits that keep the column's type
            field = draw(st.sampled_from(sorted(COLUMN_TYPES)))
            value = row.get(field)
            edit = draw(st.sampled_from(["null", "element", "drop", "add", "empty", "bad"]))
            if edit == "null":
                row[field] = None
            elif isinstance(value, list) and edit == "element" and value:
                value[draw(st.integers(0, len(value) - 1))] = draw(
                    st.sampled_from([None, -1, vocab, vocab + 7, 2, 0.5, float("nan"), float("-inf"), *FLOAT32_EDGES])
                )
            elif isinstance(value, list) and edit == "drop" and value:
                value.pop()
            elif isinstance(value, list) and edit == "add":
                value.append(value[-1] if value else 0)
            elif isinstance(value, list) and edit == "empty":
                row[field] = []
            elif edit == "bad":
                row[field] = draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -(2**63), 2**63 - 1,
                                                   *FLOAT32_EDGES]))
        rows.append(row)

    names = [field for field in COLUMN_TYPES if any(field in row for row in rows)]
    # Every field in its natural type (the first listed), or each one in a drawn type.
    clean = draw(st.sampled_from([True, True, False]))
    arrays = []
    for field in names:
        how = COLUMN_TYPES[field][0] if clean else draw(st.sampled_from(COLUMN_TYPES[field]))
        arrays.append(_column([row.get(field) for row in rows], field, how))
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(sorted(EXTRA_COLUMNS)))
        arrow_type, cells = EXTRA_COLUMNS[kind]
        names.append(f"extra_{kind}_{len(names)}")
        values = draw(st.lists(st.none() | cells, min_size=num_rows, max_size=num_rows))
        arrays.append(pa.array(values, type=arrow_type))
    if not clean and draw(st.booleans()) and names:  # a rollout field replaced by a bookkeeping type
        at = draw(st.integers(0, len(names) - 1))
        arrow_type, cells = EXTRA_COLUMNS[draw(st.sampled_from(sorted(EXTRA_COLUMNS)))]
        arrays[at] = pa.array(draw(st.lists(cells, min_size=num_rows, max_size=num_rows)), type=arrow_type)
    if draw(st.integers(0, 19)) == 13 and names:  # a column given twice: which value would a row hold?
        at = draw(st.integers(0, len(names) - 1))
        names.append(names[at])
        arrays.append(arrays[at] if draw(st.booleans()) else pa.nulls(num_rows, arrays[at].type))
    table = pa.Table.from_arrays(arrays, names=names) if names else pa.table({})
    return vocab, draw(MAX_TOKENS), table


def expect_table(table: pa.Table, path: Path, vocab: int, max_tokens: int | None) -> dict[str, Expected]:
    """``{source: Expected}`` per row, from the table in memory (before Parquet saw it)."""
    expected = {}
    for i in range(table.num_rows):
        record, broken = {}, None
        for name in table.column_names:
            try:
                record[name] = table.column(name)[i].as_py()
            except (ValueError, OverflowError, pa.ArrowException):  # Python cannot hold the value
                broken = name
                break
        if broken is not None:
            expected[f"{path}:row {i}"] = Expected(False, broken)
        else:
            expected[f"{path}:row {i}"] = expect_record(record, vocab, max_tokens)
    return expected


@FUZZ
@given(rows_and_columns(), st.integers(1, 4), st.sampled_from(["none", "snappy", "zstd"]), st.booleans())
def test_parquet_wrong_column_types_are_accepted_or_rejected_row_by_row(case, row_group_size, compression, dictionary):
    vocab, max_tokens, table = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.parquet"
        try:
            pq.write_table(table, path, row_group_size=row_group_size, compression=compression,
                           use_dictionary=dictionary)
        except pa.ArrowNotImplementedError:  # pyarrow cannot store this mix of column types: no file to read
            assume(False)
        if len(set(table.column_names)) < len(table.column_names):
            with pytest.raises(DataError, match="appears more than once"):
                collect_rollouts([path], vocab_size=vocab)
            expected = {}
        else:
            expected = expect_table(table, path, vocab, max_tokens)
        check_load(path, expected, vocab=vocab, max_tokens=max_tokens, workdir=Path(tmp))


def _valid_parquet_bytes() -> bytes:
    rows = [
        {"prompt_ids": [1, 2, i % 7], "completion_ids": [3, i % 5], "old_logprobs": [-0.5, -1.5],
         "reward": float(i), "group_id": f"g{i // 4}"}
        for i in range(24)
    ]  # fmt: skip
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer, row_group_size=5, compression="none")
    return buffer.getvalue()


VALID = _valid_parquet_bytes()


@st.composite
def damaged_parquet(draw) -> bytes:
    kind = draw(st.sampled_from(["empty", "garbage", "magic", "truncated", "flipped", "flipped", "appended"]))
    if kind == "empty":
        return b""
    if kind == "garbage":  # not Parquet at all, e.g. JSON Lines with the wrong suffix
        return draw(st.binary(max_size=300) | st.just(b'{"prompt_ids": [1]}\n'))
    if kind == "magic":
        return b"PAR1" + draw(st.binary(max_size=300)) + b"PAR1"
    if kind == "truncated":
        return VALID[: draw(st.integers(0, len(VALID) - 1))]
    if kind == "appended":
        return VALID + draw(st.binary(min_size=1, max_size=50))
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 6))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@settings(FUZZ, max_examples=200)
@given(damaged_parquet())
def test_damaged_parquet_is_a_data_error_or_read_row_by_row(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.parquet"
        path.write_bytes(data)
        try:
            num_rows = pq.ParquetFile(path).metadata.num_rows
        except Exception:  # unreadable here too: the reader must say so with a DataError
            num_rows = None
        rollouts, rejections = check_load(path, None, vocab=50, max_tokens=None, workdir=Path(tmp))
        if rollouts or rejections:
            # Every row the file declares is accounted for, once.
            rows = sorted(int(r.source.rsplit(" ", 1)[1]) for r in [*rollouts, *rejections])
            assert rows == list(range(num_rows))
