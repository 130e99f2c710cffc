"""Check a composed config against the schema and the rules of SPEC §3–§4; report every problem."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from pathlib import PurePath
from typing import Any, Literal, Union

import hydra.utils
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from rlcli.conf.machine import check_machine
from rlcli.conf.schema import LossConfig, Target, TrainConfig
from rlcli.errors import UserError
from rlcli.modules import LOSSES, PolicyLoss, make_loss, register_loss
from rlcli.modules.bounds import BOUNDS, INT64
from rlcli.training.sources import DATA_KINDS, GROUPS_OF_DATA_KINDS


class ConfigError(UserError):
    """A user's config is invalid. ``problems`` lists each as ``"key.path: what is wrong"``."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"Invalid configuration ({len(problems)} {noun}):\n{lines}")


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


DISCRIMINATORS = ("name", "kind")


def _discriminator(cls) -> tuple[str, tuple]:
    """The Literal-typed ``name`` or ``kind`` field that tells the members of a Union of dataclasses
    apart, and its values."""
    hints = typing.get_type_hints(cls)
    key = next(k for k in DISCRIMINATORS if k in hints)
    return key, typing.get_args(hints[key])


def _check_union(node, members, path, problems) -> None:
    key, _ = _discriminator(members[0])
    if not isinstance(node, DictConfig):
        problems.append(f"{path}: expected a config group, got {_describe(node)}")
        return
    choice = node.get(key)
    for cls in members:
        if choice in _discriminator(cls)[1]:
            _check_dataclass(node, cls, path, problems)
            return
    options = [opt for cls in members for opt in _discriminator(cls)[1]]
    problems.append(f"{path}.{key}: must be one of {options}, got {choice!r}")


def _check_bounds(value, meta, path, problems) -> None:
    for name, bound in meta.items():
        holds, symbol = BOUNDS[name]
        if not holds(value, bound):
            problems.append(f"{path}: must be {symbol} {bound if isinstance(bound, int) else f'{bound:g}'}, "
                            f"got {value!r}")


def _check_value(value, annotation, path, problems, meta=None) -> None:
    if annotation is Any:
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union:
        if value is None and type(None) in args:
            return
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            _check_value(value, members[0], path, problems, meta)
            return
        if all(dataclasses.is_dataclass(m) for m in members):
            _check_union(value, members, path, problems)
            return
        reasons = []  # a value passes if one member accepts it, e.g. Union[int, Literal["auto"]]
        for member in members:
            found = []
            _check_value(value, member, path, found, meta)
            if not found:
                return
            reasons += [problem.removeprefix(f"{path}: ") for problem in found]
        problems.append(f"{path}: {' or '.join(reasons)}")
        return
    if origin is Literal:
        if value not in args:
            problems.append(f"{path}: must be one of {list(args)}, got {value!r}")
        return
    if origin in (list, tuple):  # a tuple: a list of as many items; the field's bounds hold for each item
        if not isinstance(value, ListConfig):
            problems.append(f"{path}: expected a list, got {_describe(value)}")
            return
        if origin is tuple and len(value) != len(args):
            problems.append(f"{path}: expected a list of {len(args)} items, got {len(value)}: {list(value)!r}")
            return
        for i, (item, hint) in enumerate(zip(value, args if origin is tuple else args * len(value))):
            _check_value(item, hint, f"{path}[{i}]", problems, meta)
        return
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, DictConfig):
            problems.append(f"{path}: expected a config group, got {_describe(value)}")
            return
        _check_dataclass(value, annotation, path, problems)
        return
    if annotation is Target:
        if not (isinstance(value, DictConfig) and isinstance(value.get("_target_"), str)):
            problems.append(f"{path}: expected a _target_ and its arguments ({{_target_: ..., ...}}), "
                            f"got {_describe(value)}")
        return
    if annotation is bool:
        ok = isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not INT64.min <= value <= INT64.max:
            problems.append(f"{path}: must be a 64-bit integer (at most {INT64.max}), got {value!r}")
            return
    elif annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            problems.append(f"{path}: must be a finite number, got {value!r}")
            return
    else:
        ok = isinstance(value, annotation)
    if not ok:
        problems.append(f"{path}: expected {annotation.__name__}, got {_describe(value)}")
    elif meta:
        _check_bounds(value, meta, path, problems)


