"""kl.placement=reward (math.md#kl-in-the-reward): the trainer's batch stage and the files' shaping at read against
hand-derived values and float64 references written from the formulas, the same advantages whatever the split into
micro-batches, no KL term in the loss, and the config rules."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from batch_advantage_reference import grpo_batch_std_reference, reinforce_pp_baseline_reference

from rlcli.conf.schema import KLConfig
from rlcli.conf.validate import ConfigError, validate_config
from rlcli.data.document_stream import pack_documents
from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout
from rlcli.training.batches import BatchPlan
from rlcli.training.reward_kl import RewardKL, add_kl_to_rewards, subtract_kl_at_read
from train_helpers import compose_train_config

EPS = 1e-6


def doc(source, reward, group, old, ref, mask=None, proximal=None, advantage=0.0):
    """A document as the sampler made it (its advantages the sampler's), with the trainer's log-probs."""
    n = len(old)
    return Rollout(prompt_ids=(1, 2), completion_ids=(3,) * n, old_logprobs=tuple(old),
                   advantages=None if advantage is None else (advantage,) * n,
                   reward=reward, group_id=group, completion_mask=tuple(mask or (1,) * n), temperature=None,
                   source=source, index=0, ref_logprobs=tuple(ref),
                   proximal_logprobs=None if proximal is None else tuple(proximal))


def plan(docs, max_tokens=64):
    return BatchPlan(list(pack_documents(docs, max_tokens)), minibatches=1, epochs=1, seed=0, batch=0,
                     max_tokens=max_tokens, stats={"reward": 0.5})


def advantages_of(batch):
    return {d.source: d.advantages for d in batch.documents}


def test_the_math_pages_example():
    """beta 0.1, dr_grpo: sum k1 = (-1 + 1.5) + (-2 + 2.5) = 1 and 0, r' = (0.9, 0), advantages (0.45, -0.45) on every
    token, reward/kl the mean of 0.1 and 0. Fails if the KL is left out, taken per token, or of the wrong sign."""
    batch = plan([doc("a", 1.0, "g", old=[-1.0, -2.0], ref=[-1.5, -2.5]), doc("b", 0.0, "g", old=[-1.0], ref=[-1.0])])
    add_kl_to_rewards(batch, RewardKL(coef=0.1, estimator="dr_grpo", eps=EPS, k=None, recompute=False))
    assert advantages_of(batch) == {"a": pytest.approx((0.45, 0.45), rel=1e-15), "b": pytest.approx((-0.45,))}
    assert batch.stats == {"reward": 0.5, "reward/kl": pytest.approx(0.05, rel=1e-15)}
    assert [d.reward for d in batch.documents] == [1.0, 0.0]  # the record's reward stays r
    for mb in batch.micro_batches:  # the tensors the loss reads carry the new advantages
        assert mb.advantages[mb.mask > 0].tolist() == pytest.approx(
            [a for d in mb.documents for a in d.advantages], rel=1e-6)


def test_masked_tokens_do_not_count_and_recompute_reads_the_proximal_logprobs():
    """The second token is not labelled (mask 0): only -1 - (-1.5) = 0.5 counts; with recompute the denominator is
    the proximal -1.2: 0.3. Group (r=1 with the KL, r=0): dr_grpo gives +-(1 - 0.1 k)/2."""
    def batch():
        return plan([doc("a", 1.0, "g", old=[-1.0, -9.0], ref=[-1.5, 0.0], mask=[1, 0], proximal=[-1.2, -7.0]),
                     doc("b", 0.0, "g", old=[-3.0], ref=[-3.0], proximal=[-3.0])])
    sampler, recomputed = batch(), batch()
    add_kl_to_rewards(sampler, RewardKL(coef=0.1, estimator="dr_grpo", eps=EPS, k=None, recompute=False))
    add_kl_to_rewards(recomputed, RewardKL(coef=0.1, estimator="dr_grpo", eps=EPS, k=None, recompute=True))
    assert advantages_of(sampler)["a"][0] == pytest.approx((1 - 0.05) / 2, rel=1e-15)
    assert advantages_of(recomputed)["a"][0] == pytest.approx((1 - 0.03) / 2, rel=1e-14)


def test_none_leaves_the_batch_alone():
    batch = plan([doc("a", 1.0, "g", old=[-1.0], ref=[-2.0], advantage=0.7)])
    add_kl_to_rewards(batch, None)
    assert advantages_of(batch) == {"a": (0.7,)} and batch.stats == {"reward": 0.5}


def random_docs(rng, groups=6):
    docs = []
    for g in range(groups):
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 6)
            old = [rng.uniform(-4, 0) for _ in range(n)]
            docs.append(doc(f"d{len(docs)}", rng.choice([0.0, 1.0, rng.uniform(-2, 2)]), f"g{g}", old=old,
                            ref=[o + rng.uniform(-1, 1) for o in old],
                            mask=[1] + [rng.randint(0, 1) for _ in range(n - 1)]))
    return docs


def shaped_rewards(docs, beta):
    """``r - beta sum_t m_t (old_t - ref_t)`` in exact rationals."""
    def k1(d):
        return sum(Fraction(o) - Fraction(r) for o, r, m in zip(d.old_logprobs, d.ref_logprobs, d.completion_mask)
                   if m)
    return [float(Fraction(d.reward) - Fraction(beta) * k1(d)) for d in docs]


def grpo_reference(rewards, groups, eps):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = math.fsum(members) / len(members)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in members) / len(members))
        out.append(0.0 if max(members) == min(members) else (r - mean) / (std + eps))
    return out


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp_baseline", "grpo_batch_std"])
@pytest.mark.parametrize("seed", range(3))
def test_equal_the_float64_reference_whatever_the_micro_batches(estimator, seed):
    """Several groups, unequal lengths, masked tokens: the advantages of r' equal the reference, and packing the
    batch into 1 to 8 micro-batches changes nothing (they are computed over the batch's documents)."""
    docs = random_docs(random.Random(seed))
    shaped = shaped_rewards(docs, 0.2)
    groups, lengths = [d.group_id for d in docs], [d.num_labelled for d in docs]
    expected = {"grpo": lambda: grpo_reference(shaped, groups, EPS),
                "reinforce_pp_baseline": lambda: reinforce_pp_baseline_reference(shaped, groups, lengths, EPS),
                "grpo_batch_std": lambda: grpo_batch_std_reference(shaped, groups, EPS)}[estimator]()
    seen = set()
    for max_tokens in (8, 9, 11, 14, 20, 30, 60, 200):
        batch = plan(docs, max_tokens)
        seen.add(len(batch.micro_batches))
        add_kl_to_rewards(batch, RewardKL(coef=0.2, estimator=estimator, eps=EPS, k=None, recompute=False))
        got = advantages_of(batch)
        for d, e in zip(docs, expected):
            assert got[d.source] == pytest.approx((e,) * len(d.completion_ids), rel=1e-9, abs=1e-12), max_tokens
    assert max(seen) >= 8 and min(seen) == 1


def test_rollout_files_are_shaped_at_read():
    """r - beta sum (old - ref) over labelled tokens with the records' old_logprobs; unchanged with placement=loss or
    coef 0; a record that carries advantages is an error naming it."""
    cfg = compose_train_config(["data=rollouts", "data.paths=[x.jsonl]", "kl.reference=rollouts", "kl.coef=0.5",
                                "kl.placement=reward", "kl.estimator=k1"])  # k1 may be said
    rollouts = [doc("f:1", 1.0, "g", old=[-1.0, -2.0], ref=[-2.0, 0.0], mask=[1, 0], advantage=None),
                doc("f:2", 0.0, "g", old=[-1.0], ref=[-0.5], advantage=None)]
    assert [r.reward for r in subtract_kl_at_read(rollouts, cfg)] == [0.5, 0.25]
    cfg.kl.placement = "loss"
    assert subtract_kl_at_read(rollouts, cfg) is rollouts
    cfg.kl.placement = "reward"
    with pytest.raises(DataError, match=r"f:9: carries advantages, and kl.placement=reward .*\(1 records carry"):
        subtract_kl_at_read([*rollouts, doc("f:9", 1.0, "g", old=[-1.0], ref=[-1.0])], cfg)


def test_the_loss_has_no_kl_term_with_the_kl_in_the_reward():
    from rlcli.training.loss import MicroBatchLoss

    cfg = validate_config(compose_train_config())

    def spec(placement, estimator="k1"):
        kl = KLConfig(coef=0.1, estimator=estimator, ratio_weighted=False, reference="initial", placement=placement)
        return MicroBatchLoss(cfg.loss, cfg.aggregation, "basic", kl, cfg.correction).spec
    assert spec("loss").kl_on and not spec("reward").kl_on
    assert spec("loss", None).kl.estimator == "k3" and spec("loss", "k1").kl.estimator == "k1"  # null: k3 in the loss


GENERATE = ["data=generate", "kl.coef=0.1", "kl.placement=reward"]  # kl.estimator unset: k1 in the reward
FILES = ["data=rollouts", "data.paths=[x.jsonl]", "kl.reference=rollouts", "kl.coef=0.1", "kl.placement=reward"]
APPLIES = "kl.placement: reward subtracts the KL from the rewards before rlcli computes the advantages"


@pytest.mark.parametrize("overrides, message", [
    ([*GENERATE, "kl.estimator=k3"], "kl.estimator: kl.placement=reward subtracts beta x the sum of k1 = old_lp - "
                                     "ref_lp from the reward, not k3; leave kl.estimator unset (null) or set it to k1"),
    ([*GENERATE, "kl.ratio_weighted=true"], "kl.ratio_weighted: weighs the KL term of the loss"),
    ([*GENERATE, "rollout.mask_truncated=true"], "rollout.mask_truncated: drops the truncated completions"),
    ([*FILES, "kl.reference=initial"], f"{APPLIES}, so it applies with data=generate, or data=rollouts with "
                                       "kl.reference=rollouts (the records' ref_logprobs), and an advantage.estimator "
                                       "that computes them from rewards (not none or distill); got data=rollouts, "
                                       "kl.reference=initial, advantage.estimator=grpo"),
    ([*FILES, "advantage.estimator=none"], f"{APPLIES}"),
    ([*FILES, "correction.mode=truncate"], "loss.old_logprobs: kl.placement=reward with rollout files"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_train_config(overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("overrides", [GENERATE, FILES, [*GENERATE[:1], "kl.placement=reward"]],
                         ids=["generate", "files", "coef-0"])
def test_valid_configs(overrides):
    cfg = validate_config(compose_train_config(overrides))
    assert (RewardKL.of(cfg) is not None) == (overrides is GENERATE)
