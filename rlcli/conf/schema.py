"""The typed schema of `rlcli train`'s config: one dataclass per config group option.

`rlcli.conf.validate` checks a composed config against these classes (`rlcli.conf.typecheck`),
reports every problem at once, and hands `rlcli.build` instances of them. Bounds live in each field's
metadata: ``ge``/``gt``/``le``/``lt`` (a list's hold for each item; a ``tuple[...]`` is a list of
exactly that many items). Defaults live in the YAML files only; closed sets and the bounds the
library also checks come from the code that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Union

from omegaconf import DictConfig

from rlcli.conf.typecheck import Target, bounded, built, schema_fields
from rlcli.modules import AGGREGATIONS, CORRECTION_LEVELS, CORRECTION_MODES, KL_ESTIMATORS, METRIC_LEVELS, PolicyLoss
from rlcli.modules.aggregation import DIVISOR
from rlcli.modules.bounds import TEMPERATURE
from rlcli.modules.losses import make_loss
from rlcli.modules.regularizers import TERM_COEF
from rlcli.rollout.advantages import ADVANTAGE_ESTIMATORS
from rlcli.rollout.samplers import ENGINES

# Lightning's seed_everything takes a uint32 seed (it seeds numpy); its constant lives in a module that
# imports all of Lightning, which a config check need not wait for
SEED_MAX = 2**32 - 1

DTYPES = Literal["float32", "bfloat16", "float16"]
SCHEDULES = Literal["constant", "cosine"]
ATTENTION = Literal["sdpa", "eager", "flash_attention_2", "varlen"]


def _loss_object(node: DictConfig) -> PolicyLoss:
    """The loss the ``loss`` group names, with the group's keys beyond `LossConfig`'s as its options."""
    shared = {*schema_fields(LossConfig), "_target_"}
    return make_loss(node.name, **{key: node[key] for key in node.keys() if key not in shared})


@dataclass
class LossConfig:
    """The `loss` group: a registered loss ``name`` (or a `PolicyLoss` class by ``_target_``) and
    its own options, which the validator checks against that class, and how the head scores."""

    other_keys: ClassVar[bool] = True  # the options of the loss class: checked by rlcli.conf.validate
    name: str
    temperature: float = bounded(**TEMPERATURE)
    fp32_lm_head: bool
    chunk_tokens: Union[int, Literal["auto"]] = bounded(ge=0)
    old_logprobs: Literal["sampler", "recompute"]
    entropy_coef: float = bounded(**TERM_COEF)
    objective: PolicyLoss = built(_loss_object)  # the loss object, with the group's remaining keys as options


@dataclass
class KLConfig:
    coef: float = bounded(**TERM_COEF)
    estimator: Literal[KL_ESTIMATORS.names()]
    reference: str  # initial | rollouts | a model path


@dataclass
class CorrectionConfig:
    mode: Literal[CORRECTION_MODES.names()]
    level: Literal[CORRECTION_LEVELS.names()]
    low: float = bounded(gt=0)
    high: float = bounded(gt=0)


@dataclass
class AggregationConfig:
    name: Literal[AGGREGATIONS.names()]
    divisor: Optional[float] = bounded(**DIVISOR)


@dataclass
class MetricsConfig:
    level: Literal[METRIC_LEVELS]


@dataclass
class TinyModelConfig:
    kind: Literal["tiny"]
    vocab_size: Optional[int] = bounded(ge=2)  # null: the task's vocabulary, or 64
    hidden_size: int = bounded(ge=1)
    intermediate_size: int = bounded(ge=1)
    num_layers: int = bounded(ge=1)
    num_heads: int = bounded(ge=1)
    max_position_embeddings: int = bounded(ge=1)
    dtype: DTYPES
    gradient_checkpointing: bool
    attn_implementation: ATTENTION
    suggested_lr: float = bounded(gt=0)


@dataclass
class HFModelConfig:
    kind: Literal["hf"]
    path: str
    dtype: DTYPES
    gradient_checkpointing: bool
    attn_implementation: ATTENTION
    trust_remote_code: bool
    suggested_lr: float = bounded(gt=0)


@dataclass
class RolloutDataConfig:
    kind: Literal["rollouts"]
    paths: list[str]
    max_tokens: int = bounded(ge=2)
    shuffle: bool
    epochs: int = bounded(ge=1)
    on_invalid: Literal["error", "skip"]
    allow_temperature_mismatch: bool


@dataclass
class GenerateDataConfig:
    kind: Literal["generate"]
    max_tokens: int = bounded(ge=2)


@dataclass
class StreamDataConfig:
    kind: Literal["stream"]
    url: Optional[str]
    stream: str
    group: str
    max_tokens: int = bounded(ge=2)
    max_lag: int = bounded(ge=0)
    allow_temperature_mismatch: bool
    wait_warning: float = bounded(gt=0)
    idle_timeout: Optional[float] = bounded(gt=0)


@dataclass
class PublishConfig:
    dir: Optional[str]
    every: int = bounded(ge=1)
    keep: int = bounded(ge=1)


@dataclass
class SampleConfig:
    workers: int = bounded(ge=1)
    max_queue: int = bounded(ge=1)


@dataclass
class RolloutConfig:
    prompts_per_step: int = bounded(ge=1)
    group_size: int = bounded(ge=1)
    max_new_tokens: int = bounded(ge=1)
    temperature: float = bounded(**TEMPERATURE)
    top_p: float = bounded(gt=0, le=1)
    top_k: int = bounded(ge=0)
    engine: Literal[ENGINES.names()]
    save: bool
    stop: list[Union[str, int]]  # strings and token ids
    vllm: Any  # keyword arguments of vllm.LLM (a mapping; see rlcli.rollout.vllm_engine)


@dataclass
class EvalConfig:
    samples: int = bounded(ge=1)
    every: int = bounded(ge=0)
    prompts: int = bounded(ge=1)


@dataclass
class AdvantageConfig:
    estimator: Literal[ADVANTAGE_ESTIMATORS.names()]
    eps: float = bounded(gt=0)


@dataclass
class _OptimizerConfig:
    """The fields every optimizer option has: its rate and the schedule."""

    lr: float = bounded(gt=0)
    weight_decay: float = bounded(ge=0)
    schedule: SCHEDULES
    warmup_steps: int = bounded(ge=0)
    min_lr_ratio: float = bounded(ge=0, le=1)


@dataclass
class AdamWConfig(_OptimizerConfig):
    name: Literal["adamw"]
    betas: tuple[float, float] = bounded(ge=0, lt=1)  # each of the two
    eps: float = bounded(gt=0)


@dataclass
class SGDConfig(_OptimizerConfig):
    name: Literal["sgd"]
    momentum: float = bounded(ge=0)


@dataclass
class TrainerConfig:
    max_steps: int = bounded(ge=1)
    accumulate_microbatches: int = bounded(ge=1)
    minibatches: int = bounded(ge=1)
    batch_epochs: int = bounded(ge=1)
    grad_clip: float = bounded(ge=0)
    max_bad_steps: int = bounded(ge=1)
    precision: Literal["32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed"]
    accelerator: Literal["auto", "cpu", "gpu"]
    devices: int = bounded(ge=1)
    num_nodes: int = bounded(ge=1)
    checkpoint_every: int = bounded(ge=0)
    docs_per_step: int = bounded(ge=0)
    docs_per_step_mode: Literal["at_least", "exact"]

    @property
    def processes(self) -> int:
        """The run's training processes: ``devices`` on each of ``num_nodes``."""
        return self.devices * self.num_nodes


