"""The one registry idiom of rlcli: a name → implementation table filled by a decorator.

Every table that a config value picks from (losses, aggregations, KL estimators, advantage
estimators, rewards, data kinds, samplers, optimizers, strategies) is a `Registry`. Adding an
entry is one decorated function or class; the config's choices (``names()``) and the error that
lists them come from the registry. Plain Python: `rlcli.modules` stays free of other rlcli imports.

    ESTIMATORS = Registry("advantage estimator")

    @ESTIMATORS.register("rloo")
    def rloo(rewards, *, eps): ...

    ESTIMATORS["rloo"]      # the function; an unknown name is a KeyError naming the choices
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name no entry of a registry has; the message lists the registered ones."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    """Names of one ``kind`` of thing and the implementation registered under each, in order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator: register the function or class under ``name`` (default: its ``name`` attribute).
        A name taken by another entry is a ``ValueError``; registering the same entry again is a no-op."""

        def add(entry: T) -> T:
            key = name if name is not None else getattr(entry, "name", None)
            if not isinstance(key, str) or not key:
                raise ValueError(f"a {self.kind} needs a name: register({entry!r}) without one")
            taken = self._entries.get(key)
            if taken is not None and taken is not entry:
                raise ValueError(f"{self.kind} name {key!r} is taken by {getattr(taken, '__qualname__', taken)!r}")
            self._entries[key] = entry
            return entry

        return add

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __getitem__(self, name: str) -> T:
        if not isinstance(name, str) or name not in self._entries:
            raise UnknownName(f"unknown {self.kind} {name!r}; expected one of: {', '.join(self._entries)}")
        return self._entries[name]

    def get(self, name: str, default: T | None = None) -> T | None:
        return self._entries.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self):
        return self._entries.items()

    def values(self):
        return self._entries.values()

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
