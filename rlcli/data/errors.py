"""Errors raised while reading rollout data."""

from __future__ import annotations

from rlcli.errors import UserError


class DataError(UserError):
    """A user-facing data problem: the CLI prints the message and exits with code 2, no traceback."""


class RecordError(ValueError):
    """One record breaks a rule of the rollout schema (rollout-record.md).

    ``field`` is ``None`` when the problem is not tied to one field (e.g. a malformed JSON line).
    """

    def __init__(self, source: str, field: str | None, reason: str) -> None:
        self.source = source
        self.field = field
        self.reason = reason
        super().__init__(source, field, reason)

    def __str__(self) -> str:
        return format_problem(self.source, self.field, self.reason)


def format_problem(source: str, field: str | None, reason: str) -> str:
    """``"a.jsonl:3: field 'reward': reason"``, or ``"a.jsonl:3: reason"`` without a field."""
    if field is None:
        return f"{source}: {reason}"
    return f"{source}: field '{field}': {reason}"
