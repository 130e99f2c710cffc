"""Config groups compose, and every invalid config is reported in one message."""

from __future__ import annotations

import pytest

from rlcli.conf.validate import ConfigError, validate_config
from train_helpers import compose_train_config

GROUP_OPTIONS = [
    "loss=grpo", "loss=gspo",
    "aggregation=token_mean", "aggregation=sample_mean", "aggregation=prompt_mean",
    "aggregation=constant aggregation.divisor=512",
    "metrics=none", "metrics=basic", "metrics=with_entropy",
    "model=tiny", "model=hf model.path=/some/checkpoint",
    "data=rollouts", "data=generate", "optimizer=adamw", "optimizer=sgd", "trainer=default", "strategy=auto",
    "logger=csv", "logger=none", "logger=wandb", "logger=tensorboard", "logger=[wandb,tensorboard]",
    "strategy=ddp", "strategy=fsdp2 data=rollouts", "experiment=gspo_dr", "task=addition", "task=reverse",
    "launcher=local", "launcher=slurm",
    "loss=cispo", "loss=sapo", "loss=gspo_token",
]


@pytest.mark.parametrize("overrides", GROUP_OPTIONS)
def test_every_group_option_composes_and_validates(overrides):
    cfg = validate_config(compose_train_config(overrides.split()))
    group, _, option = overrides.split()[0].partition("=")
    if group == "experiment":
        assert (cfg.loss.name, cfg.aggregation.name, cfg.aggregation.divisor) == ("gspo", "constant", 1)
    elif group == "task":
        assert cfg.task["_target_"] == {"addition": "rlcli.rollout.tasks.AdditionTask",
                                     "reverse": "rlcli.rollout.tasks.ReverseTask"}[option]
    elif group == "launcher":
        assert cfg.resume == ("auto" if option == "slurm" else None)  # the launcher itself lives in hydra.*
    elif group == "logger":
        on = {name for name in ("wandb", "tensorboard") if getattr(cfg.logger, name) is not None}
        assert on == set(option.strip("[]").split(",")) - {"csv", "none"}
    else:
        node = getattr(cfg, group)
        assert option in (getattr(node, "name", None), getattr(node, "level", None), getattr(node, "kind", None),
                          getattr(node, "reduce", None)) or group == "trainer"


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(compose_train_config(overrides))
    return info.value.problems


@pytest.mark.parametrize(
    "override, expected",
    [
        ("loss.eps_low=1.0", "loss.eps_low: must be < 1"),
        ("loss.eps_low=-0.1", "loss.eps_low: must be >= 0"),
        ("loss.eps_high=-0.5", "loss.eps_high: must be >= 0"),
        ("loss.temperature=0", "loss.temperature: must be >= 1.17549e-38, got 0"),  # float32's smallest normal
        ("loss.temperature=nan", "loss.temperature: must be a finite number"),
        ("loss.chunk_tokens=-1", "loss.chunk_tokens: must be >= 0"),
        ("loss.chunk_tokens=most", "loss.chunk_tokens: expected int, got 'most' (str) or must be one of ['auto']"),
        ("loss.fp32_lm_head=maybe", "loss.fp32_lm_head: expected bool"),
        ("model.attn_implementation=flash", "model.attn_implementation: must be one of"),
        ("aggregation=constant", "aggregation.divisor: is required"),
        ("aggregation=constant aggregation.divisor=0", "aggregation.divisor: must be >= 1.17549e-38"),
        ("aggregation=constant aggregation.divisor=inf", "aggregation.divisor: must be a finite number"),
        ("aggregation=constant aggregation.divisor=null", "aggregation.divisor: is required for aggregation=constant"),
        ("aggregation.divisor=4", "aggregation.divisor: only valid with aggregation=constant"),
        ("objective=final objective.last_k=5", "objective.last_k: only valid with objective.reduce=mean_last"),
        ("objective.last_k=null", "objective.last_k: is required for objective.reduce=mean_last"),
        ("objective.last_k=0", "objective.last_k: must be >= 1"),
        ("objective.reduce=last", "objective.reduce: must be one of"),
        ("objective.direction=up", "objective.direction: must be one of"),
        ("trainer.max_steps=abc", "trainer.max_steps: expected int"),
        ("trainer.max_steps=0", "trainer.max_steps: must be >= 1"),
        ("trainer.precision=8-true", "trainer.precision: must be one of"),
        ("data=rollouts data.on_invalid=ignore", "data.on_invalid: must be one of"),
        ("data=rollouts data.paths=a.jsonl", "data.paths: expected a list"),
        ("rollout.group_size=0", "rollout.group_size: must be >= 1"),
        ("trainer.docs_per_step=8", "trainer.docs_per_step: with data=generate a step is the rollouts it sampled"),
        ("rollout.top_p=1.5", "rollout.top_p: must be <= 1"),
        ("advantage.estimator=none", "advantage.estimator: on-policy rollouts (data=generate) need grpo or dr_grpo"),
        ("strategy=fsdp2", "strategy: on-policy generation (data=generate) runs with strategy=auto or ddp"),
        ("model=hf", "model.path: is required"),
        ("optimizer.lr=-1", "optimizer.lr: must be > 0"),
        ("advantage.estimator=ppo", "advantage.estimator: must be one of"),
        ("optimizer.lr=0", "optimizer.lr: must be > 0"),
        ("+trainer.max_epochs=3", "trainer.max_epochs: unknown key"),
        ("+lossy=1", "lossy: unknown key"),
    ],
)
def test_each_invalid_value_is_named(override, expected):
    problems = problems_of(override.split())
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("0", 0), ("64", 64)])
def test_chunk_tokens_takes_a_count_or_auto(value, expected):
    assert validate_config(compose_train_config([f"loss.chunk_tokens={value}"])).loss.chunk_tokens == expected


