"""Group advantage estimators: hand-derived values and the errors of apply_advantage_estimator."""

import math

import numpy as np
import pytest

from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout
from rlcli.rollout.advantages import apply_advantage_estimator, group_advantages

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
        apply_advantage_estimator([rollout("a:1", reward=1.0, group_id="g")], "rloo", eps=EPS)
