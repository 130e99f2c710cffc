"""`rlcli eval MODEL_DIR` and `eval.every` during `rlcli train`: eval.json, the error exits, one row of
metrics per step with eval/<metric> on the due steps, DDP's shares, and a trained policy beating its
initial weights."""

from __future__ import annotations

import csv
import io
import json
import types
from pathlib import Path

import pytest
import torch

from factories import initial_policy
from rlcli.callbacks.evaluate import PeriodicEval
from rlcli.cli import main
from rlcli.commands.eval import model_overrides
from rlcli.commands.train import train
from rlcli.conf import build_target
from rlcli.conf.validate import ConfigError, validate_config
from rlcli.model.policy import build_policy
from rlcli.report.command import write_report
from rlcli.rollout.evaluate import METRICS, eval_prompts, evaluate
from rlcli.rollout.samplers import build_sampler
from train_helpers import compose_train_config, run_rlcli

EVAL_COLUMNS = [f"eval/{name}" for name in METRICS]


def save_initial_policy(model_dir: Path) -> Path:
    """The default run's initial policy (seed 0, the reverse task's vocabulary) as a Hugging Face directory."""
    cfg = validate_config(compose_train_config())
    task = build_target(cfg.task, "task")
    initial_policy(cfg, task.tokenizer.vocab_size).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory) -> Path:
    return save_initial_policy(tmp_path_factory.mktemp("models") / "tiny model's=dir")  # a path to quote


def in_process_eval(model_dir: Path, prompts: int, samples: int, seed: int = 0):
    """What `rlcli eval` computes with the default config, done here directly."""
    cfg = validate_config(compose_train_config(model_overrides([str(model_dir)])))
    task, r = build_target(cfg.task, "task"), cfg.rollout
    sampler = build_sampler(build_policy(cfg.model), r, task.tokenizer)
    return evaluate(task, sampler, eval_prompts(task, prompts), samples=samples, max_new_tokens=r.max_new_tokens,
                    seed=seed, batch_size=r.prompts_per_step * r.group_size)


