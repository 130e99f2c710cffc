"""Group advantage estimators: hand-derived values and the errors of apply_advantage_estimator."""

import math
import sys
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout
from rlcli.rollout.advantages import ADVANTAGE_ESTIMATORS, apply_advantage_estimator, group_advantages

EPS = 1e-6


def rollout(source, reward=None, group_id=None, advantages=None, completion_length=2):
    return Rollout(
        prompt_ids=(1,),
        completion_ids=(2,) * completion_length,
        old_logprobs=(-1.0,) * completion_length,
        advantages=advantages,
        reward=reward,
        group_id=group_id,
        completion_mask=(1,) * completion_length,
        temperature=None,
        source=source,
        index=0,
    )


def test_grpo_uses_population_std():
    # mean 2, population std sqrt(2/3) (the sample std would be 1 and give -1, 0, 1)
    std = math.sqrt(2 / 3)
    assert group_advantages([1.0, 2.0, 3.0], ["a"] * 3, "grpo", eps=EPS) == pytest.approx(
        [-1 / (std + EPS), 0.0, 1 / (std + EPS)], rel=1e-12
    )


def test_groups_are_interleaved_and_independent():
    rewards = [1.0, 5.0, 3.0, 5.0, 0.0]
    groups = ["a", "b", "a", "b", 7]
    # a: mean 2, std 1; b: equal rewards; 7: a group of one
    expected = [-1 / (1 + EPS), 0, 1 / (1 + EPS), 0, 0]
    assert group_advantages(rewards, groups, "grpo", eps=EPS) == pytest.approx(expected, rel=1e-12)
    assert group_advantages(rewards, groups, "dr_grpo", eps=EPS) == [-1.0, 0.0, 1.0, 0.0, 0.0]


def test_dr_grpo_is_reward_minus_group_mean():
    assert group_advantages([0.0, 0.0, 0.0, 1.0], [1, 1, 1, 1], "dr_grpo", eps=EPS) == [-0.25, -0.25, -0.25, 0.75]


def test_group_of_one_gets_zero():
    assert group_advantages([3.5], ["solo"], "grpo", eps=EPS) == [0.0]
    assert group_advantages([3.5], ["solo"], "dr_grpo", eps=EPS) == [0.0]


def test_int_and_str_group_ids_are_different_groups():
    assert group_advantages([1.0, 3.0], [1, "1"], "dr_grpo", eps=EPS) == [0.0, 0.0]


def grpo_reference(rewards, eps):
    """``(r - mean) / (std + eps)`` of one group, with the population std, in float64."""
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + eps)).tolist()


def test_eps_is_a_required_keyword():
    """``advantage.eps`` in the config is its one default."""
    with pytest.raises(TypeError):
        group_advantages([1.0, 2.0], ["g", "g"], "grpo")
    with pytest.raises(TypeError):
        group_advantages([1.0, 2.0], ["g", "g"], "grpo", 0.5)
    with pytest.raises(TypeError):
        apply_advantage_estimator([rollout("a:1", reward=1.0, group_id="g")], "grpo")


def test_group_advantages_use_the_given_eps():
    rewards, groups = [1.0, 2.0, 4.0, 0.5, 3.0], ["a", "a", "a", "b", "b"]
    expected = grpo_reference(rewards[:3], 0.5) + grpo_reference(rewards[3:], 0.5)
    assert group_advantages(rewards, groups, "grpo", eps=0.5) == pytest.approx(expected, rel=1e-12)
    assert group_advantages([0.0, 2.0], ["g", "g"], "grpo", eps=1.0) == [-0.5, 0.5]  # std 1: by hand


def test_apply_advantage_estimator_uses_the_given_eps():
    rewards = [1.0, 2.0, 4.0]
    rollouts = [rollout(f"a:{i}", reward=r, group_id="g") for i, r in enumerate(rewards)]
    result = apply_advantage_estimator(rollouts, "grpo", eps=0.5)
    expected = grpo_reference(rewards, 0.5)
    assert [r.advantages for r in result] == [pytest.approx((a, a), rel=1e-12) for a in expected]


def test_computed_in_float64():
    # float32 would lose the 1e-9 differences around 1e3
    advantages = group_advantages([1000.0, 1000.000000002], ["g", "g"], "dr_grpo", eps=EPS)
    assert advantages == pytest.approx([-1e-9, 1e-9], rel=1e-3)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        group_advantages([1.0], ["g"], "ppo", eps=EPS)
    with pytest.raises(ValueError, match="2 rewards but 1 group ids"):
        group_advantages([1.0, 2.0], ["g"], "grpo", eps=EPS)


