"""reinforce_pp_baseline and grpo_batch_std (math.md#batch-level-estimators): hand-derived batches, exact references
written from the formulas, the same advantages whatever the split into processes (an all-gather emulated by
threads), the files' and the stream push's batch, and a user's group estimator next to them."""

from __future__ import annotations

import math
import random
import threading

import pytest
from batch_advantage_reference import grpo_batch_std_reference, reinforce_pp_baseline_reference

from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout
from rlcli.rollout.advantages import (
    ADVANTAGE_ESTIMATORS,
    apply_advantage_estimator,
    batch_stage,
    estimator_keywords,
    group_advantages,
    whiten_over_tokens,
)

EPS = 1e-6
BATCH_ESTIMATORS = ("reinforce_pp_baseline", "grpo_batch_std")


def reference(estimator, rewards, groups, lengths, eps=EPS):
    if estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_reference(rewards, groups, lengths, eps)
    return grpo_batch_std_reference(rewards, groups, eps)


def test_hand_derived_batch():
    """Groups a = (1, 0) with 1 and 3 tokens, b = (5,) with 2: a_d = 0.5, -0.5, 0; over the 6 tokens mu = -1/6 and
    s^2 = (1(2/3)^2 + 3(1/3)^2 + 2(1/6)^2)/6 = 5/36; the rewards' std is sqrt(14/3) (mean 2). Fails if the mean is
    not token-weighted, the std not the population one, or the batch std taken per group."""
    rewards, groups, lengths = [1.0, 0.0, 5.0], ["a", "a", "b"], [1, 3, 2]
    s = math.sqrt(5) / 6
    assert group_advantages(rewards, groups, "reinforce_pp_baseline", eps=EPS, lengths=lengths) == pytest.approx(
        [(2 / 3) / (s + EPS), (-1 / 3) / (s + EPS), (1 / 6) / (s + EPS)], rel=1e-14)
    sigma = math.sqrt(14 / 3)
    assert group_advantages(rewards, groups, "grpo_batch_std", eps=EPS) == pytest.approx(
        [0.5 / (sigma + EPS), -0.5 / (sigma + EPS), 0.0], rel=1e-14)


def test_no_spread_and_no_tokens():
    """Equal rewards everywhere: 0 (mu_B = s_B = 0); a batch without labelled tokens: 0 too."""
    for estimator in BATCH_ESTIMATORS:
        assert group_advantages([2.0] * 4, ["a", "a", "b", "b"], estimator, eps=EPS, lengths=[1, 2, 3, 4]) == [0.0] * 4
    assert group_advantages([1.0, 0.0], ["a", "a"], "reinforce_pp_baseline", eps=EPS, lengths=[0, 0]) == [0.0, 0.0]


def random_batch(rng, groups=7):
    rewards, ids, lengths = [], [], []
    for g in range(groups):
        for _ in range(rng.randint(1, 5)):
            rewards.append(rng.choice([0.0, 1.0, rng.uniform(-3, 3), rng.uniform(-1e3, 1e3)]))
            ids.append(f"g{g}")
            lengths.append(rng.randint(0, 12))
    return rewards, ids, lengths


@pytest.mark.parametrize("estimator", BATCH_ESTIMATORS)
@pytest.mark.parametrize("seed", range(5))
def test_equal_the_exact_reference(estimator, seed):
    """Multiple groups, unequal lengths (some 0), mixed scales: the float64 reference to 1e-12."""
    rewards, groups, lengths = random_batch(random.Random(seed))
    got = group_advantages(rewards, groups, estimator, eps=EPS, lengths=lengths)
    assert got == pytest.approx(reference(estimator, rewards, groups, lengths), rel=1e-12, abs=1e-12)


def test_whitened_advantages_have_token_mean_0_and_std_1():
    """reinforce_pp_baseline's advantages have mean 0 and std s/(s + eps) over the labelled tokens (a no-signal
    group gets -mu/(s+eps), not 0)."""
    rewards, groups, lengths = [1.0, 0.0, 0.0, 3.0, 3.0], ["a", "a", "a", "b", "b"], [4, 1, 7, 2, 9]
    got = group_advantages(rewards, groups, "reinforce_pp_baseline", eps=1e-300, lengths=lengths)
    tokens = [a for a, n in zip(got, lengths) for _ in range(n)]
    assert math.fsum(tokens) == pytest.approx(0.0, abs=1e-12)
    assert math.fsum(t * t for t in tokens) / len(tokens) == pytest.approx(1.0, rel=1e-12)
    assert got[3] == got[4] != 0.0


def advantages_on_ranks(parts, rewards, groups, lengths, estimator):
    """Each process (a thread) computes the advantages of its documents ``parts[rank]``, all-gathering among the
    threads as processes do; the advantages of every document."""
    slots, barrier, got = [None] * len(parts), threading.Barrier(len(parts)), [None] * len(rewards)

    def run(rank):
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            return list(slots)

        docs = parts[rank]
        values = group_advantages([rewards[d] for d in docs], [groups[d] for d in docs], estimator, eps=EPS,
                                  lengths=[lengths[d] for d in docs], gather=gather)
        for d, value in zip(docs, values):
            got[d] = value

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


