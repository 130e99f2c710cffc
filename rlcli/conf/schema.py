"""The typed schema of `rlcli train`'s config: one dataclass per config group option.

`rlcli.conf.validate` checks a composed config against these classes (`rlcli.conf.typecheck`),
reports every problem at once, and hands `rlcli.build` instances of them. Each field's metadata holds
the key's one-line description (``rlcli train --help`` and the config reference show it,
`rlcli.conf.describe`) and its bounds: ``ge``/``gt``/``le``/``lt`` (a list's hold for each item; a
``tuple[...]`` is a list of exactly that many items). Defaults live in the YAML files only; closed
sets and the bounds the library also checks come from the code that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Union

from omegaconf import DictConfig

from rlcli.conf.typecheck import Target, built, described, schema_fields
from rlcli.modules import AGGREGATIONS, CORRECTION_LEVELS, CORRECTION_MODES, KL_ESTIMATORS, METRIC_LEVELS, PolicyLoss
from rlcli.modules.aggregation import DIVISOR
from rlcli.modules.bounds import TEMPERATURE
from rlcli.modules.losses import make_loss
from rlcli.modules.regularizers import TERM_COEF
from rlcli.objective import DIRECTIONS, REDUCTIONS
from rlcli.rollout.advantages import ADVANTAGE_ESTIMATORS, group_estimators
from rlcli.rollout.samplers import ENGINES
from rlcli.rollout.vllm_engine import OPTION_DOCS as VLLM_OPTIONS

# Lightning's seed_everything takes a uint32 seed (it seeds numpy); its constant lives in a module that
# imports all of Lightning, which a config check need not wait for
SEED_MAX = 2**32 - 1

DTYPES = Literal["float32", "bfloat16", "float16"]
SCHEDULES = Literal["constant", "cosine"]
ATTENTION = Literal["sdpa", "eager", "flash_attention_2", "varlen"]
DISTILL_REWARDS = ("none", *(name for name in group_estimators() if name != "distill"))  # distill.rewards


def _loss_object(node: DictConfig) -> PolicyLoss:
    """The loss the ``loss`` group names, with the group's keys beyond `LossConfig`'s as its options."""
    shared = {*schema_fields(LossConfig), "_target_"}
    return make_loss(node.name, **{key: node[key] for key in node.keys() if key not in shared})


@dataclass
class LossConfig:
    """The `loss` group: a registered loss ``name`` (or a `PolicyLoss` class by ``_target_``) and
    its own options, which the validator checks against that class, and how the head scores."""

    other_keys: ClassVar[bool] = True  # the options of the loss class: checked by rlcli.conf.validate
    name: str = described("the policy loss: a name in rlcli.modules.LOSSES (a loss group option, or your own)")
    temperature: float = described(
        "the temperature the trainer scores tokens at, and the sampler's (rollout.temperature follows it)",
        **TEMPERATURE)
    fp32_lm_head: bool = described("LM-head matmul and softmax in float32, for bf16/fp16 models")
    chunk_tokens: Union[int, Literal["auto"]] = described(
        "at most this many tokens' logits at once; auto: 64 MiB of float32 logits on CPU (>= 128 tokens), "
        "1 GiB on GPU; 0: one chunk per micro-batch", ge=0)
    old_logprobs: Literal["sampler", "recompute"] = described(
        "the ratio's denominator: sampler (the records' old_logprobs) or recompute (the trainer's own at the "
        "start of each batch, decoupled PPO); recompute whenever a mismatch correction is on")
    entropy_coef: float = described("c: each token's loss gets -c x its entropy (with the entropy's gradient)",
                                    **TERM_COEF)
    objective: PolicyLoss = built(_loss_object)  # the loss object, with the group's remaining keys as options


@dataclass
class KLConfig:
    """KL penalty to a reference policy: ``coef`` x k_t is added to each token's loss, or with
    ``placement=reward`` ``coef`` x the sum of k1 is subtracted from each document's reward."""

    coef: float = described("the KL penalty's weight beta (0: off)", **TERM_COEF)
    estimator: Optional[Literal[KL_ESTIMATORS.names()]] = described(
        "the estimator k_t of the KL, of delta = ref_lp - lp (null: k3 with kl.placement=loss, k1 with reward)")
    ratio_weighted: bool = described(
        "multiply the KL term by the differentiable ratio r_t = exp(lp - old_lp): with k3 its expected gradient is "
        "the reverse KL's (TRL's use_bias_correction_kl)")
    reference: str = described(
        "initial (a frozen copy of the starting weights; with model.lora, the policy with its adapters off), "
        "rollouts (the records' ref_logprobs) or a model path")
    placement: Literal["loss", "reward"] = described(
        "loss (beta x k_t in each token's loss) or reward (r - beta x the sum of k1 = old_lp - ref_lp over the "
        "document's labelled tokens, before the advantages; the loss has no KL term)")


