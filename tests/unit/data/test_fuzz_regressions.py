"""The hostile inputs the fuzz tests found problems with, one explicit case each (issue 7, item 5).

Before the fixes in rlcli/data/readers.py these crashed with something other than DataError
(RecursionError, ValueError, OverflowError, UnicodeDecodeError) or accepted a record that
silently lost a value (a key or column given twice, bytes that are not UTF-8).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rollout_oracle import check_load, check_rejections_file, expect_json_lines

from rlcli.data.readers import DataError, Rejection, collect_rollouts, load_rollouts, write_rejections

VOCAB = 50
GOOD = {"prompt_ids": [1, 2], "completion_ids": [3], "old_logprobs": [-0.5], "reward": 1.0, "group_id": "g"}


def good_line(**overrides) -> bytes:
    return json.dumps({**GOOD, **overrides}, allow_nan=True).encode()


def jsonl(tmp_path: Path, *lines: bytes) -> Path:
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def skip_load(path: Path):
    return load_rollouts([str(path)], vocab_size=VOCAB, on_invalid="skip")


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep_array"),
        pytest.param(b'{"a":' * 5_000 + b"0" + b"}" * 5_000, id="deep_object"),
        pytest.param(b"[" * 200_000, id="deep_unclosed"),
        pytest.param(good_line()[:-1] + b', "extra": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", id="deep_extra_field"),
        pytest.param(b'{"prompt_ids": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", id="deep_ids"),
    ],
)
def test_deeply_nested_line_is_rejected_not_a_recursion_error(tmp_path, line):
    path = jsonl(tmp_path, good_line(), line)
    rollouts, rejections = skip_load(path)
    assert [r.source for r in rollouts] == [f"{path}:1"]
    assert [str(r) for r in rejections] == [f"{path}:2: invalid JSON: nested deeper than 100 levels"]
    with pytest.raises(DataError, match=r"rollouts\.jsonl:2: invalid JSON: nested deeper than 100 levels"):
        load_rollouts([str(path)], vocab_size=VOCAB)


def test_nesting_depth_decides_not_the_callers_stack(tmp_path):
    """Near json's own limit (the recursion limit) a line parsed or not depending on how deep the
    caller's stack was: collect_rollouts and load_rollouts disagreed about the same file."""
    depths = [*range(95, 105), *range(900, 1010, 3)]
    lines = [good_line()[:-1] + b', "extra": ' + b"[" * d + b"]" * d + b"}" for d in depths]
    path = jsonl(tmp_path, *lines)
    data = path.read_bytes()
    rollouts, rejections = check_load(
        path, expect_json_lines(data, path, VOCAB, None), vocab=VOCAB, max_tokens=None, workdir=tmp_path
    )
    # The record is one level, its extra field d more: 100 levels at most.
    assert [r.source for r in rollouts] == [f"{path}:{i}" for i, d in enumerate(depths, 1) if d + 1 <= 100]
    assert {r.reason for r in rejections} == {"invalid JSON: nested deeper than 100 levels"}
    assert len(rollouts) + len(rejections) == len(lines)


@pytest.mark.parametrize(
    "field, literal",
    [
        ("reward", b"1" * 5_000),
        ("reward", b"-" + b"9" * 4_400),
        ("prompt_ids", b"[" + b"7" * 4_301 + b"]"),
        ("group_id", b"1" * 10_000),
    ],
)
def test_int_beyond_pythons_digit_limit_is_rejected_not_a_value_error(tmp_path, field, literal):
    path = jsonl(tmp_path, good_line(), good_line(**{field: "@@"}).replace(b'"@@"', literal))
    rollouts, rejections = skip_load(path)
    assert len(rollouts) == 1
    assert len(rejections) == 1 and rejections[0].source == f"{path}:2"
    assert rejections[0].reason.startswith("invalid JSON: ") and "digits" in rejections[0].reason


