"""rlcli's config rules: combinations of typed fields that the schema alone cannot express (math.md#aggregation).

A rule reads the typed config of one command and yields a ``"key: what is wrong"`` line for each
problem. It names the top-level keys it reads (skipped while one of them has a problem of its own)
and the commands it holds for: `TRAINING` for what only a training run needs, all of `COMMANDS`
for what evaluating needs too. The data kind's own rules (``DataKind.check_config``) run with
those of a training command.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath

from rlcli.conf.machine import machine_problems, sampler_problems
from rlcli.conf.schema import StreamDataConfig, TrainConfig, trains_adapters
from rlcli.training.distill import reward_advantage
from rlcli.training.sources import DATA_KINDS, GROUPS_OF_DATA_KINDS

COMMANDS = ("train", "sample", "loop", "eval")
TRAINING = ("train", "sample", "loop")  # the commands of a training run, which share its config
SAMPLERS = ("sample", "loop")  # the commands that start rlcli sample's sampler


@dataclass(frozen=True)
class Rule:
    reads: tuple[str, ...]  # the top-level keys it reads
    commands: tuple[str, ...]  # the commands it holds for
    check: Callable[[TrainConfig, str], Iterator[str]]


RULES: list[Rule] = []


def rule(*reads: str, commands: tuple[str, ...] = COMMANDS):
    """Decorator: add a ``check(cfg, command)`` generator of problems to `RULES`."""

    def add(check: Callable[[TrainConfig, str], Iterator[str]]):
        RULES.append(Rule(reads, commands, check))
        return check

    return add


def rule_problems(cfg: TrainConfig, command: str, invalid: set[str]) -> list[str]:
    """The problems of ``cfg`` under every rule of ``command`` whose keys have none in ``invalid``
    (the keys that broke the schema: their fields in ``cfg`` are None)."""
    problems = [p for r in RULES if command in r.commands and not invalid.intersection(r.reads)
                for p in r.check(cfg, command)]
    kind = DATA_KINDS.get(cfg.data.kind) if "data" not in invalid else None
    if kind is not None and command in TRAINING and not invalid.intersection(kind.checks_read):
        problems += kind.check_config(cfg, command)
    return problems


@rule("model")
def _lora_targets(cfg: TrainConfig, command: str) -> Iterator[str]:
    if not trains_adapters(cfg.model):
        return
    targets = cfg.model.lora.target_modules
    if not (targets == "all-linear" or (isinstance(targets, list) and targets
                                        and all(isinstance(t, str) and t for t in targets))):
        yield (f"model.lora.target_modules: all-linear or a non-empty list of module names (q_proj, v_proj, ...), "
               f"got {targets!r}")


@rule("model", "strategy", commands=TRAINING)
def _lora_strategy(cfg: TrainConfig, command: str) -> Iterator[str]:
    if trains_adapters(cfg.model) and cfg.strategy.name == "fsdp":
        yield ("strategy=fsdp: not with LoRA adapters (model.lora.rank > 0), whose checkpoints FSDP1 cannot resume "
               "from; use strategy=fsdp2 (the frozen base sharded, the adapters trained) or ddp")


@rule("model", "publish", commands=TRAINING)
def _adapter_publishing(cfg: TrainConfig, command: str) -> Iterator[str]:
    if cfg.publish is None or cfg.publish.lora != "adapter":
        return
    if not trains_adapters(cfg.model):
        yield "publish.lora=adapter: publishes LoRA adapters, and model.lora.rank is 0 (no adapters)"
    elif cfg.model.kind != "hf":
        yield ("publish.lora=adapter: the samplers apply the adapters to the base model they load from model.path; "
               "model=tiny has none on disk (use model=hf, or publish.lora=merged)")


@rule("data")
def data_groups(cfg: TrainConfig, command: str) -> Iterator[str]:
    """The groups that only some data kinds read are left out with the others."""
    kind = DATA_KINDS[cfg.data.kind]
    for group in GROUPS_OF_DATA_KINDS:
        if getattr(cfg, group) is not None and group not in kind.groups:
            users = [name for name, k in DATA_KINDS.items() if group in k.groups]
            yield f"{group}: only used with data={'|'.join(users)}"


@rule("data", "rollout", "loss", commands=TRAINING)
def sampler_temperature(cfg: TrainConfig, command: str) -> Iterator[str]:
    """The trainer scores tokens at the temperature they were sampled at: the trainer's own sampler
    (data=generate) and `rlcli sample`'s (sample, loop) sample at loss.temperature."""
    if cfg.rollout is None or not (cfg.data.kind == "generate" or command in SAMPLERS):
        return
    allowed = isinstance(cfg.data, StreamDataConfig) and cfg.data.allow_temperature_mismatch
    sampled, scored = cfg.rollout.temperature, cfg.loss.temperature
    if sampled != scored and not allowed:
        yield (f"rollout.temperature: {sampled} differs from loss.temperature={scored}; the trainer must score "
               "tokens at the sampler's temperature (set loss.temperature alone: rollout.temperature follows it)")