def test_all_problems_are_reported_together():
    problems = problems_of(["loss.eps_low=2", "trainer.max_steps=-3", "optimizer.lr=0", "+trainer.foo=1"])
    assert len(problems) == 4, problems


def test_valid_default_config_has_no_problem():
    cfg = validate_config(compose_train_config())
    assert cfg.loss.name == "grpo" and cfg.data.kind == "generate" and cfg.task["_target_"].endswith("ReverseTask")
    assert cfg.optimizer.lr == cfg.model.suggested_lr == 2e-3
    rollouts = validate_config(compose_train_config(["data=rollouts"]))
    assert rollouts.data.paths[0].endswith("toy_rollouts.jsonl") and rollouts.rollout is None


def test_the_sampler_temperature_follows_the_loss_temperature():
    cfg = validate_config(compose_train_config(["loss.temperature=0.7"]))
    assert cfg.rollout.temperature == cfg.loss.temperature == 0.7


def test_a_sampler_temperature_apart_from_the_loss_temperature_names_both_keys():
    problems = problems_of(["rollout.temperature=0.7"])
    assert any(p.startswith("rollout.temperature: 0.7 differs from loss.temperature=1.0") for p in problems), problems


@pytest.mark.parametrize("overrides, command", [
    (["data=stream", "data.url=redis://127.0.0.1:1/0"], "sample"),
    (["data=stream"], "loop"),  # the loop brings its own Redis server: no data.url
])
def test_the_samplers_of_the_live_loop_sample_at_the_loss_temperature(overrides, command):
    with pytest.raises(ConfigError) as info:
        validate_config(compose_train_config([*overrides, "rollout.temperature=0.7"]), command=command)
    assert any(p.startswith("rollout.temperature: 0.7 differs from loss.temperature=1.0") for p in info.value.problems)
    allowed = ["data.allow_temperature_mismatch=true", "rollout.temperature=0.7"]
    assert validate_config(compose_train_config([*overrides, *allowed]), command=command).rollout.temperature == 0.7


def test_the_trainer_of_a_stream_does_not_sample():
    """`rlcli train data=stream` samples nothing itself: its rollout.temperature is the samplers' business."""
    validate_config(compose_train_config(["data=stream", "data.url=redis://127.0.0.1:1/0", "rollout.temperature=0.7"]))


def test_the_eval_every_rule_is_reported_with_the_other_problems():
    problems = problems_of(["eval.every=2", "data=stream", "data.url=redis://127.0.0.1:1/0", "strategy=fsdp2",
                            "optimizer.lr=0"])
    assert any(p.startswith("eval.every: every rank samples with the whole policy") for p in problems), problems
    assert any(p.startswith("optimizer.lr: must be > 0") for p in problems), problems


def test_vllm_samples_at_temperatures_up_to_2():
    problems = problems_of(["rollout.engine=vllm", "loss.temperature=2.5"])
    assert problems == ["rollout.temperature: vLLM samples at temperatures up to 2, got 2.5 (rollout.temperature "
                        "follows loss.temperature); use rollout.engine=hf for a higher one"], problems
    validate_config(compose_train_config(["rollout.engine=vllm", "loss.temperature=2"]))
    validate_config(compose_train_config(["loss.temperature=2.5"]))