@dataclass
class CorrectionConfig:
    """Train-inference mismatch correction: importance weights of the trainer's over the sampler's
    log-probs multiply each token's policy loss (with reject: decide which tokens are trained on)."""

    mode: Literal[CORRECTION_MODES.names()] = described(
        "none, truncate (w = min(rho, high)), mask (IcePop: w = rho if low <= rho <= high, else 0) or reject "
        "(rejection sampling: a token or document with rho outside [low, high] leaves the loss mask and every count; "
        "w = 1 on the kept ones)")
    level: Literal[CORRECTION_LEVELS.names()] = described(
        "the importance ratio rho per token, per sequence, or the sequence's geometric mean")
    low: float = described("the lower bound of rho that mask and reject keep", gt=0)
    high: float = described("the upper bound of rho: truncate caps the weight there, mask and reject drop beyond it",
                            gt=0)


@dataclass
class AggregationConfig:
    """How token losses become the step loss (math.md#aggregation)."""

    name: Literal[AGGREGATIONS.names()] = described("the aggregation: the option of this group")
    divisor: Optional[float] = described(
        "aggregation=constant: the constant each document's token sum is divided by (1: by the number of "
        "documents); null for every other aggregation", **DIVISOR)


@dataclass
class MetricsConfig:
    level: Literal[METRIC_LEVELS] = described(
        "which loss metrics a step logs: none, basic (ratios, KL, clip fraction, advantages) or with_entropy")