@rule("rollout")
def rollout_stop(cfg: TrainConfig, command: str) -> Iterator[str]:
    """Stop strings that can end a completion after its first token, and ids that can be tokens (the
    model's vocabulary bounds them when the sampler is built)."""
    if cfg.rollout is None:
        return
    if "" in cfg.rollout.stop:
        yield "rollout.stop: an empty stop string would end every completion at its first token"
    negative = [i for i in cfg.rollout.stop if not isinstance(i, str) and i < 0]
    if negative:
        yield f"rollout.stop: ids {negative} are negative; token ids count from 0"


@rule("rollout")
def vllm_options(cfg: TrainConfig, command: str) -> Iterator[str]:
    """``rollout.vllm``: keyword arguments of vllm.LLM, without those rlcli sets."""
    from rlcli.rollout.vllm_engine import OWNED_OPTIONS

    if cfg.rollout is None or cfg.rollout.engine != "vllm":
        return
    options = cfg.rollout.vllm
    if not isinstance(options, dict):
        yield f"rollout.vllm: expected keyword arguments of vllm.LLM (a mapping), got {options!r}"
        return
    for key in sorted(set(options) & set(OWNED_OPTIONS)):
        yield f"rollout.vllm.{key}: rlcli sets it ({OWNED_OPTIONS[key]}); remove it"


@rule("rollout")
def vllm_temperature(cfg: TrainConfig, command: str) -> Iterator[str]:
    """vLLM samples at temperatures up to its own bound."""
    from rlcli.rollout.vllm_engine import MAX_TEMPERATURE

    r = cfg.rollout
    if r is not None and r.engine == "vllm" and r.temperature > MAX_TEMPERATURE:
        yield (f"rollout.temperature: vLLM samples at temperatures up to {MAX_TEMPERATURE:g}, got {r.temperature:g} "
               "(rollout.temperature follows loss.temperature); use rollout.engine=hf for a higher one")


@rule("rollout", "correction", commands=TRAINING)
def vllm_truncation(cfg: TrainConfig, command: str) -> Iterator[str]:
    """vLLM's log-probs of truncated sampling are not the trainer's: only the mismatch correction weighs them."""
    r = cfg.rollout
    if r is None or r.engine != "vllm" or cfg.correction.mode != "none" or (r.top_p >= 1 and r.top_k == 0):
        return
    yield (f"rollout.top_p/top_k: vLLM's log-probs with top_p={r.top_p}, top_k={r.top_k} are those of the "
           "truncated distribution, not the trainer's; turn on the mismatch correction "
           "(correction.mode=truncate or mask) or sample without truncation")


@rule("loss", "kl", "correction", "strategy", "data", "model", commands=TRAINING)
def loss_terms(cfg: TrainConfig, command: str) -> Iterator[str]:
    """What the KL penalty, the mismatch correction and the ratio's denominator need of each other."""
    kl, correction = cfg.kl, cfg.correction
    if correction.mode != "none" and cfg.loss.old_logprobs == "sampler":
        yield (f"loss.old_logprobs: correction.mode={correction.mode} weighs the trainer's own "
               "log-probs against the sampler's, so the ratio needs loss.old_logprobs=recompute")
    if correction.low > correction.high:
        yield f"correction.low: {correction.low:g} is above correction.high={correction.high:g}"
    if kl.coef <= 0:
        return
    if kl.reference == "rollouts" and cfg.data.kind not in ("rollouts", "stream"):
        yield "kl.reference: rollouts reads the records' ref_logprobs, so it needs data=rollouts or stream"
    # fsdp2 with LoRA: the reference is the sharded policy itself, its adapters off
    adapters_off = kl.reference == "initial" and trains_adapters(cfg.model) and cfg.strategy.name == "fsdp2"
    if kl.reference != "rollouts" and cfg.strategy.name in ("fsdp", "fsdp2") and not adapters_off:
        yield ("kl.reference: a reference model runs with strategy=auto or ddp; with fsdp/fsdp2 give "
               "the rollouts' ref_logprobs (kl.reference=rollouts), or, with fsdp2, train LoRA adapters "
               "(model.lora.rank > 0): kl.reference=initial is then the policy with its adapters off")


