"""Pure tensor math of rlcli: LM head log-probs, policy losses, aggregation and metrics.

Nothing here knows about Lightning or torch.distributed.
"""

from rlcli.modules.aggregation import AGGREGATIONS, StepTotals, token_weights
from rlcli.modules.fused_head import fused_micro_batch_loss, head_logprobs
from rlcli.modules.lm_head import auto_chunk_tokens, token_logprobs
from rlcli.modules.losses import GRPO, GSPO, LOSSES, LossInputs, PolicyLoss, RatioUnits, make_loss, register_loss
from rlcli.modules.metrics import METRIC_LEVELS, MetricPartials, finalize_metrics, metric_partials
from rlcli.modules.policy_loss import check_policy_loss_options, micro_batch_loss, policy_loss
from rlcli.modules.regularizers import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    KL_ESTIMATORS,
    Correction,
    KLPenalty,
    Terms,
)
from rlcli.modules.segments import Segments

__all__ = [
    "AGGREGATIONS",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "GRPO",
    "GSPO",
    "KL_ESTIMATORS",
    "LOSSES",
    "METRIC_LEVELS",
    "Correction",
    "KLPenalty",
    "Terms",
    "LossInputs",
    "MetricPartials",
    "PolicyLoss",
    "RatioUnits",
    "Segments",
    "StepTotals",
    "auto_chunk_tokens",
    "check_policy_loss_options",
    "finalize_metrics",
    "fused_micro_batch_loss",
    "head_logprobs",
    "make_loss",
    "metric_partials",
    "micro_batch_loss",
    "policy_loss",
    "register_loss",
    "token_logprobs",
    "token_weights",
]
