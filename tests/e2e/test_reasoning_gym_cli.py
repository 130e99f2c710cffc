"""`rlcli train task=reasoning_gym` and `rlcli eval` of its export, on a tiny Qwen2 with a local BPE tokenizer
and a chat template (no download): reasoning-gym's spell_backward, scored by its own scorer.

A short system prompt keeps prompts within the tiny model's 256 positions (reasoning-gym's default one alone
is about 380 tokens of this tokenizer)."""

from __future__ import annotations

import csv
import json

import pytest

from factories import make_tiny_qwen2
from rlcli.conf import build_target
from rlcli.errors import UserError
from tools.docgen.metrics import declared, matches
from train_helpers import compose_train_config, run_rlcli

TASK = ["task=reasoning_gym", "task.datasets={spell_backward: {weight: 1}}", "task.eval_size=4",
        "task.system_prompt='Answer as <answer>...</answer>.'", "rollout.max_new_tokens=4"]


@pytest.mark.slow
def test_train_logs_reward_per_dataset_and_the_export_evaluates(tmp_path):
    """Two steps train and write ``reward/spell_backward`` (reasoning-gym's score, between 0 and 1) with
    every column declared; ``rlcli eval`` of the export scores the 4 held-out entries into eval.json. Fails
    if the task does not build from the CLI, its column is missing or undeclared, or eval cannot use it."""
    model = make_tiny_qwen2(tmp_path / "model")
    trained = run_rlcli(["train", "model=hf", f"model.path={model}", *TASK, "rollout.prompts_per_step=2",
                         "rollout.group_size=2", "trainer.max_steps=2", "logger=none", "hydra.run.dir=run"], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert all(0 <= float(row["reward/spell_backward"]) <= 1 for row in rows)
    names = [name for name, _ in declared()]
    assert [column for column in rows[0] if column != "step" and not any(matches(n, column) for n in names)] == []

    evaluated = run_rlcli(["eval", str(tmp_path / "run" / "export"), *TASK, "eval.samples=2", "hydra.run.dir=eval"],
                          tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["prompts"] == 4 and set(report["metrics"]) >= {"reward", "pass@1", "pass@k"}
    assert "reward/spell_backward" in report["reward_stats"]


def test_the_default_tiny_model_is_a_config_error_asking_for_a_hugging_face_model():
    """The default model (tiny) has no tokenizer: building the task of the composed config says to use model=hf."""
    cfg = compose_train_config(["task=reasoning_gym", "task.datasets={spell_backward: {weight: 1}}"])
    with pytest.raises(UserError, match=r"^task\.tokenizer: task=reasoning_gym needs a tokenizer: .*model=hf"):
        build_target(cfg.task, "task")
