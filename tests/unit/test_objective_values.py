"""The objective of a hand-written metrics.csv (values worked out by hand below), the failures of a run without
one, and the Optuna sweeper's direction following objective.direction."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_module

from rlcli.conf.sweepers import register_sweepers
from rlcli.objective import NoObjective, write_objective

# eval/pass@1 is logged every other step only; reward at every step, its step-5 cell empty (no value)
METRICS = """step,loss,reward,eval/pass@1
1,0.5,0.25,
2,0.4,0.75,0.5
3,0.3,0.5,
4,0.2,1.0,0.25
5,0.1,,
6,0.0,0.125,1.0
"""


def objective_of(tmp_path, metric, reduce, direction="maximize", last_k=None):
    (tmp_path / "metrics.csv").write_text(METRICS)
    spec = SimpleNamespace(metric=metric, reduce=reduce, direction=direction, last_k=last_k)
    value = write_objective(tmp_path, spec)
    written = json.loads((tmp_path / "objective.json").read_text())
    assert written["value"] == value
    return written


@pytest.mark.parametrize("metric, reduce, direction, last_k, value, steps", [
    ("reward", "final", "maximize", None, 0.125, [6]),  # step 5 logged no reward: the last value is step 6's
    ("reward", "best", "maximize", None, 1.0, [4]),
    ("reward", "best", "minimize", None, 0.125, [6]),
    ("reward", "mean_last", "maximize", 3, (0.5 + 1.0 + 0.125) / 3, [3, 4, 6]),
    ("reward", "mean_last", "maximize", 100, (0.25 + 0.75 + 0.5 + 1.0 + 0.125) / 5, [1, 2, 3, 4, 6]),
    ("eval/pass@1", "final", "maximize", None, 1.0, [6]),
    ("eval/pass@1", "mean_last", "maximize", 2, (0.25 + 1.0) / 2, [4, 6]),
    ("loss", "best", "minimize", None, 0.0, [6]),
])
def test_the_objective_reduces_the_logged_values(tmp_path, metric, reduce, direction, last_k, value, steps):
    """Fails if a reduction takes an empty cell as a value, the wrong end of the column, or ignores direction."""
    written = objective_of(tmp_path, metric, reduce, direction, last_k)
    assert written == {"metric": metric, "reduce": reduce, "direction": direction, "value": value, "steps": steps}


@pytest.mark.parametrize("metric, reason", [
    ("accuracy", "objective.metric: metrics.csv has no column 'accuracy'; its columns: loss, reward, eval/pass@1"),
    ("eval/reward", "objective.metric: metrics.csv has no column 'eval/reward'"),
])
def test_a_missing_column_is_a_failure_with_its_reason(tmp_path, metric, reason):
    """Fails if a missing column gives a value (0, NaN) instead of a failure naming the column."""
    (tmp_path / "metrics.csv").write_text(METRICS)
    with pytest.raises(NoObjective, match="no column"):
        write_objective(tmp_path, SimpleNamespace(metric=metric, reduce="final", direction="maximize", last_k=None))
    written = json.loads((tmp_path / "objective.json").read_text())
    assert written["value"] is None and written["failed"].startswith(reason)


def test_an_empty_column_and_a_missing_file_are_failures(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,loss,reward\n1,0.5,\n2,0.4,\n")
    spec = SimpleNamespace(metric="reward", reduce="final", direction="maximize", last_k=None)
    with pytest.raises(NoObjective, match="the column 'reward' of metrics.csv has no value"):
        write_objective(tmp_path, spec)
    (tmp_path / "metrics.csv").unlink()
    with pytest.raises(NoObjective, match="cannot read metrics.csv"):
        write_objective(tmp_path, spec)
    assert json.loads((tmp_path / "objective.json").read_text())["value"] is None


@pytest.mark.parametrize("overrides, direction", [
    ([], "maximize"),
    (["objective.direction=minimize"], "minimize"),
    (["hydra.sweeper.direction=minimize"], "minimize"),  # the sweeper's own key still wins
])
def test_the_optuna_sweeper_follows_objective_direction(overrides, direction):
    """Fails if hydra/sweeper=optuna keeps the plugin's default (minimize) whatever objective.direction says."""
    register_sweepers()
    with initialize_config_module(config_module="rlcli.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/sweeper=optuna", *overrides], return_hydra_config=True)
    assert cfg.hydra.sweeper.direction == direction
    assert cfg.hydra.sweeper.n_trials == 20  # the plugin's other defaults are kept
