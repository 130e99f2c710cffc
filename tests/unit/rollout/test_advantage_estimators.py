"""rloo, opo and passk (math.md#advantages): hand-derived groups, exact-rational references written from the
formulas, pass@k against an enumeration of every k-subset, and the errors and config rules that go with them."""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout
from rlcli.rollout.advantages import apply_advantage_estimator, group_advantages
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.rollout.sampler import Completion
from rlcli.rollout.tasks import CharTokenizer, Prompt

EPS = 1e-6
MAX = sys.float_info.max


def rollout(source, reward, group_id="g", mask=(1, 1)):
    return Rollout(prompt_ids=(1,), completion_ids=(2,) * len(mask), old_logprobs=(-1.0,) * len(mask),
                   advantages=None, reward=reward, group_id=group_id, completion_mask=tuple(mask), temperature=None,
                   source=source, index=0)


def exact(value: Fraction) -> float:
    """``value`` rounded to float64, ±inf beyond its range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def rloo_reference(rewards):
    """``r_i - sum_{j != i} r_j / (G - 1)`` in exact rationals; 0 for G = 1."""
    r = [Fraction(x) for x in rewards]
    if len(r) == 1:
        return [0.0]
    return [exact(r[i] - (sum(r) - r[i]) / (len(r) - 1)) for i in range(len(r))]


def opo_reference(rewards, lengths):
    """``r_i - sum_j |y_j| r_j / sum_j |y_j|`` in exact rationals; 0 when no document has a labelled token."""
    if sum(lengths) == 0:
        return [0.0] * len(rewards)
    r = [Fraction(x) for x in rewards]
    baseline = sum(n * x for n, x in zip(lengths, r)) / sum(lengths)
    return [exact(x - baseline) for x in r]


def passk_by_enumeration(rewards, k):
    """Each sample's mean of ``(R_S - rho) / sigma`` over the k-subsets S that hold it, with ``R_S`` the subset's
    pass@k (its best reward) and ``rho``, ``sigma`` the mean and std of ``R_S`` over all subsets: the derivation
    of math.md, by brute force (no binomial formula)."""
    subsets = list(combinations(range(len(rewards)), k))
    passed = {s: Fraction(max(rewards[i] for i in s)) for s in subsets}
    rho = sum(passed.values()) / len(subsets)
    variance = sum((p - rho) ** 2 for p in passed.values()) / len(subsets)
    if variance == 0:
        return [0.0] * len(rewards)
    sigma = math.sqrt(variance)
    means = [sum(passed[s] - rho for s in subsets if i in s) / sum(1 for s in subsets if i in s)
             for i in range(len(rewards))]
    return [float(m) / sigma for m in means]


def test_rloo_by_hand():
    # each 1 sees the others' mean (0 + 0 + 1)/3, each 0 sees (1 + 0 + 1)/3
    assert group_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4, "rloo", eps=EPS) == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3], rel=1e-15)
    assert group_advantages([3.0, 1.0], ["g", "g"], "rloo", eps=EPS) == [2.0, -2.0]
    assert group_advantages([5.0], ["solo"], "rloo", eps=EPS) == [0.0]  # G = 1: no one to leave out
    assert group_advantages([2.5, 2.5, 2.5], ["g"] * 3, "rloo", eps=EPS) == [0.0] * 3


def test_opo_by_hand_weighs_the_baseline_by_labelled_tokens():
    # baseline (1·1 + 4·1) / (1 + 2 + 3 + 4) = 1/2; unweighted it would be the mean, also 1/2: a second case
    assert group_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4, "opo", eps=EPS, lengths=[1, 2, 3, 4]) == [0.5, -0.5,
                                                                                                         -0.5, 0.5]
    # baseline (3·1 + 1·0) / 4 = 3/4, not the mean 1/2
    assert group_advantages([1.0, 0.0], ["g", "g"], "opo", eps=EPS, lengths=[3, 1]) == [0.25, -0.75]
    # a document without labelled tokens weighs nothing in the baseline: (2·2 + 0·9) / 2 = 2
    assert group_advantages([2.0, 9.0], ["g", "g"], "opo", eps=EPS, lengths=[2, 0]) == [0.0, 7.0]
    # no labelled token in the whole group: its advantages multiply nothing, 0
    assert group_advantages([2.0, 9.0], ["g", "g"], "opo", eps=EPS, lengths=[0, 0]) == [0.0, 0.0]


def test_opo_needs_the_lengths():
    with pytest.raises(ValueError, match="advantage.estimator=opo needs one length per reward"):
        group_advantages([1.0, 0.0], ["g", "g"], "opo", eps=EPS)


def test_files_give_opo_the_labelled_tokens_not_the_completion_length():
    """Breaks if the completion length (3 and 1) were used: the baseline would be 3/4, not 1/2."""
    rollouts = [rollout("a:1", 1.0, mask=(1, 0, 0)), rollout("a:2", 0.0, mask=(1,))]
    assert [r.advantages for r in apply_advantage_estimator(rollouts, "opo", eps=EPS)] == [(0.5,) * 3, (-0.5,)]


def test_passk_by_hand_n4_c1_k2():
    """The 6 pairs of 4 samples: the 3 that hold the correct one pass, rho = 1/2 = sigma. The correct sample's pairs
    all pass: (1 - 1/2)/(1/2) = 1. An incorrect one is in 3 pairs, one with the correct sample: mean 1/3,
    (1/3 - 1/2)/(1/2) = -1/3."""
    assert group_advantages([0.0, 1.0, 0.0, 0.0], ["g"] * 4, "passk", eps=EPS, k=2) == pytest.approx(
        [-1 / 3, 1.0, -1 / 3, -1 / 3], rel=1e-15)


def test_passk_by_hand_on_a_large_group():
    """N = 2000, c = 1, k = 1000: rho = k/N = 1/2, the correct sample gets 1; an incorrect one's subsets pass
    when they hold the correct one, C(1998, 998)/C(1999, 999) = 999/1999 of them: (999/1999 - 1/2)/(1/2) = -1/1999.
    The binomials have about 600 digits: exact rationals, no overflow."""
    advantages = group_advantages([1.0] + [0.0] * 1999, ["g"] * 2000, "passk", eps=EPS, k=1000)
    assert advantages[0] == pytest.approx(1.0, rel=1e-15)
    assert advantages[1:] == pytest.approx([-1 / 1999] * 1999, rel=1e-14)


@pytest.mark.parametrize("n", range(1, 8))
def test_passk_equals_the_enumeration_of_every_k_subset(n):
    """Every group of up to 7 binary rewards (every c) and every k <= N, against the brute-force derivation."""
    for c in range(n + 1):
        rewards = [1.0] * c + [0.0] * (n - c)
        for k in range(1, n + 1):
            got = group_advantages(rewards, ["g"] * n, "passk", eps=EPS, k=k)
            assert got == pytest.approx(passk_by_enumeration(rewards, k), rel=1e-13, abs=1e-15), (c, k)
            assert math.fsum(got) == pytest.approx(0.0, abs=1e-12)  # each subset counted by its k samples


def test_passk_with_k_1_is_grpo_without_eps():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0]
    mean = 2 / 5
    std = math.sqrt(mean * (1 - mean))
    assert group_advantages(rewards, ["g"] * 5, "passk", eps=EPS, k=1) == pytest.approx(
        [(r - mean) / std for r in rewards], rel=1e-14)


@pytest.mark.parametrize(("rewards", "k"), [([0.0] * 4, 2), ([1.0] * 4, 2), ([1.0, 1.0, 0.0, 0.0], 3)])
def test_passk_without_signal_is_zero(rewards, k):
    """All wrong (rho = 0), all right, or every 3-subset of 2 right and 2 wrong holds a right one (rho = 1)."""
    assert group_advantages(rewards, ["g"] * 4, "passk", eps=EPS, k=k) == [0.0] * 4


@pytest.mark.parametrize("rewards", [[1.0, 0.5, 0.0], [0.5, 0.5, 0.5], [2.0, 0.0, 1.0], [-1.0, 0.0, 0.0]])
def test_passk_refuses_a_reward_outside_0_and_1_naming_the_group(rewards):
    """Even a group of equal rewards (no signal) is looked at."""
    rollouts = [rollout(f"r.jsonl:{i + 1}", r, group_id="q7") for i, r in enumerate(rewards)]
    bad = next(r for r in rewards if r not in (0.0, 1.0))
    with pytest.raises(DataError, match=rf"group 'q7' \(first document r\.jsonl:1, 3 in all\): advantage\.estimator="
                                        rf"passk needs rewards of 0 or 1, got {bad!r}"):
        apply_advantage_estimator(rollouts, "passk", eps=EPS, k=2)


def test_passk_refuses_a_group_smaller_than_k_naming_it():
    rollouts = [rollout("r.jsonl:1", 1.0, "a"), rollout("r.jsonl:2", 0.0, "b"), rollout("r.jsonl:3", 0.0, "b"),
                rollout("r.jsonl:4", 0.0, "b")]
    with pytest.raises(DataError, match=r"group 'a' \(first document r\.jsonl:1, 1 in all\): 1 documents, fewer "
                                        r"than advantage\.k=3"):
        apply_advantage_estimator(rollouts, "passk", eps=EPS, k=3)
    done = apply_advantage_estimator(rollouts[1:], "passk", eps=EPS, k=3)  # b alone: 3 documents, no signal
    assert [r.advantages for r in done] == [(0.0, 0.0)] * 3


REWARDS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([MAX, -MAX, 1e200, -1e200, 5e-324, 0.0])


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(REWARDS, st.integers(0, 50)), min_size=1, max_size=8))
def test_rloo_and_opo_equal_the_exact_reference_for_any_finite_rewards(members):
    """Rounding the scaled baseline costs a few ulps of the group's largest |reward|: the tolerance."""
    rewards, lengths = [r for r, _ in members], [n for _, n in members]
    groups = ["g"] * len(rewards)
    scale = max(1.0, 2 * max(abs(r) for r in rewards))
    for got, want in ((group_advantages(rewards, groups, "rloo", eps=EPS), rloo_reference(rewards)),
                      (group_advantages(rewards, groups, "opo", eps=EPS, lengths=lengths),
                       opo_reference(rewards, lengths))):
        for a, b in zip(got, want):
            if math.isinf(b):
                assert a == b
            else:
                assert a == pytest.approx(b, rel=1e-12, abs=2**-49 * scale)