@rule("rollout", "data", "trainer", commands=TRAINING)
def dynamic_sampling(cfg: TrainConfig, command: str) -> Iterator[str]:
    """``rollout.filter=zero_variance`` drops groups, judged on ``rollout.filter_metric`` (math.md#dynamic-sampling)."""
    r = cfg.rollout
    if r is None:
        return
    if r.filter == "none" and r.filter_metric is not None:
        yield f"rollout.filter_metric: only valid with rollout.filter=zero_variance, not {r.filter!r}"
    if r.filter == "none":
        return
    if r.group_size == 1:
        yield ("rollout.filter: zero_variance drops every group whose completions all score the same, so with "
               "rollout.group_size=1 it drops every group; use a larger group")
    if cfg.data.kind == "generate" and cfg.trainer.minibatches > 1:
        yield (f"rollout.filter: zero_variance may keep fewer groups than trainer.minibatches="
               f"{cfg.trainer.minibatches} (a group is never split between updates); use trainer.minibatches=1")


@rule("kl", "data", "advantage", "loss", "rollout", commands=TRAINING)
def kl_in_reward(cfg: TrainConfig, command: str) -> Iterator[str]:
    """``kl.placement=reward`` subtracts ``beta x sum k1`` from rewards before their advantages are computed
    (math.md#kl-in-the-reward): it needs rewards that rlcli turns into advantages, and both log-probs of k1."""
    kl = cfg.kl
    if kl.placement != "reward" or kl.coef == 0:
        return
    if kl.estimator not in (None, "k1"):
        yield (f"kl.estimator: kl.placement=reward subtracts beta x the sum of k1 = old_lp - ref_lp from the reward, "
               f"not {kl.estimator}; leave kl.estimator unset (null) or set it to k1")
    if kl.ratio_weighted:
        yield "kl.ratio_weighted: weighs the KL term of the loss, and with kl.placement=reward the loss has none"
    kind, estimator = cfg.data.kind, cfg.advantage.estimator
    from_files = kind == "rollouts" and kl.reference == "rollouts"
    if estimator in ("none", "distill") or not (kind == "generate" or from_files):
        got = f"data={kind}" + (f", kl.reference={kl.reference}" if kind == "rollouts" else "")
        yield ("kl.placement: reward subtracts the KL from the rewards before rlcli computes the advantages, so it "
               "applies with data=generate, or data=rollouts with kl.reference=rollouts (the records' "
               "ref_logprobs), and an advantage.estimator that computes them from rewards (not none or distill); "
               f"got {got}, advantage.estimator={estimator}")
    if kind == "generate" and cfg.rollout is not None and cfg.rollout.mask_truncated:
        yield ("rollout.mask_truncated: drops the truncated completions before the trainer recomputes their groups' "
               "advantages with kl.placement=reward; use one of the two")
    if from_files and cfg.loss.old_logprobs == "recompute":
        yield ("loss.old_logprobs: kl.placement=reward with rollout files shapes the rewards at read, with the "
               "records' old_logprobs as the ratio's denominator; set loss.old_logprobs=sampler (no correction.mode)")


@rule("reward", "rollout", "data", "trainer", commands=TRAINING)
def overlong_shaping(cfg: TrainConfig, command: str) -> Iterator[str]:
    """The overlong reward and the masking of truncated completions shape what rlcli samples
    (math.md#overlong-shaping)."""
    buffer, r = cfg.reward.overlong_buffer, cfg.rollout
    if buffer is not None and r is None:
        yield (f"reward.overlong_buffer: shapes the rewards of the completions rlcli samples (data=generate, or "
               f"rlcli sample with data=stream), not the records of data={cfg.data.kind}, which carry their rewards")
    if r is None:
        return
    if buffer is not None and buffer > r.max_new_tokens:
        yield f"reward.overlong_buffer: {buffer} is more than rollout.max_new_tokens={r.max_new_tokens} tokens"
    if r.mask_truncated and cfg.data.kind == "generate" and cfg.trainer.minibatches > 1:
        yield (f"rollout.mask_truncated: drops a whole group when all its completions are truncated, so a batch may "
               f"hold fewer groups than trainer.minibatches={cfg.trainer.minibatches} (a group is never split "
               "between updates); use trainer.minibatches=1")