def _schema_fields(cls) -> dict[str, tuple[Any, dict]]:
    """``{key: (annotation, metadata)}`` of the config keys of a schema dataclass (built fields left out)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls) if not f.metadata.get("built")}


def _check_fields(node: DictConfig, fields: dict, path: str, problems: list[str], *,
                  optional=(), others: frozenset = frozenset()) -> None:
    """Check ``node``'s keys against ``fields`` (`_schema_fields`): keys in ``optional`` may be left
    out, keys in ``others`` are checked elsewhere, any other key is unknown."""
    prefix = f"{path}." if path else ""
    for key in node.keys():
        if key not in fields and key not in others:
            problems.append(f"{prefix}{key}: unknown key (valid keys: {', '.join([*fields, *others])})")
    for name, (hint, meta) in fields.items():
        key_path = f"{prefix}{name}"
        if name not in node.keys():
            if type(None) not in typing.get_args(hint) and name not in optional:  # Optional may be left out
                problems.append(f"{key_path}: missing")
        elif OmegaConf.is_missing(node, name):
            problems.append(f"{key_path}: is required (set {key_path}=...)")
        else:
            _check_value(node[name], hint, key_path, problems, meta)


def _check_dataclass(node: DictConfig, cls, path: str, problems: list[str]) -> None:
    if cls is LossConfig:  # the loss's own options: `_check_loss_options`
        _check_fields(node, _schema_fields(cls), path, problems, others=frozenset(node.keys()))
    else:
        _check_fields(node, _schema_fields(cls), path, problems)


def _loss_class(node: DictConfig, allowed: tuple[str, ...], problems: list[str]):
    """The `PolicyLoss` class the ``loss`` group names: a registered ``name``, or a trusted
    ``_target_`` class (registered on the way, so every entry point finds it by name); None after
    reporting why not."""
    target = node.get("_target_")
    if target is None:
        name = node.get("name")
        if name not in LOSSES:
            problems.append(f"loss.name: must be one of {list(LOSSES)}, got {name!r}")
            return None
        return LOSSES[name]
    if not _trusted(str(target), allowed):
        return None  # reported by _check_targets
    try:
        cls = hydra.utils.get_class(str(target))
    except Exception as err:  # an unimportable target is the user's to fix
        problems.append(f"loss._target_: cannot import {target!r}: {err}")
        return None
    if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
        problems.append(f"loss._target_: {target!r} is not a subclass of rlcli.modules.PolicyLoss")
        return None
    register_loss(cls)
    if node.get("name") != cls.name:
        problems.append(f"loss.name: must be {cls.name!r}, the name {target} registers, got {node.get('name')!r}")
    return cls


def _check_loss_options(cfg: DictConfig, problems: list[str]) -> None:
    """The keys of the ``loss`` group beyond `LossConfig`'s: the options of the loss class it names."""
    node = cfg.get("loss")
    if not isinstance(node, DictConfig):
        return  # reported by the schema check
    cls = _loss_class(node, _trusted_modules(cfg), problems)
    if cls is None:
        return
    options = _schema_fields(cls)
    shared = frozenset([*_schema_fields(LossConfig), "_target_"])
    _check_fields(node, options, "loss", problems, optional=tuple(options), others=shared)


def _typed(node, annotation):
    """The validated ``node`` as an instance of ``annotation`` (dataclasses, lists and plain values)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if node is None:
        return None
    if origin is Union:
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return _typed(node, members[0])
        if not all(dataclasses.is_dataclass(m) for m in members):
            return node  # a plain value, e.g. Union[int, Literal["auto"]]
        key, _ = _discriminator(members[0])
        annotation = next(m for m in members if node.get(key) in _discriminator(m)[1])
    if origin is list:
        return [_typed(item, args[0]) for item in node]
    if origin is tuple:
        return tuple(_typed(item, hint) for item, hint in zip(node, args))
    if annotation is LossConfig:
        return _typed_loss(node)
    if dataclasses.is_dataclass(annotation):
        return annotation(**{
            name: _typed(node.get(name), hint) for name, (hint, _) in _schema_fields(annotation).items()
        })
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    if annotation is float:
        return float(node)  # a float key given as an int (betas=[0,0]): torch takes floats only
    return node


def _typed_loss(node: DictConfig) -> LossConfig:
    shared = {name: _typed(node[name], hint) for name, (hint, _) in _schema_fields(LossConfig).items()}
    options = {k: node[k] for k in node.keys() if k not in shared and k != "_target_"}
    return LossConfig(**shared, objective=make_loss(node.name, **options))


TRUSTED_TARGET_MODULES = ("rlcli", "torch", "transformers")


def _target_paths(node, path: str = ""):
    """``(key path, value)`` of every ``_target_`` in the config."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            if OmegaConf.is_missing(node, key):
                continue
            child = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                yield child, node[key]
            else:
                yield from _target_paths(node[key], child)
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _target_paths(item, f"{path}[{i}]")


