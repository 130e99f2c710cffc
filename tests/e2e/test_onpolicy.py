"""`data=generate`: on-policy rollouts trained through the same loss path as rollout files."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

from factories import rollout_record, write_jsonl
from rlcli.callbacks.off_policy import warn_if_off_policy
from rlcli.commands.train import train
from rlcli.data.readers import load_rollouts
from train_helpers import compose_train_config, run_rlcli, straight_and_resumed


def train_on_policy(tmp_path: Path, *overrides: str, steps: int = 2):
    cfg = compose_train_config(["data=generate", f"trainer.max_steps={steps}", *overrides])
    module = train(cfg, tmp_path / "run")
    with (tmp_path / "run" / "metrics.csv").open() as f:
        return module, list(csv.DictReader(f))


def test_first_step_is_exactly_on_policy(tmp_path):
    _, rows = train_on_policy(tmp_path, "rollout.temperature=0.7", "loss.temperature=0.7", steps=1)
    assert float(rows[0]["ratio_new_old"]) == pytest.approx(1.0, abs=1e-5)
    assert abs(float(rows[0]["kl_new_old"])) < 1e-6
    assert float(rows[0]["clipped_ratio_fraction"]) == 0.0
    for name in ("reward", "accuracy", "completion_length", "stopped_fraction"):
        assert name in rows[0]


@pytest.mark.parametrize(
    "metrics, warned",
    [({"ratio_new_old": 1.0, "kl_new_old": 0.0}, False), ({"ratio_new_old": 1.04, "kl_new_old": 0.01}, False),
     ({"ratio_new_old": 1.3, "kl_new_old": 0.01}, True), ({"ratio_new_old": 1.0, "kl_new_old": 0.05}, True)],
)
def test_off_policy_first_step_warning_rule(metrics, warned):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_off_policy(metrics, temperature=0.7)
    messages = [str(w.message) for w in caught]
    assert bool(messages) == warned
    if warned:
        assert f"ratio_new_old={metrics['ratio_new_old']:.4f}" in messages[0] and "loss.temperature=0.7" in messages[0]


def test_rollout_files_not_sampled_from_this_model_are_warned(tmp_path):
    records = [rollout_record(g, old_logprobs=[-0.2] * 4) for g in range(8)]  # far likelier than the model says
    data = write_jsonl(tmp_path / "far.jsonl", records)
    with pytest.warns(UserWarning, match=r"first step: ratio_new_old=0\.\d+, kl_new_old=\d+\.\d+, far from on-policy"):
        train(compose_train_config(["data=rollouts", f"data.paths=[{data}]", "trainer.max_steps=1"]), tmp_path / "run")


def test_saved_rollouts_replay_from_files(tmp_path):
    module, rows = train_on_policy(tmp_path, "rollout.save=true", "rollout.prompts_per_step=3",
                                   "rollout.group_size=2", steps=2)
    saved, rejected = load_rollouts([tmp_path / "run" / "rollouts.jsonl"], vocab_size=module.policy.config.vocab_size)
    assert not rejected and len(saved) == 2 * 3 * 2 == module.documents_seen
    assert [int(float(r["num_documents"])) for r in rows] == [6, 6]
    groups = {r.group_id for r in saved}
    assert len(groups) == 6 and all(sum(r.group_id == g for r in saved) == 2 for g in groups)


def test_generation_is_reproducible_with_a_seed(tmp_path):
    _, first = train_on_policy(tmp_path / "a", steps=2)
    _, second = train_on_policy(tmp_path / "b", steps=2)
    _, other_seed = train_on_policy(tmp_path / "c", "seed=1", steps=2)
    assert [r["loss"] for r in first] == [r["loss"] for r in second]
    assert [r["loss"] for r in first] != [r["loss"] for r in other_seed]


def test_a_custom_task_plugs_in_by_target(tmp_path):
    module, rows = train_on_policy(tmp_path, "~task", "+task._target_=train_helpers.EchoTask", "+task.letters=xy",
                                   "allow_targets=[train_helpers]", steps=1)
    assert module.policy.config.vocab_size == 4  # pad, eos, x, y: the tiny model takes the task's vocabulary
    assert 0.0 <= float(rows[0]["reward"]) <= 1.0


def test_task_targets_outside_the_allowlist_are_refused(tmp_path):
    result = run_rlcli(["train", "data=generate", "task._target_=os.system"], cwd=tmp_path)
    assert result.returncode == 2 and "task._target_: 'os.system' is outside the allowed modules" in result.stderr
    assert "allow_targets=[os]" in result.stderr and "Traceback" not in result.stderr


def test_a_task_target_that_does_not_exist_is_a_clear_error(tmp_path):
    result = run_rlcli(["train", "data=generate", "task._target_=nowhere.Task", "allow_targets=[nowhere]"],
                       cwd=tmp_path)
    assert result.returncode == 2 and "task: cannot build nowhere.Task" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_default_run_learns(tmp_path, loss):
    """The bare `rlcli train` (here with each loss): the mean reward rises by a clear margin."""
    torch.manual_seed(0)
    result = run_rlcli(["train", f"loss={loss}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = list((tmp_path / "outputs").glob("*/*"))
    with (run_dir / "metrics.csv").open() as f:
        rewards = [float(r["reward"]) for r in csv.DictReader(f)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first > 0.25, (first, last)


def test_saved_rollouts_are_cut_back_on_resume_and_started_anew_by_a_fresh_run(tmp_path):
    common = ["rollout.save=true", "rollout.prompts_per_step=3", "rollout.group_size=2", "trainer.max_steps=4",
              "trainer.checkpoint_every=2", "logger=none"]
    straight_dir, run = straight_and_resumed(common, tmp_path)
    straight = (straight_dir / "rollouts.jsonl").read_text()
    assert len(straight.splitlines()) == 4 * 6
    assert (run / "rollouts.jsonl").read_text() == straight  # steps 3 and 4 written once, not twice

    shutil.rmtree(run / "checkpoints")  # a fresh run refuses a directory that holds checkpoints
    train(compose_train_config(common), run)  # a fresh run in the same directory
    assert (run / "rollouts.jsonl").read_text() == straight
