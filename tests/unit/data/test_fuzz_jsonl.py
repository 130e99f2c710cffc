"""Fuzz the JSON Lines reader with hostile input (issue 7, item 5).

Every generated file is judged line by line by ``rollout_oracle`` (an independent reading of
rollout-record.md) and ``check_load`` asserts the properties: only ``DataError`` escapes, every record is
accepted or rejected exactly once, accepted documents satisfy rollout-record.md and equal their record,
``on_invalid=error`` raises iff a record is invalid and names its file and line, and
``write_rejections`` writes one JSON line per rejection.
"""

from __future__ import annotations

import json
import tempfile
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_oracle import ADVANTAGE_KINDS, advantage_fields, check_load, expect_json_lines

FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=5),  # one example takes milliseconds: this only catches a hang
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FIELDS = (
    "prompt_ids",
    "completion_ids",
    "old_logprobs",
    "advantage",
    "advantages",
    "reward",
    "group_id",
    "completion_mask",
    "temperature",
    "ref_logprobs",
)
VOCABS = st.sampled_from([1, 2, 50, 2**31 - 1])
MAX_TOKENS = st.one_of(st.none(), st.integers(1, 12))

# Right-to-left and zero-width marks, a joined emoji, a byte-order mark, NUL, a line separator.
ODD_PIECES = ["\u202e", "\u200f", "\u200b", "\u200d", "\ufeff", "\x00", "\u2028", "\u0301", "👩‍👩‍👧", "\U0010ffff"]
SURROGATES = st.characters(categories=["Cs"])
ODD_TEXT = st.lists(st.one_of(st.characters(), st.sampled_from(ODD_PIECES), SURROGATES), max_size=6).map("".join)
HUGE_INTS = st.sampled_from([10**400, -(10**400), 2**63, -(2**63) - 1, 2**64, 2 * 10**308, -(10**308)])
# The largest float32, the next float64 beyond it, and a value that is infinite as a float32.
FLOAT32_EDGES = [3.4028234663852886e38, 3.402823466385289e38, 3.4028235677973366e38, 1e39]
FLOAT32_EDGES += [-v for v in FLOAT32_EDGES]
ODD_FLOATS = st.sampled_from(
    [-0.0, 0.0, 1e308, -1e308, 5e-324, -5e-324, float("nan"), float("inf"), float("-inf"), *FLOAT32_EDGES]
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 60),
    HUGE_INTS,
    st.floats(),
    ODD_FLOATS,
    ODD_TEXT,
)
HOSTILE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=3),
    max_leaves=5,
)
LONG_LISTS = st.builds(lambda value, n: [value] * n, SCALARS, st.integers(500, 3000))

LOGPROBS = st.one_of(
    st.floats(min_value=-3.4028234663852886e38, max_value=0.0, width=32), st.integers(-50, 0), st.just(-0.0)
)


@st.composite
def valid_records(draw, vocab: int) -> dict:
    """A record rollout-record.md accepts (up to ``max_tokens``), with every optional field in play."""
    ids = st.integers(0, vocab - 1)
    length = draw(st.integers(1, 5))
    record = {
        "prompt_ids": draw(st.lists(ids, min_size=1, max_size=5)),
        "completion_ids": draw(st.lists(ids, min_size=length, max_size=length)),
        "old_logprobs": draw(st.lists(LOGPROBS, min_size=length, max_size=length)),
    }
    finite = st.floats(allow_nan=False, allow_infinity=False, width=32) | st.integers(-5, 5)
    record |= advantage_fields(draw, draw(st.sampled_from(ADVANTAGE_KINDS)), finite, length)
    if draw(st.booleans()):
        record["ref_logprobs"] = draw(st.lists(LOGPROBS, min_size=length, max_size=length))
    group = draw(st.one_of(st.none(), ODD_TEXT, st.integers(), HUGE_INTS))
    if group is not None or draw(st.booleans()):
        record["group_id"] = group
    if draw(st.booleans()):
        record["completion_mask"] = draw(
            st.lists(st.sampled_from([0, 1, True, False]), min_size=length, max_size=length)
        )
    if draw(st.booleans()):
        record["temperature"] = draw(st.floats(min_value=1e-6, max_value=10.0))
    record.update(draw(st.dictionaries(ODD_TEXT.filter(lambda k: k not in FIELDS), HOSTILE, max_size=1)))
    return record