def test_apply_grpo_expands_to_every_token_and_keeps_existing_advantages():
    rollouts = [
        rollout("a:1", reward=1.0, group_id="g", completion_length=3),
        rollout("a:2", reward=100.0, group_id="g", advantages=(9.0, 8.0)),  # kept, not part of g's statistics
        rollout("a:3", reward=3.0, group_id="g"),
        rollout("a:4", reward=5.0, group_id="h"),
    ]
    result = apply_advantage_estimator(rollouts, "grpo", eps=EPS)
    assert [r.source for r in result] == ["a:1", "a:2", "a:3", "a:4"]
    assert result[0].advantages == pytest.approx((-1 / (1 + EPS),) * 3)
    assert result[1] is rollouts[1]
    assert result[2].advantages == pytest.approx((1 / (1 + EPS),) * 2)
    assert result[3].advantages == (0.0, 0.0)
    assert result[0].reward == 1.0 and result[0].completion_ids == rollouts[0].completion_ids
    assert rollouts[0].advantages is None  # inputs are not modified


def test_apply_dr_grpo_groups_over_the_whole_dataset():
    rollouts = [rollout(f"a:{i}", reward=float(i), group_id=i % 2) for i in range(6)]
    result = apply_advantage_estimator(rollouts, "dr_grpo", eps=EPS)
    # group 0: rewards 0, 2, 4 (mean 2); group 1: 1, 3, 5 (mean 3)
    assert [r.advantages[0] for r in result] == [-2.0, -2.0, 0.0, 0.0, 2.0, 2.0]


def test_apply_none_requires_advantages():
    ready = [rollout("a:1", advantages=(1.0, 1.0)), rollout("a:2", reward=1.0, advantages=(0.0, 0.5))]
    assert apply_advantage_estimator(ready, "none", eps=EPS) == ready
    rollouts = [*ready, rollout("a:3", reward=1.0, group_id="g"), rollout("a:4")]
    with pytest.raises(DataError, match=r"a:3: no 'advantage' .*advantage\.estimator=grpo"):
        apply_advantage_estimator(rollouts, "none", eps=EPS)


@pytest.mark.parametrize("missing", ["reward", "group_id"])
def test_apply_grpo_needs_reward_and_group(missing):
    fields = {"reward": 1.0, "group_id": "g"} | {missing: None}
    rollouts = [rollout("a:1", reward=2.0, group_id="g"), rollout("a:2", **fields)]
    with pytest.raises(DataError, match=f"a:2: advantage.estimator=grpo needs '{missing}'"):
        apply_advantage_estimator(rollouts, "grpo", eps=EPS)


def test_apply_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        apply_advantage_estimator([rollout("a:1", reward=1.0, group_id="g")], "ppo", eps=EPS)


def test_a_registered_estimator_is_one_function_and_a_config_choice(monkeypatch):
    from rlcli.conf.validate import ConfigError, validate_config
    from train_helpers import compose_train_config

    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "_entries", dict(ADVANTAGE_ESTIMATORS.items()))  # undone after

    @ADVANTAGE_ESTIMATORS.register("spread")
    def spread(rewards, *, eps):
        return [r - min(rewards) for r in rewards]

    @ADVANTAGE_ESTIMATORS.register("longest")  # declares the lengths, and gets them
    def longest(rewards, *, lengths):
        return [float(n == max(lengths)) for n in lengths]

    assert group_advantages([1.0, 3.0, 2.0, 2.0], ["a", "a", "a", "b"], "spread", eps=EPS) == [0.0, 2.0, 1.0, 0.0]
    assert group_advantages([1.0, 3.0, 2.0], ["a"] * 3, "longest", eps=EPS, lengths=[4, 9, 2]) == [0.0, 1.0, 0.0]
    cfg = validate_config(compose_train_config(["data=generate", "advantage.estimator=spread"]))
    assert cfg.advantage.estimator == "spread"
    with pytest.raises(ConfigError, match=r"must be one of \['none', 'grpo', 'dr_grpo', 'rloo', "
                       r"'reinforce_pp_baseline', "
                       r"'grpo_batch_std', 'opo', 'passk', 'distill', 'spread', 'longest'\], got 'nope'"):
        validate_config(compose_train_config(["advantage.estimator=nope"]))
    with pytest.raises(ConfigError, match="need grpo or dr_grpo or rloo or reinforce_pp_baseline or grpo_batch_std "
                       "or opo or passk or distill or spread or longest"):
        validate_config(compose_train_config(["data=generate", "advantage.estimator=none"]))


def exact_group_advantages(rewards, estimator, eps):
    """One group's advantages from exact rationals (mean, deviations, variance) and a 60-digit square root."""
    values = [Fraction(r) for r in rewards]
    mean = sum(values) / len(values)
    centred = [v - mean for v in values]
    with localcontext() as context:
        context.prec = 60
        exact = [Decimal(c.numerator) / c.denominator for c in centred]
        if estimator == "grpo":
            variance = sum(c * c for c in centred) / len(values)
            std = (Decimal(variance.numerator) / variance.denominator).sqrt()
            exact = [c / (std + Decimal(eps)) for c in exact]
        return [float(a) for a in exact], float(std) if estimator == "grpo" else None  # beyond float64: ±inf