def _trusted_modules(cfg: DictConfig) -> tuple[str, ...]:
    allowed = cfg.get("allow_targets")
    return TRUSTED_TARGET_MODULES + (tuple(allowed) if isinstance(allowed, ListConfig) else ())


def _trusted(target: str, modules: tuple[str, ...]) -> bool:
    return any(target == m or target.startswith(m + ".") for m in modules)


def _check_targets(cfg: DictConfig, problems: list[str]) -> None:
    """``_target_`` builds any importable object: only rlcli, torch and transformers ones unless
    the user names more modules in ``allow_targets``."""
    allowed = _trusted_modules(cfg)
    for path, target in _target_paths(cfg):
        if not _trusted(str(target), allowed):
            problems.append(
                f"{path}: {target!r} is outside the allowed modules ({', '.join(allowed)}); "
                f"to trust it, add allow_targets=[{str(target).split('.')[0]}]"
            )


def _check_rules(cfg: DictConfig, problems: list[str]) -> None:
    """Combinations of fields that the schema alone cannot express (SPEC §4), and the data kind's own."""
    data = cfg.get("data")
    kind = DATA_KINDS.get(data.get("kind")) if isinstance(data, DictConfig) else None
    if kind is not None:
        kind.check_config(cfg, problems)
    for group in GROUPS_OF_DATA_KINDS:
        if cfg.get(group) is not None and (kind is None or group not in kind.groups):
            users = [name for name, k in DATA_KINDS.items() if group in k.groups]
            problems.append(f"{group}: only used with data={'|'.join(users)}")
    _check_loss_terms(cfg, problems)
    _check_rollout_engine(cfg, problems)
    _check_model(_group(cfg, "model"), _group(cfg, "trainer"), problems)
    subdir = _group(_group(cfg, "logger"), "tensorboard").get("subdir")
    if isinstance(subdir, str) and (PurePath(subdir).is_absolute() or ".." in PurePath(subdir).parts):
        problems.append(f"logger.tensorboard.subdir: a folder inside the run directory, got {subdir!r}")
    check_machine(_group(cfg, "trainer"), _group(cfg, "strategy"), _group(cfg, "model"), problems)
    aggregation = cfg.get("aggregation")
    if not isinstance(aggregation, DictConfig) or OmegaConf.is_missing(aggregation, "divisor"):
        return  # reported by the schema check
    name, divisor = aggregation.get("name"), aggregation.get("divisor")
    if name == "constant" and divisor is None:
        problems.append(
            "aggregation.divisor: is required for aggregation=constant "
            "(e.g. the maximum completion length, or 1 to normalise by documents)"
        )
    if name != "constant" and divisor is not None:
        problems.append(f"aggregation.divisor: only valid with aggregation=constant, not {name!r}")


def _group(cfg: DictConfig, name: str) -> DictConfig:
    node = cfg.get(name)
    return node if isinstance(node, DictConfig) else DictConfig({})


def _count(node: DictConfig, key: str) -> int | None:
    """``node[key]`` if it is an int >= 1, else None (the schema check reports it)."""
    value = node.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _check_model(model: DictConfig, trainer: DictConfig, problems: list[str]) -> None:
    """The weights' dtype that mixed precision needs, and the shape of the tiny Llama's attention: whole
    heads of an even size (rotary embeddings rotate pairs of dimensions)."""
    precision = trainer.get("precision")
    if model.get("dtype") == "float16" and str(precision).endswith("-mixed"):
        problems.append(f"model.dtype: trainer.precision={precision} computes under autocast from float32 weights "
                        "(and float16 gradients break its steps); use model.dtype=float32")
    hidden, heads = _count(model, "hidden_size"), _count(model, "num_heads")
    if model.get("kind") != "tiny" or hidden is None or heads is None:
        return
    if hidden % heads:
        problems.append(f"model.hidden_size: {hidden} is not a multiple of model.num_heads={heads}")
    elif hidden // heads % 2:
        problems.append(f"model.num_heads: {heads} heads of model.hidden_size={hidden} get {hidden // heads} "
                        "dimensions each; rotary position embeddings need an even number")