def test_eval_every_with_vllm_runs_in_one_training_process():
    stream = ["eval.every=2", "data=stream", "data.url=redis://127.0.0.1:1/0", "rollout.engine=vllm"]
    problems = problems_of([*stream, "trainer.devices=2", "trainer.accelerator=cpu"])
    assert problems == ["eval.every: with rollout.engine=vllm evaluation samples with a vLLM engine in the training "
                        "process, which runs in one process, not 2; set eval.every=0 or rollout.engine=hf"], problems
    validate_config(compose_train_config(stream))


@pytest.mark.parametrize("overrides, expected", [
    (["rollout.stop=['']"], "rollout.stop: an empty stop string would end every completion at its first token"),
    (["rollout.stop=[-1]"], "rollout.stop: ids [-1] are negative"),
])
def test_rollout_stop_is_checked_with_the_rest(overrides, expected):
    problems = problems_of([*overrides, "optimizer.lr=0"])
    assert any(p.startswith(expected) for p in problems) and len(problems) == 2, problems


@pytest.mark.parametrize("overrides, command, expected", [
    (["data=rollouts"], "sample", "data: rlcli sample pushes into a stream (data=stream), not data=rollouts"),
    (["data=stream", "~task"], "sample", "task: rlcli sample needs a task to sample"),
    (["data=stream"], "sample", "data.url: required by data=stream (redis://host:port/db)"),
    (["data=generate"], "loop", "data: rlcli loop runs samplers and a trainer around a stream (data=stream), "
                                "not data=generate"),
    (["data=rollouts"], "eval", "task: rlcli eval needs a task and its rollout options"),
])
def test_the_checks_of_each_command_are_reported_with_the_rest(overrides, command, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(compose_train_config([*overrides, "optimizer.lr=0"]), command=command)
    problems = info.value.problems
    assert any(p.startswith(expected) for p in problems) and any(p.startswith("optimizer.lr") for p in problems), \
        problems


def test_the_loss_group_becomes_its_registered_loss_object():
    cfg = validate_config(compose_train_config(["loss=gspo", "loss.eps_low=0.1", "loss.eps_high=0.3"]))
    assert type(cfg.loss.objective).__name__ == "GSPO" and cfg.loss.objective.name == "gspo"
    assert (cfg.loss.objective.eps_low, cfg.loss.objective.eps_high) == (0.1, 0.3)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["loss.name=grp0"], "loss.name: must be one of ['grpo', 'gspo'"),
        (["+loss.tau=1"], "loss.tau: unknown key"),
        (["+loss._target_=my_losses.Mine"], "loss._target_: 'my_losses.Mine' is outside the allowed modules"),
        (["+loss._target_=rlcli.modules.Segments"], "loss._target_: 'rlcli.modules.Segments' is not a subclass"),
        (["callbacks=[{_target_: my_callbacks.Notify}]"], "callbacks[0]._target_: 'my_callbacks.Notify' is outside"),
    ],
)
def test_loss_names_options_and_targets_are_checked(overrides, expected):
    problems = problems_of(overrides)
    assert any(p.startswith(expected) for p in problems), problems


def test_the_shipped_loss_files_hold_the_defaults_of_their_loss_classes():
    """The library's defaults of each loss option (its class) and the config's (its YAML) agree."""
    import dataclasses

    from rlcli.modules import LOSSES

    for name, cls in LOSSES.items():
        node = compose_train_config([f"loss={name}"]).loss
        for field in dataclasses.fields(cls):
            assert node[field.name] == field.default, (name, field.name)


