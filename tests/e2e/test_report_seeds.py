"""`rlcli train -m seed=0,1,2 loss=grpo,gspo` then `rlcli report`: two groups of three seeds, flagged as equal."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from scipy import stats

from train_helpers import run_rlcli


@pytest.mark.slow
def test_report_of_a_seeded_sweep_groups_the_seeds_and_flags_equal_losses(tmp_path):
    """Six members make two groups of three seeds; the final reward's mean and 95% interval equal those
    computed here from the members' metrics.csv (scipy called on its own); on-policy with one update per batch
    GRPO and GSPO coincide, and the report says so and why, in the terminal and in report.html."""
    train = run_rlcli(["train", "-m", "seed=0,1,2", "loss=grpo,gspo", "trainer.max_steps=2", "hydra.sweep.dir=sweep"],
                      cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    report = run_rlcli(["report", "sweep", "--out", "report"], cwd=tmp_path, extra_env={"COLUMNS": "300"})
    assert report.returncode == 0, report.stderr[-3000:]

    with (tmp_path / "report" / "groups.csv").open(newline="") as f:
        groups = {row["overrides"]: row for row in csv.DictReader(f)}
    assert sorted(groups) == ["loss=grpo trainer.max_steps=2", "loss=gspo trainer.max_steps=2"]
    with (tmp_path / "report" / "summary.csv").open(newline="") as f:
        members = list(csv.DictReader(f))
    for row in groups.values():
        assert row["seeds"] == "0 1 2" and row["members"] == "3"
        rewards = np.array([float(m["reward_final"]) for m in members if m["group"] == row["group"]])
        interval = stats.bootstrap((rewards,), np.mean, n_resamples=10_000, method="percentile",
                                   random_state=0).confidence_interval
        assert float(row["reward_mean"]) == pytest.approx(rewards.mean())
        assert (float(row["reward_ci_low"]), float(row["reward_ci_high"])) == pytest.approx(
            (interval.low, interval.high))
        assert row["equal_to"] in ("G1", "G2") and row["equal_to"] != row["group"]

    printed = " ".join(report.stdout.split())
    assert "2 groups (members with the same overrides apart from seed)" in printed
    assert "EQUAL: G1 and G2" in printed and "trainer.minibatches > 1" in printed
    html = (tmp_path / "report" / "report.html").read_text()
    assert "EQUAL: G1 and G2" in html and "data:image/png;base64," in html
    assert (tmp_path / "report" / "report_group_reward.png").is_file()
