"""Reading rollout files: every rollout-record.md rule, error and skip modes, rejections, paths, temperature."""

import json
import math
from pathlib import Path

import pytest

from rlcli.data.readers import (
    DataError,
    Rejection,
    check_temperature,
    expand_paths,
    load_rollouts,
    read_records,
    write_rejections,
)
from rlcli.data.schema import RecordError, validate_record

VOCAB = 50

# (id, fields to drop, fields to set, field named in the error, words of the reason, Parquet can hold it)
RULES = [
    ("prompt_missing", ("prompt_ids",), {}, "prompt_ids", "missing", True),
    ("prompt_not_list", (), {"prompt_ids": "1 2 3"}, "prompt_ids", "expected a list", True),
    ("prompt_empty", (), {"prompt_ids": []}, "prompt_ids", "empty", True),
    ("prompt_bool", (), {"prompt_ids": [1, True]}, "prompt_ids", "element 1 is True (a boolean)", False),
    ("prompt_float", (), {"prompt_ids": [1.0, 3.0]}, "prompt_ids", "element 0 is 1.0 (a float)", True),
    ("prompt_out_of_vocab", (), {"prompt_ids": [1, 50]}, "prompt_ids",
     "element 1 is 50, outside the vocabulary [0, 50)", True),
    ("prompt_negative", (), {"prompt_ids": [-1, 2]}, "prompt_ids", "element 0 is -1, token ids must be >= 0", True),
    ("completion_missing", ("completion_ids",), {}, "completion_ids", "missing", True),
    ("completion_null", (), {"completion_ids": None}, "completion_ids", "null", False),
    ("completion_empty", (), {"completion_ids": [], "old_logprobs": []}, "completion_ids", "empty", True),
    ("completion_out_of_vocab", (), {"completion_ids": [4, 99]}, "completion_ids", "99, outside", True),
    ("logprobs_missing", ("old_logprobs",), {}, "old_logprobs", "missing", True),
    ("logprobs_length", (), {"old_logprobs": [-1.0]}, "old_logprobs", "has 1 values but completion_ids has 2", True),
    ("logprobs_positive", (), {"old_logprobs": [-1.0, 0.5]}, "old_logprobs", "element 1 is 0.5", True),
    ("logprobs_nan", (), {"old_logprobs": [float("nan"), -1.0]}, "old_logprobs", "finite", True),
    ("logprobs_inf", (), {"old_logprobs": [-1.0, float("-inf")]}, "old_logprobs", "finite", True),
    ("logprobs_string", (), {"old_logprobs": ["-1", "-2"]}, "old_logprobs", "'-1' (a string)", True),
    ("logprobs_beyond_float32", (), {"old_logprobs": [-1.0, -1e39]}, "old_logprobs",
     "element 1 is -1e+39, outside the float32 range ±3.4028234663852886e+38 that training computes in", True),
    ("ref_logprobs_beyond_float32", (), {"ref_logprobs": [-3.5e38, -1.0]}, "ref_logprobs",
     "element 0 is -3.5e+38, outside the float32 range", True),
    ("advantage_and_advantages", (), {"advantage": 1.0, "advantages": [1.0, 2.0]}, "advantage", "both", True),
    ("advantage_nan", (), {"advantage": float("nan")}, "advantage", "finite", True),
    ("advantage_list", (), {"advantage": [1.0, 2.0]}, "advantage", "expected a finite number", True),
    ("advantages_length", (), {"advantages": [1.0, 2.0, 3.0]}, "advantages", "has 3 values", True),
    ("advantages_scalar", (), {"advantages": 1.0}, "advantages", "expected a list", True),
    ("advantage_beyond_float32", (), {"advantage": 1e39}, "advantage", "value is 1e+39, outside the float32 range",
     True),
    ("advantages_beyond_float32", (), {"advantages": [0.0, -1e300]}, "advantages",
     "element 1 is -1e+300, outside the float32 range", True),
    ("no_reward_no_advantage", ("reward",), {}, "reward", "'advantage', 'advantages' or 'reward'", True),
    ("reward_string", (), {"reward": "1.0"}, "reward", "expected a finite number", True),
    ("reward_inf", (), {"reward": float("inf")}, "reward", "finite", True),
    ("group_id_float", (), {"group_id": 1.5}, "group_id", "string or an int", True),
    ("group_id_bool", (), {"group_id": True}, "group_id", "string or an int", True),
    ("mask_value", (), {"completion_mask": [1, 2]}, "completion_mask", "element 1 is 2 (an int), expected 0 or 1",
     True),
    ("mask_fraction", (), {"completion_mask": [0.5, 1.0]}, "completion_mask", "expected 0 or 1", True),
    ("mask_float", (), {"completion_mask": [1.0, 0.0]}, "completion_mask", "element 0 is 1.0 (a float)", True),
    ("mask_length", (), {"completion_mask": [1]}, "completion_mask", "has 1 values", True),
    ("temperature_zero", (), {"temperature": 0.0}, "temperature", "must be > 0", True),
    ("temperature_negative", (), {"temperature": -1.0}, "temperature", "must be > 0", True),
    ("temperature_string", (), {"temperature": "hot"}, "temperature", "expected a finite number", True),
]