@pytest.mark.parametrize(
    ("rewards", "rloo"),
    [
        ([1e200, -1e200], [2e200, -2e200]),  # 1e200 - (-1e200)
        ([MAX, -MAX], [math.inf, -math.inf]),  # 2·MAX is beyond float64
        ([MAX, MAX, -MAX], [MAX, MAX, -MAX * 2]),
        ([1e308] * 3, [0.0] * 3),
    ],
)
def test_rloo_of_huge_rewards_does_not_overflow_before_its_result(rewards, rloo):
    assert group_advantages(rewards, ["g"] * len(rewards), "rloo", eps=EPS) == rloo


def test_rloo_advantage_beyond_float32_is_a_data_error_naming_the_record():
    rollouts = [rollout("a.jsonl:1", 3e38), rollout("a.jsonl:2", 0.0)]  # 3e38 - (0 - 1e38)/2 with the third
    with pytest.raises(DataError, match=r"^a\.jsonl:1: field 'reward': advantage\.estimator=rloo makes it the "
                                        r"advantage 3\.5e\+38 \(reward minus its group's baseline\)"):
        apply_advantage_estimator([*rollouts, rollout("a.jsonl:3", -1e38)], "rloo", eps=EPS)


class FixedSampler:
    """Answers every group with three completions of 3, 1 and 4 tokens."""

    temperature = 1.0
    vocab_size = 10
    sync_seconds = None
    GROUP = [Completion(ids=[5, 5, CharTokenizer.eos_id], logprobs=[-1.0] * 3, stopped=True),
             Completion(ids=[CharTokenizer.eos_id], logprobs=[-1.0], stopped=True),
             Completion(ids=[5] * 4, logprobs=[-1.0] * 4, stopped=False)]

    def sample(self, prompts, **_):
        return self.GROUP * (len(prompts) // len(self.GROUP))


class LengthTask:
    """Reward: the completion's first id is 5 (0 or 1), so [1, 0, 1] for the fixed group."""

    tokenizer = CharTokenizer("ab")

    def sample_prompts(self, rng, n):
        return [Prompt(text="a", ids=(3,), answer="a") for _ in range(n)]

    def reward(self, prompt, completion_ids):
        return float(completion_ids[0] == 5)

    def is_correct(self, prompt, completion_ids):
        return self.reward(prompt, completion_ids) == 1.0


def on_policy(estimator, **options):
    generator = OnPolicyRollouts(LengthTask(), FixedSampler(), prompts_per_step=2, group_size=3, max_new_tokens=4,
                                 estimator=estimator, eps=EPS, **options)
    docs, _ = generator.generate(step=0)
    return [d.advantages[0] for d in docs]


def test_on_policy_opo_weighs_by_completion_tokens_and_passk_gets_k():
    # opo: baseline (3·1 + 1·0 + 4·1) / 8 = 7/8
    assert on_policy("opo") == [1 / 8, -7 / 8, 1 / 8] * 2
    # passk, N = 3, c = 2, k = 2: every pair holds a correct sample, rho = 1: no signal
    assert on_policy("passk", k=2) == [0.0] * 6
    # k = 1: grpo without eps: mean 2/3, std sqrt(2)/3
    std = math.sqrt(2) / 3
    assert on_policy("passk", k=1) == pytest.approx([(1 / 3) / std, (-2 / 3) / std, (1 / 3) / std] * 2, rel=1e-14)
    assert on_policy("rloo") == [0.5, -1.0, 0.5] * 2  # 1 - (0 + 1)/2, 0 - (1 + 1)/2


def test_on_policy_passk_on_partial_credit_names_the_group_and_its_first_completion():
    class PartialCredit(LengthTask):
        def reward(self, prompt, completion_ids):
            return 0.5 * len(completion_ids)

    generator = OnPolicyRollouts(PartialCredit(), FixedSampler(), prompts_per_step=1, group_size=3,
                                 max_new_tokens=4, estimator="passk", eps=EPS, k=2)
    with pytest.raises(DataError, match=r"group 's0-r0-p0' \(first document rollout:step 0 rank 0 #0, 3 in all\): "
                                        r"advantage\.estimator=passk needs rewards of 0 or 1, got 1\.5"):
        generator.generate(step=0)


def test_the_stream_helper_passes_k_and_the_records_labelled_tokens():
    from rlcli.stream import group_advantages_for

    records = [{"prompt_ids": [1], "completion_ids": [2, 3, 4], "completion_mask": [1, 0, 0],
                "old_logprobs": [-1.0] * 3, "reward": 1.0, "group_id": "g"},
               {"prompt_ids": [1], "completion_ids": [2], "old_logprobs": [-1.0], "reward": 0.0, "group_id": "g"}]
    # one labelled token each: baseline 1/2 (3 tokens for the first would make it 3/4)
    assert [r["advantage"] for r in group_advantages_for(records, "opo", eps=EPS)] == [0.5, -0.5]
    # N = 2, c = 1, k = 1: grpo without eps, ±1
    assert [r["advantage"] for r in group_advantages_for(records, "passk", eps=EPS, k=1)] == [1.0, -1.0]
    with pytest.raises(DataError, match=r"group 'g' \(first document b\.jsonl:1, 2 in all\): 2 documents, fewer than "
                                        r"advantage\.k=3"):
        group_advantages_for(records, "passk", eps=EPS, k=3, names=["b.jsonl:1", "b.jsonl:2"])
    with pytest.raises(ValueError, match=r"b\.jsonl:2: field 'prompt_ids': missing"):  # opo reads a whole record
        group_advantages_for([records[0], {"reward": 0.0, "group_id": "g"}], "opo", eps=EPS,
                             names=["b.jsonl:1", "b.jsonl:2"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["advantage.estimator=passk"], "advantage.k: is required for advantage.estimator=passk"),
        (["advantage.k=2"], "advantage.k: only valid with advantage.estimator=passk, not 'grpo'"),
        (["advantage.estimator=passk", "advantage.k=0"], "advantage.k: must be >= 1"),
        (["advantage.estimator=passk", "advantage.k=9"], "advantage.k: 9 is more than rollout.group_size=8"),
        (["data=stream", "advantage.estimator=passk", "advantage.k=3", "rollout.group_size=2"],
         "advantage.k: 3 is more than rollout.group_size=2"),
    ],
)
def test_the_config_rules_of_k(overrides, expected):
    from rlcli.conf.validate import ConfigError, validate_config
    from train_helpers import compose_train_config

    with pytest.raises(ConfigError, match=expected):
        validate_config(compose_train_config(overrides), command="loop" if "data=stream" in overrides else "train")


@pytest.mark.parametrize("overrides", [["advantage.estimator=passk", "advantage.k=8"],
                                       ["advantage.estimator=passk", "advantage.k=1"], ["advantage.estimator=rloo"],
                                       ["advantage.estimator=opo"],
                                       ["data=rollouts", "data.paths=[r.jsonl]", "advantage.estimator=passk",
                                        "advantage.k=64"]])
def test_the_edges_of_k_pass(overrides):
    """k = the group's size, k = 1; with rollout files the group size is known at read time only."""
    from rlcli.conf.validate import validate_config
    from train_helpers import compose_train_config

    validate_config(compose_train_config(overrides))


@pytest.mark.parametrize(("advantage", "k"), [("passk", None), ("grpo", 2), ("passk", 0)])
def test_stream_push_checks_k(advantage, k):
    from rlcli.errors import UserError
    from rlcli.stream.push import push_files

    with pytest.raises(UserError, match="--k: the k of pass@k, an int >= 1 with --advantage passk and only with it"):
        push_files(["nothing.jsonl"], "redis://localhost:1/0", "s", advantage, 1e-6, out=sys.stdout, k=k)
