"""Config groups compose, and every invalid config is reported in one message."""

from __future__ import annotations

import pytest

from rlcli.conf.validate import ConfigError, validate_config
from train_helpers import compose_train_config, run_rlcli

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
        assert option in (getattr(node, "name", None), getattr(node, "level", None), getattr(node, "kind", None)) \
            or group == "trainer"


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
        ("loss.temperature=0", "loss.temperature: must be > 0"),
        ("loss.temperature=nan", "loss.temperature: must be a finite number"),
        ("loss.chunk_tokens=-1", "loss.chunk_tokens: must be >= 0"),
        ("loss.chunk_tokens=most", "loss.chunk_tokens: expected int, got 'most' (str) or must be one of ['auto']"),
        ("loss.fp32_lm_head=maybe", "loss.fp32_lm_head: expected bool"),
        ("model.attn_implementation=flash", "model.attn_implementation: must be one of"),
        ("aggregation=constant", "aggregation.divisor: is required"),
        ("aggregation=constant aggregation.divisor=0", "aggregation.divisor: must be > 0"),
        ("aggregation=constant aggregation.divisor=inf", "aggregation.divisor: must be a finite number"),
        ("aggregation=constant aggregation.divisor=null", "aggregation.divisor: is required for aggregation=constant"),
        ("aggregation.divisor=4", "aggregation.divisor: only valid with aggregation=constant"),
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["loss.eps_low=2", "trainer.max_steps=0"], "Invalid configuration (2 problems)"),
        (["loss=ppo"], "Could not find 'loss/ppo'"),
        (["trainer.max_epochs=1"], "trainer.max_epochs"),
        (["data=rollouts", "data.paths=[missing.jsonl]"], "missing.jsonl"),
        (["model=hf", "model.path=/nonexistent"], "model.path: /nonexistent is not a Hugging Face checkpoint"),
    ],
)
def test_cli_config_errors_exit_2_without_traceback(tmp_path, args, message):
    result = run_rlcli(["train", *args], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    output = result.stdout + result.stderr
    assert message in output
    assert "Traceback" not in output


def test_cli_cfg_job_prints_the_composed_config(tmp_path):
    result = run_rlcli(["train", "loss=gspo", "--cfg", "job"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "name: gspo" in result.stdout and "aggregation:" in result.stdout


def test_cli_help_lists_the_groups(tmp_path):
    result = run_rlcli(["train", "--help"], cwd=tmp_path)
    assert result.returncode == 0
    for group in ("loss: cispo, grpo, gspo, gspo_token, sapo", "aggregation:", "metrics:", "model:"):
        assert group in result.stdout


def test_cli_unknown_command_exits_2(tmp_path):
    result = run_rlcli(["fly"], cwd=tmp_path)
    assert result.returncode == 2 and "unknown command 'fly'" in result.stderr


def test_the_sampler_temperature_follows_the_loss_temperature():
    cfg = validate_config(compose_train_config(["loss.temperature=0.7"]))
    assert cfg.rollout.temperature == cfg.loss.temperature == 0.7


def test_a_sampler_temperature_apart_from_the_loss_temperature_names_both_keys():
    problems = problems_of(["rollout.temperature=0.7"])
    assert any(p.startswith("rollout.temperature: 0.7 differs from loss.temperature=1.0") for p in problems), problems


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
    """`rlcli.modules` used directly defaults to what `rlcli train` does."""
    import inspect

    from rlcli.modules import fused_micro_batch_loss, micro_batch_loss, policy_loss, token_logprobs

    cfg = compose_train_config(["data=rollouts"])
    expected = {"temperature": cfg.loss.temperature, "fp32": cfg.loss.fp32_lm_head,
                "chunk_tokens": cfg.loss.chunk_tokens, "aggregation": cfg.aggregation.name,
                "metrics": cfg.metrics.level, "loss": cfg.loss.name}
    for function in (fused_micro_batch_loss, micro_batch_loss, policy_loss, token_logprobs):
        parameters = inspect.signature(function).parameters
        defaults = {name: parameters[name].default for name in expected if name in parameters}
        assert defaults == {name: expected[name] for name in defaults}, function.__name__


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


def test_a_mismatch_correction_makes_the_ratio_use_the_trainer_log_probs():
    assert validate_config(compose_train_config()).loss.old_logprobs == "sampler"
    assert validate_config(compose_train_config(["correction.mode=truncate"])).loss.old_logprobs == "recompute"
