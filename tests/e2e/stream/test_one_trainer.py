"""Nothing twice, nothing shared (issue 32, items 8, 9 and 15): an id pushed twice trains once, even across a
resume; a second trainer of a consumer group is refused naming the run that holds it, while a crashed one
resumed in its own directory takes it over at once; counting the unread records of a large backlog visits a
bounded number of entries."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from factories import rollout_record
from rlcli.commands.train import train
from rlcli.errors import UserError
from rlcli.stream.connection import connect
from rlcli.stream.lease import GroupLease
from rlcli.stream.push import push_files
from rlcli.stream.queue import unread
from rlcli.stream.reader import ReaderOptions, StreamReader
from train_helpers import compose_train_config, run_rlcli

STREAM, GROUP = "rlcli:rollouts", "rlcli-trainer"  # the defaults of data=stream
LEASE = f"{STREAM}:trainer:{GROUP}"  # where docs/reference/stream-record.md says the lease is
VOCAB = 7  # the default task's (reverse) tokenizer sizes the tiny model


def overrides(url: str, *more: str, idle: str = "1") -> list[str]:
    # one 7-token record fills a micro-batch: every step trains one record
    return ["data=stream", f"data.url={url}", f"data.idle_timeout={idle}", "data.max_tokens=10", "data.max_lag=100",
            "logger=none", "trainer.accumulate_microbatches=1", "trainer.max_steps=50", *more]


def write_records(path, ids: list[str]) -> None:
    path.write_text("".join(json.dumps(rollout_record(i, vocab=VOCAB, advantage=1.0 - i % 3, id=name,
                                                      policy_version=0)) + "\n" for i, name in enumerate(ids)))


def trained_ids(run_dir) -> list[str]:
    return [i for line in (run_dir / "documents.jsonl").read_text().splitlines() for i in json.loads(line)["ids"]]


def rejections(run_dir) -> list[dict]:
    path = run_dir / "rejected.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_file_pushed_twice_trains_each_id_once_and_rejects_the_repeats(redis_url, tmp_path):
    """The issue's case: `rlcli stream push` of the same file twice. Before the fix every id trained twice."""
    ids = ["a", "b", "c", "d"]
    write_records(tmp_path / "rollouts.jsonl", ids)
    for _ in range(2):
        push_files([str(tmp_path / "rollouts.jsonl")], redis_url, STREAM, "none", 1e-6, io.StringIO())
    run = tmp_path / "run"
    train(compose_train_config(overrides(redis_url)), run)
    assert trained_ids(run) == ids
    rejected = rejections(run)
    assert [(r["record"]["id"], r["field"]) for r in rejected] == [(i, "id") for i in ids]
    assert all(r["reason"].startswith("duplicate: ") for r in rejected)


def test_a_resumed_reader_reads_its_own_entries_again_and_still_rejects_the_repeat(redis_url, tmp_path):
    """Exact resume: a reader killed before its checkpoint acknowledged anything reads its pending entries
    again; they are the first of their ids, so they are not duplicates of themselves, and the repeat is
    rejected again. Before the fix the repeat was handed out twice, once by each reader."""
    ids = ["a", "b"]
    write_records(tmp_path / "rollouts.jsonl", ids)
    for _ in range(2):
        push_files([str(tmp_path / "rollouts.jsonl")], redis_url, STREAM, "none", 1e-6, io.StringIO())
    options = ReaderOptions(stream=STREAM, group=GROUP, max_tokens=100, vocab_size=100, max_lag=10, temperature=1.0,
                            allow_temperature_mismatch=False, need_ref_logprobs=False, wait_warning=30.0,
                            idle_timeout=None)
    for _ in range(2):  # the first reader, then one in its place that reads its pending entries again
        conn = connect(redis_url)
        reader = StreamReader(conn, options, "rank0", tmp_path / "rejected.jsonl")
        handed = []
        while (doc := reader.next_document(first=False)) is not None:
            handed.append(doc.id)
        conn.close()
        assert handed == ids
        assert [json.loads(line)["record"]["id"] for line in (tmp_path / "rejected.jsonl").read_text().splitlines()] \
            == ids


