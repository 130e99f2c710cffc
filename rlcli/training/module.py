"""The LightningModule: one optimizer update (a training step) per `training_step`, over micro-batches
it pulls itself.

Read `training_step` top to bottom: take the update's micro-batches (a batch from the step source, with
the trainer's own log-probs when the loss needs them, is split into ``trainer.minibatches`` updates
and passed over ``trainer.batch_epochs`` times), agree on the update's totals across ranks,
forward/backward each micro-batch with its exact share of the loss, then one optimizer update and one
row of metrics, returned to the callbacks (`rlcli.callbacks.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch

from rlcli.callbacks.metrics import StepMetricsCallback
from rlcli.conf.schema import TrainerConfig
from rlcli.errors import UserError
from rlcli.model.lora import adapter_state, adapters_off
from rlcli.modules.metrics import Metric, MetricPartials
from rlcli.training import distributed
from rlcli.training.batches import BatchPlan, UpdatePlan
from rlcli.training.distill import add_distill_advantages
from rlcli.training.guard import UpdateGuard
from rlcli.training.logprobs import add_trainer_logprobs
from rlcli.training.loss import DeviceMicroBatch, MicroBatchLoss, micro_batch_to_device
from rlcli.training.plan import UpdateTotals, passes, plan_update, update_values_to_host
from rlcli.training.rejection import BatchRejection
from rlcli.training.reward_kl import RewardKL, add_kl_to_rewards
from rlcli.training.sources import StepSource

FIRST_COLUMNS = ("loss", "num_documents", "documents_seen", "num_tokens", "grad_norm", "lr")  # then by name
METRICS = {
    "loss": Metric("always", "`L = Σ_t w_t ℓ_t`: the step loss, summed over micro-batches and processes"),
    "documents_seen": Metric("always", "the running sum of `num_documents` (restored on resume)"),
    "grad_norm": Metric("always", "the gradient's norm before clipping (`trainer.grad_clip`); 0 in an empty step"),
    "lr": Metric("always", "the learning rate of this step's update"),
    "carried_documents": Metric("trainer.docs_per_step_mode=exact (data=rollouts or stream)",
                                "documents of the step's last fetch given back to the front of the stream "
                                "(0 on a batch's later updates)"),
}


class AdaptersOff:
    """A scorer with the policy's LoRA adapters switched off: the base model, the reference of
    ``kl.reference=initial`` without a copy of the weights (not a module: its weights are the policy's)."""

    def __init__(self, scorer: torch.nn.Module) -> None:
        self.scorer = scorer

    def __call__(self, *args, **kwargs):
        with adapters_off(self.scorer):
            return self.scorer(*args, **kwargs)


class PolicyModule(L.LightningModule):
    """Policy-gradient training of a Hugging Face causal LM on packed rollouts.

    ``loss`` says what to optimise and report (`rlcli.training.loss.MicroBatchLoss`); ``trainer`` how many
    updates a batch makes and when to give up. ``make_source(rank, world_size)`` builds this rank's
    `StepSource` (`rlcli.training.sources`); the dataloader given to ``Trainer.fit`` only ticks steps.
    ``shard(scorer, device_mesh)`` returns the scorer sharded for FSDP1 or FSDP2
    (`rlcli.training.strategy`). ``reference`` is the frozen reference policy of the KL penalty, when
    its log-probs come from a model; ``teacher`` the frozen teacher of on-policy distillation, whose
    term each token's advantage gets ``distill_coef`` times (`rlcli.training.distill`; the same object
    as ``reference`` when one model is both). ``reward_kl``: ``kl.placement=reward``'s batch stage, which
    recomputes each batch's advantages from the rewards less the KL (`rlcli.training.reward_kl`).
    With LoRA adapters (`rlcli.model.lora`), ``reference`` may be ``policy`` itself: the policy with its
    adapters off; ``base_fingerprint`` names the frozen base weights, and checkpoints hold the adapters only.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        loss: MicroBatchLoss,
        trainer: TrainerConfig,
        make_optimizer: Callable[[torch.nn.Module], tuple],
        make_source: Callable[[int, int], StepSource],
        *,
        seed: int,
        max_tokens: int,
        reference: torch.nn.Module | None = None,
        teacher: torch.nn.Module | None = None,
        distill_coef: float | None = None,
        shard: Callable | None = None,
        reward_kl: RewardKL | None = None,
        base_fingerprint: str | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.loss = loss
        self.scorer = loss.scorer(policy)
        self.reference_is_base = reference is policy
        self.reference = None if reference is None or self.reference_is_base else loss.scorer(
            reference.requires_grad_(False))
        self.base_fingerprint = base_fingerprint
        self.teacher = self.reference if teacher is not None and teacher is reference else (
            None if teacher is None else loss.scorer(teacher.requires_grad_(False)))
        self.distill_coef = distill_coef
        self.reward_kl = reward_kl
        self.trainer_config = trainer
        self.guard = UpdateGuard(trainer.grad_clip, trainer.max_bad_steps)
        self.rejection = BatchRejection(loss.spec.correction, trainer.max_bad_steps)
        self.seed = seed
        self.max_tokens = max_tokens
        self.make_optimizer = make_optimizer
        self.make_source = make_source
        self.shard = shard
        self.source: StepSource | None = None
        self.batch: BatchPlan | None = None  # the batch whose updates are being made
        self.completions: list[dict] = []  # the lines of completions.jsonl of a batch not yet trained on
        self.batches_done = 0  # batches taken from the source
        self.steps_done = 0  # training steps, including those with nothing to train on
        self.documents_seen = 0

    @property
    def policy(self) -> torch.nn.Module:
        return self.scorer.policy

    def configure_model(self) -> None:
        if self.shard is not None:
            self.scorer = self.shard(self.scorer, self.device_mesh)

    def setup(self, stage: str) -> None:
        self.source = self.make_source(self.global_rank, self.trainer.world_size)

    def checkpoint_durable(self) -> None:
        """The checkpoint just saved is on disk: the source may confirm what it holds."""
        self.source.checkpoint_durable()

    def configure_optimizers(self):
        optimizer, scheduler = self.make_optimizer(self.scorer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # the dataloader yields step ticks; micro-batches move in `MicroBatchLoss`

    def _next_update(self) -> UpdatePlan | None:
        """The next update's micro-batches; a new batch from the source when the last one is done,
        None when every rank has used up its data."""
        if self.batch is None or self.batch.remaining == 0:
            collected = self.source.next_batch(self.batches_done, self.device)
            if passes(collected.micro_batches) == 0 and self.source.ends_when_empty:
                return None
            trainer = self.trainer_config
            self.batch = BatchPlan(
                collected.micro_batches, minibatches=trainer.minibatches, epochs=trainer.batch_epochs,
                seed=self.seed, batch=self.batches_done, max_tokens=self.max_tokens, stats=collected.stats,
                carried_over=collected.carried_over,
            )
            reference = AdaptersOff(self.scorer) if self.reference_is_base else self.reference
            add_trainer_logprobs(self.batch, self.loss, self.device, policy=self.scorer, reference=reference,
                                 teacher=self.teacher)
            self.rejection(self.batch, self.device)
            add_kl_to_rewards(self.batch, self.reward_kl)
            add_distill_advantages(self.batch, self.distill_coef, self.device)
            self.completions = collected.completions
            self.batches_done += 1
        return self.batch.next_update()

    def _forward_backward(self, micro_batches: list[DeviceMicroBatch], plan: UpdateTotals,
                          optimizer) -> tuple[torch.Tensor, MetricPartials]:
        """Forward and backward every micro-batch (stand-ins past this rank's own); returns this rank's
        summed loss (float64) and metric partials, on the device: nothing in here waits for it."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        partials = MetricPartials()
        for i, micro_batch in enumerate(micro_batches):
            with optimizer.toggle_model(sync_grad=i == len(micro_batches) - 1):  # gradients sync once per step
                loss, batch_partials = self.loss.loss(self.scorer, micro_batch, plan)
                self.manual_backward(loss * distributed.gradient_scale())
            total += loss.detach().to(torch.float64)
            partials = partials + batch_partials
        return total, partials

    def training_step(self, tick, batch_idx) -> dict | None:
        """One optimizer update; returns ``{"step": N, "metrics": row, "documents": ids, "completions":
        lines}`` (the row the same on every rank, ``ids`` this rank's documents, ``lines`` this rank's
        lines of ``completions.jsonl``: those of its batch on the batch's first update, else none), or
        None once every rank is out of data.

        The update is planned on the host (`plan_update`) and its micro-batches moved to the device at
        once; then the device works through them without the host waiting for it, until the loss,
        gradient norm and metrics come back in one transfer to decide on the update
        (`update_values_to_host`)."""
        update = self._next_update()
        if update is None:
            self.trainer.should_stop = True  # every rank has used up its data
            return None
        plan = plan_update(update.micro_batches, self.device, update.stats)
        mine = update.micro_batches
        micro_batches = [micro_batch_to_device(mine[i] if i < len(mine) else None, plan.group_numbering, self.device)
                         for i in range(plan.passes)]
        optimizer = self.optimizers()
        loss, partials = self._forward_backward(micro_batches, plan, optimizer)
        grad_norm = self.guard.clip(self.scorer, plan.tokens, self.device)
        loss_value, norm_value, metrics = update_values_to_host(loss, grad_norm, partials, plan.totals)
        self.steps_done += 1
        self.documents_seen += plan.documents
        lr = optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        self.guard.apply(optimizer, self.lr_schedulers(), self.scorer, loss_value, norm_value, plan.tokens,
                         self.steps_done, self.device)
        self.source.after_update(self.steps_done)
        metrics |= {"loss": loss_value, "grad_norm": norm_value, "documents_seen": self.documents_seen, "lr": lr}
        metrics |= self.guard.counts() | plan.stats
        if update.carried_over is not None:
            metrics["carried_documents"] = update.carried_over
        for callback in self.trainer.callbacks:  # after the update, on every rank
            if isinstance(callback, StepMetricsCallback):
                metrics |= callback.step_metrics(self.trainer, self)
        names = [*FIRST_COLUMNS, *sorted(k for k in metrics if k not in FIRST_COLUMNS)]
        return {"step": self.steps_done, "metrics": {k: float(metrics[k]) for k in names},
                "documents": [doc.name for batch in update.micro_batches for doc in batch.documents],
                "completions": self._take_completions()}

    def _take_completions(self) -> list[dict]:
        completions, self.completions = self.completions, []
        return completions

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Everything beyond Lightning's state that a resumed run needs, from every rank."""
        batch = self.batch.state_dict() if self.batch is not None and self.batch.remaining else None
        checkpoint["rlcli"] = {
            "steps_done": self.steps_done,
            "batches_done": self.batches_done,
            "documents_seen": self.documents_seen,
            **self.guard.state_dict(),
            "ranks": distributed.all_gather_objects(
                {"source": self.source.state_dict(), "batch": batch, "torch_rng": torch.get_rng_state()}
            ),
        }
        if self.base_fingerprint is not None:  # LoRA: the adapters, and the base model they belong to
            checkpoint["state_dict"] = adapter_state(checkpoint["state_dict"])
            checkpoint["rlcli"]["base_model"] = self.base_fingerprint

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["rlcli"]
        if self.base_fingerprint is not None:  # a change of model.lora itself is refused before (resume_point)
            self._load_adapters_only(checkpoint)
        if len(state["ranks"]) != self.trainer.world_size:
            raise UserError(
                f"resume: the checkpoint was written by {len(state['ranks'])} processes, this run has "
                f"{self.trainer.world_size}; resume with the same trainer.devices and trainer.num_nodes"
            )
        self.steps_done = state["steps_done"]
        self.batches_done = state["batches_done"]
        self.documents_seen = state["documents_seen"]
        self.guard.load_state_dict(state)
        mine = state["ranks"][self.global_rank]
        self.source.load_state_dict(mine["source"])
        if mine["batch"] is not None:
            trainer = self.trainer_config
            self.batch = BatchPlan.from_state(mine["batch"], minibatches=trainer.minibatches,
                                              epochs=trainer.batch_epochs, seed=self.seed, max_tokens=self.max_tokens)
        torch.set_rng_state(mine["torch_rng"])

    def _load_adapters_only(self, checkpoint: dict) -> None:
        """A checkpoint of adapters: refused unless it belongs to this run's base model, then completed with
        the base weights as loaded, for Lightning's strict loading."""
        if checkpoint["rlcli"]["base_model"] != self.base_fingerprint:
            raise UserError("resume: the checkpoint's adapters were trained on other base weights than this run's "
                            "model (its weights changed since, or model.path names another model); resume with "
                            "the base model the checkpoint was trained on")
        base = {name: value for name, value in self.state_dict().items() if name not in checkpoint["state_dict"]}
        checkpoint["state_dict"] = base | checkpoint["state_dict"]