@pytest.mark.parametrize("estimator", BATCH_ESTIMATORS)
@pytest.mark.parametrize("seed", range(4))
def test_same_advantages_on_any_split_into_processes(estimator, seed):
    """Whole groups dealt to 1-8 processes (a thread each, all-gathering as on-policy steps do): every process's
    advantages equal those of the whole batch bit for bit; without the gather they would be each process's own."""
    rng = random.Random(seed)
    rewards, groups, lengths = random_batch(rng, groups=9)
    whole = group_advantages(rewards, groups, estimator, eps=EPS, lengths=lengths)
    for ranks in range(1, 9):
        owner = {g: rng.randrange(ranks) for g in dict.fromkeys(groups)}
        parts = [[d for d, g in enumerate(groups) if owner[g] == r] for r in range(ranks)]
        assert advantages_on_ranks(parts, rewards, groups, lengths, estimator) == whole, f"{ranks} processes"


def rollout(source, reward, group_id, n, advantages=None):
    return Rollout(prompt_ids=(1,), completion_ids=(2,) * n, old_logprobs=(-1.0,) * n,
                   advantages=advantages, reward=reward, group_id=group_id, completion_mask=(1,) * n,
                   temperature=None, source=source, index=0)


@pytest.mark.parametrize("estimator", BATCH_ESTIMATORS)
def test_rollout_files_batch_is_every_record_without_advantages(estimator):
    """With rollout files the batch is every record read that lacks advantages: one carrying its own is left out."""
    rollouts = [rollout("f:1", 1.0, "a", 1), rollout("f:2", 0.0, "a", 3), rollout("f:3", 5.0, "b", 2),
                rollout("f:4", 100.0, "b", 9, advantages=(7.0,) * 9)]
    done = apply_advantage_estimator(rollouts, estimator, eps=EPS)
    expected = reference(estimator, [1.0, 0.0, 5.0], ["a", "a", "b"], [1, 3, 2])
    assert [r.advantages for r in done[:3]] == [pytest.approx((e,) * r.num_labelled, rel=1e-14)
                                                for e, r in zip(expected, rollouts)]
    assert done[3].advantages == (7.0,) * 9


def test_stream_push_batch_is_the_pushed_records():
    """rlcli stream push (`group_advantages_for`): reinforce_pp_baseline weighs each record by its labelled tokens."""
    from rlcli.stream import group_advantages_for

    records = [{"prompt_ids": [1], "completion_ids": [2] * n, "old_logprobs": [-1.0] * n, "reward": r, "group_id": g}
               for n, r, g in ((1, 1.0, "a"), (3, 0.0, "a"), (2, 5.0, "b"))]
    got = [r["advantage"] for r in group_advantages_for(records, "reinforce_pp_baseline", eps=EPS)]
    assert got == pytest.approx(reinforce_pp_baseline_reference([1.0, 0.0, 5.0], ["a", "a", "b"], [1, 3, 2], EPS),
                                rel=1e-14)


def test_overflowing_group_part_is_a_data_error():
    """1.7e308 less its group's mean (-0.57e308) is beyond float64: the whitening refuses it, naming the batch."""
    with pytest.raises(DataError, match="reinforce_pp_baseline over the batch of 3 documents: .*float64"):
        group_advantages([1.7e308, -1.7e308, -1.7e308], ["g"] * 3, "reinforce_pp_baseline", eps=EPS,
                         lengths=[1, 1, 1])


def test_a_users_estimators_next_to_the_batch_ones():
    """The group estimator of the docs works unchanged, and one with a batch stage of its own declares lengths
    through its stage."""
    @ADVANTAGE_ESTIMATORS.register("test_spread")
    def spread(rewards):
        return [r - min(rewards) for r in rewards]

    @ADVANTAGE_ESTIMATORS.register("test_whitened_spread")
    @batch_stage(whiten_over_tokens)
    def whitened_spread(rewards):
        return [r - min(rewards) for r in rewards]

    try:
        assert group_advantages([1.0, 3.0, 2.0], ["a", "a", "b"], "test_spread", eps=EPS) == [0.0, 2.0, 0.0]
        assert estimator_keywords("test_whitened_spread") == ("eps", "lengths")
        got = group_advantages([1.0, 3.0], ["a", "a"], "test_whitened_spread", eps=1e-300, lengths=[1, 1])
        assert got == [-1.0, 1.0]  # (0, 2): mean 1, std 1
    finally:
        ADVANTAGE_ESTIMATORS._entries.pop("test_spread")
        ADVANTAGE_ESTIMATORS._entries.pop("test_whitened_spread")


def test_an_on_policy_round_is_the_batch():
    """One process's step (or one `rlcli sample` round): two groups of rewards (1, 0, 1) with 3, 1 and 4 tokens;
    grpo_batch_std divides by the std of all six rewards, sqrt(2)/3, reinforce_pp_baseline whitens over 16 tokens."""
    from test_advantage_estimators import on_policy

    std = math.sqrt(2) / 3
    assert on_policy("grpo_batch_std") == pytest.approx([(1 / 3) / (std + EPS), (-2 / 3) / (std + EPS),
                                                         (1 / 3) / (std + EPS)] * 2, rel=1e-14)
    assert on_policy("reinforce_pp_baseline") == pytest.approx(
        reinforce_pp_baseline_reference([1.0, 0.0, 1.0] * 2, [0, 0, 0, 1, 1, 1], [3, 1, 4] * 2, EPS), rel=1e-14)