MAX = sys.float_info.max


@pytest.mark.parametrize(
    "rewards, grpo, dr_grpo",
    [
        # mean 0, std 1e200: (±1e200) / (1e200 + 1e-6) is ±1 in float64
        ([1e200, -1e200], [1.0, -1.0], [1e200, -1e200]),
        ([MAX, -MAX, MAX, -MAX], [1.0, -1.0, 1.0, -1.0], [MAX, -MAX, MAX, -MAX]),
        # mean 0.5e308; deviations 0.5e308 (three) and -1.5e308; std sqrt(0.75)·1e308
        ([1e308, 1e308, 1e308, -1e308], [1 / math.sqrt(3)] * 3 + [-math.sqrt(3)], [0.5e308] * 3 + [-1.5e308]),
        # mean -MAX/3, deviations 4/3, -2/3, -2/3 MAX (4/3 MAX is beyond float64), std sqrt(8/9) MAX
        ([MAX, -MAX, -MAX], [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], [math.inf] + [-2 * (MAX / 3)] * 2),
        ([1e308] * 3, [0.0] * 3, [0.0] * 3),  # equal rewards, however large
    ],
)
def test_huge_rewards_give_the_exact_advantages_without_overflow(rewards, grpo, dr_grpo):
    groups = ["g"] * len(rewards)
    assert group_advantages(rewards, groups, "grpo", eps=EPS) == pytest.approx(grpo, rel=1e-14)
    assert group_advantages(rewards, groups, "dr_grpo", eps=EPS) == pytest.approx(dr_grpo, rel=1e-14)


def test_tiny_rewards_with_a_tinier_eps_are_normalised_by_their_std():
    # std sqrt(2/3)·1e-200 (its square underflows to 0 in float64) is far above eps
    advantages = group_advantages([0.0, 1e-200, 2e-200], ["g"] * 3, "grpo", eps=1e-300)
    assert advantages == pytest.approx([-1 / math.sqrt(2 / 3), 0.0, 1 / math.sqrt(2 / 3)], rel=1e-14)


REWARDS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([MAX, -MAX, 1e200, -1e200, 5e-324, 0.0])


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(REWARDS, st.sampled_from("abc")), min_size=1, max_size=8),
       st.sampled_from([1e-6, 0.5, 1e-300]))
def test_group_advantages_equal_an_exact_reference_for_any_finite_rewards(members, eps):
    rewards, groups = [r for r, _ in members], [g for _, g in members]
    grpo = group_advantages(rewards, groups, "grpo", eps=eps)
    dr_grpo = group_advantages(rewards, groups, "dr_grpo", eps=eps)
    for group in set(groups):
        indices = [i for i, g in enumerate(groups) if g == group]
        values = [rewards[i] for i in indices]
        expected, std = exact_group_advantages(values, "grpo", eps)
        expected_dr, _ = exact_group_advantages(values, "dr_grpo", eps)
        # Rounding the mean and the deviations costs a few ulps of the group's largest |reward| (s below): the
        # bound on the error that follows, divided by (std + eps) for grpo.
        scale = max(1.0, 2 * max(abs(v) for v in values))
        tolerance = 2**-45 * scale / (std + eps)
        for i, want, want_dr in zip(indices, expected, expected_dr):
            # |r - mean| <= sqrt(n - 1)·std (Samuelson): grpo advantages are small, never beyond float32
            assert abs(grpo[i]) <= math.sqrt(len(values) - 1) * (1 + 1e-12) + tolerance
            assert grpo[i] == pytest.approx(want, rel=1e-12, abs=tolerance)
            if math.isinf(want_dr):
                assert dr_grpo[i] == want_dr
            else:
                assert dr_grpo[i] == pytest.approx(want_dr, rel=1e-12, abs=2**-50 * scale)


def test_dr_grpo_advantage_beyond_float32_is_a_data_error_naming_the_record():
    rollouts = [rollout("a.jsonl:1", reward=1e39, group_id="g"), rollout("a.jsonl:2", reward=-1e39, group_id="g"),
                rollout("a.jsonl:3", reward=1e38, group_id="h"), rollout("a.jsonl:4", reward=-1e38, group_id="h")]
    assert [r.advantages[0] for r in apply_advantage_estimator(rollouts[2:], "dr_grpo", eps=EPS)] == [1e38, -1e38]
    with pytest.raises(DataError) as error:
        apply_advantage_estimator(rollouts, "dr_grpo", eps=EPS)
    assert str(error.value).startswith(
        "a.jsonl:1: field 'reward': advantage.estimator=dr_grpo makes it the advantage 1e+39 (reward minus its "
        "group's baseline), outside the float32 range ±3.4028234663852886e+38 that training computes in."
    )
    # grpo normalises by the group's std: the same rewards give ±1
    assert [r.advantages[0] for r in apply_advantage_estimator(rollouts, "grpo", eps=EPS)] == [1.0, -1.0, 1.0, -1.0]
