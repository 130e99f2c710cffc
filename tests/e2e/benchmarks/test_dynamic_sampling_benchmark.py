"""The dynamic sampling benchmark runs its three trainings and reads their counts back."""

from __future__ import annotations

import json

import pytest

from benchmarks import dynamic_sampling


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
