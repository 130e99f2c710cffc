"""The config check through the CLI: exit 2, one message, no traceback (`rlcli.conf` is unit-tested in
tests/unit/conf/)."""

from __future__ import annotations

import pytest

from train_helpers import run_rlcli


@pytest.mark.parametrize(
    "args, message",
    [
        (["loss.eps_low=2", "trainer.max_steps=0"], "Invalid configuration (2 problems)"),
        (["loss=ppo"], "Could not find 'loss/ppo'"),
        (["trainer.max_epochs=1"], "trainer.max_epochs"),
        (["data=rollouts", "data.paths=[missing.jsonl]"], "missing.jsonl"),
        (["model=hf", "model.path=/nonexistent"], "model.path: /nonexistent is not a Hugging Face checkpoint"),
        # Hydra fails on a config group set to a non-name with a traceback: the CLI reports them before it
        (["task=null", "loss=1"], "Invalid configuration (2 problems):\n  - task=null: the config group task takes "
                                  "one of addition, prompts, reasoning_gym, reverse (or a list of them); ~task leaves "
                                  "it out\n  - loss=1:"),
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


@pytest.mark.parametrize("command", ["sample", "loop"])
def test_cli_sampler_temperature_mismatch_exits_2_naming_both_keys(tmp_path, command):
    result = run_rlcli([command, "rollout.temperature=0.7", "data.url=redis://127.0.0.1:1/0", "trainer.max_steps=3",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "rollout.temperature: 0.7 differs from loss.temperature=1.0" in output and "Traceback" not in output


def test_cli_reports_several_new_problems_together_without_traceback(tmp_path):
    """One command with five problems of different kinds: one message listing all five, exit 2."""
    args = ["optimizer.betas=[0.9]", "seed=8589934592", "loss.eps_high=1e308", "model.num_heads=3", "callbacks=[1]"]
    result = run_rlcli(["train", *args], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "Invalid configuration (5 problems)" in result.stderr
    for key in ("optimizer.betas:", "seed:", "loss.eps_high:", "model.hidden_size:", "callbacks[0]:"):
        assert f"  - {key}" in result.stderr, key
