"""The bad-step policy: an update is applied only when it has something to train on and its loss and
gradient are finite; a run whose updates keep failing, or whose weights become non-finite, stops."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlcli.errors import UserError
from rlcli.modules.metrics import Metric
from rlcli.training import distributed

METRICS = {
    "empty_steps": Metric("always", "steps so far with no labelled token (`T = 0`): no update"),
    "bad_steps": Metric("always", "steps so far skipped for a non-finite loss or gradient norm"),
}


class TrainingDiverged(UserError):
    """Too many consecutive steps with a non-finite loss or gradient, or an update that made the
    parameters non-finite."""


class UpdateGuard:
    """Clips and applies each step's gradient, and counts the steps it skips (``trainer.grad_clip``,
    ``trainer.max_bad_steps``)."""

    def __init__(self, grad_clip: float, max_bad_steps: int) -> None:
        self.grad_clip = grad_clip
        self.max_bad_steps = max_bad_steps
        self.empty_steps = 0  # steps with nothing to train on
        self.bad_steps = 0  # steps skipped for a non-finite loss or gradient
        self.consecutive_bad_steps = 0

    def clip(self, model: torch.nn.Module, tokens: int, device: torch.device) -> torch.Tensor:
        """Clip the gradient of ``model`` to ``trainer.grad_clip``; its norm before clipping, on the device
        (0 for a step with no labelled token, ``tokens`` over all ranks, whose gradient is never applied)."""
        if tokens == 0:
            return torch.zeros((), device=device)
        return distributed.clip_grad_norm(model, self.grad_clip)

    def apply(self, optimizer, scheduler, model: torch.nn.Module, loss: float, grad_norm: float, tokens: int,
              step: int, device: torch.device) -> None:
        """Apply step ``step``'s clipped gradient of ``model``, given its loss and gradient norm (`clip`) on
        the host.

        No update for a step with no labelled token (``tokens`` over all ranks), or whose loss or
        gradient is not finite on some rank (every rank sees the same all-reduced loss and norm, so all
        skip together); ``max_bad_steps`` such steps in a row stop the run. An update that leaves a
        parameter non-finite on some rank stops the run at once on every rank: the weights are lost, and
        nothing after it (checkpoint, published weights, export) may hold them.
        """
        if tokens == 0:
            optimizer.zero_grad()
            self.empty_steps += 1
            rank_zero_warn(f"step {step}: no labelled token in the step; no update")
            return
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            optimizer.zero_grad()
            self.bad_steps += 1
            self.consecutive_bad_steps += 1
            rank_zero_warn(f"step {step}: loss {loss} or gradient norm {grad_norm} is not finite; no update")
            if self.consecutive_bad_steps >= self.max_bad_steps:
                raise TrainingDiverged(
                    f"training stopped at step {step}: {self.consecutive_bad_steps} steps in a row with a "
                    "non-finite loss or gradient (trainer.max_bad_steps). Lower optimizer.lr, keep trainer.grad_clip "
                    "on, or check the rollouts."
                )
            return
        self.consecutive_bad_steps = 0
        optimizer.step()
        optimizer.zero_grad()
        if not distributed.all_finite(model.parameters(), device):
            raise TrainingDiverged(
                f"training stopped at step {step}: after the optimizer update, parameters are NaN or "
                f"infinite (the loss and the gradient norm {grad_norm:.4g} were finite); nothing of this step is saved "
                "or exported. Lower optimizer.lr, keep trainer.grad_clip on, or train in bfloat16 or float32 rather "
                "than float16."
            )
        scheduler.step()

    def counts(self) -> dict[str, int]:
        """The steps skipped so far, by kind (`METRICS`)."""
        return {"empty_steps": self.empty_steps, "bad_steps": self.bad_steps}

    def state_dict(self) -> dict:
        return {"empty_steps": self.empty_steps, "bad_steps": (self.bad_steps, self.consecutive_bad_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.empty_steps = state["empty_steps"]
        self.bad_steps, self.consecutive_bad_steps = state["bad_steps"]
