"""Seed-aware reports: statistics over seeds, grouping by overrides without seed, and the equal-curves flag."""

import csv
import io
import itertools
from pathlib import Path

import numpy as np
import pytest
from report_members import on_policy, write_member
from rich.console import Console
from scipy import stats as scipy_stats

from rlcli.report.command import write_report
from rlcli.report.equal import NO_EFFECT, ON_POLICY, equal_pairs
from rlcli.report.groups import OBJECTIVE, group_runs, primary
from rlcli.report.runs import find_runs
from rlcli.report.stats import estimate, mean_band, probability_of_improvement


def runs_of(path: Path):
    return find_runs(path)[1]


# -- statistics ------------------------------------------------------------------------------------------------


def test_interval_is_scipys_percentile_bootstrap_of_the_mean():
    """The interval is scipy's percentile bootstrap (95%, 10000 resamples, seed 0), called here on its own;
    fails if the report used another method, level or seed, or interval of something else than the mean."""
    values = [0.31, 0.52, 0.44, 0.90, 0.12, 0.47]
    reference = scipy_stats.bootstrap((np.array(values),), np.mean, confidence_level=0.95, n_resamples=10_000,
                                      method="percentile", random_state=0).confidence_interval
    result = estimate(values)
    assert result.n == 6 and result.mean == pytest.approx(sum(values) / 6)
    assert (result.low, result.high) == pytest.approx((reference.low, reference.high), rel=1e-12)
    assert min(values) < result.low < result.mean < result.high < max(values)
    assert estimate(values) == result  # seeded: the same report twice


@pytest.mark.parametrize("values", [[1.0, 3.0], [2.0, -1.0, 5.0]])
def test_interval_of_two_or_three_seeds_spans_the_values_seen(values):
    """Hand-derived: with n <= 3 values, each extreme mean (every resample the same value) has probability
    1/n**n >= 1/27 > 2.5%, so the 2.5% and 97.5% percentiles are the smallest and largest value."""
    result = estimate(values)
    assert (result.low, result.high) == (min(values), max(values))
    assert result.iqm is None  # fewer than 4 seeds


def test_one_seed_has_no_interval():
    result = estimate([0.25])
    assert (result.n, result.mean, result.low, result.high, result.iqm) == (1, 0.25, None, None, None)


def test_iqm_is_the_mean_of_the_middle_half():
    """Hand-derived: sorted [-50, 1, 2, 3, 4, 5, 6, 100]; the middle half is 2, 3, 4, 5, whose mean is 3.5."""
    assert estimate([1, 2, 3, 4, 100, -50, 5, 6]).iqm == 3.5
    assert estimate([1, 2, 3, 100]).iqm == 2.5  # 4 seeds: the middle two


def pairs_reference(x, y, maximize=True):
    """P(improvement) by counting the pairs: wins + ties / 2 over n m."""
    better = sum((a > b) if maximize else (a < b) for a, b in itertools.product(x, y))
    ties = sum(a == b for a, b in itertools.product(x, y))
    return (better + ties / 2) / (len(x) * len(y))


def test_probability_of_improvement_counts_pairs():
    """Hand-derived for x = [1, 2, 3], y = [2, 2, 0]: 1 beats 0; 2 beats 0 and ties twice; 3 beats all
    three: (1 + 2 + 3) / 9 = 2/3. Lower is better: (2 + 1 + 0) / 9 = 1/3."""
    x, y = [1, 2, 3], [2, 2, 0]
    assert probability_of_improvement(x, y) == pytest.approx(2 / 3)
    assert probability_of_improvement(x, y, maximize=False) == pytest.approx(1 / 3)
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 5, 7).tolist(), rng.integers(0, 5, 4).tolist()  # many ties
    assert probability_of_improvement(a, b) == pytest.approx(pairs_reference(a, b))
    assert probability_of_improvement(a, b) + probability_of_improvement(b, a) == pytest.approx(1)


def test_band_of_three_seeds_spans_the_seeds_at_each_step():
    """Hand-derived as for the interval: 3 seeds give [min, max] at every step; 1 seed gives no band."""
    curves = np.array([[0.1, 0.5, 0.2], [0.3, 0.4, 0.2], [0.2, 0.9, 0.2]])
    mean, low, high = mean_band(curves)
    np.testing.assert_allclose(mean, curves.mean(axis=0))
    np.testing.assert_allclose(low, curves.min(axis=0), rtol=1e-12)  # a mean of three equal values: rounding
    np.testing.assert_allclose(high, curves.max(axis=0), rtol=1e-12)
    assert mean_band(curves[:1])[1:] == (None, None)


