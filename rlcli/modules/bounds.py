"""Numeric bounds of options, kept in dataclass field metadata (keys ``ge``/``gt``/``le``/``lt``).

The library checks them with `check_bounds`, the config's type check (`rlcli.conf.typecheck`) reads the
same metadata. The loss terms compute in float32 at least, so a number they compute with has to be a
float32 number: past `FLOAT32_MAX` it turns into inf (or torch refuses it as a bound), and a divisor
below `FLOAT32_TINY` loses its precision and then flushes to 0.
"""

from __future__ import annotations

import math
import operator
import typing
from dataclasses import fields
from numbers import Real

import torch

# field metadata key -> (test, how a message spells it)
BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32
INT64 = torch.iinfo(torch.int64)  # the integers torch, numpy and Lightning take

# the LM head and the sampler divide float32 logits by the temperature
TEMPERATURE = {"ge": FLOAT32_TINY, "le": FLOAT32_MAX}


def describe(bounds: dict[str, float]) -> str:
    """``{"ge": 0, "lt": 1}`` -> ``"a number in [0, 1)"``; ``{"ge": 0}`` -> ``"a finite number >= 0"``."""
    low = next((key for key in ("ge", "gt") if key in bounds), None)
    high = next((key for key in ("le", "lt") if key in bounds), None)
    if low and high:
        return f"a number in {'[(' [low == 'gt']}{bounds[low]:g}, {bounds[high]:g}{'])'[high == 'lt']}"
    return "a finite number " + " and ".join(f"{BOUNDS[key][1]} {bound:g}" for key, bound in bounds.items())


def within(value, bounds: dict[str, float]) -> bool:
    """Whether ``value`` is a finite real number (not a bool) within ``bounds``."""
    return (isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
            and all(BOUNDS[key][0](value, bound) for key, bound in bounds.items()))


def check_value(name: str, value, bounds: dict[str, float]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number within ``bounds``."""
    if not within(value, bounds):
        raise ValueError(f"{name} must be {describe(bounds)}; got {value!r}")


def bounds_of(meta) -> dict[str, float]:
    """The numeric bounds (``ge``/``gt``/``le``/``lt``) among a field's metadata ``meta``."""
    return {key: meta[key] for key in BOUNDS if key in meta}


def bound_text(bound: float) -> str:
    """A bound as messages and docs write it: an integer as is, a float in ``%g``."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def check_bounds(options) -> None:
    """Raise ``ValueError`` naming the first field of the dataclass instance ``options`` that is not a
    finite number within the bounds of its metadata. Fields without bounds are not checked, nor None in
    an ``Optional`` field (an option that is off)."""
    for f in fields(options):
        bounds = bounds_of(f.metadata)
        value = getattr(options, f.name)
        if bounds and not (value is None and _optional(type(options), f.name)):
            check_value(f.name, value, bounds)


def _optional(cls, name: str) -> bool:
    """Whether the field ``name`` of the dataclass ``cls`` is annotated ``Optional[...]``."""
    return type(None) in typing.get_args(typing.get_type_hints(cls)[name])
