"""Where a step's documents come from: rollout files, or on-policy generation from the policy."""

from __future__ import annotations

from pathlib import Path

import torch

from rlcli.data.document_stream import DocumentStream, pack_documents
from rlcli.data.writers import append_jsonl
from rlcli.rollout.onpolicy import OnPolicyRollouts
from rlcli.training.step import CollectedStep, collect_step


class RolloutFileSource:
    """This rank's share of the rollout files; a step is a number of micro-batches or documents."""

    def __init__(self, stream: DocumentStream, *, accumulate_microbatches: int, docs_per_step: int, exact: bool):
        self.stream = stream
        self.accumulate_microbatches = accumulate_microbatches
        self.docs_per_step = docs_per_step
        self.exact = exact

    def next_step(self, policy: torch.nn.Module, step: int, device: torch.device) -> CollectedStep:
        return collect_step(
            self.stream, accumulate_microbatches=self.accumulate_microbatches,
            docs_per_step=self.docs_per_step, exact=self.exact, device=device,
        )

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


class OnPolicySource:
    """Each step samples fresh groups from the current policy (all of them form the step)."""

    def __init__(self, rollouts: OnPolicyRollouts, *, max_tokens: int, save_to: Path | None = None):
        self.rollouts = rollouts
        self.max_tokens = max_tokens
        self.save_to = save_to

    def next_step(self, policy: torch.nn.Module, step: int, device: torch.device) -> CollectedStep:
        documents, stats = self.rollouts.generate(policy, step)
        if self.save_to is not None:
            append_jsonl(documents, self.save_to)
        return CollectedStep(list(pack_documents(documents, self.max_tokens)), stats=stats)

    def state_dict(self) -> dict:
        return {}  # prompts and samples derive from (seed, step, rank): nothing to keep

    def load_state_dict(self, state: dict) -> None:
        pass