def _rule_params(parquet_only=False):
    return [pytest.param(*case[1:5], id=case[0]) for case in RULES if case[5] or not parquet_only]


@pytest.mark.parametrize("drop, overrides, field, reason", _rule_params())
def test_jsonl_rule_error_names_file_line_field_and_reason(
    tmp_path, record, write_jsonl, drop, overrides, field, reason
):
    # Line 2 is blank: line numbers count it, the broken record is on line 4.
    path = write_jsonl(tmp_path / "a.jsonl", [record(), "", record(), record(drop=drop, **overrides)])
    with pytest.raises(DataError) as info:
        load_rollouts([str(path)], vocab_size=VOCAB)
    message = str(info.value)
    assert f"{path}:4: field '{field}': " in message
    assert reason in message
    assert "1 invalid records" in message


@pytest.mark.parametrize("drop, overrides, field, reason", _rule_params(parquet_only=True))
def test_parquet_rule_error_names_file_row_field_and_reason(
    tmp_path, record, write_parquet, drop, overrides, field, reason
):
    path = write_parquet(tmp_path / "b.parquet", [record(drop=drop, **overrides)])
    with pytest.raises(DataError) as info:
        load_rollouts([str(path)], vocab_size=VOCAB)
    message = str(info.value)
    assert f"{path}:row 0: field '{field}': " in message
    assert reason in message


def test_max_tokens_rule_in_file(tmp_path, record, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [record(), record(prompt_ids=[1, 2, 3, 4])])
    with pytest.raises(DataError, match=r"a\.jsonl:2: field 'completion_ids': .*data\.max_tokens=5"):
        load_rollouts([path], vocab_size=VOCAB, max_tokens=5)


def test_parquet_row_numbers_count_across_row_groups(tmp_path, record, write_parquet):
    records = [record() for _ in range(5)]
    records[3]["completion_ids"] = [4, 77]
    path = write_parquet(tmp_path / "b.parquet", records, row_group_size=2)
    sources = [source for source, _ in read_records(path)]
    assert sources == [f"{path}:row {i}" for i in range(5)]
    with pytest.raises(DataError, match=r"b\.parquet:row 3: field 'completion_ids'"):
        load_rollouts([path], vocab_size=VOCAB)


def test_jsonl_and_parquet_give_the_same_rollouts(tmp_path, record, write_jsonl, write_parquet):
    records = [
        record(advantages=[0.5, -0.5], completion_mask=[1, 0], temperature=0.9),
        record(advantages=[1.0, 2.0], group_id="g1"),
    ]
    from_jsonl, _ = load_rollouts([write_jsonl(tmp_path / "a.jsonl", records)], vocab_size=VOCAB)
    from_parquet, _ = load_rollouts([write_parquet(tmp_path / "a.parquet", records)], vocab_size=VOCAB)
    def content(r):
        return (r.prompt_ids, r.completion_ids, r.old_logprobs, r.advantages, r.completion_mask, r.group_id,
                r.temperature)

    assert [content(r) for r in from_jsonl] == [content(r) for r in from_parquet]
    assert from_parquet[0].advantages == (0.5, -0.5) and from_parquet[0].completion_mask == (1, 0)


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"prompt_ids": [1, 2', "invalid JSON"),
        ("[1, 2, 3]", "expected a JSON object per line, got list"),
        ("42", "expected a JSON object per line, got int"),
    ],
)
def test_unparsable_line_is_reported_with_its_line(tmp_path, record, write_jsonl, line, reason):
    path = write_jsonl(tmp_path / "a.jsonl", [record(), line])
    results = list(read_records(path))
    assert results[0] == (f"{path}:1", record())
    source, error = results[1]
    assert source == f"{path}:2"
    assert isinstance(error, RecordError) and reason in error.reason
    with pytest.raises(DataError, match=rf"a\.jsonl:2: {reason}"):
        load_rollouts([path], vocab_size=VOCAB)


