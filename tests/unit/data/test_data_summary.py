"""Dataset summary and `data check`: statistics, table, exit codes and the listed rejections."""

import io

import pytest
from rich.console import Console

from rlcli.data.readers import Rejection, load_rollouts
from rlcli.data.summary import data_check, print_summary, summarize

VOCAB = 50


def console():
    return Console(file=io.StringIO(), width=200, color_system=None)


def output(con):
    return con.file.getvalue()


def test_summarize_counts_and_statistics(tmp_path, record, write_jsonl):
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            record(reward=1.0, group_id="a"),
            record(reward=3.0, group_id="a", prompt_ids=[1], completion_ids=[4, 5, 6], old_logprobs=[-1, -1, -1]),
            record(drop=("reward",), group_id=2, advantages=[0.5, -1.5], completion_mask=[1, 0]),
            record(drop=("reward", "group_id"), advantage=2.0),
        ],
    )
    rollouts, _ = load_rollouts([path], vocab_size=VOCAB)
    rejected = [Rejection("x:1", "reward", "bad", None)]
    summary = summarize(rollouts, rejected)
    assert summary == {
        "documents": 4,
        "groups": 2,
        "prompt_tokens": {"min": 1, "mean": 2.5, "max": 3},
        "completion_tokens": {"min": 2, "mean": 2.25, "max": 3},
        "labelled_tokens": 2 + 3 + 1 + 2,
        "reward": {"min": 1.0, "mean": 2.0, "max": 3.0},
        "advantage": {"min": 0.5, "mean": pytest.approx(1.5), "max": 2.0},  # the masked -1.5 is not counted
        "rejected": 1,
    }


def test_summary_of_nothing_has_no_statistics():
    summary = summarize([], [])
    assert summary["documents"] == 0
    assert summary["prompt_tokens"] is None and summary["reward"] is None and summary["advantage"] is None
    con = console()
    print_summary(summary, con)
    assert "documents" in output(con)


def test_print_summary_shows_values(tmp_path, record, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [record(reward=0.25), record(reward=0.75, group_id="g1")])
    rollouts, _ = load_rollouts([path], vocab_size=VOCAB)
    con = console()
    print_summary(summarize(rollouts, []), con)
    rows = {line.split("│")[1].strip(): line for line in output(con).splitlines() if line.count("│") > 2}
    assert rows["groups"].split("│")[2].strip() == "2"
    assert [cell.strip() for cell in rows["reward"].split("│")[3:6]] == ["0.25", "0.5", "0.75"]


def test_data_check_reports_every_rejection_and_returns_2(tmp_path, record, write_jsonl, write_parquet):
    a = write_jsonl(tmp_path / "a.jsonl", [record(), record(prompt_ids=[1, 99]), "{oops"])
    b = write_parquet(tmp_path / "b.parquet", [record(), record(temperature=0.0)])
    con = console()
    assert data_check([str(a), str(b)], VOCAB, None, con) == 2
    text = output(con)
    assert f"{a}:2: field 'prompt_ids': element 1 is 99, outside the vocabulary [0, 50)" in text
    assert f"{a}:3: invalid JSON" in text
    assert f"{b}:row 1: field 'temperature': is 0.0, must be > 0" in text
    assert "3 invalid records, 2 valid" in text


def test_data_check_applies_max_tokens(tmp_path, record, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [record()])
    assert data_check([str(path)], VOCAB, 5, console()) == 0
    con = console()
    assert data_check([str(path)], VOCAB, 4, con) == 2
    assert "data.max_tokens=4" in output(con)


def test_data_check_without_vocab_size_checks_only_negative_ids(tmp_path, record, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [record(prompt_ids=[10_000]), record(completion_ids=[-1, 2])])
    con = console()
    assert data_check([str(path)], None, None, con) == 2
    assert f"{path}:2: field 'completion_ids': element 0 is -1, token ids must be >= 0" in output(con)
    assert f"{path}:1" not in output(con)


def test_data_check_all_valid_returns_0(tmp_path, record, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [record(), record(group_id="g2")])
    con = console()
    assert data_check([str(path)], VOCAB, None, con) == 0
    assert "invalid" not in output(con)


def test_data_check_missing_file_returns_2(tmp_path):
    con = console()
    assert data_check([str(tmp_path / "nope.jsonl")], VOCAB, None, con) == 2
    assert "nope.jsonl: no such file" in output(con)


def test_data_check_empty_file_returns_2(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("")
    con = console()
    assert data_check([str(path)], VOCAB, None, con) == 2
    assert "no documents" in output(con)
