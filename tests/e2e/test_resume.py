"""Exact resume and atomic checkpoints: a run killed in the middle of a save and resumed with
`resume=auto` ends exactly like a run that was never killed."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fault_injection import FAULTS_ENV, callbacks_override
from safetensors.torch import load_file

from rlcli.callbacks.resume import resume_point
from rlcli.errors import UserError

STEPS = 6


def run_cli(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-m", "rlcli", "train", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=600)


def rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


CONFIG = {"seed": 0, "resume": None, "trainer": {"max_steps": 10, "checkpoint_every": 1},
          "model": {"hidden_size": 32}, "optimizer": {"name": "adamw", "betas": [0.9, 0.999]}}


def write_checkpoint(path: Path, step: int, config: dict = CONFIG, run_id: str = "run-a", age: int = 0) -> Path:
    """A file shaped like an rlcli checkpoint, written ``age`` seconds before the others."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"run": {"id": run_id, "config": config}, "rlcli": {"steps_done": step},
                "state_dict": {"w": torch.zeros(2)}}, path)
    when = 1_000_000_000 - age
    os.utime(path, (when, when))
    return path


def with_changes(config: dict, **changes) -> dict:
    changed = json.loads(json.dumps(config))
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = changed
        for parent in parents:
            node = node[parent]
        node[key] = value
    return changed