@rule("advantage", "distill", "rollout", commands=TRAINING)
def pass_at_k(cfg: TrainConfig, command: str) -> Iterator[str]:
    """``advantage.k`` is pass@k's k, of ``passk`` alone (``advantage.estimator``, or ``distill.rewards``
    with distill); it must not exceed a group (math.md#advantages)."""
    rewards = reward_advantage(cfg.advantage, cfg.distill)
    owner = "advantage.estimator" if rewards is cfg.advantage else "distill.rewards"
    estimator, k = rewards.estimator, cfg.advantage.k
    yield from _only_with("advantage.k", k, owner, estimator, "passk", "the k of pass@k, e.g. advantage.k=4")
    if estimator == "passk" and k is not None and cfg.rollout is not None and k > cfg.rollout.group_size:
        yield (f"advantage.k: {k} is more than rollout.group_size={cfg.rollout.group_size}, the documents of a "
               "group (pass@k needs k <= the group's size)")


@rule("advantage", "teacher", "strategy", commands=TRAINING)
def distillation(cfg: TrainConfig, command: str) -> Iterator[str]:
    """``advantage.estimator=distill`` needs its teacher, a checkpoint that runs beside the whole policy
    (math.md#on-policy-distillation); ``teacher.path`` is of ``distill`` alone."""
    path = cfg.teacher.path
    yield from _only_with("teacher.path", path, "advantage.estimator", cfg.advantage.estimator, "distill",
                          "a Hugging Face model directory sharing the policy's tokenizer")
    if cfg.advantage.estimator != "distill" or path is None:
        return
    if not (Path(path) / "config.json").is_file():
        yield f"teacher.path: {path} is not a Hugging Face checkpoint directory (no config.json)"
    if cfg.strategy.name in ("fsdp", "fsdp2"):
        yield (f"teacher.path: a teacher runs whole in every process, with strategy=auto or ddp, not "
               f"{cfg.strategy.name}")


@rule("aggregation", commands=TRAINING)
def aggregation_divisor(cfg: TrainConfig, command: str) -> Iterator[str]:
    yield from _only_with("aggregation.divisor", cfg.aggregation.divisor, "aggregation", cfg.aggregation.name,
                          "constant", "e.g. the maximum completion length, or 1 to normalise by documents")


@rule("objective", commands=TRAINING)
def objective_last_k(cfg: TrainConfig, command: str) -> Iterator[str]:
    """``last_k`` is the window of mean_last, and of no other reduction."""
    yield from _only_with("objective.last_k", cfg.objective.last_k, "objective.reduce", cfg.objective.reduce,
                          "mean_last", "objective=mean_last sets it")


def _only_with(key: str, value, owner: str, chosen: str, wanted: str, example: str) -> Iterator[str]:
    """``key`` belongs to ``owner=wanted`` alone: required there (``example`` says what to set), an error with
    any other choice."""
    if chosen == wanted and value is None:
        yield f"{key}: is required for {owner}={wanted} ({example})"
    if chosen != wanted and value is not None:
        yield f"{key}: only valid with {owner}={wanted}, not {chosen!r}"


@rule("model", "trainer", commands=TRAINING)
def mixed_precision_weights(cfg: TrainConfig, command: str) -> Iterator[str]:
    """Autocast computes from float32 weights (and float16 gradients break its steps)."""
    precision = cfg.trainer.precision
    if cfg.model.dtype == "float16" and precision.endswith("-mixed"):
        yield (f"model.dtype: trainer.precision={precision} computes under autocast from float32 weights "
               "(and float16 gradients break its steps); use model.dtype=float32")


