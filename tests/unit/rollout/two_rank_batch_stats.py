"""One of two gloo processes for test_batch_stats_two_ranks.py: the batch-level estimators over the step's
rollouts of both processes (``gather=all_gather_objects``, as on-policy steps call them) and kl.placement=reward's
batch stage; writes this rank's advantages and reward/kl to ``OUT/rank<r>.json``. Usage: two_rank_batch_stats.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from test_reward_kl import doc

from rlcli.data.document_stream import pack_documents
from rlcli.rollout.advantages import group_advantages
from rlcli.training import distributed
from rlcli.training.batches import BatchPlan
from rlcli.training.reward_kl import RewardKL, add_kl_to_rewards

# each rank's groups: rewards and labelled lengths differ between the ranks
RANKS = [
    {"rewards": [1.0, 0.0, 0.0, 2.0, 2.0], "groups": ["a", "a", "a", "b", "b"], "lengths": [3, 1, 4, 2, 6]},
    {"rewards": [5.0, -1.0, 0.5, 7.0], "groups": ["c", "c", "d", "d"], "lengths": [2, 5, 1, 3]},
]
BETA = 0.25


def documents(rank: int):
    """Rank ``rank``'s documents: old log-probs -1 - 0.1 i, ref -1.5 on every labelled token."""
    part = RANKS[rank]
    return [doc(f"r{rank}-{i}", r, g, old=[-1.0 - 0.1 * i] * n, ref=[-1.5] * n)
            for i, (r, g, n) in enumerate(zip(part["rewards"], part["groups"], part["lengths"]))]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    part, result = RANKS[rank], {}
    for estimator in ("reinforce_pp_baseline", "grpo_batch_std"):
        result[estimator] = group_advantages(part["rewards"], part["groups"], estimator, eps=1e-6,
                                             lengths=part["lengths"], gather=distributed.all_gather_objects)
        batch = BatchPlan(list(pack_documents(documents(rank), 16)), minibatches=1, epochs=1, seed=0, batch=0,
                          max_tokens=16)
        add_kl_to_rewards(batch, RewardKL(coef=BETA, estimator=estimator, eps=1e-6, k=None, recompute=False))
        result[f"kl/{estimator}"] = [d.advantages[0] for d in batch.documents]
        result["reward/kl"] = batch.stats["reward/kl"]
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