def test_resume_auto_takes_the_newest_written_checkpoint_not_the_highest_step(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    write_checkpoint(checkpoints / "step-30.ckpt", 30, age=100)  # a longer, older branch of the run
    newest = write_checkpoint(checkpoints / "step-5.ckpt", 5, age=10)
    (checkpoints / "step-6.ckpt.tmp").write_bytes(b"half")  # a killed save: never a candidate
    point = resume_point("auto", tmp_path, CONFIG, max_steps=10)
    assert point.path == newest and point.run.id == "run-a" and point.run.config == CONFIG


def test_resume_auto_skips_and_names_unreadable_checkpoints(tmp_path, caplog):
    checkpoints = tmp_path / "checkpoints"
    good = write_checkpoint(checkpoints / "step-2.ckpt", 2, age=50)
    whole = write_checkpoint(checkpoints / "step-3.ckpt", 3, age=40).read_bytes()
    (checkpoints / "step-3.ckpt").write_bytes(whole[: len(whole) // 2])  # truncated
    (checkpoints / "step-4.ckpt").write_bytes(b"")  # empty
    (checkpoints / "step-5.ckpt").write_bytes(b"garbage" * 100)
    torch.save({"state_dict": {}}, checkpoints / "step-6.ckpt")  # a torch file, not an rlcli checkpoint
    with caplog.at_level(logging.WARNING, logger="rlcli"):
        point = resume_point("auto", tmp_path, CONFIG, max_steps=10)
    assert point.path == good
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 4 and all(any(f"step-{n}.ckpt" in m for m in skipped) for n in (3, 4, 5, 6))
    assert any("not an rlcli checkpoint" in m for m in skipped)


def test_resume_auto_starts_afresh_without_a_checkpoint(tmp_path):
    point = resume_point("auto", tmp_path, CONFIG, max_steps=10)
    other = resume_point("auto", tmp_path, CONFIG, max_steps=10)
    assert point.path is None and point.run.config == CONFIG and point.run.id != other.run.id


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", None])
def test_resume_path_that_is_not_a_checkpoint_is_a_user_error(tmp_path, content):
    path = tmp_path / "given.ckpt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=f"resume: .*{path.name}"):
        resume_point(str(path), tmp_path, CONFIG, max_steps=10)


def test_a_checkpoint_of_another_config_is_refused_with_the_keys_that_differ(tmp_path):
    write_checkpoint(tmp_path / "checkpoints" / "step-3.ckpt", 3)
    changed = with_changes(CONFIG, model__hidden_size=64, optimizer__name="sgd", seed=1)
    del changed["optimizer"]["betas"]
    with pytest.raises(UserError) as refused:
        resume_point("auto", tmp_path, changed, max_steps=10)
    lines = str(refused.value).splitlines()
    assert "model.hidden_size: 32 -> 64" in str(refused.value)
    assert [line.strip() for line in lines if line.startswith("  - ")] == [
        "- model.hidden_size: 32 -> 64", "- optimizer.betas: [0.9, 0.999] -> (absent)",
        "- optimizer.name: 'adamw' -> 'sgd'", "- seed: 0 -> 1"]


def test_keys_safe_to_change_may_differ_on_resume(tmp_path):
    path = write_checkpoint(tmp_path / "checkpoints" / "step-3.ckpt", 3)
    changed = with_changes(CONFIG, trainer__max_steps=20, trainer__checkpoint_every=5, resume="auto")
    point = resume_point("auto", tmp_path, changed, max_steps=20)
    assert point.path == path and point.run.id == "run-a" and point.run.config == changed


def test_data_max_tokens_may_change_on_resume(tmp_path):
    """A run stopped by a document longer than data.max_tokens continues with a larger value (issue 32); before
    the fix the key was refused like any other change."""
    config = {**CONFIG, "data": {"kind": "generate", "max_tokens": 64}}
    path = write_checkpoint(tmp_path / "checkpoints" / "step-3.ckpt", 3, config=config)
    point = resume_point("auto", tmp_path, with_changes(config, data__max_tokens=256), max_steps=10)
    assert point.path == path


def test_a_checkpoint_beyond_max_steps_is_refused(tmp_path):
    write_checkpoint(tmp_path / "checkpoints" / "step-30.ckpt", 30)
    with pytest.raises(UserError, match=r"step 30, beyond trainer.max_steps=10"):
        resume_point("auto", tmp_path, CONFIG, max_steps=10)


def test_a_fresh_run_refuses_a_directory_that_holds_checkpoints(tmp_path):
    write_checkpoint(tmp_path / "checkpoints" / "step-3.ckpt", 3)
    with pytest.raises(UserError, match="already holds checkpoints .*resume=auto"):
        resume_point(None, tmp_path, CONFIG, max_steps=10)


@pytest.mark.slow
def test_resume_auto_skips_a_truncated_newest_checkpoint_and_ends_like_a_straight_run(tmp_path):
    common = ["data=rollouts", "trainer.max_steps=3", "trainer.checkpoint_every=1", "data.max_tokens=128",
              "hydra.run.dir=run"]
    first = run_cli(common, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    straight_metrics = (run / "metrics.csv").read_text()
    straight_weights = load_file(run / "export" / "model.safetensors")
    newest = run / "checkpoints" / "step-3.ckpt"
    newest.write_bytes(newest.read_bytes()[:1000])
    (run / "checkpoints" / "last.ckpt").unlink()

    resumed = run_cli([*common, "resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert f"skipping {newest}" in output and "resuming from" in output and "step-2.ckpt" in output
    assert (run / "metrics.csv").read_text() == straight_metrics  # step 3 trained again, written once
    got = load_file(run / "export" / "model.safetensors")
    assert all(torch.equal(got[name], value) for name, value in straight_weights.items())


@pytest.mark.slow
def test_kill_during_a_save_then_resume_equals_an_uninterrupted_run(tmp_path):
    """(Two processes killed and resumed: tests/e2e/stream/test_faults.py, tests/e2e/launcher/test_slurm.py.)"""
    common = ["data=rollouts", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every=1",
              "trainer.accumulate_microbatches=2", "data.max_tokens=128"]
    straight = run_cli([*common, "hydra.run.dir=straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]

    killed = run_cli([*common, "hydra.run.dir=killed", *callbacks_override("KillDuringSave", step=3)], tmp_path,
                     **FAULTS_ENV)
    assert killed.returncode != 0
    saved = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert saved == ["step-1.ckpt", "step-2.ckpt", "step-3.ckpt.tmp"]  # the half-written one stays aside

    resumed = run_cli([*common, "hydra.run.dir=killed", "resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr and "step-2.ckpt" in resumed.stdout + resumed.stderr

    expected, actual = rows(tmp_path / "straight"), rows(tmp_path / "killed")
    assert [r["step"] for r in actual] == [str(s) for s in range(1, STEPS + 1)]
    # step 3's line was written before the kill: the resumed run drops it and writes it again, once
    audit = (tmp_path / "killed" / "documents.jsonl").read_text()
    assert audit == (tmp_path / "straight" / "documents.jsonl").read_text()
    assert [json.loads(line)["step"] for line in audit.splitlines()] == list(range(1, STEPS + 1))
    for want, got in zip(expected, actual):
        for name in ("loss", "num_documents", "documents_seen", "num_tokens", "grad_norm", "ratio_new_old"):
            assert float(got[name]) == pytest.approx(float(want[name]), rel=1e-6, abs=1e-9), (want["step"], name)
    want_params = load_file(tmp_path / "straight" / "export" / "model.safetensors")
    got_params = load_file(tmp_path / "killed" / "export" / "model.safetensors")
    for name, value in want_params.items():
        assert (got_params[name] - value).abs().max() <= 1e-6, name
