"""The sampler worker against a real Redis: what it pushes, which weights it samples with, when it
waits and when it stops; and `rlcli sample` as a process."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from factories import tiny_policy
from rlcli.commands.sample import with_stream_data
from rlcli.conf.schema import AdvantageConfig, RewardConfig, RolloutConfig, SampleConfig, StreamDataConfig
from rlcli.data.schema import validate_record
from rlcli.rollout.tasks import Prompt, ReverseTask
from rlcli.stream.connection import connect
from rlcli.stream.queue import announce_weights
from rlcli.stream.records import decode
from rlcli.stream.worker import SamplerWorker
from train_helpers import require_vllm

STREAM, GROUP = "rlcli:rollouts", "rlcli-trainer"
PROMPTS, GROUP_SIZE, TEMPERATURE = 2, 4, 0.7
EPS = 1e-6


def save_policy(directory: Path, seed: int, num_heads: int = 4) -> Path:
    """A tiny random policy for the reverse task, saved in Hugging Face format as the trainer publishes it."""
    vocab_size = ReverseTask().tokenizer.vocab_size
    tiny_policy(vocab_size, hidden_size=32, num_heads=num_heads, seed=seed).save_pretrained(directory)
    return directory


def announce(conn, version: int, path: Path | None, documents_seen: int = 0, final: bool = False) -> None:
    announce_weights(conn, STREAM, {"version": version, "path": str(path), "documents_seen": documents_seen,
                                    "final": final})


def make_worker(url: str, *, worker: int = 0, max_queue: int = 1000, max_lag: int = 4, stop=lambda: False,
                engine: str = "hf", completions: Path | None = None, overlong_buffer: int | None = None,
                mask_truncated: bool = False, group_filter: str = "none", filter_metric: str | None = None,
                rejected: Path | None = None):
    data = StreamDataConfig(kind="stream", url=url, stream=STREAM, group=GROUP, max_tokens=256, max_lag=max_lag,
                            allow_temperature_mismatch=False, wait_warning=30.0, idle_timeout=None)
    rollout = RolloutConfig(prompts_per_step=PROMPTS, group_size=GROUP_SIZE, max_new_tokens=4,
                            temperature=TEMPERATURE, top_p=1.0, top_k=0, engine=engine, save=False, log_completions=2,
                            mask_truncated=mask_truncated, filter=group_filter, filter_metric=filter_metric,
                            max_sampling_rounds=3, stop=[], vllm={"dtype": "float32", "enforce_eager": True})
    return SamplerWorker(connect(url), ReverseTask(), rollout=rollout, advantage=AdvantageConfig("grpo", EPS, None),
                         reward=RewardConfig(overlong_buffer=overlong_buffer, overlong_penalty=0.5), data=data,
                         sample=SampleConfig(workers=2, max_queue=max_queue), seed=0, worker=worker,
                         stop=stop, completions=completions, rejected=rejected)


def stream_records(conn) -> list[dict]:
    return [decode(fields) for _, fields in conn.call("xrange", STREAM)]


def grpo_reference(rewards: list[float]) -> list[float]:
    """(r - mean) / (std + eps), population std, in float64 (docs/concepts/math.md#advantages)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + EPS) for r in rewards]


def model_logprobs(path: Path, record: dict) -> torch.Tensor:
    """The completion's log-probs at the temperature, from one plain forward pass of the saved model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = record["prompt_ids"] + record["completion_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [L, V]
    logprobs = torch.log_softmax(logits[:-1] / TEMPERATURE, dim=-1)  # [L - 1, V]: predicts ids[1:]
    predicted = logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # [L - 1]
    return predicted[len(record["prompt_ids"]) - 1:]  # [completion length]


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_rounds_push_valid_records_with_grpo_advantages_and_sampler_logprobs(redis_url, tmp_path):
    conn = connect(redis_url)
    v0 = save_policy(tmp_path / "v0", seed=0)
    announce(conn, 0, v0)
    worker = make_worker(redis_url)
    assert worker.run(max_rounds=2) == "rounds"

    records = stream_records(conn)
    assert len(records) == 2 * PROMPTS * GROUP_SIZE
    vocab_size = ReverseTask().tokenizer.vocab_size
    for i, record in enumerate(records):
        validate_record(record, source="stream", index=i, vocab_size=vocab_size)
        assert record["policy_version"] == 0 and record["temperature"] == TEMPERATURE
        torch.testing.assert_close(torch.tensor(record["old_logprobs"]), model_logprobs(v0, record),
                                   rtol=0, atol=1e-5)
    assert len({r["id"] for r in records}) == len(records)

    groups = defaultdict(list)
    for record in records:
        groups[record["group_id"]].append(record)
    assert sorted(len(g) for g in groups.values()) == [GROUP_SIZE] * (2 * PROMPTS)
    for group in groups.values():
        reference = grpo_reference([r["reward"] for r in group])
        for record, advantage in zip(group, reference):
            assert record["advantages"] == pytest.approx([advantage] * len(record["completion_ids"]), abs=1e-12)
    worker.close()


def test_rounds_push_shaped_rewards_and_no_truncated_completion(redis_url, tmp_path):
    """The sampler shapes as the trainer does (math.md#overlong-shaping): with reward.overlong_buffer=2 and
    p = 0.5 each pushed reward is the task's plus 0.5 x R_len(|y|) (float64, from the formula), and with
    rollout.mask_truncated no pushed completion lacks its eos."""
    conn = connect(redis_url)
    announce(conn, 0, save_policy(tmp_path / "v0", seed=0))
    worker = make_worker(redis_url, overlong_buffer=2, mask_truncated=True)
    assert worker.run(max_rounds=2) == "rounds"
    records = stream_records(conn)
    task = ReverseTask()
    assert 0 < len(records) < 2 * PROMPTS * GROUP_SIZE  # the untrained policy truncates some completions
    for record in records:
        ids = record["completion_ids"]
        assert ids[-1] == task.tokenizer.eos_id
        text = task.tokenizer.decode(record["prompt_ids"])
        plain = task.reward(Prompt(text=text, ids=tuple(record["prompt_ids"]), answer=text[:-1][::-1]), ids)
        r_len = 0.0 if len(ids) <= 4 - 2 else ((4 - 2) - len(ids)) / 2
        assert record["reward"] == plain + 0.5 * r_len
    worker.close()


def test_rounds_push_only_the_kept_groups_and_reject_the_others(redis_url, tmp_path, caplog):
    """rollout.filter=zero_variance on accuracy in the sampler (math.md#dynamic-sampling); the untrained policy is
    nearly always wrong, so most groups are dropped and each round samples up to 3 rounds. Every pushed group is
    whole and mixes right and wrong answers; each line of rejected.jsonl is a record of a group whose completions
    (rejudged here by the task) are all right or all wrong, with its reason and an id of its own; the log lines
    count both. Pushing a dropped group, or dropping a kept one, fails."""
    conn = connect(redis_url)
    announce(conn, 0, save_policy(tmp_path / "v0", seed=0))
    worker = make_worker(redis_url, group_filter="zero_variance", filter_metric="accuracy",
                         rejected=tmp_path / "rejected.jsonl")
    with caplog.at_level(logging.INFO, logger="rlcli"):
        assert worker.run(max_rounds=2) == "rounds"
    worker.close()
    task = ReverseTask()

    def correct(record):
        text = task.tokenizer.decode(record["prompt_ids"])
        return task.is_correct(Prompt(text=text, ids=tuple(record["prompt_ids"]), answer=text[:-1][::-1]),
                               record["completion_ids"])

    pushed, dropped = defaultdict(list), defaultdict(list)
    for record in stream_records(conn):
        pushed[record["group_id"]].append(correct(record))
    lines = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    for line in lines:
        dropped[line["record"]["group_id"]].append(correct(line["record"]))
        assert line["field"] == "accuracy" and line["reason"].startswith(
            "rollout.filter=zero_variance: all 4 documents of group")
    assert len(dropped) > len(pushed)
    assert all(len(v) == GROUP_SIZE and len(set(v)) > 1 for v in pushed.values())
    assert all(len(v) == GROUP_SIZE and len(set(v)) == 1 for v in dropped.values())
    assert not set(pushed) & set(dropped)
    assert len({line["record"]["id"] for line in lines}) == len(lines)
    logged = [m for m in caplog.messages if "pushed" in m]
    kept = sum(float(m.split("groups_kept ")[1].split(",")[0]) for m in logged)
    filtered = sum(float(m.split("groups_filtered ")[1].split(",")[0]) for m in logged)
    assert (kept, filtered) == (len(pushed), len(dropped))


def test_each_round_appends_the_text_of_one_record_of_each_group(redis_url, tmp_path):
    """The sampler's completions.jsonl: per round the first pushed record of each group, decoded by the
    task's tokenizer, with the weights' version; a wrong record, text or version fails it."""
    conn = connect(redis_url)
    announce(conn, 3, save_policy(tmp_path / "v3", seed=0))
    worker = make_worker(redis_url, completions=tmp_path / "completions.jsonl")
    worker.run(max_rounds=2)
    worker.close()
    tokenizer = ReverseTask().tokenizer
    firsts = {}
    for record in stream_records(conn):
        firsts.setdefault(record["group_id"], record)
    logged = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [line["round"] for line in logged] == [0, 0, 1, 1]  # log_completions=2 of PROMPTS=2 groups a round
    assert len({line["group_id"] for line in logged}) == 4
    for line in logged:
        record = firsts[line["group_id"]]
        assert line["policy_version"] == 3
        assert line["prompt"] == tokenizer.decode(record["prompt_ids"])
        assert line["completion"] == tokenizer.decode(record["completion_ids"])
        assert (line["reward"], line["advantage"], line["length"]) == (
            record["reward"], record["advantages"][0], len(record["completion_ids"]))
        assert line["stopped"] == (record["completion_ids"][-1] == tokenizer.eos_id)


def test_a_new_announcement_is_loaded_before_the_next_round(redis_url, tmp_path):
    conn = connect(redis_url)
    announce(conn, 0, save_policy(tmp_path / "v0", seed=0))
    worker = make_worker(redis_url)
    worker.run(max_rounds=1)
    v1 = save_policy(tmp_path / "v1", seed=1)
    announce(conn, 1, v1, documents_seen=PROMPTS * GROUP_SIZE)
    worker.run(max_rounds=1)

    records = stream_records(conn)
    assert [r["policy_version"] for r in records] == [0] * (PROMPTS * GROUP_SIZE) + [1] * (PROMPTS * GROUP_SIZE)
    last = records[-1]
    torch.testing.assert_close(torch.tensor(last["old_logprobs"]), model_logprobs(v1, last), rtol=0, atol=1e-5)
    assert len({r["id"] for r in records}) == len(records)
    worker.close()


def test_a_vllm_sampler_loads_each_announced_version_into_one_engine(redis_url, tmp_path):
    require_vllm()
    conn = connect(redis_url)
    v0 = save_policy(tmp_path / "v0", seed=0, num_heads=1)  # heads of 32 dimensions, as vLLM's CPU kernels need
    announce(conn, 0, v0)
    worker = make_worker(redis_url, engine="vllm")
    try:
        worker.run(max_rounds=1)
        engine = worker.rollouts.sampler.engine
        v1 = save_policy(tmp_path / "v1", seed=1, num_heads=1)
        announce(conn, 1, v1, documents_seen=PROMPTS * GROUP_SIZE)
        worker.run(max_rounds=1)
        assert worker.rollouts.sampler.engine is engine  # built once, loaded twice
    finally:
        worker.close()
    records = stream_records(conn)
    assert [r["policy_version"] for r in records] == [0] * (PROMPTS * GROUP_SIZE) + [1] * (PROMPTS * GROUP_SIZE)
    for record in records:
        weights = v0 if record["policy_version"] == 0 else v1
        torch.testing.assert_close(torch.tensor(record["old_logprobs"]), model_logprobs(weights, record),
                                   rtol=0, atol=1e-5)


def save_adapter_version(base: Path, directory: Path, seed: int) -> tuple[Path, Path]:
    """LoRA adapters (rank 4, random B, so they change the model) on the saved policy ``base``, in peft's format
    as ``publish.lora=adapter`` publishes them, and, as the reference, peft's own merge of them into the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    model.peft_config["default"].base_model_name_or_path = str(base)
    model.save_pretrained(directory)
    model.merge_and_unload().save_pretrained(directory.with_name(directory.name + "-merged"))
    return directory, directory.with_name(directory.name + "-merged")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_published_adapters_are_sampled_on_the_base_model(redis_url, tmp_path, engine):
    """publish.lora=adapter: each announced version is an adapter directory; the sampler applies it to the base
    model its config names (vLLM: one engine with LoRA, the base loaded once). Every record's log-probs are those
    of peft's merge of that version into the base. Fails if an adapter is ignored (the base's log-probs) or a
    later version keeps the first one's."""
    if engine == "vllm":
        require_vllm()
    conn = connect(redis_url)
    base = save_policy(tmp_path / "base", seed=0, num_heads=1)  # heads of 32 dimensions, as vLLM's CPU kernels need
    versions = [save_adapter_version(base, tmp_path / f"v{v}", seed=v) for v in (0, 1)]
    announce(conn, 0, versions[0][0])
    worker = make_worker(redis_url, engine=engine)
    try:
        worker.run(max_rounds=1)
        announce(conn, 1, versions[1][0], documents_seen=PROMPTS * GROUP_SIZE)
        worker.run(max_rounds=1)
    finally:
        worker.close()
    records = stream_records(conn)
    assert [r["policy_version"] for r in records] == [0] * (PROMPTS * GROUP_SIZE) + [1] * (PROMPTS * GROUP_SIZE)
    for record in records:
        merged = versions[record["policy_version"]][1]
        torch.testing.assert_close(torch.tensor(record["old_logprobs"]), model_logprobs(merged, record),
                                   rtol=0, atol=1e-5)


def test_a_restarted_sampler_repeats_no_id_group_or_sample(redis_url, tmp_path):
    conn = connect(redis_url)
    announce(conn, 0, save_policy(tmp_path / "v0", seed=0))
    for _ in range(2):  # the same worker index, started twice, sampling round 0 with the same weights
        worker = make_worker(redis_url, worker=1)
        worker.run(max_rounds=1)
        worker.close()
    records = stream_records(conn)
    half = len(records) // 2
    assert len({r["id"] for r in records}) == len(records)
    assert not {r["group_id"] for r in records[:half]} & {r["group_id"] for r in records[half:]}
    assert [r["completion_ids"] for r in records[:half]] != [r["completion_ids"] for r in records[half:]]


def fill(conn, count: int) -> None:
    for i in range(count):
        conn.call("xadd", STREAM, {"record": json.dumps({"id": f"filler-{i}"})})


def read_through_group(conn, count: int) -> None:
    """Read ``count`` entries as the trainer's consumer group does (they stop being unread)."""
    if not any(g["name"] == GROUP for g in conn.call("xinfo_groups", STREAM)):
        conn.call("xgroup_create", STREAM, GROUP, id="0")
    conn.call("xreadgroup", GROUP, "trainer", {STREAM: ">"}, count=count)


@pytest.mark.parametrize("limit", ["max_queue", "max_lag"])
def test_back_pressure_holds_rounds_until_the_trainer_reads(redis_url, tmp_path, caplog, limit):
    conn = connect(redis_url)
    if limit == "max_queue":  # 4 unread > max_queue 3
        options, filled, read, message = {"max_queue": 3}, 4, 4, "more than sample.max_queue=3 unread records"
        announce(conn, 0, save_policy(tmp_path / "v0", seed=0))
    else:  # trainer at v2 after 16 documents (8 per version): 12 unread reach it at v3.5, 1.5 > max_lag 1
        options, filled, read, message = {"max_lag": 1}, 12, 8, "would reach the trainer at about v3.5"
        announce(conn, 2, save_policy(tmp_path / "v2", seed=0), documents_seen=16)
    fill(conn, filled)
    stop = threading.Event()
    worker = make_worker(redis_url, stop=stop.is_set, **options)
    outcome = []
    caplog.set_level(logging.INFO, logger="rlcli")
    thread = threading.Thread(target=lambda: outcome.append(worker.run()))
    thread.start()
    try:
        wait_until(lambda: message in caplog.text)
        time.sleep(1.0)
        assert conn.call("xlen", STREAM) == filled  # nothing pushed while the trainer is behind
        assert caplog.text.count(message) == 1  # said once per wait
        read_through_group(conn, read)
        wait_until(lambda: conn.call("xlen", STREAM) > filled)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert outcome == ["stopped"]
    worker.close()


def test_waits_for_the_first_announcement_and_stops_on_final(redis_url, tmp_path, caplog):
    conn = connect(redis_url)
    caplog.set_level(logging.INFO, logger="rlcli")
    worker = make_worker(redis_url)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(worker.run()))
    thread.start()
    try:
        wait_until(lambda: "waiting for the trainer's first published weights at rlcli:rollouts:weights"
                   in caplog.text)
        v0 = save_policy(tmp_path / "v0", seed=0)
        announce(conn, 0, v0)
        wait_until(lambda: conn.call("xlen", STREAM) > 0)
        announce(conn, 0, v0, final=True)
    finally:
        thread.join(timeout=60)
    assert outcome == ["final"]
    assert conn.call("xlen", STREAM) % (PROMPTS * GROUP_SIZE) == 0  # whole rounds only
    worker.close()


def test_with_stream_data_adds_data_stream_unless_chosen():
    assert with_stream_data(["seed=1"]) == ["seed=1", "data=stream"]
    assert with_stream_data(["data=generate", "seed=1"]) == ["data=generate", "seed=1"]
    assert with_stream_data(["data.url=redis://h:1/0"]) == ["data.url=redis://h:1/0", "data=stream"]


def start_sample(args: list[str], cwd: Path, worker: str = "0") -> subprocess.Popen:
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               RLCLI_SAMPLE_WORKER=worker)
    return subprocess.Popen([sys.executable, "-m", "rlcli", "sample", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("args, worker, message", [
    (["sample.workers=0"], "0", "sample.workers: must be >= 1"),
    ([], "0", "data.url: required by data=stream"),
    (["data.url=redis://127.0.0.1:6379/0", "sample.workers=2"], "2",
     "RLCLI_SAMPLE_WORKER='2': must be a sampler index from 0 to sample.workers - 1 = 1"),
    (["data=generate"], "0", "data: rlcli sample pushes into a stream"),
    (["nosuchgroup=1"], "0", "nosuchgroup"),
])
def test_sample_config_errors_exit_2_with_one_message(tmp_path, args, worker, message):
    process = start_sample([*args, "hydra.run.dir=run"], tmp_path, worker)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert message in output and "Traceback" not in output


@pytest.mark.slow
@pytest.mark.parametrize("end, code", [("final", 0), (signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_sample_runs_until_final_or_a_signal(redis_url, tmp_path, end, code):
    conn = connect(redis_url)
    v0 = save_policy(tmp_path / "v0", seed=0)
    announce(conn, 0, v0)
    process = start_sample([f"data.url={redis_url}", "hydra.run.dir=run", "rollout.prompts_per_step=2",
                            "rollout.group_size=2", "sample.max_queue=1000000"], tmp_path)
    try:
        wait_until(lambda: conn.call("xlen", STREAM) >= 8 or process.poll() is not None, timeout=120)
        if end == "final":
            announce(conn, 0, v0, final=True)
        else:
            process.send_signal(end)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == code, output
    assert ("trainer finished" if end == "final" else f"stopped by {end.name}") in output
    assert "round 0: v0" in output
    assert (tmp_path / "run" / "sample.log").is_file()
    assert conn.call("xlen", STREAM) % 4 == 0  # whole rounds only