@dataclass
class AutoStrategyConfig:
    name: Literal["auto"]


@dataclass
class DDPStrategyConfig:
    name: Literal["ddp"]
    process_group_backend: Optional[Literal["gloo", "nccl"]]


@dataclass
class FSDPStrategyConfig:
    name: Literal["fsdp"]
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
    cpu_offload: bool
    process_group_backend: Optional[Literal["gloo", "nccl"]]


@dataclass
class FSDP2StrategyConfig:
    name: Literal["fsdp2"]
    mixed_precision: Optional[Literal["bf16"]]
    process_group_backend: Optional[Literal["gloo", "nccl"]]


@dataclass
class WandbConfig:
    project: str
    entity: Optional[str]
    name: Optional[str]
    group: Optional[str]
    tags: list[str]
    notes: Optional[str]
    mode: Optional[Literal["online", "offline", "disabled"]]


@dataclass
class TensorBoardConfig:
    subdir: str


@dataclass
class LoggerConfig:
    """Each present key turns one logger on (``logger=[wandb,tensorboard]``)."""

    wandb: Optional[WandbConfig]
    tensorboard: Optional[TensorBoardConfig]


@dataclass
class TrainConfig:
    seed: int = bounded(ge=0, le=SEED_MAX)
    resume: Optional[str]
    allow_targets: list[str]
    callbacks: list[Target]  # extra Lightning callbacks
    loss: LossConfig
    kl: KLConfig
    correction: CorrectionConfig
    aggregation: AggregationConfig
    metrics: MetricsConfig
    model: Union[TinyModelConfig, HFModelConfig]
    data: Union[RolloutDataConfig, GenerateDataConfig, StreamDataConfig]
    rollout: Optional[RolloutConfig]  # with data=generate or stream
    task: Optional[Target]  # with data=generate or stream
    publish: Optional[PublishConfig]  # with data=stream
    sample: Optional[SampleConfig]  # with data=stream
    advantage: AdvantageConfig
    eval: EvalConfig
    optimizer: Union[AdamWConfig, SGDConfig]
    trainer: TrainerConfig
    strategy: Union[AutoStrategyConfig, DDPStrategyConfig, FSDPStrategyConfig, FSDP2StrategyConfig]
    logger: LoggerConfig