def start_trainer(url: str, run_dir, cwd) -> subprocess.Popen:
    """`rlcli train data=stream` waiting for ever on the (empty) stream, in its own process group."""
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "rlcli", "train", *overrides(url, idle="null"),
                             f"hydra.run.dir={run_dir}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_a_second_trainer_of_the_group_is_refused_and_the_first_resumed_takes_it_over(redis_url, tmp_path):
    """Before the fix the second trainer read the group's records too (it started and waited like the first)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    held = (tmp_path / "first").resolve()
    first = start_trainer(redis_url, tmp_path / "first", tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not (client.exists(STREAM) and any(g["name"] == GROUP for g in client.xinfo_groups(STREAM))):
            assert first.poll() is None, first.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the first trainer did not start reading"
            time.sleep(0.2)
        second = run_rlcli(["train", *overrides(redis_url), f"hydra.run.dir={tmp_path / 'second'}"], tmp_path,
                           timeout=300)
        assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
        output = second.stdout + second.stderr
        assert f"consumer group '{GROUP}' of stream '{STREAM}' is held by the run in {held} (host " in output
        assert "Traceback" not in output
        assert not (tmp_path / "second" / "documents.jsonl").exists()
        os.killpg(first.pid, signal.SIGKILL)  # a crash: the lease stays until it lapses
        first.wait()
        assert json.loads(client.get(LEASE))["run"] == str(held) and client.pttl(LEASE) > 0
        write_records(tmp_path / "rollouts.jsonl", ["a", "b"])
        push_files([str(tmp_path / "rollouts.jsonl")], redis_url, STREAM, "none", 1e-6, io.StringIO())
        train(compose_train_config(overrides(redis_url, "resume=auto")), tmp_path / "first")  # not refused
        assert trained_ids(tmp_path / "first") == ["a", "b"]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        client.close()


def test_a_lease_of_a_run_that_stopped_renewing_it_lapses(redis_url, tmp_path):
    """A crashed holder blocks the group only until its lease lapses; the lease is written here as the
    documented JSON with a short lifetime instead of waiting for the 30 s of a real one."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.set(LEASE, json.dumps({"run": "/elsewhere/run", "host": "node7", "pid": 12345}), px=1500)
    conn = connect(redis_url)
    lease = GroupLease(conn, STREAM, GROUP, tmp_path, renew=False)
    with pytest.raises(UserError, match="is held by the run in /elsewhere/run \\(host node7, process 12345\\)"):
        lease.take()
    time.sleep(1.6)
    lease.take()
    assert json.loads(client.get(LEASE))["run"] == str(tmp_path.resolve())
    conn.close()
    client.close()


def test_counting_the_unread_records_of_a_large_backlog_visits_a_bounded_number_of_entries(redis_url):
    """30000 records pushed, 1000 read by the group: 29000 unread. Every stream range that Redis runs for a
    count (seen with MONITOR, scripts' commands included) asks for at most the bound plus nothing more, and
    the count is exact up to the bound. Before the fix the count read the whole backlog (an XRANGE without
    COUNT: 1.09 s a call at 300k unread, blocking Redis)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    pipe = client.pipeline(transaction=False)
    for i in range(30_000):
        pipe.xadd(STREAM, {"record": json.dumps({"id": f"r{i}"})})
    pipe.execute()
    client.xgroup_create(STREAM, GROUP, id="0")
    client.xreadgroup(GROUP, "rank0", {STREAM: ">"}, count=1000)
    conn = connect(redis_url)
    with client.monitor() as monitor:
        counts = [unread(conn, STREAM, GROUP, at_most=bound) for bound in (100, 257, 40_000)]
        client.echo("counted")
        ranges = []
        while (command := monitor.next_command()["command"]) != "ECHO counted":
            if command.split()[0].upper() in ("XRANGE", "XREVRANGE", "XREAD", "XREADGROUP"):
                ranges.append(command.split())
    assert counts == [100, 257, 29_000]
    assert [(words[-2].upper(), int(words[-1])) for words in ranges] == [("COUNT", 100), ("COUNT", 257),
                                                                        ("COUNT", 40_000)]
    conn.close()
    client.close()
