"""`rlcli train` end to end on the tiny model: every loss x aggregation, outputs, data errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from factories import initial_policy, rollout_record, write_jsonl
from rlcli.commands.train import train
from rlcli.errors import UserError
from train_helpers import compose_train_config, run_rlcli

AGGREGATIONS = ["token_mean", "sample_mean", "prompt_mean", "constant aggregation.divisor=16"]
AGGREGATIONS = [f"aggregation={a}" for a in AGGREGATIONS]
SPEC_METRICS = {
    "loss", "num_documents", "documents_seen", "num_tokens", "grad_norm", "lr", "old_logprobs",
    "new_logprobs", "ratio_new_old", "ratio_new_old_sum", "ratio_new_old_squared_sum", "kl_new_old",
    "clipped_ratio_fraction", "advantage", "max_advantage", "min_advantage",
}


def train_in_process(tmp_path: Path, rollouts: Path, *overrides: str, steps: int = 3):
    run_dir = tmp_path / "run"
    cfg = compose_train_config([
        "data=rollouts", f"data.paths=[{rollouts}]", "data.max_tokens=32", f"trainer.max_steps={steps}",
        "trainer.accumulate_microbatches=2", "optimizer.lr=1e-2", *overrides,
    ])
    return train(cfg, run_dir), run_dir


def read_metrics(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_train_every_loss_and_aggregation(tmp_path, small_rollouts, loss, aggregation):
    torch.manual_seed(0)
    module, run_dir = train_in_process(tmp_path, small_rollouts, f"loss={loss}", *aggregation.split())

    rows = read_metrics(run_dir)
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    expected = SPEC_METRICS | ({"num_segments"} if loss == "gspo" else set())
    assert expected <= set(rows[0])
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in rows)
    assert int(float(rows[-1]["documents_seen"])) == sum(int(float(r["num_documents"])) for r in rows)

    initial = initial_policy(compose_train_config()).state_dict()
    changed = [name for name, p in module.policy.state_dict().items() if not torch.equal(p, initial[name])]
    assert changed, "training did not change any parameter"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "config.yaml").is_file()


def test_export_reloads_with_transformers_and_gives_the_same_logits(tmp_path, small_rollouts):
    from transformers import AutoModelForCausalLM

    module, run_dir = train_in_process(tmp_path, small_rollouts, steps=2)
    export = run_dir / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module.policy.eval()(input_ids).logits
        actual = reloaded(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


def test_checkpoint_every_n_steps(tmp_path, small_rollouts):
    _, run_dir = train_in_process(tmp_path, small_rollouts, "trainer.checkpoint_every=2", steps=3)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step-2.ckpt", "step-3.ckpt"]  # every 2 steps, and the final step


def test_run_ends_when_the_data_is_used_up_and_trains_every_document_once(tmp_path, small_rollouts):
    module, run_dir = train_in_process(tmp_path, small_rollouts, steps=1000)
    rows = read_metrics(run_dir)
    assert int(float(rows[-1]["documents_seen"])) == 16
    assert module.documents_seen == 16


def test_skip_mode_trains_the_valid_records_and_writes_the_rejected(tmp_path):
    records = [rollout_record(g) for g in range(10)]
    records[2]["old_logprobs"][0] = 0.5  # positive log-probability
    records[7]["completion_ids"] = []  # empty completion
    data = write_jsonl(tmp_path / "mixed.jsonl", records)
    module, run_dir = train_in_process(tmp_path, data, "data.on_invalid=skip", steps=1000)
    rejected = [json.loads(line) for line in (run_dir / "rejected.jsonl").read_text().splitlines()]
    assert sorted(r["source"] for r in rejected) == [f"{data}:3", f"{data}:8"]
    assert module.documents_seen + len(rejected) == len(records)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda r: r.update(prompt_ids=[]), "field 'prompt_ids'"),
        (lambda r: r.update(completion_ids=[1, 99]), "field 'completion_ids'"),
        (lambda r: r.update(old_logprobs=[-1.0]), "field 'old_logprobs'"),
        (lambda r: r.update(advantage=float("nan")), "field 'advantage'"),
        (lambda r: r.pop("reward"), "reward"),
        (lambda r: r.update(completion_mask=[1, 2, 1, 1]), "field 'completion_mask'"),
        (lambda r: r.update(temperature=-1.0), "field 'temperature'"),
    ],
)
def test_invalid_record_stops_before_training_with_file_line_and_field(tmp_path, breakage, message):
    records = [rollout_record(g) for g in range(4)]
    breakage(records[1])
    data = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(UserError, match=f"{data}:2") as info:
        train_in_process(tmp_path, data)
    assert message in str(info.value)
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_record_temperature_must_match_loss_temperature(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", [rollout_record(g, temperature=0.7) for g in range(4)])
    with pytest.raises(UserError, match="temperature"):
        train_in_process(tmp_path, data)
    module, _ = train_in_process(tmp_path, data, "loss.temperature=0.7", steps=1)
    assert module.documents_seen > 0


def test_one_step_of_many_micro_batches_equals_one_big_micro_batch(tmp_path, small_rollouts):
    """math.md#aggregation invariance through the real module: the split of a step changes nothing."""
    params = []
    for max_tokens, accumulate in ((10_000, 1), (24, 16)):
        torch.manual_seed(0)
        module, _ = train_in_process(
            tmp_path / f"split{max_tokens}", small_rollouts, "optimizer=sgd", "optimizer.lr=1.0",
            "trainer.grad_clip=0", "aggregation=prompt_mean", f"data.max_tokens={max_tokens}",
            f"trainer.accumulate_microbatches={accumulate}", steps=1,
        )
        assert module.documents_seen == 16
        params.append(torch.cat([p.detach().flatten() for p in module.policy.parameters()]))
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=1e-6)


def test_packed_logprobs_equal_one_document_at_a_time(small_rollouts):
    from rlcli.data.packing import make_micro_batch
    from rlcli.data.readers import load_rollouts
    from rlcli.model.scorer import TokenScorer
    from rlcli.modules import HeadSpec
    from rlcli.rollout.advantages import apply_advantage_estimator

    cfg = compose_train_config(["data=rollouts"])
    policy = initial_policy(cfg)
    scorer = TokenScorer(policy, HeadSpec(chunk_tokens=0), with_entropy=False)
    documents, _ = load_rollouts([small_rollouts], vocab_size=64)
    documents = apply_advantage_estimator(documents, "grpo", eps=cfg.advantage.eps)[:6]

    def logprobs_of(batch):
        with torch.no_grad():
            return scorer(batch.input_ids, batch.position_ids, batch.labels)[0]

    packed = logprobs_of(make_micro_batch(documents))
    alone = torch.cat([logprobs_of(make_micro_batch([doc])) for doc in documents])
    assert packed.shape == alone.shape and (packed != 0).sum() > 10
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_cli_default_training_and_bad_data_exit_codes(tmp_path):
    result = run_rlcli(["train", "trainer.max_steps=2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = list((tmp_path / "outputs").glob("*/*"))
    assert len(read_metrics(run_dir)) == 2 and (run_dir / "export" / "model.safetensors").is_file()
    assert "step 2/2" in result.stdout and "export (Hugging Face):" in result.stdout  # progress and summary

    bad = write_jsonl(tmp_path / "bad.jsonl", [rollout_record(0, old_logprobs=[0.1, -1, -1, -1])])
    result = run_rlcli(["train", "data=rollouts", f"data.paths=[{bad}]"], cwd=tmp_path)
    assert result.returncode == 2
    assert f"{bad}:1: field 'old_logprobs'" in result.stderr and "Traceback" not in result.stderr