def run_eval(model_dir: Path, run_dir: Path, *overrides: str) -> dict:
    result = run_rlcli(["eval", str(model_dir), f"hydra.run.dir={run_dir}", *overrides], cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"eval.json: {run_dir / 'eval.json'}" in result.stdout
    return json.loads((run_dir / "eval.json").read_text())


def test_eval_writes_eval_json_with_what_evaluate_computes(initial_model, tmp_path):
    result = run_rlcli(["eval", str(initial_model), f"hydra.run.dir={tmp_path / 'run'}", "eval.samples=3",
                        "eval.prompts=5", "seed=2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for label in ("mean reward", "pass@1", "pass@3", "mean length", "stopped fraction", "prompts"):
        assert label in result.stdout
    path = tmp_path / "run" / "eval.json"
    assert f"eval.json: {path}" in result.stdout
    report = json.loads(path.read_text())
    assert report["prompts"] == 5 and report["samples"] == 3 and list(report["metrics"]) == list(METRICS)
    assert report["config"]["model"]["path"] == str(initial_model)
    assert report["config"]["seed"] == 2 and report["config"]["task"]["_target_"] == "rlcli.rollout.tasks.ReverseTask"
    expected = in_process_eval(initial_model, prompts=5, samples=3, seed=2)
    assert report["rows"] == expected.rows and report["metrics"] == expected.metrics
    assert all(len(row["completions"]) == 3 for row in report["rows"])


@pytest.mark.parametrize("args", [["eval"], ["eval", "eval.samples=2"]])
def test_eval_without_a_model_directory_exits_2(args, capsys):
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "rlcli eval: error: give the model directory first: rlcli eval MODEL_DIR [HYDRA OVERRIDES]\n")


def test_eval_of_a_directory_that_does_not_exist_says_so(tmp_path, capsys):
    """Before the fix the path went on to the tokenizer's loader, which said "Repo id must be in the form"."""
    missing = tmp_path / "missing"
    assert main(["eval", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"rlcli eval: error: {missing}: no such model directory (a local Hugging Face model directory; Hub names "
        "are not fetched): rlcli eval MODEL_DIR [HYDRA OVERRIDES]\n")


@pytest.mark.parametrize("case, message", [
    ("not a model", "rlcli eval: error: model.path: {dir} is not a Hugging Face checkpoint directory (no config.json)"),
    ("no task", "rlcli eval: error: Invalid configuration (1 problem):\n"
                "  - task: rlcli eval needs a task and its rollout options (data=generate or stream,"),
])
def test_eval_errors_are_one_message_and_exit_2(initial_model, tmp_path, case, message):
    model_dir = tmp_path / "empty" if case == "not a model" else initial_model
    model_dir.mkdir(exist_ok=True)
    extra = ["data=rollouts"] if case == "no task" else []
    result = run_rlcli(["eval", str(model_dir), f"hydra.run.dir={tmp_path / 'run'}", *extra], cwd=tmp_path)
    assert result.returncode == 2
    output = result.stderr.strip()
    assert len(output.splitlines()) == message.count("\n") + 1, result.stderr[-3000:]
    assert output.startswith(message.format(dir=model_dir)), result.stderr[-3000:]
    assert not (tmp_path / "run" / "eval.json").exists()


def read_rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_eval_every_adds_eval_metrics_to_the_rows_of_due_steps(tmp_path):
    cfg = compose_train_config(["trainer.max_steps=4", "eval.every=2", "eval.prompts=6", "eval.samples=2"])
    module = train(cfg, tmp_path / "run")
    rows = read_rows(tmp_path / "run")
    assert [row["step"] for row in rows] == ["1", "2", "3", "4"]  # one row per step
    for row in rows:
        assert all((row[c] != "") == (row["step"] in ("2", "4")) for c in EVAL_COLUMNS), row
    # step 4 is the last: its evaluation is the trained policy's, as evaluate() gives it
    typed = validate_config(cfg)
    task = build_target(typed.task, "task")
    expected = evaluate(task, build_sampler(module.policy, typed.rollout, task.tokenizer), eval_prompts(task, 6),
                        samples=2, max_new_tokens=4, seed=0, batch_size=64)
    assert {c: float(rows[3][c]) for c in EVAL_COLUMNS} == {f"eval/{k}": v for k, v in expected.metrics.items()}

    from rich.console import Console

    report = write_report(tmp_path / "run", console=Console(file=io.StringIO()))
    names = [p.name for p in report.plots]
    assert [n for n in names if n.startswith("report_eval")] == [f"report_eval_{m}.png" for m in METRICS]
    assert not any(m.startswith("eval/") for m in report.skipped)


def test_periodic_eval_samples_in_eval_mode_on_due_steps_only():
    cfg = validate_config(compose_train_config())
    task = build_target(cfg.task, "task")
    torch.manual_seed(0)
    policy = build_policy(cfg.model, default_vocab_size=task.tokenizer.vocab_size)
    modes = []
    forward = policy.forward
    policy.forward = lambda *a, **k: modes.append((policy.training, torch.is_grad_enabled())) or forward(*a, **k)
    callback = PeriodicEval(task, eval_prompts(task, 3), every=2, samples=2, rollout=cfg.rollout, seed=0)
    module = types.SimpleNamespace(steps_done=0, device=torch.device("cpu"), policy=policy.train())
    for step in (0, 1, 3):
        module.steps_done = step
        assert callback.step_metrics(None, module) == {}
    assert not modes
    module.steps_done = 4
    metrics = callback.step_metrics(None, module)
    assert list(metrics) == EVAL_COLUMNS
    assert modes and set(modes) == {(False, False)}  # eval mode, no gradients
    assert policy.training  # back in train mode


@pytest.mark.parametrize("overrides, message", [
    (["data=rollouts"], "eval.every: evaluation needs a task (data=generate or stream), not data=rollouts"),
    (["data=stream", "data.url=redis://127.0.0.1:1/0", "strategy=fsdp2"],
     "eval.every: every rank samples with the whole policy, so evaluation runs with strategy=auto or ddp, not fsdp2"),
])
def test_eval_every_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as caught:
        train(compose_train_config(["eval.every=2", *overrides]), tmp_path / "run")
    assert caught.value.problems == [message]


@pytest.mark.slow
def test_eval_every_on_two_ddp_ranks_reduces_their_shares(tmp_path):
    run_dir = tmp_path / "run"
    result = run_rlcli(["train", "strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.max_steps=2",
                        "eval.every=2", "eval.prompts=5", "eval.samples=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_rows(run_dir)
    assert [row["step"] for row in rows] == ["1", "2"] and rows[0]["eval/reward"] == ""
    # rank r evaluated prompts r, r + 2, ... with seed 0 + r, on the exported (final) weights
    cfg = validate_config(compose_train_config(model_overrides([str(run_dir / "export")])))
    task = build_target(cfg.task, "task")
    sampler = build_sampler(build_policy(cfg.model), cfg.rollout, task.tokenizer)
    prompts = eval_prompts(task, 5)
    shares = [evaluate(task, sampler, prompts[r::2], samples=2, max_new_tokens=4, seed=r, batch_size=64)
              for r in (0, 1)]
    for name in METRICS:
        expected = sum(row[name] for share in shares for row in share.rows) / 5
        assert float(rows[1][f"eval/{name}"]) == pytest.approx(expected, abs=1e-12), name


@pytest.mark.slow
def test_eval_of_the_trained_export_beats_the_initial_weights(initial_model, tmp_path):
    train(compose_train_config(), tmp_path / "train")  # the default run: 60 steps on the reverse task
    before = run_eval(initial_model, tmp_path / "before")["metrics"]
    after = run_eval(tmp_path / "train" / "export", tmp_path / "after")["metrics"]
    assert after["reward"] > before["reward"] + 0.2, (before, after)
    assert after["pass@1"] > before["pass@1"] + 0.2 and after["pass@k"] > before["pass@k"], (before, after)