LORA_INITS = ("default", "gaussian")  # peft's initialisations that leave the base model as it is and B = 0


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (peft), for model=tiny and model=hf."""

    rank: int = described("the adapters' rank; 0: no adapters, the whole model trains", ge=0)
    alpha: float = described("the adapters' scale is alpha / rank", gt=0)
    dropout: float = described("dropout on the adapters' input (0 keeps the first step on-policy)", ge=0, lt=1)
    target_modules: Any = described(
        "the layers that get adapters: all-linear (every linear layer but the LM head) or a list of module names "
        "(q_proj, v_proj, ...)")
    init: Literal[LORA_INITS] = described(
        "default: A random (Kaiming), B zero; gaussian: A Gaussian, B zero (both start at the base model)")


@dataclass
class TinyModelConfig:
    """A small randomly initialised Llama-style causal LM built from a config (no download)."""

    kind: Literal["tiny"] = described("the model option: tiny")
    vocab_size: Optional[int] = described("the vocabulary size; null: the task's vocabulary with a task, else 64",
                                          ge=2)
    hidden_size: int = described("the hidden size, a multiple of num_heads with an even head size", ge=1)
    intermediate_size: int = described("the MLP's inner size", ge=1)
    num_layers: int = described("decoder layers", ge=1)
    num_heads: int = described("attention heads (vLLM's CPU attention takes head sizes 32, 64, 80, ... only)", ge=1)
    init_std: Optional[float] = described(
        "the initial weights' standard deviation (norms start at 1); null: 1/sqrt(hidden_size)", gt=0, le=1)
    max_position_embeddings: int = described("the longest sequence the model takes, in tokens", ge=1)
    dtype: DTYPES = described("the parameters' dtype")
    gradient_checkpointing: bool = described("recompute activations in the backward pass to save memory")
    attn_implementation: ATTENTION = described(
        "the attention kernel; varlen: attention within each packed document")
    suggested_lr: float = described("optimizer.lr unless it is set: a tiny model learns fast", gt=0)
    compile: bool = described(
        "torch.compile the transformer body of the policy, reference and teacher, and the loss on the head's "
        "log-probs (dynamic shapes: packed rows of any length share one compile)")
    lora: Optional[LoraConfig] = described("LoRA adapters: only they train when lora.rank > 0 (null: none)")


@dataclass
class HFModelConfig:
    """A local Hugging Face checkpoint (a directory with config.json and weights)."""

    kind: Literal["hf"] = described("the model option: hf")
    path: str = described("the checkpoint's directory (required)")
    dtype: DTYPES = described("the parameters' dtype")
    gradient_checkpointing: bool = described("recompute activations in the backward pass to save memory")
    attn_implementation: ATTENTION = described(
        "the attention kernel; varlen: attention within each packed document")
    trust_remote_code: bool = described("let transformers run the checkpoint's own model code")
    suggested_lr: float = described("optimizer.lr unless it is set: a usual RL rate for pretrained models", gt=0)
    compile: bool = described(
        "torch.compile the transformer body of the policy, reference and teacher, and the loss on the head's "
        "log-probs (dynamic shapes: packed rows of any length share one compile)")
    lora: Optional[LoraConfig] = described("LoRA adapters: only they train when lora.rank > 0 (null: none)")


def trains_adapters(model: TinyModelConfig | HFModelConfig) -> bool:
    """Whether ``model.lora`` puts LoRA adapters on the policy (set, with a rank above 0)."""
    return model.lora is not None and model.lora.rank > 0


@dataclass
class RolloutDataConfig:
    """Rollout files written by a sampler (rollout-record.md)."""

    kind: Literal["rollouts"] = described("the data option: rollouts")
    paths: list[str] = described(".jsonl or .parquet files or globs")
    max_tokens: int = described("tokens per packed micro-batch; a longer document is an error", ge=2)
    shuffle: bool = described("shuffle the documents (seeded) before packing")
    epochs: int = described("passes over the files; the run ends when they are used up", ge=1)
    on_invalid: Literal["error", "skip"] = described(
        "an invalid record is an error, or is skipped and written to rejected.jsonl in the run directory")
    filter: Literal["none", "zero_variance"] = described(
        "DAPO's dynamic sampling on read: zero_variance drops every group (records sharing a group_id) whose "
        "records' rewards are all equal, listed in rejected.jsonl (none: off)")
    allow_temperature_mismatch: bool = described(
        "train on records sampled at a temperature other than loss.temperature")
    log_completions: int = described(
        "documents of each step written with their token ids to completions.jsonl, one of each group in turn "
        "(0: off)", ge=0)


@dataclass
class GenerateDataConfig:
    """On-policy rollouts sampled by the trainer itself from the task (``rollout``, ``task``)."""

    kind: Literal["generate"] = described("the data option: generate")
    max_tokens: int = described("tokens per packed micro-batch", ge=2)


@dataclass
class StreamDataConfig:
    """The live loop: rollouts read from a Redis stream that samplers push into."""

    kind: Literal["stream"] = described("the data option: stream")
    url: Optional[str] = described(
        "the Redis server, redis://[:PASSWORD@]host:port/db (rediss:// with TLS, unix:///path/to/socket); required "
        "by rlcli train and rlcli sample, set by rlcli loop when it starts its own server; a password is masked "
        "(****) in every file and log, and kept in RLCLI_REDIS_PASSWORD")
    stream: str = described(
        "the stream's key; rejected records go to <stream>:rejected, announcements to <stream>:weights")
    group: str = described("the trainer's consumer group (one consumer per process: rank0, rank1, ...)")
    max_tokens: int = described("tokens per packed micro-batch; a longer record is rejected", ge=2)
    max_lag: int = described(
        "the staleness bound, in versions: a record more than this many versions behind the trainer is dropped",
        ge=0)
    allow_temperature_mismatch: bool = described(
        "train on records sampled at a temperature other than loss.temperature")
    wait_warning: float = described(
        "seconds without a record before the trainer says it is waiting (and again after every such interval)",
        gt=0)
    idle_timeout: Optional[float] = described(
        "seconds without a record after which training ends; null: wait for ever", gt=0)


@dataclass
class PublishConfig:
    """The weights back to the samplers (data=stream)."""

    dir: Optional[str] = described(
        "where v<version>/ directories are written; null: <run dir>/weights (samplers on other nodes need "
        "a shared filesystem)")
    every: int = described("publish the weights after every N steps", ge=1)
    keep: int = described("the newest versions kept on disk", ge=1)
    lora: Literal["merged", "adapter"] = described(
        "with model.lora: publish the merged model (merged), or the adapters alone, which the samplers apply to "
        "the base model at model.path (adapter: a fraction of the bytes; model=hf)")


@dataclass
class SampleConfig:
    """`rlcli sample` and the samplers `rlcli loop` starts (data=stream)."""

    workers: int = described("sampler processes that rlcli loop starts: at most the machine's cores, and as many as "
                             "its memory holds", ge=1)
    max_queue: int = described("a sampler waits while the stream holds more unread records than this", ge=1)


@dataclass
class RolloutConfig:
    """How rollouts are sampled: by the trainer (data=generate) or by `rlcli sample` (data=stream)."""

    prompts_per_step: int = described(
        "prompts per step and process (per sampler round with rlcli sample)", ge=1)
    group_size: int = described("completions per prompt (a GRPO group)", ge=1)
    max_new_tokens: int = described("the most tokens a completion has", ge=1)
    temperature: float = described("the sampling temperature: follows loss.temperature (the two must be equal)",
                                   **TEMPERATURE)
    top_p: float = described("nucleus sampling's probability mass (1: off)", gt=0, le=1)
    top_k: int = described("sample among the k likeliest tokens (0: off)", ge=0)
    engine: Literal[ENGINES.names()] = described(
        "the sampler: hf (rlcli's built-in sampler) or vllm (a vLLM engine; make setup-vllm)")
    save: bool = described("data=generate: also write the rollouts to <run dir>/rollouts.jsonl (a rollout file)")
    log_completions: int = described(
        "rollouts of each step (each sampler round) written with their text to completions.jsonl, one of each "
        "group in turn (0: off)", ge=0)
    mask_truncated: bool = described(
        "drop the completions that reach max_new_tokens without a stop after their group's advantages are "
        "computed: they train no token and count in no total (DAPO's overlong filtering)")
    filter: Literal["none", "zero_variance"] = described(
        "DAPO's dynamic sampling: zero_variance drops every group whose filter_metric is equal across the group "
        "and samples more rounds until prompts_per_step groups are kept (none: off)")
    filter_metric: Optional[Literal["accuracy", "reward"]] = described(
        "what filter=zero_variance compares: accuracy (task.is_correct), reward (the task's, before the overlong "
        "shaping); null: accuracy where the task's reward has an accuracy term (task=prompts with exact_match or "
        "math_verify), else reward")
    max_sampling_rounds: int = described(
        "filter=zero_variance: the most sampling rounds of a step (then it trains the groups it kept)", ge=1)
    stop: list[Union[str, int]] = described(
        "stop strings and token ids that end a completion (kept in it), besides eos")
    vllm: Any = described(
        "rollout.engine=vllm: keyword arguments of vllm.LLM, passed through (add others with "
        "+rollout.vllm.KEY=VALUE)", keys=VLLM_OPTIONS)


@dataclass
class EvalConfig:
    """Evaluation: `rlcli eval MODEL_DIR`, and during training with ``every``."""

    samples: int = described("completions per prompt (the k of pass@k)", ge=1)
    every: int = described("rlcli train: evaluate every N steps, logged as eval/<metric> (0: off)", ge=0)
    prompts: int = described(
        "prompts drawn with a fixed seed from a task without a held-out split (reverse, addition)", ge=1)


@dataclass
class AdvantageConfig:
    """Advantages of records that carry ``reward`` instead of ``advantage(s)``."""

    estimator: Literal[ADVANTAGE_ESTIMATORS.names()] = described(
        "none (every record must carry advantages), or per group: grpo ((r - mean) / (std + eps)), dr_grpo "
        "(r - mean), rloo (r - mean of the others), opo (r - the length-weighted mean), reinforce_pp_baseline "
        "(r - mean, whitened over the batch's labelled tokens), grpo_batch_std ((r - mean) / (the batch's reward "
        "std + eps)) or passk (pass@k, "
        "binary rewards); distill: on-policy distillation from teacher.path (distill.*)")
    eps: float = described("the eps added to the std of grpo, reinforce_pp_baseline and grpo_batch_std", gt=0)
    k: Optional[int] = described(
        "passk: the k of pass@k, at most the group's size (required with estimator=passk, only valid with it)", ge=1)


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (advantage.estimator=distill, math.md#on-policy-distillation)."""

    path: Optional[str] = described(
        "a Hugging Face model directory sharing the policy's tokenizer (required with advantage.estimator=distill, "
        "only valid with it); the same path as kl.reference shares its model and forward")