def test_the_library_defaults_are_the_config_defaults():
    """`rlcli.modules` used directly (its `LossSpec` and `HeadSpec`) defaults to what `rlcli train` does."""
    from rlcli.modules import HeadSpec, LossSpec

    cfg = compose_train_config(["data=rollouts"])
    spec, head = LossSpec(), HeadSpec()
    assert (spec.loss.name, spec.aggregation, spec.metrics) == (cfg.loss.name, cfg.aggregation.name, cfg.metrics.level)
    assert (head.temperature, head.fp32, head.chunk_tokens, head.compile) == (
        cfg.loss.temperature, cfg.loss.fp32_lm_head, cfg.loss.chunk_tokens, cfg.model.compile)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["kl.estimator=k4"], "kl.estimator: must be one of ['k1', 'k2', 'k3']"),
        (["kl.coef=-0.1"], "kl.coef: must be >= 0"),
        (["correction.mode=truncate", "correction.low=3", "correction.high=2"], "correction.low: 3 is above"),
        (["correction.mode=clip"], "correction.mode: must be one of"),
        (["correction.level=word"], "correction.level: must be one of"),
        (["correction.mode=mask", "loss.old_logprobs=sampler"], "loss.old_logprobs: correction.mode=mask weighs"),
        (["trainer.minibatches=9"], "trainer.minibatches: 9 is more than the 8 groups of a batch"),
        (["trainer.minibatches=0"], "trainer.minibatches: must be >= 1"),
        (["trainer.batch_epochs=0"], "trainer.batch_epochs: must be >= 1"),
        (["loss.entropy_coef=-1"], "loss.entropy_coef: must be >= 0"),
        (["kl.coef=0.1", "kl.reference=rollouts"], "kl.reference: rollouts reads the records' ref_logprobs"),
        (["data=rollouts", "strategy=fsdp2", "kl.coef=0.1"], "kl.reference: a reference model runs with"),
    ],
)
def test_the_terms_of_the_loss_family_are_checked_with_the_rest(overrides, expected):
    problems = problems_of(overrides)
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.lora.rank=4", "model.lora.target_modules=[]"], "model.lora.target_modules: all-linear or a non-empty"),
        (["model.lora.rank=4", "model.lora.target_modules=3"], "model.lora.target_modules: all-linear or a non-empty"),
        (["model.lora.init=pissa"], "model.lora.init: must be one of ['default', 'gaussian']"),
        (["model.lora.dropout=1"], "model.lora.dropout: must be < 1"),
        (["data=rollouts", "model.lora.rank=4", "strategy=fsdp"], "strategy=fsdp: not with LoRA adapters"),
        (["data=stream", "data.url=redis://127.0.0.1:1/0", "publish.lora=adapter"],
         "publish.lora=adapter: publishes LoRA adapters, and model.lora.rank is 0"),
        (["data=stream", "data.url=redis://127.0.0.1:1/0", "publish.lora=adapter", "model.lora.rank=4"],
         "publish.lora=adapter: the samplers apply the adapters to the base model"),
    ],
)
def test_lora_settings_are_checked(overrides, expected):
    problems = problems_of(overrides)
    assert any(p.startswith(expected) for p in problems), problems


def test_fsdp2_with_lora_takes_the_base_as_its_kl_reference():
    cfg = validate_config(compose_train_config(["data=rollouts", "strategy=fsdp2", "kl.coef=0.1", "model.lora.rank=4"]))
    assert (cfg.strategy.name, cfg.kl.reference, cfg.model.lora.rank) == ("fsdp2", "initial", 4)


def test_a_mismatch_correction_makes_the_ratio_use_the_trainer_log_probs():
    assert validate_config(compose_train_config()).loss.old_logprobs == "sampler"
    assert validate_config(compose_train_config(["correction.mode=truncate"])).loss.old_logprobs == "recompute"