def test_invalid_utf8_line_is_reported(tmp_path, record):
    path = tmp_path / "a.jsonl"
    path.write_bytes(json.dumps(record()).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(DataError, match=r"a\.jsonl:2: invalid JSON"):
        load_rollouts([path], vocab_size=VOCAB)


@pytest.mark.parametrize(
    "text, field",
    [
        ('"old_logprobs": [NaN, -1.0], "reward": 1.0', "old_logprobs"),
        ('"old_logprobs": [-1.0, -1.0], "reward": Infinity', "reward"),
        ('"old_logprobs": [-1.0, -1.0], "advantage": -Infinity', "advantage"),
    ],
)
def test_nan_and_infinity_literals_are_rejected(tmp_path, text, field):
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt_ids": [1], "completion_ids": [2, 3], ' + text + "}\n")
    with pytest.raises(DataError, match=rf"a\.jsonl:1: field '{field}': .*finite"):
        load_rollouts([path], vocab_size=VOCAB)


def test_validate_record_rejects_a_non_object():
    with pytest.raises(RecordError, match="x:1: expected an object"):
        validate_record([1, 2], source="x:1", index=0, vocab_size=VOCAB)


def test_error_mode_lists_every_problem_in_one_message(tmp_path, record, write_jsonl):
    records = [record(reward="bad") if i % 2 else record() for i in range(50)]  # 25 invalid
    path = write_jsonl(tmp_path / "a.jsonl", records)
    with pytest.raises(DataError) as info:
        load_rollouts([path], vocab_size=VOCAB)
    message = str(info.value)
    assert message.startswith("25 invalid records")
    listed = [line for line in message.splitlines() if "field 'reward'" in line]
    reason = "value is 'bad' (a string), expected a finite number"
    assert listed == [f"  {path}:{n}: field 'reward': {reason}" for n in range(2, 41, 2)]
    assert "... and 5 more" in message
    assert "data.on_invalid=skip" in message


def test_error_mode_lists_problems_of_all_files(tmp_path, record, write_jsonl, write_parquet):
    a = write_jsonl(tmp_path / "a.jsonl", [record(prompt_ids=[])])
    b = write_parquet(tmp_path / "b.parquet", [record(), record(temperature=-2.0)])
    with pytest.raises(DataError) as info:
        load_rollouts([a, b], vocab_size=VOCAB)
    message = str(info.value)
    assert f"{a}:1: field 'prompt_ids'" in message and f"{b}:row 1: field 'temperature'" in message
    assert "... and" not in message


def test_skip_mode_accounts_for_every_record(tmp_path, record, write_jsonl, write_parquet):
    a = write_jsonl(
        tmp_path / "a.jsonl",
        [
            record(),
            "not json",
            record(old_logprobs=[-1.0, float("nan")]),
            "",
            record(group_id=1),
            record(prompt_ids=[]),
        ],
    )
    b = write_parquet(tmp_path / "b.parquet", [record(completion_mask=[1, 3]), record(reward=2.0)])
    rollouts, rejections = load_rollouts([a, b], vocab_size=VOCAB, on_invalid="skip")
    assert [r.source for r in rollouts] == [f"{a}:1", f"{a}:5", f"{b}:row 1"]
    assert [r.index for r in rollouts] == [0, 1, 2]
    assert [(j.source, j.field) for j in rejections] == [
        (f"{a}:2", None),
        (f"{a}:3", "old_logprobs"),
        (f"{a}:6", "prompt_ids"),
        (f"{b}:row 0", "completion_mask"),
    ]
    assert len(rollouts) + len(rejections) == 7  # every non-blank line and row
    assert rejections[0].record is None
    assert rejections[3].record["completion_mask"] == [1, 3]


def test_write_rejections_round_trips(tmp_path, record):
    rejections = [
        Rejection("a.jsonl:2", None, "invalid JSON: Expecting value", None),
        Rejection("a.jsonl:3", "old_logprobs", "element 0 is nan (a float)", record(old_logprobs=[float("nan"), -1.0])),
        Rejection("b.parquet:row 0", "reward", "value is inf", record(reward=float("inf"), blob=b"\x00")),
    ]
    path = tmp_path / "run" / "rejected.jsonl"
    write_rejections(rejections, path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3
    expected = [(r.source, r.field, r.reason) for r in rejections]
    assert [(d["source"], d["field"], d["reason"]) for d in lines] == expected
    assert lines[0]["record"] is None
    assert math.isnan(lines[1]["record"]["old_logprobs"][0])
    assert lines[1]["record"]["prompt_ids"] == [1, 2, 3]
    assert lines[2]["record"]["reward"] == math.inf and lines[2]["record"]["blob"] == str(b"\x00")


def test_no_valid_documents_is_an_error_in_skip_mode(tmp_path, record, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [record(prompt_ids=[]), "{"])
    with pytest.raises(DataError, match=r"no valid documents in .*a\.jsonl \(2 invalid records\)"):
        load_rollouts([path], vocab_size=VOCAB, on_invalid="skip")


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="no valid documents"):
        load_rollouts([path], vocab_size=VOCAB)