@pytest.mark.parametrize(
    "field, literal, accepted",
    [
        ("prompt_ids", b"[" + b"1" * 400 + b"]", False),  # 10**400-ish id: outside any vocabulary
        ("prompt_ids", b"[-" + b"1" * 400 + b"]", False),
        ("old_logprobs", b"[-" + b"1" * 400 + b"]", False),  # too large for a float: not finite
        ("old_logprobs", b"[-1e400]", False),
        ("old_logprobs", b"[-0.0]", True),
        ("old_logprobs", b"[-0]", True),
        ("old_logprobs", b"[NaN]", False),
        ("old_logprobs", b"[-Infinity]", False),
        ("advantage", b"1e400", False),
        ("advantage", b"-1E-400", True),  # underflows to -0.0: finite
        ("reward", b"Infinity", False),
        ("reward", b"NaN", False),
        ("temperature", b"NaN", False),
        ("temperature", b"1e400", False),
        ("group_id", b"1" + b"0" * 400, True),  # an int, however large, is a group id
        ("group_id", b"1e400", False),
        ("group_id", b"NaN", False),
    ],
)
def test_huge_and_non_finite_numbers(tmp_path, field, literal, accepted):
    path = jsonl(tmp_path, good_line(), good_line(**{field: "@@"}).replace(b'"@@"', literal))
    rollouts, rejections = skip_load(path)
    assert [r.source for r in rollouts][1:] == ([f"{path}:2"] if accepted else [])
    if not accepted:
        assert [(r.source, r.field) for r in rejections] == [(f"{path}:2", field)]
    for rollout in rollouts:
        assert all(math.isfinite(v) and v <= 0 for v in rollout.old_logprobs)
    check_rejections_file(rejections, tmp_path / "rejected.jsonl")


@pytest.mark.parametrize(
    "raw",
    [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xff", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xe2\x82"],
    ids=["surrogate_d800", "surrogate_dfff", "ff", "overlong", "past_10ffff", "cut_short"],
)
def test_bytes_that_are_not_utf8_reject_the_line(tmp_path, raw):
    # json.loads(bytes) decodes with 'surrogatepass': an encoded surrogate used to become a group id.
    path = jsonl(tmp_path, good_line(), good_line(group_id="@@").replace(b"@@", raw))
    rollouts, rejections = skip_load(path)
    assert [r.source for r in rollouts] == [f"{path}:1"]
    assert len(rejections) == 1 and rejections[0].source == f"{path}:2"
    assert rejections[0].reason.startswith("invalid JSON: not UTF-8")


def test_escaped_surrogate_byte_order_mark_and_odd_unicode_are_fine(tmp_path):
    odd = ["\ud800", "\u202eevil\u202c", "zero\u200bwidth", "👩‍👩‍👧", "\x00", "\u2028", ""]
    lines = [b"\xef\xbb\xbf" + good_line(group_id="bom")]  # a byte-order mark (first line of Windows files)
    lines += [good_line(group_id=g, **{g or "empty": g}) for g in odd]  # as group id, as extra key and value
    path = jsonl(tmp_path, *lines)
    rollouts, rejections = skip_load(path)
    assert not rejections
    assert [r.group_id for r in rollouts] == ["bom", *odd]
    as_rejections = [Rejection(r.source, "group_id", "test", {"group_id": r.group_id}) for r in rollouts]
    check_rejections_file(as_rejections, tmp_path / "rejected.jsonl")


@pytest.mark.parametrize("key", ["prompt_ids", "reward", "group_id", "sampler_note"])
def test_key_given_twice_is_rejected_not_last_one_wins(tmp_path, key):
    line = good_line(sampler_note="x")[:-1] + f', "{key}": {json.dumps(GOOD.get(key, "y"))}}}'.encode()
    path = jsonl(tmp_path, good_line(), line)
    rollouts, rejections = skip_load(path)
    assert len(rollouts) == 1
    assert [str(r) for r in rejections] == [f"{path}:2: invalid JSON: key '{key}' is given more than once"]


def test_write_rejections_of_a_deeply_nested_record(tmp_path):
    # dataclasses.asdict deep-copied the record and hit the recursion limit at ~300 levels.
    nested = b"[" * 98 + b"]" * 98  # the deepest prompt_ids a JSON line may hold
    path = jsonl(tmp_path, good_line(), good_line(prompt_ids="@@").replace(b'"@@"', b"[" + nested + b"]"))
    rollouts, rejections = skip_load(path)
    assert len(rollouts) == 1 and [r.field for r in rejections] == ["prompt_ids"]
    check_rejections_file(rejections, tmp_path / "run" / "rejected.jsonl")

    deeper: list = []
    for _ in range(100_000):  # deeper than json can write: the line says so and keeps the rest
        deeper = [deeper]
    out = tmp_path / "deeper.jsonl"
    write_rejections([Rejection("a.jsonl:3", "prompt_ids", "why", {"prompt_ids": deeper})], out)
    entry = json.loads(out.read_text(encoding="utf-8"))
    assert (entry["source"], entry["field"], entry["reason"]) == ("a.jsonl:3", "prompt_ids", "why")
    assert entry["record"].startswith("<record not written: RecursionError")


# --- Parquet -----------------------------------------------------------------------------------


