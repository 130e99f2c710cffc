"""The keys of `rlcli train`'s config, described: a row per key of a composed config with its type, its
default as the YAML writes it, its bounds or choices and its one-line description.

Each description lives in code, once: the schema's field metadata (`rlcli.conf.schema`), a loss
class's option metadata (`rlcli.modules.losses`), a task class's ``OPTION_DOCS`` (`rlcli.rollout.tasks`)
with ``OPTION_KEYS`` for the keys of an option that is a mapping (``task.dataset.path``), and
`rlcli.rollout.vllm_engine.OPTION_DOCS` (through the schema's ``keys``). ``rlcli train --help``
and the config reference page (``python -m tools.docgen``) both print these rows.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal, Union

from omegaconf import DictConfig, OmegaConf

from rlcli.conf import group_options, quiet_local_config_folder
from rlcli.conf.schema import TrainConfig
from rlcli.conf.targets import is_trusted, trusted_modules
from rlcli.conf.typecheck import Target, schema_fields, union_member
from rlcli.conf.validate import loss_class
from rlcli.modules.bounds import BOUNDS, bound_text, bounds_of

# the keys Hydra itself reads in a node it builds
HYDRA_KEYS = {
    "_target_": "the class or function that builds this object (from rlcli or a module of allow_targets)",
    "_recursive_": "false: the nested _target_ nodes (e.g. reward terms) reach the object unbuilt",
}
__all__ = ["HYDRA_KEYS", "Row", "compose", "group_options", "help_text", "option_doc", "rows"]

# groups whose options set other groups' keys (experiment) or Hydra's own (launcher): no keys of their own
NO_KEYS_OF_THEIR_OWN = ("experiment", "launcher")


@dataclass(frozen=True)
class Row:
    """A config key: its dotted path, type, default as written (``${...}`` unresolved, ``???``: required),
    bounds or choices, and description ("" where the code gives none)."""

    key: str
    type: str
    default: str
    limits: str
    doc: str


def option_doc(group: str, option: str) -> str:
    """The comment that opens ``rlcli/conf/<group>/<option>.yaml`` (``# @package`` lines left out), one line."""
    lines = []
    for line in (files("rlcli.conf") / group / f"{option}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def compose(overrides: Sequence[str] = (), *, with_hydra: bool = False) -> DictConfig:
    """The composed `rlcli train` config for ``overrides``, as ``--cfg job`` prints it (with Hydra's node
    too if ``with_hydra``); interpolations unresolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    quiet_local_config_folder()
    with initialize_config_module(config_module="rlcli.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)


def rows(cfg: DictConfig) -> list[Row]:
    """A row per key of the composed config ``cfg`` (outside ``hydra``), in its order; a mapping the
    schema describes key by key (``rollout.vllm``, a task, a group) gives a row per key inside it."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    out: list[Row] = []
    _walk(plain, TrainConfig, "", out, trusted_modules(cfg))
    return out


def _walk(node: dict, cls, prefix: str, out: list[Row], allowed: tuple[str, ...]) -> None:
    fields = schema_fields(cls)
    options = _loss_options(node, allowed) if getattr(cls, "other_keys", False) else {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key in fields:
            _field(value, *fields[key], path, out, allowed)
        elif key in options:
            out.append(_leaf(path, value, *options[key]))
        elif key in HYDRA_KEYS:
            out.append(Row(path, type(value).__name__, _text(value), "", HYDRA_KEYS[key]))
        else:
            out.append(Row(path, "", _text(value), "", ""))


def _loss_options(node: dict, allowed: tuple[str, ...]) -> dict[str, tuple[Any, dict]]:
    """``{option: (annotation, metadata)}`` of the loss class the ``loss`` node names (none if it names none)."""
    cls = loss_class(node, allowed, [])
    return schema_fields(cls) if cls is not None else {}


def _field(value, hint, meta: dict, path: str, out: list[Row], allowed: tuple[str, ...]) -> None:
    members = [m for m in _members(hint) if m is not type(None)]
    groups = [m for m in members if dataclasses.is_dataclass(m)]
    if groups and isinstance(value, dict):
        cls = groups[0] if len(groups) == 1 else union_member(value, groups)
        if cls is not None:
            _walk(value, cls, f"{path}.", out, allowed)
            return
    if members == [Target] and isinstance(value, dict):
        _target_rows(value, path, out, allowed)
    elif "keys" in meta and isinstance(value, dict):
        for key, item in value.items():
            out.append(Row(f"{path}.{key}", "", _text(item), "", meta["keys"].get(key, "")))
    else:
        out.append(_leaf(path, value, hint, meta))


def _target_rows(node: dict, path: str, out: list[Row], allowed: tuple[str, ...]) -> None:
    """The keys of a node that builds an object: its ``_target_``'s keywords, described by the class's
    ``OPTION_DOCS``, and the keys of a mapping keyword by its ``OPTION_KEYS`` (imported only from a trusted
    module)."""
    docs, keys, hints = {}, {}, {}
    target = node.get("_target_")
    if isinstance(target, str) and is_trusted(target, allowed):
        from hydra.utils import get_object

        try:
            built = get_object(target)
            docs = getattr(built, "OPTION_DOCS", {})
            keys = getattr(built, "OPTION_KEYS", {})
            hints = typing.get_type_hints(built.__init__ if isinstance(built, type) else built)
        except Exception:  # an unimportable target: the run reports it; here its keys go undescribed
            pass
    for key, value in node.items():
        if key in HYDRA_KEYS:
            out.append(Row(f"{path}.{key}", type(value).__name__, _text(value), "", HYDRA_KEYS[key]))
        else:
            out.append(_leaf(f"{path}.{key}", value, hints.get(key, Any), {"doc": docs.get(key, "")}))
            if key in keys and isinstance(value, dict):
                out += [Row(f"{path}.{key}.{k}", "", _text(v), "", keys[key].get(k, "")) for k, v in value.items()]


def _leaf(path: str, value, hint, meta: dict) -> Row:
    return Row(path, type_text(hint), _text(value), limits_text(hint, meta), meta.get("doc", ""))


def _text(value) -> str:
    """A value as the YAML writes it: null, true, [a, b], ${interpolation} as is."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    if value == "":
        return '""'
    return str(value)


def _members(hint) -> list:
    """The members of a Union (``X | Y`` too), or ``[hint]``."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return list(typing.get_args(hint))
    return [hint]


def type_text(hint) -> str:
    """``int``, ``float or null``, ``list of str``, ``list of 2 float``, ``int or str`` (``Literal`` values' type)."""
    if hint is Any:
        return "any"
    if hint is Target:
        return "_target_ node"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " or ".join(dict.fromkeys(type(a).__name__ for a in args))
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is tuple:
        return f"list of {len(args)} {type_text(args[0])}"
    members = _members(hint)
    if len(members) > 1:
        texts = [type_text(m) for m in members if m is not type(None)]
        text = " or ".join(dict.fromkeys(t for text in texts for t in text.split(" or ")))
        return text + (" or null" if type(None) in members else "")
    return getattr(hint, "__name__", str(hint))


def limits_text(hint, meta: dict) -> str:
    """The bounds (``>= 0``, ``[0, 1)``) and the choices (``one of a, b``) of a key."""
    parts = []
    bounds = bounds_of(meta)
    low = next((k for k in ("ge", "gt") if k in bounds), None)
    high = next((k for k in ("le", "lt") if k in bounds), None)
    if low and high:
        parts.append(f"{'[(' [low == 'gt']}{bound_text(bounds[low])}, {bound_text(bounds[high])}{'])'[high == 'lt']}")
    elif low or high:
        key = low or high
        parts.append(f"{BOUNDS[key][1]} {bound_text(bounds[key])}")
    choices = [a for m in _members(hint) if typing.get_origin(m) is Literal for a in typing.get_args(m)]
    if choices:
        parts.append("one of " + ", ".join(str(c) for c in choices))
    return "; ".join(parts)


def help_text(command: str, cfg: DictConfig) -> str:
    """``rlcli <command> --help``: the config groups, each with the option ``cfg`` (composed with its Hydra
    node) uses, and every key of ``cfg`` with its value as written, type, limits and description."""
    choices = cfg.hydra.runtime.choices if "hydra" in cfg else {}
    lines = [f"usage: rlcli {command} [KEY=VALUE | GROUP=OPTION | +KEY=VALUE ...] [--cfg job] [-m] [--hydra-help]",
             "",
             "Config groups (GROUP=OPTION):"]
    for group, options in group_options().items():
        chosen = f"  (this config: {choices[group]})" if choices.get(group) else ""
        lines.append(f"  {group}: {', '.join(options)}{chosen}")
    lines += ["", "Keys (KEY=VALUE; ??? must be set; `--cfg job` prints the composed config; the reference of "
              "every group option: docs/reference/config.md):"]
    for row in rows(cfg):
        what = ", ".join(part for part in (row.type, row.limits) if part)
        lines.append(f"  {row.key}={row.default}" + (f"  ({what})" if what else ""))
        if row.doc:
            lines.append(f"      {row.doc}")
    return "\n".join(lines) + "\n"
