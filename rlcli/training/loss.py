"""The loss of one micro-batch as the config says, and the one place that calls `rlcli.modules`' head.

`micro_batch_to_device` puts a micro-batch's ``[L]`` tensors on the device (or a stand-in's, for a rank
with fewer micro-batches than the others) with its layout, worked out on the host from its documents, so
that the loss reads nothing back from the device; `MicroBatchLoss` turns the ``loss``, ``aggregation``,
``metrics``, ``kl`` and ``correction`` config groups into the loss spec and head spec, and calls the
fused head and loss (`loss(...)`) or the head's log-probs alone (`logprobs`) inside the scorer's forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial

import torch

from rlcli.conf.schema import AggregationConfig, CorrectionConfig, KLConfig, LossConfig
from rlcli.data.packing import MicroBatch
from rlcli.model.scorer import PackedDocuments, TokenScorer
from rlcli.modules import Correction, HeadSpec, KLPenalty, LabelledRows, LossInputs, LossSpec, MetricPartials, Segments
from rlcli.modules.fused_head import fused_micro_batch_loss, head_logprobs
from rlcli.training.plan import UpdateTotals, to_device

TENSOR_FIELDS = ("input_ids", "position_ids", "labels", "sampler_logprobs", "advantages", "mask", "document_index")
TRAINER_FIELDS = ("proximal_logprobs", "reference_logprobs")  # there when every document carries them


@dataclass(frozen=True)
class DeviceMicroBatch:
    """A micro-batch's tensors on the device, with what the host knows of its layout: the loss of it reads
    nothing back from the device.

    Attributes:
        tensors: the ``[L]`` tensors by name (`TENSOR_FIELDS`, the `TRAINER_FIELDS` it has, ``group_index``).
        documents: its documents (``document_index`` numbers them 0..S-1).
        labelled: its labelled positions, as the fused head takes them.
        packed: its documents as the attention takes them.
        batch: the micro-batch, or None for a stand-in.
    """

    tensors: dict[str, torch.Tensor]
    documents: Segments
    labelled: LabelledRows
    packed: PackedDocuments
    batch: MicroBatch | None


def micro_batch_to_device(batch: MicroBatch | None, group_numbering: dict, device: torch.device) -> DeviceMicroBatch:
    """The micro-batch on ``device``, its layout worked out on the host. ``None`` stands for a rank that has
    fewer micro-batches than the others: one ignored token, so that every rank runs the same passes and
    collectives, and it adds nothing."""
    if batch is None:
        t = {name: torch.zeros(1, dtype=torch.long) for name in (*TENSOR_FIELDS, "group_index")}  # [1] each
        t["labels"] -= 100
        t |= {name: t["sampler_logprobs"] for name in TRAINER_FIELDS}
        rows, counts, offsets = [], [], [0, 1]
    else:
        t = {name: getattr(batch, name) for name in (*TENSOR_FIELDS, *TRAINER_FIELDS)
             if getattr(batch, name) is not None}
        t["group_index"] = batch.group_index(group_numbering)
        rows, counts = batch.labelled_rows()
        offsets = batch.document_offsets()
    runs = [run for run, count in enumerate(counts) for _ in range(count)]
    host = t | {"rows": torch.tensor(rows, dtype=torch.long), "runs": torch.tensor(runs, dtype=torch.long),
                "offsets": torch.tensor(offsets, dtype=torch.int32)}
    on_device = {name: to_device(value, device) for name, value in host.items()}
    tensors = {name: on_device[name] for name in t}
    return DeviceMicroBatch(
        tensors=tensors,
        documents=Segments(inverse=tensors["document_index"], count=len(offsets) - 1),
        labelled=LabelledRows(rows=on_device["rows"], runs=on_device["runs"], counts=tuple(counts)),
        packed=PackedDocuments(index=tensors["document_index"], offsets=on_device["offsets"],
                               longest=max(b - a for a, b in itertools.pairwise(offsets))),
        batch=batch,
    )


class MicroBatchLoss:
    """What to optimise and report (``loss``, ``aggregation``, ``metrics``, ``kl``, ``correction``), applied
    to one micro-batch at a time. With ``loss.old_logprobs=recompute`` the ratio's denominator is the
    trainer's own log-probs at the start of the batch (`rlcli.training.logprobs`), else the sampler's.
    ``compile`` (``model.compile``): the loss math through ``torch.compile`` (`HeadSpec.compile`)."""

    def __init__(self, loss: LossConfig, aggregation: AggregationConfig, metrics: str, kl: KLConfig,
                 correction: CorrectionConfig, compile: bool = False) -> None:
        self.spec = LossSpec(
            loss=loss.objective, aggregation=aggregation.name, divisor=aggregation.divisor, metrics=metrics,
            kl=KLPenalty(coef=kl.coef, estimator=kl.estimator or KLPenalty.estimator,  # null: the default, k3
                         ratio_weighted=kl.ratio_weighted) if kl.coef > 0 and kl.placement == "loss" else None,
            entropy_coef=loss.entropy_coef,
            correction=None if correction.mode == "none" else Correction(
                mode=correction.mode, level=correction.level, low=correction.low, high=correction.high),
        )
        self.head = HeadSpec(temperature=loss.temperature, fp32=loss.fp32_lm_head, chunk_tokens=loss.chunk_tokens,
                             compile=compile)
        self.recompute = loss.old_logprobs == "recompute"

    def scorer(self, policy: torch.nn.Module) -> TokenScorer:
        """``policy`` with this loss's head at the end of its forward."""
        return TokenScorer(policy, self.head, with_entropy=self.spec.metrics == "with_entropy")

    def loss(self, scorer: TokenScorer, micro_batch: DeviceMicroBatch, plan: UpdateTotals
             ) -> tuple[torch.Tensor, MetricPartials]:
        """This micro-batch's share of the update's loss, and its metric partials."""
        t = micro_batch.tensors
        inputs = LossInputs(
            proximal_logprobs=t["proximal_logprobs" if self.recompute else "sampler_logprobs"],
            advantages=t["advantages"], mask=t["mask"], document_index=t["document_index"],
            group_index=t["group_index"],
            sampler_logprobs=t["sampler_logprobs"] if self.spec.correction_on else None,
            reference_logprobs=t["reference_logprobs"] if self.spec.kl_on else None,
            documents=micro_batch.documents,
        )  # [L] each

        def head_loss(hidden, weight):  # [L, H], [V, H]
            return fused_micro_batch_loss(hidden, weight, t["labels"], inputs, plan.totals, self.spec, self.head,
                                          labelled=micro_batch.labelled)

        return scorer(t["input_ids"], t["position_ids"], t["labels"], head_loss=head_loss, documents=micro_batch.packed)

    def logprobs(self, scorer: TokenScorer, micro_batch: DeviceMicroBatch) -> torch.Tensor:
        """``[L]``: the scorer's log-probs of the micro-batch, by the head this loss uses, bit for bit (0
        where nothing is trained on)."""
        t = micro_batch.tensors
        score = partial(head_logprobs, labels=t["labels"], mask=t["mask"], document_index=t["document_index"],
                        spec=self.spec, head=self.head, labelled=micro_batch.labelled)
        return scorer(t["input_ids"], t["position_ids"], t["labels"], head_loss=score, documents=micro_batch.packed)