@st.composite
def hostile_records(draw, vocab: int) -> dict:
    """A valid record with up to three hostile edits: wrong types, bad elements, lengths, deletions,
    numbers at the edge of the float32 range."""
    record = draw(valid_records(vocab))
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from((*FIELDS, "extra")))
        edit = draw(st.sampled_from(["set", "delete", "element", "length", "empty", "long", "long_valid", "edge"]))
        current = record.get(field)
        if edit == "edge":  # a number at the float32 edge, negative in a list of log-probs
            value = draw(st.sampled_from(FLOAT32_EDGES))
            value = -abs(value) if field.endswith("logprobs") else value
            if isinstance(current, list) and current:
                current[draw(st.integers(0, len(current) - 1))] = value
            else:
                record[field] = value
        elif edit == "set":
            record[field] = draw(HOSTILE)
        elif edit == "delete":
            record.pop(field, None)
        elif edit == "element" and isinstance(current, list) and current:
            current[draw(st.integers(0, len(current) - 1))] = draw(SCALARS | HOSTILE)
        elif edit == "length" and isinstance(current, list):
            if current and draw(st.booleans()):
                current.pop()
            else:
                current.append(current[0] if current else 0)
        elif edit == "empty":
            record[field] = []
        elif edit == "long":
            record[field] = draw(LONG_LISTS)
        elif edit == "long_valid":  # a very long document that is otherwise fine
            n = draw(st.integers(500, 3000))
            record.update(completion_ids=[vocab - 1] * n, old_logprobs=[-0.5] * n)
            for name in ("advantages", "completion_mask", "ref_logprobs"):
                record.pop(name, None)
    return record


def record_bytes(record: dict, ensure_ascii: bool) -> bytes:
    # Without ensure_ascii a lone surrogate goes out as its (invalid) UTF-8 encoding.
    return json.dumps(record, ensure_ascii=ensure_ascii, allow_nan=True).encode("utf-8", "surrogatepass")


# Literals a JSON writer would not produce, spliced in as a field's value.
LITERALS = [
    "NaN", "Infinity", "-Infinity", "-NaN", "1e400", "-1e400", "1E-400", "-0.0", "-0", "01", "1.", ".5", "+1",
    "0x10", "1" * 5000, "-" + "9" * 4400, "0." + "0" * 5000 + "1", "9" * 4300, "[1,]", "[1 2]", "'a'", "tru",
    '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', '"\\x41"', "[NaN]", "[-Infinity]", "[1e400]", "[" + "1" * 5000 + "]",
    "{}", "[[]]", "[" * 50 + "]" * 50, "[" * 995 + "]" * 995, "[" * 5000 + "]" * 5000, "[" * 200000,
]  # fmt: skip
# Bytes that are not UTF-8: a lone byte, an encoded surrogate, an overlong '/', past U+10FFFF, cut short.
BAD_UTF8 = [
    b"\xff",
    b"\xfe\xff",
    b"\xed\xa0\x80",
    b"\xed\xbf\xbf",
    b"\xc0\xaf",
    b"\xf4\x90\x80\x80",
    b"\xe2\x82",
    b"\x80",
]
BLANKS = [b"", b" ", b"\t", b"\r", b"\x0b", b"\x0c", b" \t\r "]