def test_unknown_on_invalid_mode(tmp_path, record, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [record()])
    with pytest.raises(ValueError, match="on_invalid"):
        load_rollouts([path], vocab_size=VOCAB, on_invalid="ignore")


def test_unreadable_parquet_is_a_data_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot read Parquet"):
        load_rollouts([path], vocab_size=VOCAB)


def test_index_runs_across_files_in_order(tmp_path, record, write_jsonl):
    a = write_jsonl(tmp_path / "a.jsonl", [record(), record()])
    b = write_jsonl(tmp_path / "b.json", [record()])
    rollouts, _ = load_rollouts([b, a], vocab_size=VOCAB)
    assert [(r.source, r.index) for r in rollouts] == [(f"{b}:1", 0), (f"{a}:1", 1), (f"{a}:2", 2)]


def _touch(*paths: Path) -> None:
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


def test_expand_paths_sorts_globs_and_deduplicates(tmp_path):
    _touch(tmp_path / "b.jsonl", tmp_path / "a.jsonl", tmp_path / "c.parquet", tmp_path / "sub" / "d.jsonl")
    d = tmp_path
    assert expand_paths([f"{d}/*.jsonl"]) == [d / "a.jsonl", d / "b.jsonl"]
    given_order = expand_paths([f"{d}/c.parquet", f"{d}/*.jsonl", f"{d}/a.jsonl"])
    assert given_order == [d / "c.parquet", d / "a.jsonl", d / "b.jsonl"]
    assert expand_paths([f"{d}/**/*.jsonl"]) == [d / "a.jsonl", d / "b.jsonl", d / "sub" / "d.jsonl"]


def test_expand_paths_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _touch(tmp_path / "x.jsonl")
    assert expand_paths(["~/x.jsonl"]) == [tmp_path / "x.jsonl"]


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("missing.jsonl", "missing.jsonl: no such file"),
        ("*.arrow", r"\*.arrow: matches no file"),
        ("notes.txt", "notes.txt: unsupported file type '.txt'"),
        ("*", "notes.txt: unsupported file type"),
        ("sub", "sub: is a directory"),
    ],
)
def test_expand_paths_errors_name_the_pattern(tmp_path, pattern, message):
    _touch(tmp_path / "a.jsonl", tmp_path / "notes.txt", tmp_path / "sub" / "b.jsonl")
    with pytest.raises(DataError, match=message):
        expand_paths([str(tmp_path / pattern)])


def test_expand_paths_needs_a_pattern():
    with pytest.raises(DataError, match="no rollout files"):
        expand_paths([])


def _with_temperatures(tmp_path, record, write_jsonl, temperatures):
    records = [record(drop=("temperature",) if t is None else (), temperature=t) for t in temperatures]
    rollouts, _ = load_rollouts([write_jsonl(tmp_path / "a.jsonl", records)], vocab_size=VOCAB)
    return rollouts


def test_temperature_within_tolerance_passes(tmp_path, record, write_jsonl):
    rollouts = _with_temperatures(tmp_path, record, write_jsonl, [0.7, None, 0.7000005])
    assert check_temperature(rollouts, 0.7) == 0
    just_over = _with_temperatures(tmp_path, record, write_jsonl, [0.70001])
    assert check_temperature(just_over, 0.7, allow_mismatch=True) == 1


def test_temperature_mismatch_names_source_values_and_fix(tmp_path, record, write_jsonl):
    rollouts = _with_temperatures(tmp_path, record, write_jsonl, [1.0, 0.7, 0.6, None])
    with pytest.raises(DataError) as info:
        check_temperature(rollouts, 1.0)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'a.jsonl'}:2: sampled at temperature 0.7 but loss.temperature=1.0")
    assert "2 rollouts differ" in message
    assert "loss.temperature=0.7" in message and "data.allow_temperature_mismatch=true" in message
    assert check_temperature(rollouts, 1.0, allow_mismatch=True) == 2