# -- grouping --------------------------------------------------------------------------------------------------


def test_members_are_grouped_by_their_overrides_without_seed(tmp_path):
    """Fails if seed stayed in the key (six groups) or other overrides were dropped (one group)."""
    members = [["loss=grpo", "seed=0"], ["loss=gspo", "seed=0"], ["loss=grpo", "seed=1"], ["seed=1", "loss=gspo"],
               ["loss=grpo", "++seed=2"], ["loss=grpo", "seed=0", "trainer.minibatches=4"]]
    for i, overrides in enumerate(members):
        write_member(tmp_path / str(i), overrides, on_policy([0.1 * i], [0.0]))
    groups = group_runs(runs_of(tmp_path), ["reward"])
    assert [(g.id, g.overrides, g.seeds, [r.name for r in g.members]) for g in groups] == [
        ("G1", ["loss=grpo"], ["0", "1", "2"], ["0", "2", "4"]),
        ("G2", ["loss=gspo"], ["0", "1"], ["1", "3"]),
        ("G3", ["loss=grpo", "trainer.minibatches=4"], ["0"], ["5"]),
    ]
    assert groups[0].finals["reward"].mean == pytest.approx(np.mean([0.0, 0.2, 0.4]))


def test_groups_csv_holds_the_scipy_interval_and_the_objective(tmp_path):
    """groups.csv: per group the final objective's mean and interval (scipy, called here), the failed members,
    and P(improvement) on the objective with its direction (minimize)."""
    objective = {"metric": "loss", "reduce": "final", "direction": "minimize"}
    a, b = [0.5, 0.25, 0.75], [1.5, 1.0]
    for i, value in enumerate(a):
        write_member(tmp_path / str(i), ["loss=grpo", f"seed={i}"], on_policy([0.1], [value]),
                     {**objective, "value": value})
    for i, value in enumerate(b):
        write_member(tmp_path / str(3 + i), ["loss=gspo", f"seed={i}"], on_policy([0.2], [value]),
                     {**objective, "value": value})
    write_member(tmp_path / "5", ["loss=gspo", "seed=2"], on_policy([0.2], [2.0]), {"value": None, "failed": "NaN"})

    write_report(tmp_path, console=Console(file=io.StringIO(), width=300))

    assert primary(group_runs(runs_of(tmp_path), [OBJECTIVE])) == (OBJECTIVE, False)
    with (tmp_path / "groups.csv").open(newline="") as f:
        rows = {row["group"]: row for row in csv.DictReader(f)}
    for group, values in (("G1", a), ("G2", b)):
        ci = scipy_stats.bootstrap((np.array(values),), np.mean, n_resamples=10_000, method="percentile",
                                   random_state=0).confidence_interval
        assert float(rows[group]["objective_mean"]) == pytest.approx(np.mean(values))
        assert float(rows[group]["objective_ci_low"]) == pytest.approx(ci.low)
        assert float(rows[group]["objective_ci_high"]) == pytest.approx(ci.high)
    assert rows["G1"]["objective_failed"] == "0" and rows["G2"]["objective_failed"] == "1"
    assert rows["G2"]["members"] == "3" and rows["G2"]["seeds"] == "0 1 2"
    assert float(rows["G1"]["p_better_than_G2"]) == 1.0  # every loss of G1 is lower
    assert float(rows["G2"]["p_better_than_G1"]) == 0.0
    assert list(rows) == ["G1", "G2"]  # best first


def test_iqm_column_appears_with_four_seeds(tmp_path):
    """Four seeds of one configuration: groups.csv's reward_iqm is the mean of the middle two (hand-derived
    from [0.1, 0.2, 0.3, 0.9]: 0.25), and the group table gets a 'reward IQM' column; one seed has no IQM."""
    for i, reward in enumerate([0.3, 0.9, 0.1, 0.2]):
        write_member(tmp_path / str(i), ["loss=grpo", f"seed={i}"], on_policy([reward], [0.0]))
    write_member(tmp_path / "4", ["loss=gspo", "seed=0"], on_policy([0.5], [0.0]))
    write_report(tmp_path, console=Console(file=io.StringIO(), width=300))
    with (tmp_path / "groups.csv").open(newline="") as f:
        rows = {row["group"]: row for row in csv.DictReader(f)}
    assert float(rows["G1"]["reward_iqm"]) == pytest.approx(0.25)
    assert rows["G2"]["reward_iqm"] == "" and rows["G2"]["reward_ci_low"] == ""  # 1 seed: no interval either
    assert "| reward IQM |" in (tmp_path / "summary.md").read_text()


