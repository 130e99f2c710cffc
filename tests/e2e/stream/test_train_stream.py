"""`rlcli train data=stream` against a real Redis: what trains, what is rejected, what is published."""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
import time

import pytest
import redis
from safetensors.torch import load_file

from factories import rollout_record
from rlcli.callbacks.preemption import stop_code
from rlcli.commands.train import train
from rlcli.signals import RunSignals
from rlcli.stream import StreamWriter
from train_helpers import compose_train_config

VOCAB = 7  # the default task's (reverse) tokenizer sizes the tiny model


def record(i: int, version: int = 0, **extra) -> dict:
    """A 7-token record (3 prompt + 4 completion) with advantages, id ``r<i>``."""
    base = rollout_record(i, vocab=VOCAB, advantage=1.0 - (i % 3), id=f"r{i}", policy_version=version)
    return base | extra


def overrides(url: str, *more: str, max_lag: int = 100) -> list[str]:
    # one 7-token record fills a micro-batch: every step trains exactly the records it says
    return ["data=stream", f"data.url={url}", "data.idle_timeout=1", "data.max_tokens=10", f"data.max_lag={max_lag}",
            "logger=none", "trainer.accumulate_microbatches=1", "trainer.max_steps=50", *more]


def documents(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "documents.jsonl").read_text().splitlines()]