@dataclass
class DistillConfig:
    """What advantage.estimator=distill adds to each token's advantage (math.md#on-policy-distillation)."""

    coef: float = described(
        "lambda: each token's advantage gets lambda x (teacher_lp - lp), the teacher's minus the trainer's "
        "log-prob at the start of the batch", **TERM_COEF)
    rewards: Literal[DISTILL_REWARDS] = described(
        "the rewards' part of the advantages: none (0: pure distillation) or a group estimator, computed where "
        "advantage.estimator's would be")


@dataclass
class RewardConfig:
    """DAPO's overlong reward, added to the rewards of the completions rlcli samples (math.md#overlong-shaping)."""

    overlong_buffer: Optional[int] = described(
        "L_c: the last L_c tokens before rollout.max_new_tokens, over which the overlong reward falls linearly from "
        "0 to -1 (null: off)", ge=1)
    overlong_penalty: float = described("p: the overlong reward's weight in the reward", ge=0)


@dataclass
class _OptimizerConfig:
    """The fields every optimizer option has: its rate and the schedule."""

    lr: float = described("the learning rate; by default model.suggested_lr", gt=0)
    weight_decay: float = described("decoupled weight decay (adamw), L2 penalty (sgd)", ge=0)
    schedule: SCHEDULES = described("constant, or cosine after warmup down to min_lr_ratio x lr")
    warmup_steps: int = described("steps of linear warmup up to lr (the first at lr / warmup_steps)", ge=0)
    min_lr_ratio: float = described("the cosine schedule's final rate, as a fraction of lr", ge=0, le=1)