@rule("model")
def tiny_attention_heads(cfg: TrainConfig, command: str) -> Iterator[str]:
    """The tiny Llama's attention: whole heads of an even size (rotary embeddings rotate pairs of dimensions)."""
    if cfg.model.kind != "tiny":
        return
    hidden, heads = cfg.model.hidden_size, cfg.model.num_heads
    if hidden % heads:
        yield f"model.hidden_size: {hidden} is not a multiple of model.num_heads={heads}"
    elif hidden // heads % 2:
        yield (f"model.num_heads: {heads} heads of model.hidden_size={hidden} get {hidden // heads} "
               "dimensions each; rotary position embeddings need an even number")


@rule("logger", commands=TRAINING)
def tensorboard_folder(cfg: TrainConfig, command: str) -> Iterator[str]:
    tensorboard = cfg.logger.tensorboard
    subdir = PurePath(tensorboard.subdir) if tensorboard is not None else None
    if subdir is not None and (subdir.is_absolute() or ".." in subdir.parts):
        yield f"logger.tensorboard.subdir: a folder inside the run directory, got {tensorboard.subdir!r}"


@rule("trainer", "strategy", "model")
def this_machine(cfg: TrainConfig, command: str) -> Iterator[str]:
    yield from machine_problems(cfg.trainer, cfg.strategy, cfg.model)


@rule("eval", "data", "strategy", "task", "rollout", "trainer", commands=("train", "loop"))
def periodic_eval(cfg: TrainConfig, command: str) -> Iterator[str]:
    """``eval.every`` samples the data kind's task with the whole policy on every rank."""
    if cfg.eval.every == 0:
        return
    if cfg.task is None:
        yield f"eval.every: evaluation needs a task (data=generate or stream), not data={cfg.data.kind}"
    if cfg.strategy.name not in ("auto", "ddp"):
        yield ("eval.every: every rank samples with the whole policy, so evaluation runs with "
               f"strategy=auto or ddp, not {cfg.strategy.name}")
    processes = cfg.trainer.processes
    if cfg.rollout is not None and cfg.rollout.engine == "vllm" and processes > 1:
        yield (f"eval.every: with rollout.engine=vllm evaluation samples with a vLLM engine in the training "
               f"process, which runs in one process, not {processes}; set eval.every=0 or rollout.engine=hf")


@rule("task", commands=TRAINING)
def prompts_to_train_on(cfg: TrainConfig, command: str) -> Iterator[str]:
    """A ``task=prompts`` run trains on prompt files or datasets, none held out (`PromptsTask.training_problems`)."""
    import hydra.utils

    from rlcli.rollout.prompts import PromptsTask

    if cfg.task is None:
        return
    try:
        cls = hydra.utils.get_class(cfg.task["_target_"])
    except Exception:  # a function, or a target that does not import: building the task tells
        return
    if issubclass(cls, PromptsTask):
        yield from PromptsTask.training_problems(cfg.task.get("paths"), cfg.task.get("eval_paths"),
                                                 cfg.task.get("dataset"), cfg.task.get("mixture"),
                                                 cfg.task.get("eval_split"))


@rule("data", commands=("sample",))
def sample_command(cfg: TrainConfig, command: str) -> Iterator[str]:
    if cfg.data.kind != "stream":
        yield f"data: rlcli sample pushes into a stream (data=stream), not data={cfg.data.kind}"


@rule("data", "task", commands=SAMPLERS)
def task_to_sample(cfg: TrainConfig, command: str) -> Iterator[str]:
    if cfg.data.kind == "stream" and cfg.task is None:
        yield "task: rlcli sample needs a task to sample (task=reverse, or a _target_)"


@rule("data", commands=("loop",))
def loop_command(cfg: TrainConfig, command: str) -> Iterator[str]:
    if cfg.data.kind != "stream":
        yield (f"data: rlcli loop runs samplers and a trainer around a stream (data=stream), "
               f"not data={cfg.data.kind}")


@rule("sample", commands=("loop",))
def loop_samplers(cfg: TrainConfig, command: str) -> Iterator[str]:
    """`rlcli loop` starts ``sample.workers`` processes on this machine: as many as its cores and memory run."""
    if cfg.sample is not None:
        yield from sampler_problems(cfg.sample.workers)


@rule("data", "task", "rollout", commands=("eval",))
def eval_command(cfg: TrainConfig, command: str) -> Iterator[str]:
    if cfg.task is None or cfg.rollout is None:
        yield (f"task: rlcli eval needs a task and its rollout options (data=generate or stream, the "
               f"default), not data={cfg.data.kind}")
