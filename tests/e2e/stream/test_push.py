"""`rlcli stream push` against a real server: ids, versions and advantages as the files imply."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from rlcli.cli import main
from rlcli.stream import connection, push
from rlcli.stream.server import free_port
from train_helpers import compose_train_config

STREAM = "test:pushed"


def doc(**fields) -> dict:
    return {"prompt_ids": [1, 2], "completion_ids": [3, 4], "old_logprobs": [-0.5, -1.5], **fields}


def write_lines(path, *lines) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def entries(url: str, stream: str = STREAM) -> list[dict]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return [json.loads(fields["record"]) for _, fields in client.xrange(stream)]
    finally:
        client.close()


def test_push_fills_ids_versions_and_grpo_advantages(redis_url, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(push, "BATCH", 2)  # three round trips, in order
    a = write_lines(
        tmp_path / "a.jsonl",
        json.dumps(doc(reward=1.0, group_id="g")),
        "",
        json.dumps(doc(reward=0.0, group_id="g")),
        json.dumps(doc(reward=0.5, group_id="h", id="mine", policy_version=4)),
    )
    b = write_lines(
        tmp_path / "b.jsonl",
        json.dumps(doc(reward=0.0, group_id="h")),
        json.dumps(doc(reward=99.0, group_id="g", advantages=[2.0, -2.0])),
    )
    assert main(["stream", "push", a, b, "--url", redis_url, "--stream", STREAM]) == 0

    # g: rewards 1, 0 -> mean 0.5, population std 0.5; h (across the files): 0.5, 0 -> mean 0.25, std 0.25.
    # The record with advantages keeps them and is not part of g.
    eps = 1e-6
    expected = [
        (f"{a}:1", 0, 0.5 / (0.5 + eps)),
        (f"{a}:3", 0, -0.5 / (0.5 + eps)),
        ("mine", 4, 0.25 / (0.25 + eps)),
        (f"{b}:1", 0, -0.25 / (0.25 + eps)),
    ]
    pushed = entries(redis_url)
    assert [(r["id"], r["policy_version"]) for r in pushed[:4]] == [(i, v) for i, v, _ in expected]
    assert [r["advantage"] for r in pushed[:4]] == pytest.approx([adv for _, _, adv in expected], rel=1e-12)
    assert pushed[4] == {**doc(reward=99.0, group_id="g", advantages=[2.0, -2.0]), "id": f"{b}:2",
                         "policy_version": 0}
    out = capsys.readouterr().out
    assert out == f"pushed 5 records to stream '{STREAM}' at {redis_url} (stream length 5)\n"


def test_console_script_pushes_parquet_with_dr_grpo(redis_url, tmp_path):
    path = tmp_path / "p.parquet"
    rows = [doc(reward=r, group_id=g) for r, g in [(3.0, 1), (1.0, 1), (2.0, 2), (0.5, 1)]]
    pq.write_table(pa.Table.from_pylist(rows), path)
    result = subprocess.run(
        [sys.executable, "-m", "rlcli", "stream", "push", str(path), "--url", redis_url, "--advantage", "dr_grpo"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "pushed 4 records to stream 'rlcli:rollouts'" in result.stdout
    pushed = entries(redis_url, "rlcli:rollouts")
    # group 1: rewards 3, 1, 0.5 -> mean 1.5; group 2 alone -> 0
    assert [(r["id"], r["policy_version"], r["advantage"]) for r in pushed] == [
        (f"{path}:row 0", 0, 1.5), (f"{path}:row 1", 0, -0.5), (f"{path}:row 2", 0, 0.0), (f"{path}:row 3", 0, -1.0)
    ]


def test_push_computes_grpo_advantages_with_the_eps_given(redis_url, tmp_path):
    a = write_lines(tmp_path / "a.jsonl", json.dumps(doc(reward=1.0, group_id="g")),
                    json.dumps(doc(reward=0.0, group_id="g")))
    assert main(["stream", "push", a, "--url", redis_url, "--stream", STREAM, "--eps", "0.5"]) == 0
    # rewards 1, 0: mean 0.5, population std 0.5 -> (r - 0.5) / (0.5 + 0.5) = ±0.5
    assert [r["advantage"] for r in entries(redis_url)] == [0.5, -0.5]


def test_push_computes_passk_and_opo_advantages(redis_url, tmp_path):
    a = write_lines(tmp_path / "a.jsonl", *(json.dumps(doc(reward=r, group_id="g")) for r in (0.0, 1.0, 0.0, 0.0)),
                    json.dumps(doc(reward=1.0, group_id="h", completion_mask=[1, 0])),
                    json.dumps(doc(reward=0.0, group_id="h")))
    assert main(["stream", "push", a, "--url", redis_url, "--stream", STREAM, "--advantage", "passk", "--k", "2"]) == 0
    # g: N = 4, c = 1, k = 2 (math.md's example): 1 for the correct one, -1/3 for the others; h: N = 2, c = 1: every
    # pair holds the correct one, no signal
    assert [r["advantage"] for r in entries(redis_url)] == pytest.approx([-1 / 3, 1.0, -1 / 3, -1 / 3, 0.0, 0.0])
    assert main(["stream", "push", a, "--url", redis_url, "--stream", "opo", "--advantage", "opo"]) == 0
    # h: 1 and 2 labelled tokens: baseline (1·1 + 2·0)/3 = 1/3
    assert [r["advantage"] for r in entries(redis_url, "opo")[4:]] == pytest.approx([2 / 3, -1 / 3], rel=1e-15)


def test_push_defaults_are_the_training_config(tmp_path, capsys):
    advantage = compose_train_config().advantage
    with pytest.raises(SystemExit):
        main(["stream", "push", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert f"advantage.estimator, {advantage.estimator})" in usage and f"advantage.eps, {advantage.eps})" in usage
    assert main(["stream", "push", "x.jsonl", "--url", "redis://127.0.0.1:1/0", "--eps", "0"]) == 2
    assert "rlcli stream push: error: --eps: must be > 0, got 0.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("second", "advantage", "problem"),
    [
        ('{"reward": 1.0, "group_id": ', "grpo", "b.jsonl:2: invalid JSON"),
        (json.dumps(doc(reward=1.0)), "grpo", "b.jsonl:2: field 'group_id': is None"),
        (json.dumps(doc(advantage=float("nan"))), "grpo", "b.jsonl:2: field 'advantage': is not JSON"),
        (json.dumps(doc(advantage=1.0, id="dup")), "grpo", "b.jsonl:2: field 'id': 'dup' is also the id of"),
        (json.dumps(doc(advantage=1.0, policy_version="v1")), "grpo", "b.jsonl:2: field 'policy_version': is 'v1'"),
        (json.dumps(doc(reward=1.0, group_id="g")), "none", "b.jsonl:2: no 'advantage' or 'advantages' and "
                                                           "--advantage none"),
    ],
)
def test_bad_record_exits_2_naming_it_and_pushes_nothing(
    redis_url, tmp_path, capsys, monkeypatch, second, advantage, problem
):
    monkeypatch.setattr(push, "BATCH", 1)  # the good records would be pushed first if not all checked before
    a = write_lines(tmp_path / "a.jsonl", json.dumps(doc(advantage=0.5, id="dup")))
    b = write_lines(tmp_path / "b.jsonl", json.dumps(doc(advantage=1.0)), second)
    assert main(["stream", "push", a, b, "--url", redis_url, "--stream", STREAM, "--advantage", advantage]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcli stream push: error: ") and f"{tmp_path}/{problem}" in err
    assert entries(redis_url) == []


def test_unreachable_url_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(connection, "CONNECT_TIMEOUT", 0.3)
    url = f"redis://127.0.0.1:{free_port()}/0"
    a = write_lines(tmp_path / "a.jsonl", json.dumps(doc(advantage=0.5)))
    assert main(["stream", "push", a, "--url", url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"rlcli stream push: error: --url: no Redis server answers at {url}")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
