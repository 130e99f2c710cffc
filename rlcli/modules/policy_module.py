"""The LightningModule: one optimizer step per `training_step`, over micro-batches it pulls itself.

Read `training_step` top to bottom: fetch the step's micro-batches, agree on the step totals
across ranks, forward/backward each micro-batch with its exact share of the loss, then one
optimizer update and one row of metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlcli import distributed
from rlcli.data.packing import MicroBatch
from rlcli.data.stream import DocumentStream
from rlcli.modules.aggregation import StepTotals
from rlcli.modules.lm_head import token_logprobs
from rlcli.modules.metrics import MetricPartials, finalize_metrics
from rlcli.modules.policy_loss import micro_batch_loss
from rlcli.modules.segments import Segments


@dataclass(frozen=True)
class LossSettings:
    """What `micro_batch_loss` and `token_logprobs` need from the `loss`, `aggregation` and
    `metrics` groups."""

    loss: str = "grpo"
    aggregation: str = "token_mean"
    divisor: float | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    metrics: str = "basic"
    temperature: float = 1.0
    fp32_lm_head: bool = False
    chunk_tokens: int = 0


@dataclass(frozen=True)
class StepPlan:
    """What every rank knows before the first backward of a step."""

    totals: StepTotals
    group_numbering: dict


def plan_step(micro_batches: list[MicroBatch], device: torch.device) -> StepPlan:
    """Step totals (D, T, P, T_g) over all micro-batches of all ranks."""
    numbering = distributed.step_group_numbering(
        [doc.group_id for batch in micro_batches for doc in batch.documents]
    )
    totals = StepTotals.zeros(len(numbering))
    for batch in micro_batches:
        totals = totals + StepTotals.of_tokens(
            batch.mask, Segments.of(batch.document_index), batch.group_index(numbering), len(numbering)
        )
    flat = distributed.all_reduce(totals.flatten().to(device), "sum")
    return StepPlan(totals=StepTotals.unflatten(flat), group_numbering=numbering)


def reduce_partials(partials: MetricPartials) -> MetricPartials:
    """Combine every rank's metric partials (sums add, maxima/minima reduce)."""
    reduced = MetricPartials()
    for name, op in (("means", "sum"), ("sums", "sum"), ("maxima", "max"), ("minima", "min")):
        values = getattr(partials, name)
        if values:
            keys = sorted(values)
            flat = distributed.all_reduce(torch.stack([values[k] for k in keys]), op)
            setattr(reduced, name, dict(zip(keys, flat)))
    return reduced


class PolicyModule(L.LightningModule):
    """Policy-gradient training of a Hugging Face causal LM on packed rollouts.

    ``make_stream(rank, world_size)`` builds this rank's `DocumentStream`; the dataloader given to
    ``Trainer.fit`` only ticks steps.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        settings: LossSettings,
        make_optimizer: Callable[[torch.nn.Module], tuple],
        make_stream: Callable[[int, int], DocumentStream],
        *,
        accumulate_microbatches: int = 1,
        grad_clip: float = 0.0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.settings = settings
        self.make_optimizer = make_optimizer
        self.make_stream = make_stream
        self.accumulate_microbatches = accumulate_microbatches
        self.grad_clip = grad_clip
        self.stream: DocumentStream | None = None
        self.steps_done = 0  # training steps, including those with nothing to train on
        self.documents_seen = 0
        self.empty_steps = 0

    def setup(self, stage: str) -> None:
        self.stream = self.make_stream(self.global_rank, self.trainer.world_size)

    def configure_optimizers(self):
        optimizer, scheduler = self.make_optimizer(self.policy)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # the dataloader yields step ticks; micro-batches move in `_to_device`

    def _to_device(self, batch: MicroBatch) -> dict[str, torch.Tensor]:
        names = ("input_ids", "position_ids", "labels", "old_logprobs", "advantages", "mask", "document_index")
        return {name: getattr(batch, name).to(self.device) for name in names}

    def token_logprobs(self, input_ids, position_ids, labels):
        """Log-probs (and entropy) of ``labels`` for one packed row: ``[L] -> ([L], [L] | None)``."""
        hidden = self.policy.base_model(
            input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False
        ).last_hidden_state[0]  # [L, H]
        s = self.settings
        return token_logprobs(
            hidden,
            self.policy.get_output_embeddings().weight,
            labels,
            temperature=s.temperature,
            fp32=s.fp32_lm_head,
            chunk_tokens=s.chunk_tokens,
            with_entropy=s.metrics == "with_entropy",
        )

    def _micro_batch(self, batch: MicroBatch, plan: StepPlan) -> tuple[torch.Tensor, MetricPartials]:
        t = self._to_device(batch)
        logprobs, entropy = self.token_logprobs(t["input_ids"], t["position_ids"], t["labels"])
        s = self.settings
        return micro_batch_loss(
            logprobs, t["old_logprobs"].to(logprobs.dtype), t["advantages"].to(logprobs.dtype),
            t["mask"], t["document_index"], plan.totals, batch.group_index(plan.group_numbering).to(self.device),
            loss=s.loss, aggregation=s.aggregation, divisor=s.divisor, eps_low=s.eps_low,
            eps_high=s.eps_high, metrics=s.metrics, entropy=entropy,
        )

    def training_step(self, tick, batch_idx):
        micro_batches = self.stream.next_micro_batches(self.accumulate_microbatches)
        ranks_with_data = distributed.all_reduce(torch.tensor([float(bool(micro_batches))], device=self.device))
        if ranks_with_data.item() == 0:
            self.trainer.should_stop = True  # every rank has used up its data
            return None

        plan = plan_step(micro_batches, self.device)
        optimizer = self.optimizers()
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        partials = MetricPartials()
        for batch in micro_batches:
            loss, batch_partials = self._micro_batch(batch, plan)
            self.manual_backward(loss * distributed.gradient_scale())
            step_loss += loss.detach().to(torch.float64)
            partials = partials + batch_partials

        metrics = {"loss": distributed.all_reduce(step_loss, "sum")}
        metrics |= finalize_metrics(reduce_partials(partials), plan.totals)
        self.steps_done += 1
        num_documents = int(plan.totals.documents.item())
        lr = optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        self.documents_seen += num_documents
        if plan.totals.tokens.item() == 0:
            optimizer.zero_grad()
            self.empty_steps += 1
            rank_zero_warn(f"step {self.steps_done}: no labelled token in {num_documents} documents; no update")
            metrics["grad_norm"] = torch.zeros((), dtype=torch.float64)
        else:
            metrics["grad_norm"] = self._clip_gradients()
            optimizer.step()
            optimizer.zero_grad()
            self.lr_schedulers().step()
        metrics |= {"documents_seen": self.documents_seen, "empty_steps": self.empty_steps, "lr": lr}
        self._log_step(metrics)
        return None

    def _clip_gradients(self) -> torch.Tensor:
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)
        return norm.detach().to(torch.float64)

    def _log_step(self, metrics: dict) -> None:
        first = ("loss", "num_documents", "documents_seen", "num_tokens", "grad_norm", "lr")
        names = [*first, *sorted(k for k in metrics if k not in first)]
        values = {k: float(metrics[k]) for k in names}
        for logger in self.loggers:
            logger.log_metrics(values, step=self.steps_done)
        self.log_dict(
            {"loss": values["loss"], "docs": values["documents_seen"]},
            prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1,
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rlcli"] = {
            "stream": self.stream.state_dict() if self.stream else None,
            "steps_done": self.steps_done,
            "documents_seen": self.documents_seen,
            "empty_steps": self.empty_steps,
        }
