"""Float64 references of the batch-level estimators (math.md#batch-level-estimators), written from the formulas
with exact rationals (no rlcli code): reinforce_pp_baseline and grpo_batch_std over a whole batch."""

from __future__ import annotations

import math
from fractions import Fraction


def group_centred(rewards, groups):
    """``a_d = r_d - mean of d's group``, exact."""
    r = [Fraction(x) for x in rewards]
    members = {}
    for d, g in enumerate(groups):
        members.setdefault(g, []).append(d)
    mean = {g: sum(r[d] for d in ds) / len(ds) for g, ds in members.items()}
    return [r[d] - mean[g] for d, g in enumerate(groups)]


def reinforce_pp_baseline_reference(rewards, groups, lengths, eps):
    """``(a_d - mu_B) / (s_B + eps)`` with the token-weighted mean and population std of the ``a_d``."""
    a = group_centred(rewards, groups)
    tokens = sum(lengths)
    if tokens == 0:
        return [0.0] * len(a)
    mu = sum(n * x for n, x in zip(lengths, a)) / tokens
    s = math.sqrt(sum(n * (x - mu) ** 2 for n, x in zip(lengths, a)) / tokens)
    return [float(x - mu) / (s + eps) for x in a]


def grpo_batch_std_reference(rewards, groups, eps):
    """``a_d / (sigma_B + eps)`` with the population std of the batch's rewards."""
    a = group_centred(rewards, groups)
    r = [Fraction(x) for x in rewards]
    mean = sum(r) / len(r)
    sigma = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
    return [float(x) / (sigma + eps) for x in a]