def _check_rollout_engine(cfg: DictConfig, problems: list[str]) -> None:
    """What ``rollout.engine=vllm`` needs: its options as a mapping without the keys rlcli sets, and no
    truncated sampling unless the mismatch correction weighs the sampler's log-probs."""
    from rlcli.rollout.vllm_engine import OWNED_OPTIONS

    rollout = _group(cfg, "rollout")
    if rollout.get("engine") != "vllm":
        return
    options = rollout.get("vllm")
    if not isinstance(options, DictConfig):
        problems.append(f"rollout.vllm: expected keyword arguments of vllm.LLM (a mapping), got {_describe(options)}")
    else:
        for key in sorted(set(options.keys()) & set(OWNED_OPTIONS)):
            problems.append(f"rollout.vllm.{key}: rlcli sets it ({OWNED_OPTIONS[key]}); remove it")
    top_p, top_k = rollout.get("top_p"), rollout.get("top_k")
    truncated = (isinstance(top_p, (int, float)) and top_p < 1) or (isinstance(top_k, int) and top_k > 0)
    if truncated and _group(cfg, "correction").get("mode", "none") == "none":
        problems.append(f"rollout.top_p/top_k: vLLM's log-probs with top_p={top_p}, top_k={top_k} are those of the "
                        "truncated distribution, not the trainer's; turn on the mismatch correction "
                        "(correction.mode=truncate or mask) or sample without truncation")


def _check_loss_terms(cfg: DictConfig, problems: list[str]) -> None:
    """What the KL penalty, the mismatch correction and the ratio's denominator need of each other."""
    loss, kl, correction = _group(cfg, "loss"), _group(cfg, "kl"), _group(cfg, "correction")
    strategy, data = _group(cfg, "strategy"), _group(cfg, "data")
    if correction.get("mode", "none") != "none" and loss.get("old_logprobs") == "sampler":
        problems.append(f"loss.old_logprobs: correction.mode={correction.get('mode')} weighs the trainer's own "
                        "log-probs against the sampler's, so the ratio needs loss.old_logprobs=recompute")
    low, high = correction.get("low"), correction.get("high")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) and low > high:
        problems.append(f"correction.low: {low} is above correction.high={high}")
    coef = kl.get("coef")
    if not (isinstance(coef, (int, float)) and coef > 0):
        return
    if kl.get("reference") == "rollouts" and data.get("kind") not in ("rollouts", "stream"):
        problems.append("kl.reference: rollouts reads the records' ref_logprobs, so it needs data=rollouts or stream")
    if kl.get("reference") != "rollouts" and strategy.get("name") in ("fsdp", "fsdp2"):
        problems.append("kl.reference: a reference model runs with strategy=auto or ddp; with fsdp/fsdp2 give "
                        "the rollouts' ref_logprobs (kl.reference=rollouts)")


def resolve_config(cfg: DictConfig) -> DictConfig:
    """A copy of a composed ``rlcli train`` config without Hydra's own node, interpolations resolved."""
    node = copy.deepcopy(cfg)
    if "hydra" in node:
        with open_dict(node):
            del node["hydra"]
    try:
        OmegaConf.resolve(node)
    except Exception as err:  # a broken interpolation is a user error too
        raise ConfigError([f"cannot resolve the config: {err}"]) from None
    return node


def validate_config(cfg: DictConfig) -> TrainConfig:
    """The typed form of a composed ``rlcli train`` config, or ``ConfigError`` listing every problem."""
    node = resolve_config(cfg)
    problems: list[str] = []
    _check_dataclass(node, TrainConfig, "", problems)
    _check_loss_options(node, problems)
    _check_rules(node, problems)
    _check_targets(node, problems)
    if problems:
        raise ConfigError(problems)
    return _typed(node, TrainConfig)