def metrics(run_dir) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def test_every_record_trains_once_in_stream_order_and_is_acknowledged_and_trimmed(redis_url, tmp_path):
    with StreamWriter(redis_url) as writer:
        writer.push_many([record(i) for i in range(6)])
    module = train(compose_train_config(overrides(redis_url, "trainer.checkpoint_every=2")), tmp_path)

    assert [d["ids"] for d in documents(tmp_path)] == [[f"r{i}"] for i in range(6)]
    assert [d["step"] for d in documents(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert module.steps_done == 6
    r = client(redis_url)
    assert r.xpending("rlcli:rollouts", "rlcli-trainer")["pending"] == 0
    assert r.xlen("rlcli:rollouts") == 0  # acknowledged entries are trimmed
    assert not (tmp_path / "rejected.jsonl").exists()


def test_published_weights_are_the_trained_policy_and_announced(redis_url, tmp_path):
    with StreamWriter(redis_url) as writer:
        writer.push_many([record(i) for i in range(3)])
    train(compose_train_config(overrides(redis_url, "publish.keep=2")), tmp_path)

    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]  # the newest 2 of v0..v3
    announced = json.loads(client(redis_url).get("rlcli:rollouts:weights"))
    assert announced == {"version": 3, "path": str(tmp_path / "weights" / "v3"), "documents_seen": 3, "final": True}
    published = load_file(tmp_path / "weights" / "v3" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert published.keys() == exported.keys()
    assert all((published[k] == exported[k]).all() for k in published)
    assert not any(load_file(tmp_path / "weights" / "v2" / "model.safetensors")[k].equal(published[k])
                   for k in published if k.endswith("q_proj.weight"))  # a version per update
    times = [float(row["weight_publish_time"]) for row in metrics(tmp_path)]
    assert len(times) == 3 and all(t > 0 for t in times)


def test_stale_records_are_dropped_with_the_reason_and_counted(redis_url, tmp_path):
    # step 1 runs at version 0 and trains r0; step 2 runs at version 1, where max_lag=0 accepts only
    # records sampled by version 1: r1 and r2 (version 0) are dropped, r3 (version 1) trains.
    with StreamWriter(redis_url) as writer:
        writer.push_many([record(0), record(1), record(2), record(3, version=1)])
    train(compose_train_config(overrides(redis_url, max_lag=0)), tmp_path)

    assert [d["ids"] for d in documents(tmp_path)] == [["r0"], ["r3"]]
    rows = metrics(tmp_path)
    assert [float(r["stale_dropped"]) for r in rows] == [0.0, 2.0]
    assert [float(r["staleness_mean"]) for r in rows] == [0.0, 0.0]
    rejected = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert [(r["record"]["id"], r["field"]) for r in rejected] == [("r1", "policy_version"), ("r2", "policy_version")]
    assert all("stale: sampled by policy version 0, 1 versions before the trainer's 1" in r["reason"] for r in rejected)
    in_redis = client(redis_url).xrange("rlcli:rollouts:rejected")
    assert len(in_redis) == 2 and "stale" in in_redis[0][1]["record"]


def test_staleness_is_the_trainer_version_minus_the_sampler_version(redis_url, tmp_path):
    with StreamWriter(redis_url) as writer:  # step k (version k - 1) trains record k - 1
        writer.push_many([record(0, version=0), record(1, version=0), record(2, version=0), record(3, version=2)])
    train(compose_train_config(overrides(redis_url, max_lag=4)), tmp_path)
    rows = metrics(tmp_path)
    assert [float(r["staleness_mean"]) for r in rows] == [0.0, 1.0, 2.0, 1.0]
    assert [float(r["staleness_max"]) for r in rows] == [0.0, 1.0, 2.0, 1.0]
    assert [float(r["reward"]) for r in rows] == [record(i)["reward"] for i in range(4)]


def test_invalid_entries_are_rejected_with_their_reason_and_nothing_stays_pending(redis_url, tmp_path):
    r = client(redis_url)
    good = record(0)
    broken = {k: v for k, v in record(1).items() if k != "completion_ids"}
    r.xadd("rlcli:rollouts", {"record": json.dumps(broken)})
    r.xadd("rlcli:rollouts", {"record": json.dumps({k: v for k, v in record(2).items() if k != "id"})})
    r.xadd("rlcli:rollouts", {"record": json.dumps({k: v for k, v in record(3).items() if k != "advantage"})})
    r.xadd("rlcli:rollouts", {"record": "{not json"})
    r.xadd("rlcli:rollouts", {"other": "field"})
    r.xadd("rlcli:rollouts", {"record": json.dumps(record(4, completion_ids=[1, 2, 99, 3]))})
    r.xadd("rlcli:rollouts", {"record": json.dumps(record(5, advantage=-1e39))})  # -inf as a float32
    r.xadd("rlcli:rollouts", {"record": json.dumps(good)})
    train(compose_train_config(overrides(redis_url)), tmp_path)

    assert [d["ids"] for d in documents(tmp_path)] == [["r0"]]
    rejected = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    fields = [r["field"] for r in rejected]
    assert fields == ["completion_ids", "id", "advantages", None, None, "completion_ids", "advantage"]
    reasons = [r["reason"] for r in rejected]
    assert "missing (required)" in reasons[0] and "not JSON" in reasons[3] and "no 'record' field" in reasons[4]
    assert "outside the vocabulary [0, 7)" in reasons[5]
    assert "value is -1e+39, outside the float32 range" in reasons[6]
    assert r.xlen("rlcli:rollouts:rejected") == 7
    assert r.xpending("rlcli:rollouts", "rlcli-trainer")["pending"] == 0


def test_docs_per_step_exact_holds_the_surplus_back_without_losing_it(redis_url, tmp_path):
    with StreamWriter(redis_url) as writer:  # records of 7 and 5 tokens; micro-batches of up to 14 tokens
        writer.push_many([record(i, **({"completion_ids": [1, 2]} | {"old_logprobs": [-1.0, -1.0]}
                                         if i % 2 else {})) for i in range(11)])
    train(compose_train_config(overrides(redis_url, "data.max_tokens=14", "trainer.docs_per_step=3",
                                         "trainer.docs_per_step_mode=exact")), tmp_path)
    steps = [d["ids"] for d in documents(tmp_path)]
    assert [len(ids) for ids in steps] == [3, 3, 3, 2]
    assert [i for ids in steps for i in ids] == [f"r{i}" for i in range(11)]


def test_a_waiting_trainer_says_so_and_trains_what_comes_later(redis_url, tmp_path, caplog):
    def push_late():  # 2.5 s after the trainer's first read
        r = client(redis_url)
        while not (r.exists("rlcli:rollouts") and r.xinfo_groups("rlcli:rollouts")
                   and r.xinfo_consumers("rlcli:rollouts", "rlcli-trainer")):
            time.sleep(0.05)
        time.sleep(2.5)
        with StreamWriter(redis_url) as writer:
            writer.push_many([record(0), record(1)])

    pusher = threading.Thread(target=push_late)
    pusher.start()
    train(compose_train_config(overrides(redis_url, "data.wait_warning=1", "data.idle_timeout=6")), tmp_path)
    pusher.join()
    assert [d["ids"] for d in documents(tmp_path)] == [["r0"], ["r1"]]
    assert "no rollouts for 1 s on rlcli:rollouts; is a sampler running?" in caplog.text
    assert float(metrics(tmp_path)[0]["wait_time"]) >= 2.0


def test_queue_depth_counts_the_records_not_yet_trained(redis_url, tmp_path):
    with StreamWriter(redis_url) as writer:
        writer.push_many([record(i) for i in range(5)])
    train(compose_train_config(overrides(redis_url)), tmp_path)
    assert [float(r["queue_depth"]) for r in metrics(tmp_path)] == [4.0, 3.0, 2.0, 1.0, 0.0]


@pytest.mark.parametrize("url", ["http://localhost:6379", "redis://"])
def test_a_malformed_url_is_a_config_error(url, tmp_path):
    from rlcli.errors import UserError

    with pytest.raises(UserError, match="data.url"):
        train(compose_train_config(overrides(url)), tmp_path)


def test_data_url_is_required(tmp_path):
    from rlcli.errors import UserError

    with pytest.raises(UserError, match="data.url: required by data=stream"):
        train(compose_train_config(["data=stream"]), tmp_path)


def test_a_signal_stops_a_trainer_waiting_on_an_empty_stream_at_once(redis_url, tmp_path):
    with StreamWriter(redis_url) as writer:
        writer.push_many([record(0)])

    def signal_once_waiting():  # after step 1, the trainer waits for records that never come
        r = client(redis_url)
        while not (tmp_path / "metrics.csv").exists():
            time.sleep(0.05)
        time.sleep(1.0)
        r.close()
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_once_waiting)
    started = time.monotonic()
    sender.start()
    with RunSignals():  # what `rlcli train` runs in
        module = train(compose_train_config(overrides(redis_url, "data.idle_timeout=120")), tmp_path)
    sender.join()
    assert stop_code(module.trainer) is not None  # stopped by the signal
    assert module.steps_done == 1  # the next step ended empty at the signal
    assert time.monotonic() - started < 60
    assert (tmp_path / "checkpoints" / "step-1.ckpt").is_file()
    assert not json.loads(client(redis_url).get("rlcli:rollouts:weights"))["final"]  # samplers wait for a resume


def test_with_lora_the_published_weights_are_the_merged_policy(redis_url, tmp_path):
    """model.lora: each published version is a whole Hugging Face model, the base merged with the adapters of
    that version, named as the base model names its weights: a sampler loading it computes what the trained
    policy computes. Fails if the adapters' own names or the unmerged base were published."""
    import torch
    from transformers import AutoModelForCausalLM

    with StreamWriter(redis_url) as writer:
        writer.push_many([record(i) for i in range(3)])
    module = train(compose_train_config(overrides(redis_url, "model.lora.rank=4", "optimizer.lr=0.05")), tmp_path)

    published = load_file(tmp_path / "weights" / "v3" / "model.safetensors")
    assert not any(".lora_" in k or ".base_layer" in k for k in published)
    sampler = AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "v3", dtype=torch.float64).eval()
    assert published.keys() == AutoModelForCausalLM.from_config(sampler.config).state_dict().keys()
    policy = module.policy.to(torch.float64).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        assert not torch.equal(expected, AutoModelForCausalLM.from_pretrained(
            tmp_path / "weights" / "v2", dtype=torch.float64)(input_ids=ids).logits)  # a version per update
        torch.testing.assert_close(sampler(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
    assert (tmp_path / "weights" / "v3" / "adapter" / "adapter_model.safetensors").is_file()


def test_with_publish_lora_adapter_only_the_adapters_are_published(redis_url, tmp_path):
    """publish.lora=adapter on a checkpoint: each version holds the adapters alone (peft's files, no model), and
    the HF engine's sampler of a version (the base from model.path with them) computes what the trained policy
    computes. Fails if the whole model is published, or the adapters name another base."""
    import torch
    from transformers import AutoModelForCausalLM

    from factories import make_tiny_qwen2
    from rlcli.rollout.samplers import ENGINES

    model = make_tiny_qwen2(tmp_path / "model")
    with StreamWriter(redis_url) as writer:
        writer.push_many([record(i) for i in range(3)])
    module = train(compose_train_config(overrides(redis_url, "model=hf", f"model.path={model}", "model.lora.rank=4",
                                                  "optimizer.lr=0.05", "publish.lora=adapter")), tmp_path / "run")

    version = tmp_path / "run" / "weights" / "v3"
    assert sorted(p.name for p in version.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    sampler = ENGINES["hf"](None, False).of_checkpoint(version, {"temperature": 1.0}).model.to(torch.float64)
    policy = module.policy.to(torch.float64).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        assert (expected - base(input_ids=ids).logits).abs().max() > 1e-3  # the adapters moved
        torch.testing.assert_close(sampler(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
