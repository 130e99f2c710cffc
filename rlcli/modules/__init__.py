"""Pure tensor math of rlcli: LM head log-probs, policy losses, aggregation and metrics.

Nothing here knows about Lightning or torch.distributed. A loss call takes three bundles: the
`LossInputs` (tensors named by where they come from), the `LossSpec` (what to optimise) and, for the
fused head, the `HeadSpec` (how the head scores).
"""

from rlcli.modules.aggregation import AGGREGATIONS, StepTotals, token_weights
from rlcli.modules.fused_head import LabelledRows, fused_micro_batch_loss, head_logprobs
from rlcli.modules.lm_head import HeadSpec, auto_chunk_tokens, token_logprobs
from rlcli.modules.losses import GRPO, GSPO, LOSSES, LossInputs, PolicyLoss, RatioUnits, make_loss
from rlcli.modules.metrics import METRIC_LEVELS, MetricPartials, finalize_metrics, metric_partials
from rlcli.modules.policy_loss import LossSpec, micro_batch_loss, policy_loss
from rlcli.modules.registry import Registry, UnknownName
from rlcli.modules.regularizers import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    KL_ESTIMATORS,
    Correction,
    KLPenalty,
    reject_tokens,
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
    "HeadSpec",
    "LabelledRows",
    "LossInputs",
    "LossSpec",
    "MetricPartials",
    "PolicyLoss",
    "RatioUnits",
    "Registry",
    "Segments",
    "StepTotals",
    "UnknownName",
    "auto_chunk_tokens",
    "finalize_metrics",
    "fused_micro_batch_loss",
    "head_logprobs",
    "make_loss",
    "metric_partials",
    "micro_batch_loss",
    "policy_loss",
    "reject_tokens",
    "token_logprobs",
    "token_weights",
]