@dataclass
class AdamWConfig(_OptimizerConfig):
    name: Literal["adamw"] = described("the optimizer option: adamw")
    betas: tuple[float, float] = described("AdamW's two moment decay rates, each in [0, 1)", ge=0, lt=1)
    eps: float = described("AdamW's eps, added to the second moment's square root", gt=0)


@dataclass
class SGDConfig(_OptimizerConfig):
    name: Literal["sgd"] = described("the optimizer option: sgd")
    momentum: float = described("SGD's momentum (0: none)", ge=0)


@dataclass
class TrainerConfig:
    max_steps: int = described(
        "optimizer updates; a run on rollout files also ends when they are used up", ge=1)
    accumulate_microbatches: int = described(
        "micro-batches per step and process (a static step: docs_per_step=0)", ge=1)
    minibatches: int = described(
        "optimizer updates per collected batch (its groups split between them, never a group)", ge=1)
    batch_epochs: int = described("passes over each batch, its mini-batches reshuffled by the seed", ge=1)
    grad_clip: float = described("the largest gradient norm; 0 disables clipping", ge=0)
    max_bad_steps: int = described(
        "steps in a row with a non-finite loss or gradient (or, with rollout.mask_truncated, every completion "
        "truncated; with correction.mode=reject, batches with every token rejected) before the run stops", ge=1)
    precision: Literal["32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed"] = described(
        "Lightning's precision of the training step")
    accelerator: Literal["auto", "cpu", "gpu"] = described(
        "the device kind: auto (Lightning picks a GPU if there is one), cpu or gpu")
    devices: int = described("processes per node (one per GPU)", ge=1)
    num_nodes: int = described("nodes of the run", ge=1)
    checkpoint_every: int = described("save a checkpoint every N steps (0: only at the end)", ge=0)
    docs_per_step: int = described(
        "> 0: a step gathers micro-batches until the whole job holds this many documents", ge=0)
    docs_per_step_mode: Literal["at_least", "exact"] = described(
        "at_least keeps the micro-batch that crosses docs_per_step; exact carries the surplus over to the next step")

    @property
    def processes(self) -> int:
        """The run's training processes: ``devices`` on each of ``num_nodes``."""
        return self.devices * self.num_nodes


BACKEND = "the process group's backend; null: gloo on CPU, nccl on GPU"


@dataclass
class AutoStrategyConfig:
    name: Literal["auto"] = described("the strategy option: auto (one process)")


@dataclass
class DDPStrategyConfig:
    name: Literal["ddp"] = described("the strategy option: ddp (DistributedDataParallel, one process per device)")
    process_group_backend: Optional[Literal["gloo", "nccl"]] = described(BACKEND)


@dataclass
class FSDPStrategyConfig:
    name: Literal["fsdp"] = described(
        "the strategy option: fsdp (Lightning's FSDPStrategy, GPU only, one unit per decoder layer)")
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = described(
        "what FSDP shards: parameters, gradients and optimizer states, or fewer of them")
    cpu_offload: bool = described("offload the parameters and their gradients to CPU memory (FSDP's CPUOffload)")
    process_group_backend: Optional[Literal["gloo", "nccl"]] = described(BACKEND)


