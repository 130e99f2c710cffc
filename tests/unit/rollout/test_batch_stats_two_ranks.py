"""The batch-level estimators on two real processes (gloo): each rank holds other rewards, and both get the
advantages of the whole batch, the float64 reference over both ranks' documents (the sampler's advantages and
kl.placement=reward's recomputed ones alike). Fails if a rank normalised over its own documents alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from batch_advantage_reference import grpo_batch_std_reference, reinforce_pp_baseline_reference
from two_rank_batch_stats import BETA, RANKS

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(estimator, rewards, groups, lengths):
    if estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_reference(rewards, groups, lengths, 1e-6)
    return grpo_batch_std_reference(rewards, groups, 1e-6)


@pytest.mark.slow
def test_two_ranks_get_the_statistics_of_the_whole_batch(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parents[1]), str(HERE.parents[2])]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "two_rank_batch_stats.py"), str(tmp_path)],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    rewards = [x for part in RANKS for x in part["rewards"]]
    groups = [x for part in RANKS for x in part["groups"]]
    lengths = [x for part in RANKS for x in part["lengths"]]
    # kl.placement=reward: document i of a rank has sum k1 = n (-1 - 0.1 i + 1.5)
    shaped = [r - BETA * n * (0.5 - 0.1 * i) for part in RANKS
              for i, (r, n) in enumerate(zip(part["rewards"], part["lengths"]))]
    for estimator in ("reinforce_pp_baseline", "grpo_batch_std"):
        got = ranks[0][estimator] + ranks[1][estimator]
        assert got == pytest.approx(reference(estimator, rewards, groups, lengths), rel=1e-12, abs=1e-12)
        got = ranks[0][f"kl/{estimator}"] + ranks[1][f"kl/{estimator}"]
        assert got == pytest.approx(reference(estimator, shaped, groups, lengths), rel=1e-12, abs=1e-12)
    terms = [BETA * n * (0.5 - 0.1 * i) for part in RANKS for i, n in enumerate(part["lengths"])]
    assert ranks[0]["reward/kl"] == ranks[1]["reward/kl"] == pytest.approx(sum(terms) / len(terms), rel=1e-12)
