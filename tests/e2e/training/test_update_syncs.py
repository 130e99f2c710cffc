"""No host synchronisation inside the micro-batch loop of `rlcli train` (issue 33), counted exactly on the CPU.

A few steps of ``rlcli train model=tiny data=rollouts`` run in-process under `benchmarks.dispatch.StepCounts`:
an `OpCounter` per optimizer step (`PolicyModule.training_step`, not while the step source reads its batch)
and one per micro-batch (its `MicroBatchLoss.loss` and the backward that follows). Every micro-batch must
make no synchronising operation (``.item()``, ``nonzero``, ``unique``, boolean indexing, ...) and every
step at most 4, at 4 and 16 micro-batches per step and with the loss options that add work to the loop.
A failure prints where the syncs come from. Any ``.item()`` (or a ``unique``, ...) added to the loss, the
head or the backward fails the first test; one added per step beyond the budget, the second.
"""

from __future__ import annotations

import pytest

from benchmarks.dispatch import StepCounts
from rlcli.commands.train import train
from train_helpers import compose_train_config

STEPS = 2
MAX_SYNCS_PER_STEP = 4
BASE = ["model=tiny", "data=rollouts", "logger=none", f"trainer.max_steps={STEPS}"]
CONFIGS = {  # name: (overrides, micro-batches of each step)
    "4 micro-batches": (["trainer.accumulate_microbatches=4"], [4, 4]),
    "16 micro-batches": (["trainer.accumulate_microbatches=16"], [16, 16]),
    # every option that adds work to the loop, in one run: a sequence-level loss with the dual clip, the
    # entropy bonus and its metric, a KL penalty to the reference model, the mismatch correction, prompt_mean
    "every loss option": (["loss=gspo_token", "loss.dual_clip=3", "metrics=with_entropy", "loss.entropy_coef=0.01",
                           "kl.coef=0.1", "correction.mode=truncate", "aggregation=prompt_mean"], [4, 4]),
    # two updates per batch on the trainer's own log-probs
    "recompute, 2 mini-batches": (["loss.old_logprobs=recompute", "trainer.minibatches=2"], [3, 2]),
    "generate": (["data=generate"], [2, 2]),  # the training part: the sampling is not counted
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def counted(request, tmp_path_factory) -> tuple[str, list[int], StepCounts]:
    """The counts of one configuration's run: (name, micro-batches of each step, counts)."""
    overrides, micro_batches = CONFIGS[request.param]
    with StepCounts(where=3) as counts:
        train(compose_train_config([*BASE, *overrides]), tmp_path_factory.mktemp("run"))
    return request.param, micro_batches, counts


@pytest.mark.slow
def test_no_micro_batch_synchronises_the_host(counted):
    name, micro_batches, counts = counted
    assert [len(loop) for loop in counts.micro_batches] == micro_batches  # the loop was counted
    assert all(c.total > 0 for loop in counts.micro_batches for c in loop)
    found = [(s + 1, m + 1, c) for s, loop in enumerate(counts.micro_batches) for m, c in enumerate(loop)
             if c.sync_count]
    if found:
        step, micro_batch, first = found[0]
        pytest.fail(f"{name}: {len(found)} micro-batches synchronise the host, "
                    f"{sum(c.sync_count for *_, c in found)} syncs in all; step {step}'s micro-batch {micro_batch}: "
                    f"{dict(first.syncs)}, at\n{first.report_sites()}")


@pytest.mark.slow
def test_an_optimizer_step_synchronises_the_host_at_most_4_times(counted):
    name, _, counts = counted
    assert len(counts.steps) == STEPS
    found = [(s + 1, c) for s, c in enumerate(counts.steps) if c.sync_count > MAX_SYNCS_PER_STEP]
    if found:
        step, first = found[0]
        pytest.fail(f"{name}: syncs per step {[c.sync_count for c in counts.steps]}, more than "
                    f"{MAX_SYNCS_PER_STEP}; step {step}: {dict(first.syncs)}, at\n{first.report_sites()}")