# -- equal curves ----------------------------------------------------------------------------------------------


def sweep(path: Path, second: dict[int, dict[str, list[float]]], first_seeds=(0, 1)):
    """Two losses, seeds 0 and 1: the grpo members' curves are fixed, the gspo ones are ``second[seed]``."""
    curves = {0: on_policy([0.1, 0.3, 0.5], [0.2, -0.1, 0.05]), 1: on_policy([0.2, 0.2, 0.4], [0.3, 0.1, -0.2])}
    i = 0
    for seed in first_seeds:
        write_member(path / str(i), ["loss=grpo", f"seed={seed}"], curves[seed])
        i += 1
    for seed, columns in second.items():
        write_member(path / str(i), ["loss=gspo", f"seed={seed}"], columns)
        i += 1
    return curves


def test_identical_curves_are_flagged_with_the_on_policy_reason(tmp_path):
    """The gspo curves equal the grpo ones up to 1e-9 of rounding in the loss: one pair, and the reason names
    the settings that make the losses differ; the flag reaches the terminal, summary.md and report.html."""
    base = {0: on_policy([0.1, 0.3, 0.5], [0.2, -0.1, 0.05]), 1: on_policy([0.2, 0.2, 0.4], [0.3, 0.1, -0.2])}
    second = {seed: {**c, "loss": [v + 1e-9 for v in c["loss"]]} for seed, c in base.items()}
    sweep(tmp_path, second)
    con = Console(file=io.StringIO(), width=300)
    write_report(tmp_path, console=con)

    pairs = equal_pairs(group_runs(runs_of(tmp_path), []))
    assert [(p.first, p.second, p.metrics, p.reason) for p in pairs] == [("G1", "G2", ["reward", "loss"], ON_POLICY)]
    for text in (con.file.getvalue(), (tmp_path / "summary.md").read_text()):
        assert "EQUAL: G1 and G2" in " ".join(text.split())
    html = (tmp_path / "report.html").read_text()
    assert "EQUAL: G1 and G2" in html and "trainer.minibatches &gt; 1" in html


def test_equal_curves_off_policy_get_the_generic_reason(tmp_path):
    second = {seed: {**c, "ratio_new_old": [0.9, 1.1, 1.0]} for seed, c in sweep(tmp_path, {}).items()}
    sweep(tmp_path / "b", second)
    assert [p.reason for p in equal_pairs(group_runs(runs_of(tmp_path / "b"), []))] == [NO_EFFECT]


@pytest.mark.parametrize("change", ["reward", "loss", "seeds", "steps"])
def test_different_curves_are_not_flagged(tmp_path, change):
    """A reward that differs in one step, a loss that differs beyond rounding (1e-4), other seeds, or fewer
    steps: no pair."""
    base = {0: on_policy([0.1, 0.3, 0.5], [0.2, -0.1, 0.05]), 1: on_policy([0.2, 0.2, 0.4], [0.3, 0.1, -0.2])}
    second = {seed: dict(c) for seed, c in base.items()}
    if change == "reward":
        second[1]["reward"] = [0.2, 0.2, 0.45]
    elif change == "loss":
        second[0]["loss"] = [0.2, -0.1, 0.0501]
    elif change == "seeds":
        second = {2: base[0], 1: base[1]}
    else:
        second[0] = on_policy([0.1, 0.3], [0.2, -0.1])
    sweep(tmp_path, second)
    con = Console(file=io.StringIO(), width=300)
    write_report(tmp_path, console=con)
    assert equal_pairs(group_runs(runs_of(tmp_path), [])) == []
    assert "EQUAL" not in con.file.getvalue() and "EQUAL" not in (tmp_path / "report.html").read_text()


def test_group_tables_and_the_flag_fit_a_narrow_console(tmp_path):
    """At 60 columns the group table turns into one block per group, and the EQUAL line wraps; no line is wider."""
    base = {0: on_policy([0.1, 0.3, 0.5], [0.2, -0.1, 0.05]), 1: on_policy([0.2, 0.2, 0.4], [0.3, 0.1, -0.2])}
    sweep(tmp_path, base)
    con = Console(file=io.StringIO(), width=60, color_system=None)
    write_report(tmp_path, console=con)
    printed = con.file.getvalue()
    assert max(len(line.rstrip()) for line in printed.splitlines()) <= 60
    assert "G1  0 1  loss=grpo" in printed and "EQUAL: G1 and G2" in " ".join(printed.split())
