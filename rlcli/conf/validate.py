"""Check a composed config against the schema and the rules of SPEC §3–§4; report every problem."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from typing import Any, Literal, Union

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from rlcli.conf.schema import TrainConfig
from rlcli.errors import UserError


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
    rules = {"ge": (lambda a, b: a >= b, ">="), "gt": (lambda a, b: a > b, ">"),
             "le": (lambda a, b: a <= b, "<="), "lt": (lambda a, b: a < b, "<")}
    for name, bound in meta.items():
        holds, symbol = rules[name]
        if not holds(value, bound):
            problems.append(f"{path}: must be {symbol} {bound}, got {value!r}")


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
    if origin is list:
        if not isinstance(value, ListConfig):
            problems.append(f"{path}: expected a list, got {_describe(value)}")
            return
        for i, item in enumerate(value):
            _check_value(item, args[0], f"{path}[{i}]", problems)
        return
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, DictConfig):
            problems.append(f"{path}: expected a config group, got {_describe(value)}")
            return
        _check_dataclass(value, annotation, path, problems)
        return
    if annotation is bool:
        ok = isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
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


def _check_dataclass(node: DictConfig, cls, path: str, problems: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{path}." if path else ""
    for key in node.keys():
        if key not in fields:
            problems.append(f"{prefix}{key}: unknown key (valid keys: {', '.join(fields)})")
    for name, f in fields.items():
        key_path = f"{prefix}{name}"
        if name not in node.keys():
            if type(None) not in typing.get_args(hints[name]):  # an Optional field may be left out
                problems.append(f"{key_path}: missing")
        elif OmegaConf.is_missing(node, name):
            problems.append(f"{key_path}: is required (set {key_path}=...)")
        else:
            _check_value(node[name], hints[name], key_path, problems, dict(f.metadata))


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


def _check_targets(cfg: DictConfig, problems: list[str]) -> None:
    """``_target_`` builds any importable object: only rlcli, torch and transformers ones unless
    the user names more modules in ``allow_targets``."""
    allowed = TRUSTED_TARGET_MODULES + tuple(cfg.get("allow_targets") or ())
    for path, target in _target_paths(cfg):
        if not any(str(target) == m or str(target).startswith(m + ".") for m in allowed):
            problems.append(
                f"{path}: {target!r} is outside the allowed modules ({', '.join(allowed)}); "
                f"to trust it, add allow_targets=[{str(target).split('.')[0]}]"
            )


def _check_rules(cfg: DictConfig, problems: list[str]) -> None:
    """Combinations of fields that the schema alone cannot express (SPEC §4)."""
    strategy, trainer = cfg.get("strategy"), cfg.get("trainer")
    if isinstance(strategy, DictConfig) and strategy.get("name") == "fsdp" and isinstance(trainer, DictConfig):
        import torch

        if trainer.get("accelerator") == "cpu" or not torch.cuda.is_available():
            problems.append("strategy: fsdp needs GPUs; on CPU use strategy=fsdp2 (FSDP2 over gloo)")
    data = cfg.get("data")
    if isinstance(data, DictConfig) and data.get("kind") == "generate":
        for key in ("rollout", "task"):
            if cfg.get(key) is None:
                problems.append(f"{key}: required by data=generate")
        if isinstance(trainer, DictConfig) and trainer.get("docs_per_step"):
            problems.append("trainer.docs_per_step: with data=generate a step is the rollouts it sampled "
                            "(rollout.prompts_per_step x rollout.group_size per process); use it with data=rollouts")
        advantage = cfg.get("advantage")
        if isinstance(advantage, DictConfig) and advantage.get("estimator") == "none":
            problems.append("advantage.estimator: on-policy rollouts (data=generate) need grpo or dr_grpo")
        if isinstance(strategy, DictConfig) and strategy.get("name") in ("fsdp", "fsdp2"):
            problems.append("strategy: on-policy generation (data=generate) runs with strategy=auto or ddp")
    elif cfg.get("rollout") is not None or cfg.get("task") is not None:
        problems.append("rollout/task: only used with data=generate")
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


def validate_config(cfg: DictConfig) -> DictConfig:
    """Return a resolved copy of a composed ``rlcli train`` config, or raise ``ConfigError``
    listing every problem at once."""
    node = copy.deepcopy(cfg)
    if "hydra" in node:
        with open_dict(node):
            del node["hydra"]
    try:
        OmegaConf.resolve(node)
    except Exception as err:  # a broken interpolation is a user error too
        raise ConfigError([f"cannot resolve the config: {err}"]) from None
    problems: list[str] = []
    _check_dataclass(node, TrainConfig, "", problems)
    _check_rules(node, problems)
    _check_targets(node, problems)
    if problems:
        raise ConfigError(problems)
    return node
