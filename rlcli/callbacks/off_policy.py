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