# Values that used to pass validation and then end in a traceback (issue 19, item 6): each is now a
# problem of the validator that names its key. Where the bound comes from is in the comment.
@pytest.mark.parametrize(
    "overrides, expected",
    [
        # torch's AdamW unpacks exactly two betas, each in [0, 1)
        (["optimizer.betas=[0.9]"], "optimizer.betas: expected a list of 2 items, got 1: [0.9]"),
        (["optimizer.betas=[0.9,0.99,0.999]"], "optimizer.betas: expected a list of 2 items, got 3"),
        (["optimizer.betas=[2,3]"], "optimizer.betas[0]: must be < 1, got 2"),
        (["optimizer.betas=[0.9,1.0]"], "optimizer.betas[1]: must be < 1, got 1.0"),
        (["optimizer.betas=[-0.1,0.9]"], "optimizer.betas[0]: must be >= 0, got -0.1"),
        # Lightning's seed_everything (numpy) takes 0..2**32-1
        (["seed=8589934592"], "seed: must be <= 4294967295, got 8589934592"),
        (["seed=-1"], "seed: must be >= 0, got -1"),
        # float32 numbers in the loss: 1 + eps_high is a float32 clamp bound, 4/tau a float32 factor, ...
        (["loss.eps_high=1e308"], "loss.eps_high: must be <= 3.40282e+38, got 1e+308"),
        (["loss=cispo", "loss.eps_high=1e308"], "loss.eps_high: must be <= 3.40282e+38"),
        (["loss=sapo", "loss.tau_pos=1e-38"], "loss.tau_pos: must be >= 1.17549e-38, got 1e-38"),
        (["loss=sapo", "loss.tau_neg=1e39"], "loss.tau_neg: must be <= 3.40282e+38"),
        (["kl.coef=1e39"], "kl.coef: must be <= 3.40282e+38"),
        (["loss.entropy_coef=1e39"], "loss.entropy_coef: must be <= 3.40282e+38"),
        (["loss.temperature=1e-308"], "loss.temperature: must be >= 1.17549e-38, got 1e-308"),
        (["aggregation=constant", "aggregation.divisor=5e-324"], "aggregation.divisor: must be >= 1.17549e-38"),
        # integers reach torch and Lightning as 64-bit ones
        (["trainer.devices=9223372036854775808"], "trainer.devices: must be a 64-bit integer"),
        (["model.vocab_size=9223372036854775808"], "model.vocab_size: must be a 64-bit integer"),
        # the tiny Llama: whole heads, of an even size for the rotary embeddings
        (["model.num_heads=3"], "model.hidden_size: 64 is not a multiple of model.num_heads=3"),
        (["model.hidden_size=12", "model.num_heads=4"],
         "model.num_heads: 4 heads of model.hidden_size=12 get 3 dimensions each; rotary position embeddings"),
        (["model.hidden_size=4", "model.num_heads=4"], "model.num_heads: 4 heads of model.hidden_size=4 get 1"),
        # autocast casts from float32 weights; float16 ones break the mixed-precision step
        (["trainer.precision=16-mixed", "model.dtype=float16"], "model.dtype: trainer.precision=16-mixed computes"),
        (["trainer.precision=bf16-mixed", "model.dtype=float16"], "model.dtype: trainer.precision=bf16-mixed"),
        # TensorBoard writes into the run directory (an absolute folder failed when the run ended)
        (["logger=tensorboard", "logger.tensorboard.subdir=/proc/nope"],
         "logger.tensorboard.subdir: a folder inside the run directory, got '/proc/nope'"),
        (["logger=tensorboard", "logger.tensorboard.subdir=../up"], "logger.tensorboard.subdir: a folder inside"),
        # a node that builds an object is a _target_ and its arguments
        (["callbacks=[1]"], "callbacks[0]: expected a _target_ and its arguments ({_target_: ..., ...}), got 1"),
        (["callbacks=[{every: 2}]"], "callbacks[0]: expected a _target_ and its arguments"),
        # vLLM's log-probs are those of the truncated distribution; rlcli owns the engine's log-prob mode
        (["rollout.engine=vllm", "rollout.top_p=0.9"], "rollout.top_p/top_k: vLLM's log-probs with top_p=0.9, top_k=0"),
        (["rollout.engine=vllm", "rollout.top_k=5"], "rollout.top_p/top_k: vLLM's log-probs with top_p=1.0, top_k=5"),
        (["rollout.engine=vllm", "+rollout.vllm.logprobs_mode=raw_logprobs"],
         "rollout.vllm.logprobs_mode: rlcli sets it (always processed_logprobs"),
        (["rollout.engine=vllm", "rollout.vllm=3"], "rollout.vllm: expected keyword arguments of vllm.LLM"),
        (["rollout.engine=vllm", "trainer.devices=2", "strategy=ddp"],
         "rollout.engine: a colocated vLLM engine samples in one process"),
    ],
)
def test_values_that_broke_a_run_are_refused_naming_their_key(overrides, expected):
    problems = problems_of(overrides)
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.betas=[0,0.999999]"], ["seed=4294967295"], ["seed=0"],
        ["loss.eps_high=3.4028234663852886e38"], ["loss=sapo", "loss.tau_pos=1.2e-38", "loss.tau_neg=3.4e38"],
        ["loss.temperature=1.2e-38"], ["model.hidden_size=8", "model.num_heads=4"],
        ["trainer.precision=bf16-mixed", "model.dtype=bfloat16"],
        ["trainer.precision=bf16-true", "model.dtype=float16"],
        ["callbacks=[{_target_: rlcli.callbacks.console.RichConsole}]"],
        ["logger=tensorboard", "logger.tensorboard.subdir=tb/run"],
        ["rollout.engine=vllm", "rollout.top_k=5", "rollout.top_p=0.9", "correction.mode=truncate"],
        ["rollout.engine=vllm", "+rollout.vllm.max_num_seqs=64"],
    ],
)
def test_values_at_the_edges_of_the_new_rules_pass(overrides):
    validate_config(compose_train_config(overrides))


