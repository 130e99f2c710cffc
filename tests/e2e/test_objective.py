"""`rlcli train`'s objective through the CLI: objective.json against the run's own metrics.csv, and real
Optuna studies (hydra/sweeper=optuna) whose results name the best member's objective, with a failing member
recorded as a failed trial, in-process and through submitit's local executor (launcher=local)."""

from __future__ import annotations

import csv
import json
import math

import pytest
from fault_injection import FAULTS_ENV, callbacks_override
from omegaconf import OmegaConf

from train_helpers import run_rlcli

TINY = ["trainer.max_steps=2", "hydra.sweep.dir=sweep"]


def two_trials(seed: int, space: str) -> list[str]:
    """A study of two trials of Optuna's random sampler (``seed``) over ``space``, half of them allowed to fail."""
    return ["hydra/sweeper=optuna", "hydra/sweeper/sampler=random", f"hydra.sweeper.sampler.seed={seed}",
            "hydra.sweeper.n_trials=2", "hydra.sweeper.max_failure_rate=0.5", space, *TINY]


GRAD_CLIP = "trainer.grad_clip=interval(-1.0,1.0)"  # a negative draw is a config error


def logged(run_dir, metric: str) -> list[tuple[int, float]]:
    """(step, value) of each non-empty cell of ``metric`` in the run's metrics.csv."""
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [(int(row["step"]), float(row[metric])) for row in csv.DictReader(f) if row[metric] not in ("", "nan")]


def objective_json(run_dir) -> dict:
    return json.loads((run_dir / "objective.json").read_text())


def members(sweep) -> list:
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


@pytest.mark.slow
def test_objective_json_reduces_the_runs_metric(tmp_path):
    """Each reduction of the loss (minimised) equals the one worked out here from the member's metrics.csv;
    fails if a reduction reads the wrong rows or best ignores objective.direction."""
    result = run_rlcli(["train", "-m", "objective=final,best,mean_last", "objective.metric=loss",
                        "objective.direction=minimize", "trainer.max_steps=3", "hydra.sweep.dir=sweep"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for member, reduce in zip(members(tmp_path / "sweep"), ["final", "best", "mean_last"]):
        values = logged(member, "loss")
        assert len(values) == 3
        expected = {"final": values[-1], "best": min(values, key=lambda sv: sv[1]),
                    "mean_last": (None, math.fsum(v for _, v in values) / 3)}[reduce]  # last_k=10 > 3 steps
        written = objective_json(member)
        assert written["value"] == pytest.approx(expected[1], rel=1e-12)
        assert written["steps"] == ([expected[0]] if reduce != "mean_last" else [1, 2, 3])
        assert (written["metric"], written["reduce"], written["direction"]) == ("loss", reduce, "minimize")


@pytest.mark.slow
def test_an_optuna_study_optimises_the_objective(tmp_path):
    """A real TPE study of three trials: each trial's objective is its mean reward (all steps: last_k=10), and
    optimization_results.yaml's best value is the largest of them; fails if rlcli train returns no float."""
    result = run_rlcli(["train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
                        "optimizer.lr=interval(1e-4,1e-2)", *TINY], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    values = []
    for member in members(tmp_path / "sweep"):
        rewards = [v for _, v in logged(member, "reward")]
        assert objective_json(member)["value"] == pytest.approx(math.fsum(rewards) / len(rewards), rel=1e-12)
        values.append(objective_json(member)["value"])
    assert len(values) == 3
    results = OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml")
    assert results.best_value == max(values)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [[], ["launcher=local"]], ids=["in-process", "launcher=local"])
def test_a_failing_member_is_a_failed_trial_and_the_study_goes_on(tmp_path, launcher):
    """Optuna's random sampler (seed 1) draws grad_clip -0.166 then 0.441: the first is a config error. The study
    ends with that trial failed (its reason logged in one line, and in its objective.json) and the other's
    objective as the best; fails if a member's failure exits the study or its value does not come back."""
    result = run_rlcli(["train", "-m", *launcher, *two_trials(1, GRAD_CLIP)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    clips = {m: float(next(o for o in OmegaConf.load(m / ".hydra" / "overrides.yaml") if "grad_clip" in o)
                      .split("=")[1]) for m in members(tmp_path / "sweep")}
    failed, trained = sorted(clips, key=clips.get)
    assert clips[failed] < 0 <= clips[trained]
    reason = f"Invalid configuration (1 problem): - trainer.grad_clip: must be >= 0, got {clips[failed]}"
    assert objective_json(failed) == {"value": None, "failed": reason}
    assert f"Failed experiment: {failed}: {reason}\n" in output
    results = OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml")
    assert results.best_value == objective_json(trained)["value"] is not None
    assert results.best_params["trainer.grad_clip"] == clips[trained]


@pytest.mark.slow
def test_a_member_stopped_by_non_finite_losses_is_a_failed_trial(tmp_path):
    """The loss is NaN at step 2 of every trial; seed 0 draws max_bad_steps 5 (the step is skipped, the run
    ends) then 1 (the run stops): that member is a failed trial with the guard's reason, the other is the best."""
    result = run_rlcli(["train", "-m", *two_trials(0, "trainer.max_bad_steps=choice(1,5)"),
                        *callbacks_override("NanLossAt", step=2, rank=0)], cwd=tmp_path, extra_env=FAULTS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    trained, failed = members(tmp_path / "sweep")
    reason = "training stopped at step 2: 1 steps in a row with a non-finite loss or gradient"
    assert objective_json(failed)["value"] is None and objective_json(failed)["failed"].startswith(reason)
    assert f"Failed experiment: {failed}: {reason}" in result.stdout + result.stderr
    rewards = [v for _, v in logged(trained, "reward")]
    assert objective_json(trained)["value"] == pytest.approx(math.fsum(rewards) / len(rewards), rel=1e-12)
    assert OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml").best_value == \
        objective_json(trained)["value"]


def test_failures_beyond_the_budget_stop_the_study_with_one_message(tmp_path):
    """Seed 2 draws two negative grad_clips: both members fail, beyond max_failure_rate=0.5; the study stops with
    exit 2 and rlcli's one-line error, no traceback (fails if the sweeper's raise escapes as a traceback)."""
    result = run_rlcli(["train", "-m", *two_trials(2, GRAD_CLIP)], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "rlcli train: error: the sweep stopped, more members failed than hydra.sweeper.max_failure_rate " \
           "allows; " in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "sweep" / "optimization_results.yaml").exists()
