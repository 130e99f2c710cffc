"""Check a composed config once, for one command, and report every problem at once
(math.md#policy-losses, #aggregation).

The config is resolved once, then checked against the schema (`rlcli.conf.typecheck`, with the
options of the loss class the ``loss`` group names), its ``_target_`` trust (`rlcli.conf.targets`)
and rlcli's rules on its typed form (`rlcli.conf.rules`, those of the command). A rule reads typed
groups: one whose groups have problems already is skipped, so each problem is told once.
"""

from __future__ import annotations

import copy
import re

import hydra.utils
from omegaconf import DictConfig, OmegaConf, open_dict

from rlcli.conf import typecheck
from rlcli.conf.rules import COMMANDS, rule_problems
from rlcli.conf.schema import LossConfig, TrainConfig
from rlcli.conf.targets import is_trusted, trusted_modules, untrusted_targets
from rlcli.errors import UserError
from rlcli.modules import LOSSES, PolicyLoss


class ConfigError(UserError):
    """A user's config is invalid. ``problems`` lists each as ``"key.path: what is wrong"``."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"Invalid configuration ({len(problems)} {noun}):\n{lines}")


def loss_class(node: DictConfig, allowed: tuple[str, ...], problems: list[str]):
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
    if not is_trusted(str(target), allowed):
        return None  # reported with the other untrusted targets
    try:
        cls = hydra.utils.get_class(str(target))
    except Exception as err:  # an unimportable target is the user's to fix
        problems.append(f"loss._target_: cannot import {target!r}: {err}")
        return None
    if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
        problems.append(f"loss._target_: {target!r} is not a subclass of rlcli.modules.PolicyLoss")
        return None
    LOSSES.register()(cls)
    if node.get("name") != cls.name:
        problems.append(f"loss.name: must be {cls.name!r}, the name {target} registers, got {node.get('name')!r}")
    return cls


def _loss_option_problems(cfg: DictConfig) -> list[str]:
    """The keys of the ``loss`` group beyond `LossConfig`'s: the options of the loss class it names."""
    node = cfg.get("loss")
    if not isinstance(node, DictConfig):
        return []  # reported by the schema check
    problems: list[str] = []
    cls = loss_class(node, trusted_modules(cfg), problems)
    if cls is not None:
        options = typecheck.schema_fields(cls)
        shared = frozenset([*typecheck.schema_fields(LossConfig), "_target_"])
        problems += typecheck.check(node, cls, "loss", optional=tuple(options), others=shared)
    return problems


def resolve_config(cfg: DictConfig) -> DictConfig:
    """A copy of a composed config without Hydra's own node, interpolations resolved."""
    node = copy.deepcopy(cfg)
    if "hydra" in node:
        with open_dict(node):
            del node["hydra"]
    try:
        OmegaConf.resolve(node)
    except Exception as err:  # a broken interpolation is a user error too
        raise ConfigError([f"cannot resolve the config: {err}"]) from None
    return node


def _top_key(problem: str) -> str:
    """The top-level key a ``"key.path: what is wrong"`` line is about."""
    return re.match(r"[^.\[:/]*", problem).group()


def load_config(cfg: DictConfig, command: str = "train") -> tuple[DictConfig, TrainConfig]:
    """The resolved config (what a run saves) and its typed form, checked for ``command`` (`COMMANDS`),
    or `ConfigError` listing every problem."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, got {command!r}")
    node = resolve_config(cfg)
    problems = typecheck.check(node, TrainConfig) + _loss_option_problems(node) + untrusted_targets(node)
    invalid = {_top_key(p) for p in problems}  # their fields stay None: the rules that read them are skipped
    fields = typecheck.schema_fields(TrainConfig)
    typed = TrainConfig(**{name: None if name in invalid else typecheck.typed(node.get(name), hint)
                           for name, (hint, _) in fields.items()})
    problems += rule_problems(typed, command, invalid)
    if problems:
        raise ConfigError(problems)
    return node, typed


def validate_config(cfg: DictConfig, command: str = "train") -> TrainConfig:
    """The typed form of a composed config, checked for ``command``, or `ConfigError` listing every problem."""
    return load_config(cfg, command)[1]
