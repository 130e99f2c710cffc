"""Overlong shaping (math.md#overlong-shaping): R_len at its boundaries, the shaped rewards and
advantages of on-policy rollouts, the masking of truncated completions, and the config rules."""

from __future__ import annotations

import math

import pytest

from rlcli.conf.validate import ConfigError, validate_config
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.rollout.overlong import NO_SHAPING, Overlong, overlong_reward
from rlcli.rollout.sampler import Completion
from rlcli.rollout.tasks import CharTokenizer, ReverseTask
from train_helpers import compose_train_config

EPS = 1e-6
EOS, JUNK = CharTokenizer.eos_id, 2


@pytest.mark.parametrize(
    "length, max_new_tokens, buffer, expected",
    [
        # L = 10, L_c = 4: no penalty up to 6 tokens, then -1/4 per token down to -1 at 10, -1 beyond
        (1, 10, 4, 0.0), (6, 10, 4, 0.0), (7, 10, 4, -0.25), (8, 10, 4, -0.5), (9, 10, 4, -0.75),
        (10, 10, 4, -1.0), (11, 10, 4, -1.0), (100, 10, 4, -1.0),
        # L_c = L: every token costs 1/L
        (0, 4, 4, 0.0), (1, 4, 4, -0.25), (3, 4, 4, -0.75), (4, 4, 4, -1.0), (5, 4, 4, -1.0),
        # L_c = 1: only a completion of L tokens (or more) is penalised
        (4, 5, 1, 0.0), (5, 5, 1, -1.0), (6, 5, 1, -1.0),
        # a buffer of 3: thirds
        (2, 5, 3, 0.0), (3, 5, 3, -1 / 3), (4, 5, 3, -2 / 3), (5, 5, 3, -1.0),
    ],
)
def test_overlong_reward_at_its_boundaries(length, max_new_tokens, buffer, expected):
    """Hand-derived values of R_len; an off-by-one at L - L_c or L, or a wrong slope, fails."""
    assert overlong_reward(length, max_new_tokens, buffer) == expected


def test_bad_shaping_is_refused():
    with pytest.raises(ValueError, match="overlong buffer must be >= 1, got 0"):
        Overlong(buffer=0)
    with pytest.raises(ValueError, match="overlong penalty must be >= 0, got -0.5"):
        Overlong(buffer=2, penalty=-0.5)
    with pytest.raises(ValueError, match="the overlong buffer 6 is longer than max_new_tokens=5"):
        rollouts(Overlong(buffer=6))


class ScriptedSampler:
    """A `Sampler` that answers every group of prompts with ``group`` (its completions in order)."""

    temperature = 1.0
    vocab_size = 10
    sync_seconds = None

    def __init__(self, group):
        self.group = group

    def sample(self, prompts, *, max_new_tokens, stop_ids, pad_id, generator):
        assert max_new_tokens == 5
        return self.group * (len(prompts) // len(self.group))


# max_new_tokens 5: lengths 3 (stopped), 1 (stopped), 5 (truncated), 2 (stopped)
GROUP = [
    Completion(ids=[JUNK, JUNK, EOS], logprobs=[-0.5, -1.5, -0.1], stopped=True),
    Completion(ids=[EOS], logprobs=[-0.25], stopped=True),
    Completion(ids=[JUNK] * 5, logprobs=[-2.0, -0.5, -1.0, -3.0, -0.2], stopped=False),
    Completion(ids=[JUNK, EOS], logprobs=[-0.3, -0.4], stopped=True),
]


def rollouts(overlong, group=GROUP):
    task = ReverseTask(min_len=2, max_len=2)
    return OnPolicyRollouts(task, ScriptedSampler(group), prompts_per_step=2, group_size=len(group),
                            max_new_tokens=5, eps=EPS, overlong=overlong)


def grpo_reference(rewards):
    mean = math.fsum(rewards) / len(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + EPS) for r in rewards]


