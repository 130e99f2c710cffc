"""An independent reading of rollout-record.md for the fuzz tests, and the checks every load must pass.

Nothing here calls ``rlcli.data.schema``: the rules are written again from the rollout-record reference table (plus
the choices the readers document: ``null`` counts as absent, extra fields are ignored, a
``completion_mask`` may hold booleans, ``temperature`` must be > 0, token ids must be ints,
not floats, the optional ``ref_logprobs`` follow the ``old_logprobs`` rules, and log-probs and
advantages must lie in the float32 range, the dtype they are trained in), so that a rule the code
forgets shows up as a record accepted here and there not.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from rlcli.data.readers import MAX_JSON_DEPTH, DataError, collect_rollouts, load_rollouts, write_rejections
from rlcli.data.schema import Rollout

_BLANK = re.compile(rb"[ \t\n\r\x0b\x0c]*")  # what bytes.strip() removes
_BOM = b"\xef\xbb\xbf"
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Expected:
    """What must happen to one record: accepted (``valid``) or rejected naming ``field``.

    ``field`` is ``None`` for a line that is not a JSON object, ``...`` where any field will do.
    ``raw`` is the parsed record when there is one.
    """

    valid: bool
    field: Any = ...
    raw: Any = None


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_finite(value: Any) -> bool:
    if type(value) not in (int, float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range
        return False


def _id_list(value: Any, vocab: int) -> bool:
    return type(value) is list and len(value) >= 1 and all(_is_int(t) and 0 <= t < vocab for t in value)


def _in_float32(value: Any) -> bool:
    """A number whose float (how every number is read) lies in the float32 range: log-probs and
    advantages are trained in float32."""
    return _is_finite(value) and abs(float(value)) <= _FLOAT32_MAX


def _float32_list(value: Any, length: int) -> bool:
    return type(value) is list and len(value) == length and all(_in_float32(v) for v in value)


def _logprob_list(value: Any, length: int) -> bool:
    return _float32_list(value, length) and all(v <= 0 for v in value)


def spec_problem(record: Any, vocab: int, max_tokens: int | None = None) -> str | None:
    """The field of the first rollout-record.md rule ``record`` breaks (in table order), ``None`` if it is valid."""
    if not isinstance(record, dict):
        return "<not an object>"
    get = record.get
    for field in ("prompt_ids", "completion_ids"):
        if not _id_list(get(field), vocab):
            return field
    length = len(get("completion_ids"))
    if not _logprob_list(get("old_logprobs"), length):
        return "old_logprobs"
    scalar, per_token = get("advantage"), get("advantages")
    if scalar is not None and per_token is not None:
        return "advantage"
    if scalar is not None and not _in_float32(scalar):
        return "advantage"
    if per_token is not None and not _float32_list(per_token, length):
        return "advantages"
    reward = get("reward")
    if reward is not None and not _is_finite(reward):
        return "reward"
    if scalar is None and per_token is None and reward is None:
        return "reward"
    group = get("group_id")
    if group is not None and not (type(group) is str or _is_int(group)):
        return "group_id"
    mask = get("completion_mask")
    if mask is not None and not (
        type(mask) is list and len(mask) == length and all(type(m) in (int, bool) and m in (0, 1) for m in mask)
    ):
        return "completion_mask"
    temperature = get("temperature")
    if temperature is not None and not (_is_finite(temperature) and temperature > 0):
        return "temperature"
    ref_logprobs = get("ref_logprobs")
    if ref_logprobs is not None and not _logprob_list(ref_logprobs, length):
        return "ref_logprobs"
    if max_tokens is not None and len(get("prompt_ids")) + length > max_tokens:
        return "completion_ids"
    return None


def expect_record(record: Any, vocab: int, max_tokens: int | None) -> Expected:
    problem = spec_problem(record, vocab, max_tokens)
    return Expected(problem is None, problem, record)


ADVANTAGE_KINDS = ("advantage", "advantages", "reward", "both")


def advantage_fields(draw, kind: str, finite, length: int) -> dict:
    """The advantage/reward fields of a fuzzed record of ``kind`` (one of ``ADVANTAGE_KINDS``;
    "both" gives a scalar advantage and a reward), values drawn from ``finite``."""
    fields = {}
    if kind in ("advantage", "both"):
        fields["advantage"] = draw(finite)
    if kind == "advantages":
        fields["advantages"] = draw(st.lists(finite, min_size=length, max_size=length))
    if kind in ("reward", "both"):
        fields["reward"] = draw(finite)
    return fields


def _depth(value: Any) -> int:
    """Nesting depth of lists and dicts, counted level by level (breadth first, no recursion)."""
    depth, level = 0, [value]
    while containers := [v for v in level if isinstance(v, (list, dict))]:
        depth += 1
        level = [child for v in containers for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key given twice")
    return dict(pairs)


def expect_json_lines(data: bytes, path: Path, vocab: int, max_tokens: int | None) -> dict[str, Expected]:
    """``{source: Expected}`` for every record line of a JSON Lines file holding ``data``.

    A record line is any line (split at ``\\n``) with something other than ASCII whitespace. It is
    a record when it is UTF-8 (a leading byte-order mark allowed) holding one JSON object whose
    keys are all different, nested at most ``MAX_JSON_DEPTH`` levels; then rollout-record.md decides.
    """
    expected = {}
    for number, line in enumerate(data.split(b"\n"), start=1):
        if _BLANK.fullmatch(line):
            continue
        source = f"{path}:{number}"
        try:
            text = (line[len(_BOM) :] if line.startswith(_BOM) else line).decode("utf-8")
            value = json.loads(text, object_pairs_hook=_unique)
        except (ValueError, RecursionError):
            expected[source] = Expected(False, None)
            continue
        if not isinstance(value, dict) or _depth(value) > MAX_JSON_DEPTH:
            expected[source] = Expected(False, None)
        else:
            expected[source] = expect_record(value, vocab, max_tokens)
    return expected


def check_rollout(rollout: Rollout, vocab: int, max_tokens: int | None) -> None:
    """An accepted document satisfies rollout-record.md, read off the ``Rollout`` itself."""
    length = len(rollout.completion_ids)
    for ids in (rollout.prompt_ids, rollout.completion_ids):
        assert type(ids) is tuple and len(ids) >= 1
        assert all(type(t) is int and 0 <= t < vocab for t in ids), ids
    for logprobs in (rollout.old_logprobs, *([] if rollout.ref_logprobs is None else [rollout.ref_logprobs])):
        assert len(logprobs) == length
        assert all(type(v) is float and _in_float32(v) and v <= 0 for v in logprobs)
    if rollout.advantages is None:
        assert type(rollout.reward) is float and math.isfinite(rollout.reward)
    else:
        assert len(rollout.advantages) == length
        assert all(type(v) is float and _in_float32(v) for v in rollout.advantages)
    assert rollout.reward is None or (type(rollout.reward) is float and math.isfinite(rollout.reward))
    assert rollout.group_id is None or type(rollout.group_id) in (str, int)
    assert len(rollout.completion_mask) == length and all(
        type(m) is int and m in (0, 1) for m in rollout.completion_mask
    )
    t = rollout.temperature
    assert t is None or (type(t) is float and math.isfinite(t) and t > 0)
    if max_tokens is not None:
        assert rollout.num_tokens <= max_tokens


def check_matches_record(rollout: Rollout, raw: dict[str, Any]) -> None:
    """Nothing truncated or changed: the document holds exactly the values of its record."""
    assert rollout.prompt_ids == tuple(raw["prompt_ids"])
    assert rollout.completion_ids == tuple(raw["completion_ids"])
    length = len(rollout.completion_ids)
    assert rollout.old_logprobs == tuple(float(v) for v in raw["old_logprobs"])
    ref_logprobs = raw.get("ref_logprobs")
    assert rollout.ref_logprobs == (None if ref_logprobs is None else tuple(float(v) for v in ref_logprobs))
    if raw.get("advantage") is not None:
        assert rollout.advantages == (float(raw["advantage"]),) * length
    elif raw.get("advantages") is not None:
        assert rollout.advantages == tuple(float(v) for v in raw["advantages"])
    else:
        assert rollout.advantages is None
    assert rollout.reward == (None if raw.get("reward") is None else float(raw["reward"]))
    group = raw.get("group_id")
    assert rollout.group_id == group and type(rollout.group_id) is type(group)
    mask = raw.get("completion_mask")
    assert rollout.completion_mask == ((1,) * length if mask is None else tuple(int(m) for m in mask))
    assert rollout.temperature == (None if raw.get("temperature") is None else float(raw["temperature"]))


def check_rejections_file(rejections: list, out: Path) -> None:
    """``write_rejections`` never fails and writes one JSON line per rejection."""
    write_rejections(rejections, out)
    text = out.read_text(encoding="utf-8")
    lines = text.split("\n")
    assert lines[-1] == ""  # every line ends with a newline, the file with one
    lines = lines[:-1]
    assert len(lines) == len(rejections)
    for line, rejection in zip(lines, rejections):
        entry = json.loads(line)
        assert set(entry) == {"source", "field", "reason", "record"}
        assert (entry["source"], entry["field"], entry["reason"]) == (
            rejection.source,
            rejection.field,
            rejection.reason,
        )


def check_load(
    path: Path,
    expected: dict[str, Expected] | None,
    *,
    vocab: int,
    max_tokens: int | None,
    workdir: Path,
) -> tuple[list[Rollout], list]:
    """Every property of the brief for one rollout file.

    ``expected`` maps each record's source to its verdict; ``None`` when the test cannot know
    the records (a damaged file), then only the record rules are checked.
    Returns the accepted documents and the rejections (both empty when the file is unreadable).
    """
    # 1. Reading never fails with anything but DataError (a clean user error naming the file).
    try:
        rollouts, rejections = collect_rollouts([path], vocab_size=vocab, max_tokens=max_tokens)
    except DataError as err:
        assert str(path) in str(err)
        assert expected is None or not expected, "a readable file was refused"
        for mode in ("skip", "error"):
            try:
                load_rollouts([str(path)], vocab_size=vocab, max_tokens=max_tokens, on_invalid=mode)
            except DataError as again:
                assert str(path) in str(again)
            else:
                raise AssertionError(f"on_invalid={mode} loaded a file that cannot be read")
        return [], []

    # 2. Every record is accepted or rejected, once, in file order; nothing else appears.
    accepted = [r.source for r in rollouts]
    rejected = [r.source for r in rejections]
    assert len(set(accepted)) == len(accepted) and len(set(rejected)) == len(rejected)
    assert not set(accepted) & set(rejected)
    assert [r.index for r in rollouts] == list(range(len(rollouts)))
    if expected is not None:
        assert set(accepted) | set(rejected) == set(expected)
        order = {source: i for i, source in enumerate(expected)}
        assert accepted == sorted(accepted, key=order.__getitem__)
        assert rejected == sorted(rejected, key=order.__getitem__)

    # 3. An accepted document satisfies rollout-record.md and equals its record; a rejected one breaks a rule.
    for rollout in rollouts:
        check_rollout(rollout, vocab, max_tokens)
        if expected is not None:
            verdict = expected[rollout.source]
            assert verdict.valid, f"accepted {rollout.source} breaking {verdict.field!r}: {verdict.raw!r}"
            check_matches_record(rollout, verdict.raw)
    for rejection in rejections:
        assert rejection.reason
        assert str(rejection).startswith(rejection.source + ": ")
        if expected is not None:
            verdict = expected[rejection.source]
            assert not verdict.valid, f"rejected valid {rejection.source}: {rejection}"
            if verdict.field is not ...:
                assert rejection.field == verdict.field, (str(rejection), verdict.field)

    # 4. write_rejections of whatever was rejected.
    check_rejections_file(rejections, workdir / "run" / "rejected.jsonl")

    # 5. on_invalid=skip returns the same, or DataError when nothing is valid.
    try:
        skipped, skip_rejections = load_rollouts(
            [str(path)], vocab_size=vocab, max_tokens=max_tokens, on_invalid="skip"
        )
    except DataError as err:
        assert not rollouts, f"skip refused a file with {len(rollouts)} valid documents: {err}"
        assert str(path) in str(err)
    else:
        assert skipped == rollouts
        assert [str(r) for r in skip_rejections] == [str(r) for r in rejections]

    # 6. on_invalid=error raises iff a record is invalid (or none is valid), naming file and line/row.
    try:
        loaded, _ = load_rollouts([str(path)], vocab_size=vocab, max_tokens=max_tokens, on_invalid="error")
    except DataError as err:
        message = str(err)
        assert rejections or not rollouts, f"error mode refused a clean file: {message}"
        assert str(path) in message
        if rejections:
            assert f"{rejections[0].source}: " in message  # the file and its line or row
            assert f"{len(rejections)} invalid records" in message
    else:
        assert not rejections and rollouts
        assert loaded == rollouts
    return rollouts, rejections
