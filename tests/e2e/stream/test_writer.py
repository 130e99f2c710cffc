"""StreamWriter against a real server: entries read back as pushed; bad records refused with the reason."""

from __future__ import annotations

import json
import math

import pytest
import redis

from rlcli.stream import StreamWriter, group_advantages_for

STREAM = "test:rollouts"


def record(n: int, **fields) -> dict:
    base = {"id": f"r{n}", "policy_version": n % 3, "prompt_ids": [1, 2], "completion_ids": [3, 4 + n],
            "old_logprobs": [-0.5, -0.25], "advantage": 0.5 * n}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


def read_back(url: str) -> list[tuple[str, dict]]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return [(entry_id, json.loads(fields["record"])) for entry_id, fields in client.xrange(STREAM)]
    finally:
        client.close()


def test_pushed_records_read_back_in_order(redis_url):
    records = [record(n) for n in range(5)]
    with StreamWriter(redis_url, STREAM) as writer:
        first = writer.push(records[0])
        rest = writer.push_many(records[1:])
        assert writer.length() == 5
    assert read_back(redis_url) == list(zip([first, *rest], records))


def test_push_many_of_nothing_adds_nothing(redis_url):
    with StreamWriter(redis_url, STREAM) as writer:
        assert writer.push_many([]) == []
    assert read_back(redis_url) == []


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (record(1, id=None), r"record 1: field 'id': is None"),
        (record(1, id=7), r"record 1: field 'id': is 7"),
        (record(1, policy_version=None), r"record 1: field 'policy_version': is None"),
        (record(1, policy_version=-1), r"record 1: field 'policy_version': is -1"),
        (record(1, policy_version=1.0), r"record 1: field 'policy_version': is 1.0"),
        (record(1, advantage=None), r"record 1: field 'advantages': no 'advantage' or 'advantages'"),
        (record(1, old_logprobs=[-0.5, math.nan]), r"record 1: field 'old_logprobs': is not JSON \(NaN"),
        (record(1, reward=-math.inf), r"record 1: field 'reward': is not JSON"),
        (record(1, extra={1, 2}), r"record 1: field 'extra': is not JSON"),
    ],
)
def test_bad_record_is_refused_and_nothing_pushed(redis_url, bad, message):
    with StreamWriter(redis_url, STREAM) as writer:
        with pytest.raises(ValueError, match=message):
            writer.push_many([record(0), bad, record(2)])
        with pytest.raises(ValueError, match=message.replace("record 1", "record 0")):
            writer.push(bad)
    assert read_back(redis_url) == []


def test_per_token_advantages_are_accepted(redis_url):
    pushed = record(0, advantage=None, advantages=[0.25, -1.0])
    with StreamWriter(redis_url, STREAM) as writer:
        writer.push(pushed)
    assert [r for _, r in read_back(redis_url)] == [pushed]


def test_group_advantages_from_rewards_match_the_grpo_formula():
    rewards = {"a": [1.0, 0.0, 0.0, 1.0, 1.0], "b": [0.25, 0.75], "c": [3.0], "d": [2.0, 2.0]}
    records = [{"id": f"{g}{i}", "reward": r, "group_id": g} for g, rs in rewards.items() for i, r in enumerate(rs)]
    records.append({"id": "kept", "reward": 100.0, "group_id": "a", "advantages": [9.0]})  # not in group a
    eps = 1e-6
    # Group a: mean 3/5 = 0.6; squared deviations 0.16, 0.36, 0.36, 0.16, 0.16 -> population
    # variance 1.2/5 = 0.24. Group b: mean 0.5, population std 0.25. c (one record) and d (equal
    # rewards) have std 0 and centred rewards 0: advantage 0.
    std_a = math.sqrt(0.24)
    expected = [0.4 / (std_a + eps), -0.6 / (std_a + eps), -0.6 / (std_a + eps), 0.4 / (std_a + eps),
                0.4 / (std_a + eps), -0.25 / (0.25 + eps), 0.25 / (0.25 + eps), 0.0, 0.0, 0.0]
    filled = group_advantages_for(records, "grpo", eps=eps)
    assert [r["advantage"] for r in filled[:-1]] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert filled[-1] == records[-1] and "advantage" not in filled[-1]
    assert all("advantage" not in r for r in records[:-1])  # the input is not modified

    dr = group_advantages_for(records, "dr_grpo", eps=eps)
    assert [r["advantage"] for r in dr[:-1]] == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4, -0.25, 0.25, 0, 0, 0])


def test_group_advantages_of_huge_rewards_are_finite():
    records = [{"id": "a", "reward": 1e200, "group_id": "g"}, {"id": "b", "reward": -1e200, "group_id": "g"}]
    # mean 0, std 1e200: ±1e200 / (1e200 + 1e-6) is ±1 in float64
    assert [r["advantage"] for r in group_advantages_for(records, "grpo", eps=1e-6)] == [1.0, -1.0]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"reward": None, "group_id": "g"}, r"record 1: field 'reward': is None"),
        ({"reward": math.nan, "group_id": "g"}, r"record 1: field 'reward': is nan"),
        ({"reward": 1.0}, r"record 1: field 'group_id': is None"),
        ({"reward": 1.0, "group_id": [1]}, r"record 1: field 'group_id': is \[1\]"),
    ],
)
def test_group_advantages_need_a_reward_and_a_group(bad, message):
    with pytest.raises(ValueError, match=message):
        group_advantages_for([{"reward": 1.0, "group_id": "g"}, bad], "grpo", eps=1e-6)
    with pytest.raises(ValueError, match=message.replace("record 1", "b.jsonl:2")):
        group_advantages_for([{"reward": 1.0, "group_id": "g"}, bad], "grpo", eps=1e-6,
                             names=["b.jsonl:1", "b.jsonl:2"])


def test_a_push_retried_after_its_reply_was_lost_adds_nothing_twice(redis_url, monkeypatch):
    """The first attempt reaches the server but its reply is lost; the retry must not add the records again."""
    with StreamWriter(redis_url, STREAM) as writer:
        call = writer.conn.call
        attempts = []

        def lose_first_reply(command, *args, **kwargs):
            result = call(command, *args, **kwargs)
            if command == "eval" and not attempts:
                attempts.append(result)
                return call(command, *args, **kwargs)  # what RedisConnection.call does after a lost reply
            return result

        monkeypatch.setattr(writer.conn, "call", lose_first_reply)
        ids = writer.push_many([record(0), record(1)])
    assert ids == attempts[0]
    assert [r["id"] for _, r in read_back(redis_url)] == ["r0", "r1"]
