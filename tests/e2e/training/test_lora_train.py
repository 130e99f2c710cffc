"""LoRA training end to end (``model.lora``, issue 30): the adapters raise the default task's reward as full
fine-tuning does, the reference is the base model, only the adapters train and only they are checkpointed, a
checkpoint refuses another base model, exact resume, and an export whose merged weights and peft adapter
reproduce the trained policy's log-probs.

The runs are shared: `lora_run` is ``rlcli train model.lora.rank=8 kl.coef=0.05`` (the default task, 4 steps);
`hf_run` is the same on a tiny Qwen2 checkpoint (``model=hf``), trained on rollout files.
"""

from __future__ import annotations

import copy
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fault_injection import FAULTS_ENV, callbacks_override
from safetensors.torch import load_file, save_file

from factories import initial_policy, make_tiny_qwen2, rollout_record, write_jsonl
from rlcli.commands.train import train
from rlcli.errors import UserError
from train_helpers import compose_train_config

pytestmark = pytest.mark.slow  # each test needs a training run of a few seconds (shared by the module)

LORA = ["model.lora.rank=8", "kl.coef=0.05"]
TINY = [*LORA, "trainer.max_steps=4", "trainer.checkpoint_every=2"]


def read_metrics(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def mean_reward(rows: list[dict], steps: slice) -> float:
    rewards = [float(r["reward"]) for r in rows][steps]
    return sum(rewards) / len(rewards)


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``model``'s float64 log-probs of each next token of ``input_ids`` [B, T] -> [B, T - 1]."""
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits  # [B, T, V]
    logprobs = torch.log_softmax(logits[:, :-1].double(), dim=-1)  # [B, T - 1, V]
    return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    return train(compose_train_config(TINY), run_dir), run_dir


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The same run with model.lora.rank=0 (the whole model trains), 1 step: the size of a checkpoint."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    train(compose_train_config([*TINY, "model.lora.rank=0", "trainer.max_steps=1"]), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """(base model directory, overrides, trained module, run directory) of 2 LoRA steps on a tiny Qwen2
    checkpoint."""
    root = tmp_path_factory.mktemp("hf")
    base = make_tiny_qwen2(root / "base")
    rollouts = write_jsonl(root / "rollouts.jsonl", [rollout_record(g, completion_len=3 + g % 5) for g in range(16)])
    overrides = ["model=hf", f"model.path={base}", *LORA, "data=rollouts", f"data.paths=[{rollouts}]",
                 "data.max_tokens=32", "trainer.accumulate_microbatches=2", "trainer.max_steps=2",
                 "optimizer.lr=1e-2", "logger=none"]
    run_dir = root / "run"
    return base, overrides, train(compose_train_config(overrides), run_dir), run_dir


def test_the_reference_is_the_base_model_kl_is_zero_at_step_1_then_grows(lora_run):
    """kl.reference=initial with LoRA is the policy with its adapters off: at step 1 (B = 0) it is the policy,
    ``kl_ref`` exactly 0 and the ratio 1; later the adapters have moved and ``kl_ref > 0``. Fails if the adapters
    do not start at zero (step 1), or if the reference keeps its adapters on (kl_ref stays 0)."""
    rows = read_metrics(lora_run[1])
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert float(rows[0]["kl_ref"]) == 0.0
    assert float(rows[0]["ratio_new_old"]) == pytest.approx(1.0, abs=1e-6)
    assert all(float(r["kl_ref"]) > 0 for r in rows[1:]), [r["kl_ref"] for r in rows]


def test_only_the_adapters_train_and_only_they_are_checkpointed(lora_run):
    """After the run the base weights equal the initial ones bit for bit, the checkpoint's state dict holds the
    adapters of every linear layer but the head and nothing else, and the export is the merged model: peft's own
    ``merge_and_unload`` of ``export/adapter`` onto the initial weights, off the base where adapters are. Fails if
    the base is not frozen or if `PolicyModule.on_save_checkpoint` keeps the base weights."""
    from peft import PeftModel

    module, run_dir = lora_run
    base = initial_policy(compose_train_config(TINY), vocab_size=module.policy.config.vocab_size)
    initial = {name: value.clone() for name, value in base.state_dict().items()}
    trained = module.policy.state_dict()
    layers = [name for name, m in base.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    assert len(layers) == 14  # q, k, v, o, gate, up, down in each of 2 layers

    adapted = {f"{layer}.weight" for layer in layers}
    for name, value in initial.items():
        held = name.replace(".weight", ".base_layer.weight") if name in adapted else name
        assert torch.equal(trained[held], value), name

    saved = checkpoint_state(run_dir / "checkpoints" / "last.ckpt")
    assert set(saved) == {f"scorer.policy.{layer}.lora_{ab}.default.weight" for layer in layers for ab in "AB"}

    export = load_file(run_dir / "export" / "model.safetensors")
    assert set(export) == set(initial)
    assert all(not torch.equal(export[name], initial[name]) for name in adapted)
    assert all(torch.equal(export[name], initial[name]) for name in set(initial) - adapted)
    merged = PeftModel.from_pretrained(base, run_dir / "export" / "adapter").merge_and_unload().state_dict()
    for name, value in merged.items():
        torch.testing.assert_close(export[name], value, rtol=0, atol=1e-6)


def test_a_lora_checkpoint_is_a_small_fraction_of_a_full_one(lora_run, full_run):
    """The checkpoint holds the adapters and their optimizer state, not the base weights: on the tiny model
    (17,408 of 100,544 parameters trainable) 252 kB against the full run's 1,376 kB (0.18; the full one holds
    the reference's copy too), less than the base weights alone. Fails if the base weights are checkpointed too
    (0.41 of the full one then, over the base weights' size)."""
    module, run_dir = lora_run
    lora = (run_dir / "checkpoints" / "last.ckpt").stat().st_size
    full = (full_run / "checkpoints" / "last.ckpt").stat().st_size
    base = sum(p.numel() * p.element_size() for name, p in module.policy.named_parameters() if ".lora_" not in name)
    assert lora / full < 0.5
    assert lora < base


def test_lora_raises_the_default_task_reward_as_full_fine_tuning_does(tmp_path):
    """60 steps of ``rlcli train model.lora.rank=8 kl.coef=0.05`` against the same run training the whole model:
    the adapters raise the mean reward of steps 51-60 over that of steps 1-10 by at least 0.7 of what full
    fine-tuning gains (seed 0: 0.45 against 0.38; docs/how-to/lora.md has three seeds). Fails if the sampler does
    not see the adapters, or with the tiny model's former init (std 0.02, whose frozen head keeps every logit
    within about +-1.3: a gain of 0.05)."""
    gains = {}
    for name, rank in (("lora", 8), ("full", 0)):
        run_dir = tmp_path / name
        train(compose_train_config([*LORA, f"model.lora.rank={rank}", "logger=none"]), run_dir)
        rows = read_metrics(run_dir)
        assert len(rows) == 60
        gains[name] = mean_reward(rows, slice(-10, None)) - mean_reward(rows, slice(0, 10))
    assert gains["full"] > 0.3, gains
    assert gains["lora"] >= 0.7 * gains["full"], gains


def test_killed_in_a_save_and_resumed_equals_the_straight_run(lora_run, tmp_path):
    """Exact resume with adapters: `rlcli train` dies in its step-4 save (the process exits at once, as under kill
    -9, leaving ``step-4.ckpt.tmp``), resumes from step 2 with ``resume=auto``, and logs the same metrics and
    exports the same merged weights and adapters as the straight run. Fails if the resume does not load the
    checkpoint's adapters (or their optimizer state)."""
    straight, killed = lora_run[1], tmp_path / "killed"
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", **FAULTS_ENV)
    died = subprocess.run([sys.executable, "-m", "rlcli", "train", *TINY, f"hydra.run.dir={killed}",
                           *callbacks_override("KillDuringSave", step=4)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert died.returncode == 137, died.stderr[-3000:]
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step-2.ckpt", "step-4.ckpt.tmp"]
    train(compose_train_config([*TINY, "resume=auto"]), killed)

    want, got = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in got] == ["1", "2", "3", "4"]
    for expected, actual in zip(want, got, strict=True):
        for name, value in expected.items():
            # the straight run trained in this process, the killed one in its own, whose float32 sums may round
            # otherwise from step 1 on: kl_new_old, pure rounding of about 1e-9, then differs by up to 1e-8
            assert float(actual[name]) == pytest.approx(float(value), rel=1e-6, abs=1e-7), (expected["step"], name)
    for path in ("model.safetensors", "adapter/adapter_model.safetensors"):
        expected, actual = load_file(straight / "export" / path), load_file(killed / "export" / path)
        assert set(actual) == set(expected)
        for name, value in expected.items():
            assert (actual[name] - value).abs().max() <= 1e-6, (path, name)


def test_a_changed_base_model_is_refused_on_resume(hf_run, tmp_path):
    """A checkpoint of adapters names the base weights it was trained on: one changed weight of ``model.path``
    on disk, and the resume is refused naming the base model. Fails without the fingerprint check in
    `PolicyModule.on_load_checkpoint` (the resume trains on)."""
    base, overrides, _, run_dir = hf_run
    run = shutil.copytree(run_dir, tmp_path / "run")
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    try:
        with pytest.raises(UserError, match="resume: the checkpoint's adapters were trained on other base weights"):
            train(compose_train_config([*overrides, "trainer.max_steps=3", "resume=auto"]), run)
    finally:
        weights.write_bytes(original)


def test_lora_and_full_checkpoints_refuse_each_other(lora_run, full_run, tmp_path):
    """A LoRA checkpoint resumed with model.lora.rank=0, and a full one with model.lora.rank=8: one message each,
    naming the key. Fails if either resume is let through."""
    for run_dir, rank, change in [(lora_run[1], 0, "8 -> 0"), (full_run, 8, "0 -> 8")]:
        run = shutil.copytree(run_dir, tmp_path / run_dir.parent.name)
        with pytest.raises(UserError) as refused:
            train(compose_train_config([*TINY, f"model.lora.rank={rank}", "resume=auto"]), run)
        changes = [line.strip() for line in str(refused.value).splitlines() if line.startswith("  - ")]
        assert changes == [f"- model.lora.rank: {change}"]


def test_the_export_reproduces_the_trained_policy_logprobs(hf_run):
    """What `rlcli eval` loads of ``export/`` (the merged model) and ``export/adapter`` put on the base model
    with ``peft.PeftModel.from_pretrained`` both give the trained policy's log-probs (all three in float64), which
    differ from the base model's. Fails if the merge or the saved adapters are wrong (e.g. a missing scale)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlcli.commands.eval import model_overrides
    from rlcli.conf.validate import validate_config
    from rlcli.model.policy import build_policy

    base, _, module, run_dir = hf_run
    export = run_dir / "export"
    input_ids = torch.randint(0, module.policy.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    trained = token_logprobs(copy.deepcopy(module.policy), input_ids)  # [3, 15]
    before = token_logprobs(AutoModelForCausalLM.from_pretrained(base), input_ids)
    assert (trained - before).abs().max() > 1e-3  # the adapters moved the policy

    evaluated = build_policy(validate_config(compose_train_config(model_overrides([str(export)]))).model)
    torch.testing.assert_close(token_logprobs(evaluated, input_ids), trained, rtol=0, atol=1e-5)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export / "adapter")
    torch.testing.assert_close(token_logprobs(adapter, input_ids), trained, rtol=0, atol=1e-10)
