"""A tiny random-init model learns the default built-in task from its own rollouts.

The loop below is a minimal stand-in for the trainer (one GRPO update per step on fresh
rollouts); it fixed the recommended default run of ``rlcli train``: `DEFAULTS`.
"""

from __future__ import annotations

import time

import pytest
import torch

from factories import tiny_policy
from rlcli.data.packing import make_micro_batch
from rlcli.modules import HeadSpec, LossInputs, LossSpec, policy_loss, token_logprobs
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.rollout.sampler import HFSampler
from rlcli.rollout.tasks import ReverseTask

DEFAULTS = dict(
    steps=60,
    prompts_per_step=8,
    group_size=8,
    max_new_tokens=4,
    temperature=1.0,
    lr=2e-3,
    grad_clip=1.0,
    hidden_size=64,
    num_layers=2,
)


def train_on_rollouts(
    task, model, *, steps, prompts_per_step, group_size, max_new_tokens, temperature, lr, grad_clip, seed=0
):
    """Alternate generation and one GRPO (token_mean) update; the mean reward of every step."""
    rollouts = OnPolicyRollouts(
        task,
        HFSampler(model, temperature=temperature),
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        estimator="grpo",
        eps=1e-6,
        seed=seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    head = model.get_output_embeddings().weight
    rewards = []
    for step in range(steps):
        docs, stats = rollouts.generate(step)
        rewards.append(stats["reward"])
        batch = make_micro_batch(docs)  # one packed row of every document
        hidden = model.base_model(
            input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False
        ).last_hidden_state[0]  # [L, H]
        logprobs, _ = token_logprobs(hidden, head, batch.labels, HeadSpec(temperature=temperature))  # [L]
        inputs = LossInputs(proximal_logprobs=batch.sampler_logprobs, advantages=batch.advantages, mask=batch.mask,
                            document_index=batch.document_index)
        loss, _ = policy_loss(logprobs, inputs, LossSpec(metrics="none"))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return rewards


@pytest.mark.slow
def test_mean_reward_rises_on_the_default_task():
    settings = dict(DEFAULTS)
    task = ReverseTask()
    model = tiny_policy(
        task.tokenizer.vocab_size, hidden_size=settings.pop("hidden_size"), num_layers=settings.pop("num_layers")
    )
    start = time.perf_counter()
    rewards = train_on_rollouts(task, model, **settings)
    seconds = time.perf_counter() - start
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward, first 5 steps {first:.3f}, last 5 steps {last:.3f}, {seconds:.1f} s")
    assert last >= 0.5 and last - first >= 0.3, rewards
