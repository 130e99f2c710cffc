"""The loss of one micro-batch as the config says, and the one place that calls `rlcli.modules`' head.

`micro_batch_tensors` puts a micro-batch's ``[L]`` tensors on the device (or a stand-in's, for a rank
with fewer micro-batches than the others); `MicroBatchLoss` turns the ``loss``, ``aggregation``,
``metrics``, ``kl`` and ``correction`` config groups into the loss spec and head spec, and calls the
fused head and loss (`loss(...)`) or the head's log-probs alone (`logprobs`) inside the scorer's forward.
"""

from __future__ import annotations

from functools import partial

import torch

from rlcli.conf.schema import AggregationConfig, CorrectionConfig, KLConfig, LossConfig
from rlcli.data.packing import MicroBatch
from rlcli.model.scorer import TokenScorer
from rlcli.modules import Correction, HeadSpec, KLPenalty, LossInputs, LossSpec, MetricPartials
from rlcli.modules.fused_head import fused_micro_batch_loss, head_logprobs
from rlcli.training.plan import UpdateTotals

TENSOR_FIELDS = ("input_ids", "position_ids", "labels", "sampler_logprobs", "advantages", "mask", "document_index")
TRAINER_FIELDS = ("proximal_logprobs", "reference_logprobs")  # there when every document carries them


def micro_batch_tensors(batch: MicroBatch | None, device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch's ``[L]`` tensors on ``device``. ``None`` stands for a rank that has fewer
    micro-batches than the others: one ignored token, so that every rank runs the same passes and
    collectives, and it adds nothing."""
    if batch is None:
        t = {name: torch.zeros(1, dtype=torch.long) for name in TENSOR_FIELDS}  # [1] each
        t["labels"] -= 100
        t |= {name: t["sampler_logprobs"] for name in TRAINER_FIELDS}
    else:
        t = {name: getattr(batch, name) for name in (*TENSOR_FIELDS, *TRAINER_FIELDS)
             if getattr(batch, name) is not None}
    return {name: value.to(device) for name, value in t.items()}


class MicroBatchLoss:
    """What to optimise and report (``loss``, ``aggregation``, ``metrics``, ``kl``, ``correction``), applied
    to one micro-batch at a time. With ``loss.old_logprobs=recompute`` the ratio's denominator is the
    trainer's own log-probs at the start of the batch (`rlcli.training.logprobs`), else the sampler's."""

    def __init__(self, loss: LossConfig, aggregation: AggregationConfig, metrics: str, kl: KLConfig,
                 correction: CorrectionConfig) -> None:
        self.spec = LossSpec(
            loss=loss.objective, aggregation=aggregation.name, divisor=aggregation.divisor, metrics=metrics,
            kl=KLPenalty(coef=kl.coef, estimator=kl.estimator or KLPenalty.estimator,  # null: the default, k3
                         ratio_weighted=kl.ratio_weighted) if kl.coef > 0 and kl.placement == "loss" else None,
            entropy_coef=loss.entropy_coef,
            correction=None if correction.mode == "none" else Correction(
                mode=correction.mode, level=correction.level, low=correction.low, high=correction.high),
        )
        self.head = HeadSpec(temperature=loss.temperature, fp32=loss.fp32_lm_head, chunk_tokens=loss.chunk_tokens)
        self.recompute = loss.old_logprobs == "recompute"

    def scorer(self, policy: torch.nn.Module) -> TokenScorer:
        """``policy`` with this loss's head at the end of its forward."""
        return TokenScorer(policy, self.head, with_entropy=self.spec.metrics == "with_entropy")

    def loss(self, scorer: TokenScorer, batch: MicroBatch | None, plan: UpdateTotals,
             device: torch.device) -> tuple[torch.Tensor, MetricPartials]:
        """This micro-batch's share of the update's loss, and its metric partials (see
        `micro_batch_tensors` for ``None``)."""
        t = micro_batch_tensors(batch, device)
        group_index = torch.zeros(1, dtype=torch.long) if batch is None else batch.group_index(plan.group_numbering)
        inputs = LossInputs(
            proximal_logprobs=t["proximal_logprobs" if self.recompute else "sampler_logprobs"],
            advantages=t["advantages"], mask=t["mask"], document_index=t["document_index"],
            group_index=group_index.to(device),
            sampler_logprobs=t["sampler_logprobs"] if self.spec.correction_on else None,
            reference_logprobs=t["reference_logprobs"] if self.spec.kl_on else None,
        )  # [L] each

        def head_loss(hidden, weight):  # [L, H], [V, H]
            return fused_micro_batch_loss(hidden, weight, t["labels"], inputs, plan.totals, self.spec, self.head)

        return scorer(t["input_ids"], t["position_ids"], t["labels"], head_loss=head_loss)

    def logprobs(self, scorer: TokenScorer, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[L]``: the scorer's log-probs of the micro-batch tensors ``t``, by the head this loss uses, bit
        for bit (0 where nothing is trained on)."""
        score = partial(head_logprobs, labels=t["labels"], mask=t["mask"], document_index=t["document_index"],
                        spec=self.spec, head=self.head)
        return scorer(t["input_ids"], t["position_ids"], t["labels"], head_loss=score)
