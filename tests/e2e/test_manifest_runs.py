"""Every command's run directory holds ``manifest.json`` from start to end: the command and its overrides, the
code (the checkout's commit, as git itself reports it), how the run ended, and one entry per start when a run is
resumed. Fails when a command does not record its run, or records the wrong commit, overrides or outcome."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import rlcli
from train_helpers import run_rlcli

CHECKOUT = Path(rlcli.__file__).resolve().parents[1]


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _head() -> str | None:
    proc = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


@pytest.mark.slow
def test_train_resume_and_eval_record_their_runs(tmp_path):
    run = tmp_path / "run"
    first = ["trainer.max_steps=2", "trainer.checkpoint_every=1", f"hydra.run.dir={run}"]
    result = run_rlcli(["train", *first], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = _manifest(run)
    assert manifest["command"] == "train" and manifest["status"] == "done"
    assert manifest["overrides"] == first[:2]  # Hydra's task overrides: hydra.run.dir is Hydra's own
    assert manifest["ended"] >= manifest["started"]
    if _head() is not None:
        assert manifest["git"]["commit"] == _head()
    assert manifest["versions"]["torch"] == __import__("torch").__version__

    again = ["trainer.max_steps=3", "trainer.checkpoint_every=1", "resume=auto", f"hydra.run.dir={run}"]
    result = run_rlcli(["train", *again], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = _manifest(run)
    assert resumed["started"] == manifest["started"]  # the run's first start is kept
    assert [start["status"] for start in resumed["starts"]] == ["done", "done"]
    assert "overrides" in resumed["starts"][1]["changed"]

    evaluated = tmp_path / "eval"
    result = run_rlcli(["eval", str(run / "export"), "eval.prompts=2", "eval.samples=1", f"hydra.run.dir={evaluated}"],
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _manifest(evaluated)["command"] == "eval" and _manifest(evaluated)["status"] == "done"


def test_a_failed_run_records_why(tmp_path):
    run = tmp_path / "run"
    result = run_rlcli(["train", "trainer.max_steps=0", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert result.returncode == 2
    expected = "failed: Invalid configuration (1 problem): - trainer.max_steps: must be >= 1, got 0"
    assert _manifest(run)["status"] == expected