@pytest.mark.parametrize(
    "gpus, overrides, expected",
    [
        ((None, 0), ["trainer.accelerator=gpu"], "trainer.accelerator: gpu, but torch finds no GPU on this machine"),
        (("cuda", 1), ["trainer.devices=2", "strategy=ddp"],
         "trainer.devices: 2 processes need a GPU each, this machine has 1"),
        (("cuda", 1), ["trainer.accelerator=gpu", "trainer.devices=3", "strategy=ddp"], "trainer.devices: 3 processes"),
        ((None, 0), ["strategy=ddp", "strategy.process_group_backend=nccl"],
         "strategy.process_group_backend: nccl connects CUDA GPUs"),
        (("cuda", 1), ["trainer.accelerator=cpu", "strategy=ddp", "strategy.process_group_backend=nccl"],
         "strategy.process_group_backend: nccl connects CUDA GPUs"),
        ((None, 0), ["trainer.devices=5", "strategy=ddp"],
         "trainer.devices: 5 processes on CPU, more than the 4 cores"),
        (("mps", 1), ["data=rollouts", "strategy=fsdp"], "strategy: fsdp needs CUDA GPUs"),
        (("cuda", 1), ["data=rollouts", "strategy=fsdp", "trainer.accelerator=cpu"], "strategy: fsdp needs CUDA GPUs"),
    ],
)
def test_what_a_config_asks_of_the_machine_is_checked(monkeypatch, gpus, overrides, expected):
    monkeypatch.setattr("rlcli.conf.machine.gpus", lambda: gpus)
    monkeypatch.setattr("rlcli.conf.machine.os.cpu_count", lambda: 4)
    problems = problems_of(overrides)
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize(
    "gpus, overrides",
    [
        (("cuda", 2), ["trainer.accelerator=gpu", "trainer.devices=2", "strategy=ddp",
                       "strategy.process_group_backend=nccl"]),
        ((None, 0), ["trainer.devices=4", "strategy=ddp"]),  # a process per core
        (("cuda", 1), ["data=rollouts", "strategy=fsdp"]),
    ],
)
def test_what_the_machine_has_passes(monkeypatch, gpus, overrides):
    monkeypatch.setattr("rlcli.conf.machine.gpus", lambda: gpus)
    monkeypatch.setattr("rlcli.conf.machine.os.cpu_count", lambda: 4)
    validate_config(compose_train_config(overrides))


@pytest.mark.parametrize(
    "gpus, flash_attn, accelerator, expected",
    [
        (("cuda", 1), False, "auto", "model.attn_implementation: flash_attention_2 needs the flash_attn package"),
        (("cuda", 1), True, "cpu", "model.attn_implementation: flash_attention_2 runs on GPUs only"),
        (("cuda", 1), True, "gpu", None),
    ],
)
def test_flash_attention_needs_its_package_and_a_gpu(monkeypatch, gpus, flash_attn, accelerator, expected):
    import transformers.utils

    monkeypatch.setattr("rlcli.conf.machine.gpus", lambda: gpus)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: flash_attn)
    overrides = ["model.attn_implementation=flash_attention_2", f"trainer.accelerator={accelerator}"]
    if expected is None:
        validate_config(compose_train_config(overrides))
    else:
        assert any(p.startswith(expected) for p in problems_of(overrides))


def test_the_machine_rules_see_this_machine():
    """Unpatched: the GPUs Lightning would use here, and whether transformers can run flash attention."""
    import torch
    from transformers.utils import is_flash_attn_2_available

    from rlcli.conf.machine import gpus

    kind, count = gpus()
    assert count == (torch.cuda.device_count() if kind == "cuda" else int(kind == "mps"))
    assert (kind is None) == (not torch.cuda.is_available() and not torch.backends.mps.is_available())
    problems = problems_of(["model.attn_implementation=flash_attention_2", "trainer.accelerator=cpu"])
    assert any(p.startswith("model.attn_implementation: flash_attention_2") for p in problems)
    if not is_flash_attn_2_available():
        assert any("needs the flash_attn package" in p for p in problems)