@st.composite
def hostile_lines(draw, vocab: int) -> bytes:
    """One line of a JSON Lines file (it may hold no ``\\n``, or a few)."""
    kind = draw(
        st.sampled_from(
            ["record", "record", "record", "literal", "bad_utf8", "duplicate", "truncated", "binary", "not_object",
             "blank", "bom", "utf16", "two_records", "deep"]
        )
    )  # fmt: skip
    record = draw(hostile_records(vocab))
    if kind == "record":
        return record_bytes(record, draw(st.booleans()))
    if kind == "literal":
        record[draw(st.sampled_from((*FIELDS, "extra")))] = "@@RAW@@"
        return record_bytes(record, True).replace(b'"@@RAW@@"', draw(st.sampled_from(LITERALS)).encode())
    if kind == "bad_utf8":
        record[draw(st.sampled_from(("group_id", "extra", "prompt_ids")))] = "@@RAW@@"
        return record_bytes(record, True).replace(b"@@RAW@@", draw(st.sampled_from(BAD_UTF8)))
    if kind == "duplicate":
        key = draw(st.sampled_from((*FIELDS, "extra")))
        value = json.dumps(record.get(key, [0]), allow_nan=True)
        return record_bytes(record, True)[:-1] + f', "{key}": {value}}}'.encode()
    if kind == "truncated":
        line = record_bytes(record, draw(st.booleans()))
        return line[: draw(st.integers(0, len(line) - 1))]
    if kind == "binary":
        return draw(st.binary(max_size=64))
    if kind == "not_object":
        return json.dumps(draw(HOSTILE.filter(lambda v: not isinstance(v, dict))), allow_nan=True).encode()
    if kind == "blank":
        return draw(st.sampled_from(BLANKS))
    if kind == "bom":
        return b"\xef\xbb\xbf" + record_bytes(record, True) + draw(st.sampled_from(BLANKS))
    if kind == "utf16":
        return json.dumps(record).encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))
    if kind == "two_records":
        return record_bytes(record, True) + draw(st.sampled_from([b"", b" ", b"\r"])) + record_bytes(record, True)
    depth = draw(st.one_of(st.integers(1, 300), st.sampled_from([98, 99, 100, 995, 1000, 5000, 100_000])))
    record[draw(st.sampled_from(("prompt_ids", "old_logprobs", "group_id", "extra")))] = "@@RAW@@"
    nested = (b"[" if draw(st.booleans()) else b'{"a":') * depth
    closing = b"]" * depth if nested.startswith(b"[") else b"}" * depth
    return record_bytes(record, True).replace(b'"@@RAW@@"', nested + b"0" * (not nested.startswith(b"[")) + closing)


@st.composite
def jsonl_files(draw) -> tuple[int, int | None, bytes]:
    vocab = draw(VOCABS)
    lines = draw(st.lists(hostile_lines(vocab), max_size=6))
    newline = draw(st.sampled_from([b"\n", b"\r\n"]))
    data = newline.join(lines) + (newline if draw(st.booleans()) else b"")
    return vocab, draw(MAX_TOKENS), data


@FUZZ
@given(jsonl_files())
def test_hostile_jsonl_is_accepted_or_rejected_record_by_record(case):
    vocab, max_tokens, data = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.jsonl"
        path.write_bytes(data)
        expected = expect_json_lines(data, path, vocab, max_tokens)
        check_load(path, expected, vocab=vocab, max_tokens=max_tokens, workdir=Path(tmp))


@FUZZ
@given(st.data())
def test_hostile_records_agree_with_the_spec(data):
    """Every line a JSON object: the record-level rules of rollout-record.md get all the tries."""
    vocab = data.draw(VOCABS)
    max_tokens = data.draw(MAX_TOKENS)
    records = data.draw(st.lists(hostile_records(vocab), min_size=1, max_size=6))
    payload = b"".join(record_bytes(r, True) + b"\n" for r in records)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.json"  # .json is JSON Lines too
        path.write_bytes(payload)
        expected = expect_json_lines(payload, path, vocab, max_tokens)
        assert len(expected) == len(records)
        check_load(path, expected, vocab=vocab, max_tokens=max_tokens, workdir=Path(tmp))


@settings(FUZZ, max_examples=100)
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_never_escape_as_anything_but_data_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "garbage.jsonl"
        path.write_bytes(data)
        check_load(path, expect_json_lines(data, path, 50, None), vocab=50, max_tokens=None, workdir=Path(tmp))
