"""The dynamic sampling benchmark runs its three trainings and reads their counts back, and records a run that
stops at trainer.max_bad_steps."""

from __future__ import annotations

import json

import pytest

from benchmarks import dynamic_sampling
from benchmarks.live_loop import timed_rows


@pytest.mark.slow
def test_dynamic_sampling_counts_the_rounds_of_each_run(tmp_path):
    """Two steps each of the plain run and the filter on accuracy (the reward's filter is the same code on
    another metric): the plain run samples 8 groups in 1 round a step; a filtered run's groups a step are at
    most 8 x its rounds (a round draws only the missing groups) and its kept groups at most 8. The JSON holds
    the table's numbers."""
    r = dynamic_sampling.main(["--steps", "2", "--runs", "plain", "zero_variance (accuracy)",
                               "--json", str(tmp_path / "ds.json")])
    plain, *filtered = r["runs"]
    assert [run["name"] for run in r["runs"]] == ["plain", "zero_variance (accuracy)"]
    assert (plain["batches"], plain["sampling_rounds"], plain["groups_sampled"]) == (2, 1.0, 8.0)
    for run in filtered:
        assert run["batches"] == 2 + run["empty_steps"] and 1 <= run["sampling_rounds"] <= 4
        assert run["groups_kept"] <= 8 and run["groups_sampled"] <= 8 * run["sampling_rounds"]
    assert json.loads((tmp_path / "ds.json").read_text()) == r


@pytest.mark.slow
def test_a_run_stopped_by_max_bad_steps_is_recorded_and_any_other_failure_ends_the_benchmark(tmp_path):
    """The accuracy filter with one sampling round and ``trainer.max_bad_steps=2`` stops the run (seed 0) at its
    second batch in a row that keeps no group: `timed_rows` returns the steps it logged and rlcli's error. Not
    expected (no ``stop``), the same end is a `SystemExit` naming the command."""
    argv = ["train", "logger=none", "trainer.max_steps=20", "rollout.filter=zero_variance",
            "rollout.filter_metric=accuracy", "rollout.max_sampling_rounds=1", "trainer.max_bad_steps=2"]
    rows, _, stopped = timed_rows(argv, tmp_path / "expected", stop=dynamic_sampling.BAD_STEPS_STOP)
    assert 1 <= len(rows) < 20
    assert stopped.startswith("rlcli train: error: rollout.filter: 2 steps in a row kept no document")
    with pytest.raises(SystemExit, match=r"rollout.filter_metric=accuracy .* failed \(2\)"):
        timed_rows(argv, tmp_path / "unexpected")