def test_the_overlong_reward_is_added_to_the_rewards_before_the_advantages():
    """Rewards are the unshaped ones plus p x R_len (L = 5, L_c = 3: R_len of lengths 3, 1, 5, 2 is -1/3,
    0, -1, 0), in float64; advantages, ``reward``, ``reward/overlong`` and the logged lines follow them.
    Shaping after the advantages, a wrong p or a metric of p x R_len fails."""
    plain, plain_stats, _ = rollouts(NO_SHAPING).generate_logged(0, 0)
    docs, stats, lines = rollouts(Overlong(buffer=3, penalty=0.5)).generate_logged(0, 8)
    r_len = [-1 / 3, 0.0, -1.0, 0.0] * 2
    expected = [d.reward + 0.5 * o for d, o in zip(plain, r_len)]
    assert [d.reward for d in docs] == expected
    assert [list(d.completion_ids) for d in docs] == [list(d.completion_ids) for d in plain]
    for g in range(2):
        advantages = grpo_reference(expected[4 * g: 4 * g + 4])
        assert [d.advantages[0] for d in docs[4 * g: 4 * g + 4]] == pytest.approx(advantages, rel=1e-12)
    assert stats["reward"] == pytest.approx(math.fsum(expected) / 8, rel=1e-12)
    assert stats["reward/overlong"] == pytest.approx((-1 / 3 - 1.0) / 4, rel=1e-12)
    assert "reward/overlong" not in plain_stats and "truncated_fraction" not in stats
    assert [line["rewards"]["overlong"] for line in lines] == r_len  # all 8, in order


def test_truncated_completions_are_masked_after_their_groups_advantages():
    """Under ``mask_truncated`` the truncated completion (#2 of each group) is no document; the others keep
    their names and the advantages of the whole group; the statistics are those of all 8 sampled
    completions, 2 of them truncated. Dropping before the advantages, or keeping the truncated, fails."""
    plain, plain_stats, _ = rollouts(NO_SHAPING).generate_logged(0, 0)
    docs, stats, _ = rollouts(Overlong(mask_truncated=True)).generate_logged(0, 0)
    kept = [0, 1, 3, 4, 5, 7]
    assert [d.source for d in docs] == [f"rollout:step 0 rank 0 #{i}" for i in kept]
    assert [d.advantages for d in docs] == [plain[i].advantages for i in kept]
    assert all(d.completion_ids[-1] == EOS for d in docs)
    assert stats["truncated_fraction"] == 2 / 8
    assert {k: v for k, v in stats.items() if k != "truncated_fraction"} == plain_stats


def test_a_group_of_truncated_completions_leaves_the_step():
    """Two groups whose completions are all truncated leave nothing: no document, no group."""
    truncated = [GROUP[2], GROUP[2]]
    docs, stats, _ = rollouts(Overlong(mask_truncated=True), truncated).generate_logged(0, 0)
    assert docs == [] and stats["truncated_fraction"] == 1.0


def problems_of(overrides):
    with pytest.raises(ConfigError) as info:
        validate_config(compose_train_config(overrides))
    return info.value.problems


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["reward.overlong_buffer=0"], "reward.overlong_buffer: must be >= 1"),
        (["reward.overlong_buffer=2", "reward.overlong_penalty=-1"], "reward.overlong_penalty: must be >= 0"),
        (["reward.overlong_buffer=5", "rollout.max_new_tokens=4"],
         "reward.overlong_buffer: 5 is more than rollout.max_new_tokens=4 tokens"),
        (["data=rollouts", "data.paths=[x.jsonl]", "reward.overlong_buffer=2"],
         "reward.overlong_buffer: shapes the rewards of the completions rlcli samples (data=generate, or rlcli "
         "sample with data=stream), not the records of data=rollouts, which carry their rewards"),
        (["rollout.mask_truncated=true", "trainer.minibatches=2"],
         "rollout.mask_truncated: drops a whole group when all its completions are truncated"),
    ],
)
def test_config_errors(overrides, expected):
    assert any(p.startswith(expected) for p in problems_of(overrides)), problems_of(overrides)


def test_valid_shaping_configs():
    cfg = validate_config(compose_train_config(["reward.overlong_buffer=4", "rollout.max_new_tokens=4",
                                                "reward.overlong_penalty=0", "rollout.mask_truncated=true"]))
    assert Overlong.of(cfg.reward, cfg.rollout) == Overlong(buffer=4, penalty=0.0, mask_truncated=True)
    assert validate_config(compose_train_config()).reward.overlong_buffer is None  # off by default
    stream = ["data=stream", "data.url=redis://127.0.0.1:1/0", "reward.overlong_buffer=2"]
    assert validate_config(compose_train_config(stream), command="sample").reward.overlong_buffer == 2
