"""Check a config node against a schema of dataclasses, and build the typed instances of a valid one.

Generic: nothing here knows rlcli's groups. A schema is a dataclass whose field annotations are
``bool``/``int``/``float``/``str``, ``Literal[...]``, ``Optional``, ``list[...]``, ``tuple[...]`` (a
list of exactly that many items), ``Union[int, Literal[...]]``, nested dataclasses, a ``Union`` of
dataclasses told apart by a ``Literal``-typed ``name`` or ``kind`` field, `Target` and ``Any``.
Each key's one-line description (``doc``) and numeric bounds live in its field's metadata
(`described`); a `built` field is no key: its builder makes it from the node. A dataclass with
``other_keys = True`` takes keys besides its fields, which its owner checks. Each problem is a line
``"key.path: what is wrong"``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlcli.modules.bounds import BOUNDS, INT64, bound_text, bounds_of

DISCRIMINATORS = ("name", "kind")


class Target(dict):
    """The type of a node that builds an object: ``_target_`` (a class or function of a trusted module,
    see ``allow_targets``) and its arguments."""


def described(doc: str, **bounds) -> Any:
    """A config key's field: its one-line description (``rlcli train --help``, the config reference)
    and its numeric bounds, e.g. ``max_lag: int = described("the staleness bound, in versions", ge=0)``."""
    return dataclasses.field(metadata={"doc": doc, **bounds})


def built(builder: Callable[[DictConfig], Any]) -> Any:
    """A field that is no config key: ``builder(node)`` makes it from the group's node once it is valid."""
    return dataclasses.field(metadata={"built": builder})


def schema_fields(cls) -> dict[str, tuple[Any, dict]]:
    """``{key: (annotation, metadata)}`` of the config keys of a schema dataclass (built fields left out)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls) if not f.metadata.get("built")}


def describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check(node: DictConfig, cls, path: str = "", *, optional=(), others=frozenset()) -> list[str]:
    """The problems of ``node`` as the schema dataclass ``cls``: keys in ``optional`` may be left out,
    keys in ``others`` are checked elsewhere, any other key is unknown."""
    problems: list[str] = []
    if getattr(cls, "other_keys", False):
        others = frozenset(node.keys())
    _check_fields(node, schema_fields(cls), path, problems, optional, others)
    return problems


def _discriminator(cls) -> tuple[str, tuple]:
    """The Literal-typed ``name`` or ``kind`` field that tells the members of a Union of dataclasses
    apart, and its values."""
    hints = typing.get_type_hints(cls)
    key = next(k for k in DISCRIMINATORS if k in hints)
    return key, typing.get_args(hints[key])


def union_member(node, members) -> Any:
    """The member of a Union of dataclasses that ``node``'s discriminator names, or None."""
    key, _ = _discriminator(members[0])
    return next((cls for cls in members if node.get(key) in _discriminator(cls)[1]), None)


def _check_fields(node: DictConfig, fields: dict, path: str, problems: list[str], optional, others) -> None:
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


def _check_dataclass(node, cls, path: str, problems: list[str]) -> None:
    if not isinstance(node, DictConfig):
        problems.append(f"{path}: expected a config group, got {describe(node)}")
    else:
        problems += check(node, cls, path)


def _check_union(node, members, path: str, problems: list[str]) -> None:
    if not isinstance(node, DictConfig):
        problems.append(f"{path}: expected a config group, got {describe(node)}")
        return
    cls = union_member(node, members)
    if cls is not None:
        problems += check(node, cls, path)
        return
    key, _ = _discriminator(members[0])
    options = [opt for cls in members for opt in _discriminator(cls)[1]]
    problems.append(f"{path}.{key}: must be one of {options}, got {node.get(key)!r}")


def _check_bounds(value, meta: dict, path: str, problems: list[str]) -> None:
    for name, bound in bounds_of(meta).items():
        holds, symbol = BOUNDS[name]
        if not holds(value, bound):
            problems.append(f"{path}: must be {symbol} {bound_text(bound)}, "
                            f"got {value!r}")


def _check_value(value, annotation, path: str, problems: list[str], meta=None) -> None:
    if annotation is Any:
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union:
        _check_union_value(value, args, path, problems, meta)
    elif origin is Literal:
        if value not in args:
            problems.append(f"{path}: must be one of {list(args)}, got {value!r}")
    elif origin in (list, tuple):
        _check_list(value, origin, args, path, problems, meta)
    elif dataclasses.is_dataclass(annotation):
        _check_dataclass(value, annotation, path, problems)
    elif annotation is Target:
        if not (isinstance(value, DictConfig) and isinstance(value.get("_target_"), str)):
            problems.append(f"{path}: expected a _target_ and its arguments ({{_target_: ..., ...}}), "
                            f"got {describe(value)}")
    else:
        _check_scalar(value, annotation, path, problems, meta)


def _check_union_value(value, args, path: str, problems: list[str], meta) -> None:
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
        found: list[str] = []
        _check_value(value, member, path, found, meta)
        if not found:
            return
        reasons += [problem.removeprefix(f"{path}: ") for problem in found]
    problems.append(f"{path}: {' or '.join(reasons)}")


def _check_list(value, origin, args, path: str, problems: list[str], meta) -> None:
    """A tuple is a list of as many items; the field's bounds hold for each item."""
    if not isinstance(value, ListConfig):
        problems.append(f"{path}: expected a list, got {describe(value)}")
        return
    if origin is tuple and len(value) != len(args):
        problems.append(f"{path}: expected a list of {len(args)} items, got {len(value)}: {list(value)!r}")
        return
    for i, (item, hint) in enumerate(zip(value, args if origin is tuple else args * len(value))):
        _check_value(item, hint, f"{path}[{i}]", problems, meta)


def _check_scalar(value, annotation, path: str, problems: list[str], meta) -> None:
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
        problems.append(f"{path}: expected {annotation.__name__}, got {describe(value)}")
    elif meta:
        _check_bounds(value, meta, path, problems)


def typed(node, annotation):
    """The checked ``node`` as an instance of ``annotation`` (dataclasses, lists and plain values)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if node is None:
        return None
    if origin is Union:
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return typed(node, members[0])
        if not all(dataclasses.is_dataclass(m) for m in members):
            return node  # a plain value, e.g. Union[int, Literal["auto"]]
        annotation = union_member(node, members)
    if origin is list:
        return [typed(item, args[0]) for item in node]
    if origin is tuple:
        return tuple(typed(item, hint) for item, hint in zip(node, args))
    if dataclasses.is_dataclass(annotation):
        values = {name: typed(node.get(name), hint) for name, (hint, _) in schema_fields(annotation).items()}
        values |= {f.name: f.metadata["built"](node) for f in dataclasses.fields(annotation) if f.metadata.get("built")}
        return annotation(**values)
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    if annotation is float:
        return float(node)  # a float key given as an int (betas=[0,0]): torch takes floats only
    return node
