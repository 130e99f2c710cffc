"""The console of a plain `rlcli train` shows rlcli's own lines (issue 32, item 18): the other libraries'
lines and warnings (Lightning's accelerator lines, its tips and its srun hint) go to train.log only, and
no save logs Lightning's "`weights_only` was not set"."""

from __future__ import annotations

import shutil

import pytest

from factories import make_tiny_qwen2
from train_helpers import run_rlcli

THIRD_PARTY = {  # a line of each library that a plain run on this machine writes, and where it comes from
    "GPU available:": "Lightning's accelerator line",
    "💡 Tip:": "Lightning's tip",
}
SRUN_HINT = "The `srun` command is available on your system but is not used"  # Lightning, where srun is on PATH


@pytest.mark.slow
def test_the_console_shows_rlclis_lines_and_train_log_the_others(tmp_path):
    """Before the fix the console showed each of these lines, and both showed "`weights_only` was not set"
    at every checkpoint."""
    result = run_rlcli(["train", "trainer.max_steps=2", "trainer.checkpoint_every=1", "logger=none",
                        "hydra.run.dir=run"], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    console, log = result.stdout + result.stderr, (tmp_path / "run" / "train.log").read_text()
    assert "trained 2 steps" in console  # rlcli's own lines are there
    for line, what in THIRD_PARTY.items():
        assert line not in console, what
        assert line in log, what
    if shutil.which("srun"):
        assert SRUN_HINT not in console and SRUN_HINT in log
    assert "weights_only" not in console + log


@pytest.mark.slow
def test_loading_a_hugging_face_model_draws_no_progress_bar(tmp_path):
    """Before the fix transformers drew "Loading weights" on stderr for the policy of model=hf."""
    model = make_tiny_qwen2(tmp_path / "model")
    result = run_rlcli(["train", "model=hf", f"model.path={model}", "trainer.max_steps=1", "logger=none",
                        "hydra.run.dir=run"], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Loading weights" not in result.stdout + result.stderr