@dataclass
class FSDP2StrategyConfig:
    name: Literal["fsdp2"] = described(
        "the strategy option: fsdp2 (torch fully_shard per decoder layer, on GPUs or CPU processes)")
    mixed_precision: Optional[Literal["bf16"]] = described(
        "null: the parameters' dtype; bf16: bf16 compute, float32 gradient reduction")
    process_group_backend: Optional[Literal["gloo", "nccl"]] = described(BACKEND)


@dataclass
class WandbConfig:
    project: str = described("the Weights & Biases project")
    entity: Optional[str] = described("the team or user; null: your default entity")
    name: Optional[str] = described("the run's name; null: the run directory's name, or the sweep member's overrides")
    group: Optional[str] = described("the run's group; null: the sweep directory for the members of a multirun")
    tags: list[str] = described("the run's tags")
    notes: Optional[str] = described("the run's notes")
    mode: Optional[Literal["online", "offline", "disabled"]] = described(
        "null: online with an API key, else offline into the run directory; WANDB_MODE, when set, wins")


@dataclass
class TensorBoardConfig:
    subdir: str = described("the folder of the event files, inside the run directory")


@dataclass
class LoggerConfig:
    """Each present key turns one logger on (``logger=[wandb,tensorboard]``)."""

    wandb: Optional[WandbConfig] = described("Weights & Biases (logger=wandb)")
    tensorboard: Optional[TensorBoardConfig] = described("TensorBoard (logger=tensorboard)")


@dataclass
class ObjectiveConfig:
    """The number `rlcli train` writes to objective.json and hands Hydra's optimising sweepers (Optuna, ...):
    one metrics.csv column, reduced over the steps that logged it."""

    metric: str = described("the metrics.csv column, e.g. reward, accuracy or eval/pass@1")
    reduce: Literal[REDUCTIONS] = described(
        "final (the last logged value), best (the largest, or smallest with direction=minimize) or mean_last "
        "(the mean of the last last_k); the option of this group")
    last_k: Optional[int] = described(
        "objective=mean_last: how many of the last logged values to average (fewer if fewer were logged); "
        "null for the other reductions", ge=1)
    direction: Literal[DIRECTIONS] = described(
        "maximize or minimize: which value is best, for reduce=best and for the sweeper (hydra.sweeper.direction "
        "follows it)")


@dataclass
class TrainConfig:
    seed: int = described("seeds the model, the data order and the sampling", ge=0, le=SEED_MAX)
    resume: Optional[str] = described(
        "null: start fresh; auto: continue from the newest complete checkpoint of the run directory; "
        "PATH: that checkpoint file")
    allow_targets: list[str] = described(
        "top-level modules of your own code whose objects a _target_ may name (besides rlcli)")
    callbacks: list[Target] = described(
        "extra Lightning callbacks, each a _target_ (from a trusted module) and its arguments")
    loss: LossConfig = described("the policy loss")
    kl: KLConfig = described("the KL penalty")
    correction: CorrectionConfig = described("the mismatch correction")
    aggregation: AggregationConfig = described("the aggregation")
    metrics: MetricsConfig = described("the loss metrics")
    model: Union[TinyModelConfig, HFModelConfig] = described("the policy")
    data: Union[RolloutDataConfig, GenerateDataConfig, StreamDataConfig] = described("where rollouts come from")
    rollout: Optional[RolloutConfig] = described("sampling, with data=generate or stream")
    task: Optional[Target] = described("the task, with data=generate or stream")
    publish: Optional[PublishConfig] = described("weight publishing, with data=stream")
    sample: Optional[SampleConfig] = described("the samplers, with data=stream")
    advantage: AdvantageConfig = described("advantages from rewards")
    reward: RewardConfig = described("the overlong reward of sampled completions")
    teacher: TeacherConfig = described("the teacher of advantage.estimator=distill")
    distill: DistillConfig = described("on-policy distillation's advantages (advantage.estimator=distill)")
    eval: EvalConfig = described("evaluation")
    optimizer: Union[AdamWConfig, SGDConfig] = described("the optimizer")
    trainer: TrainerConfig = described("the training loop")
    strategy: Union[AutoStrategyConfig, DDPStrategyConfig, FSDPStrategyConfig, FSDP2StrategyConfig] = described(
        "the distributed strategy")
    logger: LoggerConfig = described("the loggers besides metrics.csv")
    objective: ObjectiveConfig = described("the run's objective, for Hydra's optimising sweepers")
