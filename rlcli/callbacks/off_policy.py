"""A warning when the first step shows that the trainer does not score the rollouts as their sampler did."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from rlcli.callbacks.metrics import step_row

# A first step whose ratio or kl is further from on-policy than this gets a warning.
PARITY_RATIO_TOLERANCE = 0.05
PARITY_KL_TOLERANCE = 0.02


def warn_if_off_policy(metrics: dict, temperature: float) -> None:
    """Warn when the first step's ratio/kl show that the trainer does not score the rollouts as
    their sampler did (ratio 1 and kl 0 are expected for on-policy data)."""
    ratio, kl = float(metrics.get("ratio_new_old", 1.0)), float(metrics.get("kl_new_old", 0.0))
    if abs(ratio - 1) <= PARITY_RATIO_TOLERANCE and kl <= PARITY_KL_TOLERANCE:
        return
    rank_zero_warn(
        f"first step: ratio_new_old={ratio:.4f}, kl_new_old={kl:.4f}, far from on-policy (1, 0). Likely causes: "
        f"loss.temperature={temperature} is not the sampler's temperature; the sampler ran at another precision "
        "(try loss.fp32_lm_head=true or model.dtype); or the rollouts were not sampled from this model."
    )


class OffPolicyWarning(L.Callback):
    """`warn_if_off_policy` on the row of step 1 (``temperature``: ``loss.temperature``)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = step_row(outputs)
        if row is not None and outputs["step"] == 1:
            warn_if_off_policy(row, self.temperature)


# After this many steps with every ratio at 1 and no clipping, `RatioAtOneWarning` speaks.
RATIO_AT_ONE_STEPS = 5
RATIO_AT_ONE_TOLERANCE = 1e-6


class RatioAtOneWarning(L.Callback):
    """Warns once when the first `RATIO_AT_ONE_STEPS` steps all had ``ratio_new_old`` within
    `RATIO_AT_ONE_TOLERANCE` of 1 and nothing clipped (``clipped_ratio_fraction`` 0 where the loss has
    a clip): every policy loss then reduces to the same policy gradient (math.md), so runs that differ
    only in the loss cannot differ. Silent without ratio metrics (``metrics=none``)."""

    def __init__(self) -> None:
        self.steps = 0  # steps so far with the ratio at 1 and nothing clipped

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = step_row(outputs)
        if row is None or self.steps < 0 or "ratio_new_old" not in row:
            return
        at_one = abs(row["ratio_new_old"] - 1) <= RATIO_AT_ONE_TOLERANCE and row.get("clipped_ratio_fraction", 0) == 0
        self.steps = self.steps + 1 if at_one else -1  # -1: a step left 1, nothing more to say
        if self.steps == RATIO_AT_ONE_STEPS:
            self.steps = -1
            rank_zero_warn(
                f"the ratio new/old has been 1 and the clip has not acted in the first {RATIO_AT_ONE_STEPS} steps: "
                "every loss (grpo, gspo, cispo, ...) is then the same policy gradient, so runs that differ only "
                "in the loss will not differ. The losses differ when the policy moves between sampling and an "
                "update: trainer.minibatches > 1 or trainer.batch_epochs > 1, rollout files (data=rollouts) "
                "sampled by an older policy, or the live loop (rlcli loop) with staleness (data.max_lag > 0)."
            )
