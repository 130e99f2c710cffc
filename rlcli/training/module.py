"""The LightningModule: one optimizer update per `training_step`, over micro-batches it pulls itself.

Read `training_step` top to bottom: take the update's micro-batches (a batch from the step source,
with the trainer's own log-probs when the loss needs them, is split into `trainer.minibatches`
updates and passed over `trainer.batch_epochs` times), agree on the step totals across ranks,
forward/backward each micro-batch with its exact share of the loss, then one optimizer update and
one row of metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlcli.conf.schema import AggregationConfig, CorrectionConfig, KLConfig, LossConfig, TrainerConfig
from rlcli.data.packing import MicroBatch
from rlcli.errors import UserError
from rlcli.loggers.documents import DocumentsLog
from rlcli.loggers.metrics_csv import MetricsCSVLogger
from rlcli.model.scorer import TokenScorer
from rlcli.modules import Correction, KLPenalty
from rlcli.modules.fused_head import fused_micro_batch_loss, head_logprobs
from rlcli.modules.metrics import MetricPartials, finalize_metrics
from rlcli.training import distributed
from rlcli.training.batches import BatchPlan, Update
from rlcli.training.publish import WeightPublisher
from rlcli.training.sources import StepSource
from rlcli.training.step import StepPlan, mean_over_ranks, plan_step, reduce_partials

TENSOR_FIELDS = ("input_ids", "position_ids", "labels", "old_logprobs", "advantages", "mask", "document_index")


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


class TrainingDiverged(UserError):
    """Too many consecutive steps with a non-finite loss or gradient, or an update that made the
    parameters non-finite."""


class PolicyModule(L.LightningModule):
    """Policy-gradient training of a Hugging Face causal LM on packed rollouts.

    The ``loss``, ``aggregation``, ``metrics``, ``kl`` and ``correction`` config groups say what to
    optimise and report; ``trainer`` how many updates a batch makes and when to give up.
    ``make_source(rank, world_size)`` builds this rank's `StepSource` (`rlcli.training.sources`); the
    dataloader given to ``Trainer.fit`` only ticks steps. ``shard(scorer, device_mesh)`` returns the
    scorer sharded for FSDP1 or FSDP2 (`rlcli.training.strategy`). ``reference`` is the frozen
    reference policy of the KL penalty, when its log-probs come from a model. ``documents_log``
    records which documents trained each update; ``publisher`` sends the weights to samplers.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        loss: LossConfig,
        aggregation: AggregationConfig,
        metrics: str,
        kl: KLConfig,
        correction: CorrectionConfig,
        trainer: TrainerConfig,
        make_optimizer: Callable[[torch.nn.Module], tuple],
        make_source: Callable[[int, int], StepSource],
        *,
        seed: int,
        max_tokens: int,
        reference: torch.nn.Module | None = None,
        shard: Callable | None = None,
        documents_log: DocumentsLog | None = None,
        publisher: WeightPublisher | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        head = dict(temperature=loss.temperature, fp32_lm_head=loss.fp32_lm_head, chunk_tokens=loss.chunk_tokens)
        self.scorer = TokenScorer(policy, with_entropy=metrics == "with_entropy", **head)
        self.reference = None if reference is None else TokenScorer(reference.requires_grad_(False),
                                                                     with_entropy=False, **head)
        self.loss = loss
        self.aggregation = aggregation
        self.metrics = metrics
        self.kl = KLPenalty(coef=kl.coef, estimator=kl.estimator) if kl.coef > 0 else None
        self.correction = None if correction.mode == "none" else Correction(
            mode=correction.mode, level=correction.level, low=correction.low, high=correction.high)
        self.trainer_config = trainer
        self.seed = seed
        self.max_tokens = max_tokens
        self.make_optimizer = make_optimizer
        self.make_source = make_source
        self.shard = shard
        self.documents_log = documents_log
        self.publisher = publisher
        self.source: StepSource | None = None
        self.batch: BatchPlan | None = None  # the batch whose updates are being made
        self.batches_done = 0  # batches taken from the source
        self.steps_done = 0  # training steps, including those with nothing to train on
        self.documents_seen = 0
        self.empty_steps = 0
        self.bad_steps = 0  # steps skipped for a non-finite loss or gradient
        self.consecutive_bad_steps = 0
        self.last_metrics: dict[str, float] = {}  # the latest step's row, for the console

    @property
    def preempted(self) -> bool:
        """Training stopped early because a rank received a signal (`rlcli.signals`)."""
        return any(getattr(c, "preempted", False) for c in self.trainer.callbacks)

    @property
    def policy(self) -> torch.nn.Module:
        return self.scorer.policy

    def configure_model(self) -> None:
        if self.shard is not None:
            self.scorer = self.shard(self.scorer, self.device_mesh)

    def setup(self, stage: str) -> None:
        self.source = self.make_source(self.global_rank, self.trainer.world_size)

    def on_train_start(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(self, self.steps_done)  # the weights samplers start from

    def on_train_end(self) -> None:
        if self.publisher is not None:
            # a run stopped by a signal continues later: its samplers keep waiting
            self.publisher.publish(self, self.steps_done, final=not self.preempted)

    def checkpoint_durable(self) -> None:
        """The checkpoint just saved is on disk: the source may confirm what it holds."""
        self.source.checkpoint_durable()

    def configure_optimizers(self):
        optimizer, scheduler = self.make_optimizer(self.scorer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # the dataloader yields step ticks; micro-batches move in `_micro_batch_loss`

    @property
    def recompute(self) -> bool:
        """The ratio's denominator is the trainer's own log-probs at the start of each batch."""
        return self.loss.old_logprobs == "recompute"

    def _passes(self, micro_batches: list[MicroBatch]) -> int:
        """The most micro-batches any rank has: the passes every rank makes (stand-ins past its own)."""
        return int(distributed.all_reduce(torch.tensor(len(micro_batches), device=self.device), "max"))

    def _tensors(self, batch: MicroBatch | None) -> dict[str, torch.Tensor]:
        """The micro-batch's ``[L]`` tensors on this device. ``None`` stands for a rank that has fewer
        micro-batches than the others: one ignored token, so every rank runs the same passes and
        collectives, and it adds nothing."""
        if batch is None:
            t = {name: torch.zeros(1, dtype=torch.long) for name in TENSOR_FIELDS}
            t["labels"] -= 100
            t["proximal_logprobs"] = t["ref_logprobs"] = t["old_logprobs"]
        else:
            t = {name: getattr(batch, name) for name in TENSOR_FIELDS}
            t |= {name: getattr(batch, name) for name in ("proximal_logprobs", "ref_logprobs")
                  if getattr(batch, name) is not None}
        return {name: value.to(self.device) for name, value in t.items()}

    def _micro_batch_loss(self, batch: MicroBatch | None, plan: StepPlan) -> tuple[torch.Tensor, MetricPartials]:
        """This micro-batch's share of the step loss (see `_tensors` for ``None``)."""
        t = self._tensors(batch)
        group_index = torch.zeros(1, dtype=torch.long) if batch is None else batch.group_index(plan.group_numbering)
        loss, aggregation = self.loss, self.aggregation

        def head_loss(hidden, weight):
            return fused_micro_batch_loss(
                hidden, weight, t["labels"], t["proximal_logprobs" if self.recompute else "old_logprobs"],
                t["advantages"], t["mask"], t["document_index"], plan.totals, group_index.to(self.device),
                loss=loss.objective, aggregation=aggregation.name, divisor=aggregation.divisor, metrics=self.metrics,
                temperature=loss.temperature, fp32=loss.fp32_lm_head, chunk_tokens=loss.chunk_tokens,
                reference_logprobs=t["ref_logprobs"] if self.kl else None,
                behaviour_logprobs=t["old_logprobs"] if self.correction else None,
                kl=self.kl, entropy_coef=loss.entropy_coef, correction=self.correction,
            )

        return self.scorer(t["input_ids"], t["position_ids"], t["labels"], head_loss=head_loss)

    @torch.no_grad()
    def _add_trainer_logprobs(self, batch: BatchPlan) -> None:
        """Give the batch's documents the log-probs the loss needs from the trainer itself: the policy's
        own (``proximal_logprobs``, with ``loss.old_logprobs=recompute``) and the reference model's
        (``ref_logprobs``, KL to a reference model), by the head the loss uses, on the micro-batches of
        the first epoch: so the batch's first update starts at ratio 1 and ``kl_ref = 0`` exactly."""
        scorers = {"proximal_logprobs": self.scorer if self.recompute else None,
                   "ref_logprobs": self.reference if self.kl else None}
        scorers = {name: scorer for name, scorer in scorers.items() if scorer is not None}
        if not scorers:
            return
        micro_batches = [mb for part in batch.parts(0) for mb in part]
        passes = self._passes(micro_batches)
        head = dict(loss=self.loss.objective, temperature=self.loss.temperature, fp32=self.loss.fp32_lm_head,
                    chunk_tokens=self.loss.chunk_tokens)
        values: dict[int, dict] = {}
        for i in range(passes):  # every rank the same passes (a sharded scorer gathers its weights)
            micro_batch = micro_batches[i] if i < len(micro_batches) else None
            t = self._tensors(micro_batch)
            score = partial(head_logprobs, labels=t["labels"], mask=t["mask"], document_index=t["document_index"],
                            **head)
            scored = {name: scorer(t["input_ids"], t["position_ids"], t["labels"], head_loss=score)
                      for name, scorer in scorers.items()}  # [L] each
            if micro_batch is not None:
                per_document = {name: micro_batch.completion_values(v) for name, v in scored.items()}
                for d, doc in enumerate(micro_batch.documents):
                    values[id(doc)] = {name: v[d] for name, v in per_document.items()}
        batch.fill(values)

    def _next_update(self) -> Update | None:
        """The next update's micro-batches; a new batch from the source when the last one is done,
        None when every rank has used up its data."""
        if self.batch is None or self.batch.remaining == 0:
            step = self.source.next_step(self.batches_done, self.device)
            if self._passes(step.micro_batches) == 0:
                return None
            trainer = self.trainer_config
            self.batch = BatchPlan(
                step.micro_batches, minibatches=trainer.minibatches, epochs=trainer.batch_epochs, seed=self.seed,
                batch=self.batches_done, max_tokens=self.max_tokens, stats=step.stats, carried_over=step.carried_over,
            )
            self._add_trainer_logprobs(self.batch)
            self.batches_done += 1
        return self.batch.next_update()

    def training_step(self, tick, batch_idx):
        step = self._next_update()
        if step is None:
            self.trainer.should_stop = True  # every rank has used up its data
            return None
        passes = self._passes(step.micro_batches)
        plan = plan_step(step.micro_batches, self.device)
        optimizer = self.optimizers()
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        partials = MetricPartials()
        for i in range(passes):
            batch = step.micro_batches[i] if i < len(step.micro_batches) else None
            with optimizer.toggle_model(sync_grad=i == passes - 1):  # gradients sync once per step
                loss, batch_partials = self._micro_batch_loss(batch, plan)
                self.manual_backward(loss * distributed.gradient_scale())
            step_loss += loss.detach().to(torch.float64)
            partials = partials + batch_partials

        metrics = {"loss": distributed.all_reduce(step_loss, "sum")}
        metrics |= finalize_metrics(reduce_partials(partials, self.device), plan.totals)
        self.steps_done += 1
        num_documents = int(plan.totals.documents.item())
        self.documents_seen += num_documents
        lr = optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        metrics["grad_norm"] = self._update(optimizer, float(metrics["loss"]), plan)
        self.source.after_update(self.steps_done)
        if self.documents_log is not None:
            names = [doc.name for batch in step.micro_batches for doc in batch.documents]
            self.documents_log.append(self.steps_done, [n for rank in distributed.all_gather_objects(names)
                                                        for n in rank])
        if self.publisher is not None and self.publisher.due(self.steps_done):
            metrics["weight_publish_time"] = self.publisher.publish(self, self.steps_done)
        metrics |= {"documents_seen": self.documents_seen, "empty_steps": self.empty_steps,
                    "bad_steps": self.bad_steps, "lr": lr}
        metrics |= mean_over_ranks(step.stats, self.device)
        if getattr(self.source, "exact", False):
            metrics["carried_documents"] = step.carried_over
        if self.steps_done == 1:
            warn_if_off_policy(metrics, self.loss.temperature)
        metrics |= self._callback_metrics()
        self._log_step(metrics)
        return None

    def _callback_metrics(self) -> dict[str, float]:
        """What callbacks add to this step's row: each callback with a ``step_metrics(trainer, module)``
        method (e.g. ``eval.every``'s `rlcli.callbacks.evaluate.PeriodicEval`) is asked on every rank,
        after the update, so that a step keeps one row of metrics."""
        metrics: dict[str, float] = {}
        for callback in self.trainer.callbacks:
            if callable(getattr(callback, "step_metrics", None)):
                metrics |= callback.step_metrics(self.trainer, self)
        return metrics

    def _update(self, optimizer, loss: float, plan: StepPlan) -> float:
        """Clip and apply the step's gradient; returns the gradient norm before clipping.

        No update for a step with nothing to train on, or whose loss or gradient is not finite on
        some rank (every rank sees the same all-reduced loss and norm, so all skip together);
        ``max_bad_steps`` such steps in a row stop the run. An update that leaves a parameter non-finite
        on some rank stops the run at once on every rank: the weights are lost, and nothing after it
        (checkpoint, published weights, export) may hold them.
        """
        if plan.totals.tokens.item() == 0:
            optimizer.zero_grad()
            self.empty_steps += 1
            rank_zero_warn(f"step {self.steps_done}: no labelled token in the step; no update")
            return 0.0
        grad_norm = distributed.clip_grad_norm(self.scorer, self.trainer_config.grad_clip)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            optimizer.zero_grad()
            self.bad_steps += 1
            self.consecutive_bad_steps += 1
            rank_zero_warn(f"step {self.steps_done}: loss {loss} or gradient norm {grad_norm} is not finite; no update")
            if self.consecutive_bad_steps >= self.trainer_config.max_bad_steps:
                raise TrainingDiverged(
                    f"training stopped at step {self.steps_done}: {self.consecutive_bad_steps} steps in a row with a "
                    "non-finite loss or gradient (trainer.max_bad_steps). Lower optimizer.lr, keep trainer.grad_clip "
                    "on, or check the rollouts."
                )
            return grad_norm
        self.consecutive_bad_steps = 0
        optimizer.step()
        optimizer.zero_grad()
        if not distributed.all_finite(self.scorer.parameters(), self.device):
            raise TrainingDiverged(
                f"training stopped at step {self.steps_done}: after the optimizer update, parameters are NaN or "
                f"infinite (the loss and the gradient norm {grad_norm:.4g} were finite); nothing of this step is saved "
                "or exported. With model.dtype=float16 this is AdamW's optimizer.eps underflowing to 0 in float16: "
                "use model.dtype=bfloat16 or float32. Else lower optimizer.lr."
            )
        self.lr_schedulers().step()
        return grad_norm

    def _log_step(self, metrics: dict) -> None:
        first = ("loss", "num_documents", "documents_seen", "num_tokens", "grad_norm", "lr")
        names = [*first, *sorted(k for k in metrics if k not in first)]
        values = {k: float(metrics[k]) for k in names}
        self.last_metrics = {"step": self.steps_done, **values}
        for logger in self.loggers:
            logger.log_metrics(values, step=self.steps_done)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Everything beyond Lightning's state that a resumed run needs, from every rank."""
        batch = self.batch.state_dict() if self.batch is not None and self.batch.remaining else None
        checkpoint["rlcli"] = {
            "steps_done": self.steps_done,
            "batches_done": self.batches_done,
            "documents_seen": self.documents_seen,
            "empty_steps": self.empty_steps,
            "bad_steps": (self.bad_steps, self.consecutive_bad_steps),
            "ranks": distributed.all_gather_objects(
                {"source": self.source.state_dict(), "batch": batch, "torch_rng": torch.get_rng_state()}
            ),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["rlcli"]
        if len(state["ranks"]) != self.trainer.world_size:
            raise UserError(
                f"resume: the checkpoint was written by {len(state['ranks'])} processes, this run has "
                f"{self.trainer.world_size}; resume with the same trainer.devices and trainer.num_nodes"
            )
        self.steps_done = state["steps_done"]
        self.batches_done = state["batches_done"]
        self.documents_seen = state["documents_seen"]
        self.empty_steps = state["empty_steps"]
        self.bad_steps, self.consecutive_bad_steps = state["bad_steps"]
        mine = state["ranks"][self.global_rank]
        self.source.load_state_dict(mine["source"])
        if mine["batch"] is not None:
            trainer = self.trainer_config
            self.batch = BatchPlan.from_state(mine["batch"], minibatches=trainer.minibatches,
                                              epochs=trainer.batch_epochs, seed=self.seed, max_tokens=self.max_tokens)
        torch.set_rng_state(mine["torch_rng"])
        for logger in self.loggers:
            if isinstance(logger, MetricsCSVLogger):
                logger.resume_at(self.steps_done)
        if self.documents_log is not None:
            self.documents_log.resume_at(self.steps_done)