def parquet(tmp_path: Path, table: pa.Table, **options) -> Path:
    path = tmp_path / "rollouts.parquet"
    pq.write_table(table, path, **options)
    return path


def good_table(n: int = 3, **columns) -> pa.Table:
    data = {key: [value] * n for key, value in GOOD.items()}
    data.update(columns)
    return pa.table(data)


def test_parquet_column_given_twice_is_a_data_error(tmp_path):
    # The row dict kept only the last column: prompt_ids [49] was trained on, [1, 2] silently gone.
    table = good_table(2)
    table = table.append_column("prompt_ids", pa.array([[49], [49]]))
    path = parquet(tmp_path, table)
    with pytest.raises(DataError, match=r"rollouts\.parquet: column 'prompt_ids' appears more than once"):
        skip_load(path)


@pytest.mark.parametrize(
    "column, arrow_type",
    [
        (pa.array([2**31 - 1, 0, None], pa.date32()), "date32"),  # past year 9999
        (pa.array([2**62, 1, None], pa.duration("s")), "duration"),  # more days than timedelta holds
    ],
    ids=["date32", "duration"],
)
def test_parquet_value_python_cannot_hold_rejects_its_row(tmp_path, column, arrow_type):
    path = parquet(tmp_path, good_table(3).append_column("sampled_at", column), row_group_size=2)
    rollouts, rejections = skip_load(path)
    assert [r.source for r in rollouts] == [f"{path}:row 1", f"{path}:row 2"]
    assert [(r.source, r.field) for r in rejections] == [(f"{path}:row 0", "sampled_at")]
    assert rejections[0].reason.startswith("cannot be read as a Python value")
    with pytest.raises(DataError, match=r"rollouts\.parquet:row 0: field 'sampled_at': cannot be read"):
        load_rollouts([str(path)], vocab_size=VOCAB)


def test_parquet_nanosecond_timestamp_column_never_escapes(tmp_path):
    # Without pandas, a timestamp with nanoseconds cannot become a datetime: its row is rejected.
    stamps = pa.array([1_700_000_000_123_456_789, 1_700_000_000_123_456_000, None], pa.timestamp("ns"))
    path = parquet(tmp_path, good_table(3).append_column("sampled_at", stamps))
    rollouts, rejections = skip_load(path)
    assert {r.source for r in rollouts} >= {f"{path}:row 1", f"{path}:row 2"}
    assert len(rollouts) + len(rejections) == 3
    assert all(r.field == "sampled_at" for r in rejections)


def _parquet_bytes(**options) -> bytes:
    rows = [{**GOOD, "group_id": group, "zz_col": 1} for group in ("QQQQQQQQ", "g1")]
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer, compression="none", **options)
    return buffer.getvalue()


def test_parquet_string_that_is_not_utf8_rejects_its_row(tmp_path):
    data = _parquet_bytes(use_dictionary=False, write_statistics=False)
    path = tmp_path / "rollouts.parquet"
    path.write_bytes(data.replace(b"QQQQQQQQ", b"Q\xff\xfeQQQQQ"))
    rollouts, rejections = skip_load(path)
    assert [r.group_id for r in rollouts] == ["g1"]
    assert [(r.source, r.field) for r in rejections] == [(f"{path}:row 0", "group_id")]


def test_parquet_column_name_that_is_not_utf8_is_a_data_error(tmp_path):
    data = _parquet_bytes()
    path = tmp_path / "rollouts.parquet"
    path.write_bytes(data.replace(b"zz_col", b"\xff\xfe_col"))
    with pytest.raises(DataError, match=r"rollouts\.parquet: cannot read Parquet file"):
        skip_load(path)


@pytest.mark.parametrize(
    "data",
    [b"", b"PAR1", b"PAR1PAR1", b'{"prompt_ids": [1]}\n', b"\x00" * 100, _parquet_bytes()[:-1], _parquet_bytes()[:100]],
    ids=["empty", "magic_only", "two_magics", "jsonl_inside", "zeros", "last_byte_cut", "first_100_bytes"],
)
def test_file_that_is_not_parquet_is_a_data_error_naming_it(tmp_path, data):
    path = tmp_path / "rollouts.parquet"
    path.write_bytes(data)
    for mode in ("skip", "error"):
        with pytest.raises(DataError, match=r"rollouts\.parquet: cannot read Parquet file"):
            load_rollouts([str(path)], vocab_size=VOCAB, on_invalid=mode)
    with pytest.raises(DataError):
        collect_rollouts([path], vocab_size=VOCAB)
