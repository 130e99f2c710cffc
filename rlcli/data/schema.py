"""The rollout record (rollout-record.md): one document, and the rules that validate it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlcli.data.errors import RecordError
from rlcli.modules.bounds import FLOAT32_MAX  # 3.4028234663852886e+38, the largest float32

__all__ = ["FLOAT32_MAX", "FLOAT32_RANGE", "RecordError", "Rollout", "validate_record"]

# Log-probs and advantages become float32 tensors (`rlcli.data.packing`): a value beyond ±FLOAT32_MAX,
# finite here in float64, would be infinite there and turn a whole step's loss into ±inf or NaN.
FLOAT32_RANGE = f"outside the float32 range ±{FLOAT32_MAX!r} that training computes in"


@dataclass(frozen=True)
class Rollout:
    """One validated document: a prompt and one sampled completion.

    ``old_logprobs``, ``advantages`` and ``completion_mask`` hold one value per completion token.
    ``advantages`` is ``None`` until an advantage estimator fills it from ``reward``.
    ``ref_logprobs`` are a reference policy's log-probs when the record carries them;
    ``proximal_logprobs`` are the trainer's own at the start of a batch, when it computes them, and
    ``teacher_logprobs`` a distillation teacher's (`rlcli.training.distill`).
    ``source`` is where the record came from (``"a.jsonl:12"``, 1-based line, or
    ``"b.parquet:row 3"``, 0-based row); ``index`` is its position among the dataset's documents.
    A record read from a stream also has its own ``id`` and the ``policy_version`` that sampled it.
    ``rejected``: ``correction.mode=reject`` took every labelled token of it out of ``completion_mask``, so it
    is in no step total (math.md#mismatch-correction).
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantages: tuple[float, ...] | None
    reward: float | None
    group_id: str | int | None
    completion_mask: tuple[int, ...]
    temperature: float | None
    source: str
    index: int
    ref_logprobs: tuple[float, ...] | None = None
    proximal_logprobs: tuple[float, ...] | None = None
    teacher_logprobs: tuple[float, ...] | None = None
    id: str | None = None
    policy_version: int | None = None
    rejected: bool = False

    @property
    def name(self) -> str:
        """What ``documents.jsonl`` calls it: its ``id`` if it has one, else its ``source``."""
        return self.source if self.id is None else self.id

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_labelled(self) -> int:
        """Completion tokens that are trained on (``completion_mask == 1``)."""
        return sum(self.completion_mask)

    def with_advantages(self, values: Sequence[float]) -> Rollout:
        """A copy with ``advantages`` set to ``values`` (one per completion token)."""
        if len(values) != len(self.completion_ids):
            raise ValueError(
                f"{self.source}: {len(values)} advantages for {len(self.completion_ids)} completion tokens"
            )
        return dataclasses.replace(self, advantages=tuple(float(v) for v in values))


class _Invalid(Exception):
    """A broken rule inside one record; ``validate_record`` adds the source."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason


def validate_record(
    raw: Mapping[str, Any],
    *,
    source: str,
    index: int,
    vocab_size: int | None,
    max_tokens: int | None = None,
) -> Rollout:
    """Check one raw record against every rule of rollout-record.md and return it as a ``Rollout``.

    Fields are checked in table order and the first broken rule raises ``RecordError``. A field
    set to ``null`` counts as absent (Parquet writes ``null`` where a row lacks a column).
    Log-probs and advantages must be finite in float32, the dtype they are trained in; ``reward``
    and ``temperature`` in float64, which they are used in.
    Unknown extra fields are allowed and ignored: samplers write their own bookkeeping.
    A scalar ``advantage`` is expanded to every completion token; a missing
    ``completion_mask`` means every completion token is trained on. With ``max_tokens``, a
    document longer than that is rejected: a document is never split. Without ``vocab_size``
    (no model at hand, e.g. ``rlcli data check``) token ids are only checked to be >= 0.
    """
    try:
        return _parse(raw, source=source, index=index, vocab_size=vocab_size, max_tokens=max_tokens)
    except _Invalid as err:
        raise RecordError(source, err.field, err.reason) from None


def _parse(
    raw: Mapping[str, Any], *, source: str, index: int, vocab_size: int | None, max_tokens: int | None
) -> Rollout:
    if not isinstance(raw, Mapping):
        raise _Invalid(None, f"expected an object with the rollout fields, got {_describe(raw)}")
    prompt_ids = _token_ids(raw, "prompt_ids", vocab_size)
    completion_ids = _token_ids(raw, "completion_ids", vocab_size)
    length = len(completion_ids)
    old_logprobs = _logprobs(_required(raw, "old_logprobs"), "old_logprobs", length)
    advantages = _advantages(raw, length)
    reward = _optional_number(raw, "reward")
    if advantages is None and reward is None:
        raise _Invalid("reward", "missing: a record needs 'advantage', 'advantages' or 'reward'")
    group_id = _group_id(raw)
    completion_mask = _completion_mask(raw, length)
    temperature = _optional_number(raw, "temperature")
    if temperature is not None and temperature <= 0:
        raise _Invalid("temperature", f"is {temperature}, must be > 0")
    ref_logprobs = None if raw.get("ref_logprobs") is None else _logprobs(raw["ref_logprobs"], "ref_logprobs", length)
    num_tokens = len(prompt_ids) + length
    if max_tokens is not None and num_tokens > max_tokens:
        raise _Invalid(
            "completion_ids",
            f"prompt + completion is {num_tokens} tokens, more than data.max_tokens={max_tokens} "
            "(a document is never split or truncated)",
        )
    return Rollout(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        old_logprobs=old_logprobs,
        advantages=advantages,
        reward=reward,
        group_id=group_id,
        completion_mask=completion_mask,
        temperature=temperature,
        source=source,
        index=index,
        ref_logprobs=ref_logprobs,
    )


def _required(raw: Mapping[str, Any], field: str) -> Any:
    value = raw.get(field)
    if value is None:
        raise _Invalid(field, "is null (required)" if field in raw else "missing (required)")
    return value


def _list(value: Any, field: str, of: str) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise _Invalid(field, f"expected a list of {of}, got {_describe(value)}")
    return value


def _token_ids(raw: Mapping[str, Any], field: str, vocab_size: int | None) -> tuple[int, ...]:
    values = _list(_required(raw, field), field, "token ids")
    if not values:
        raise _Invalid(field, "is empty, at least 1 token is required")
    for i, value in enumerate(values):
        if not _is_int(value):
            raise _Invalid(field, f"element {i} is {_describe(value)}, expected an int token id")
        if value < 0:
            raise _Invalid(field, f"element {i} is {value}, token ids must be >= 0")
        if vocab_size is not None and value >= vocab_size:
            raise _Invalid(field, f"element {i} is {value}, outside the vocabulary [0, {vocab_size})")
    return tuple(values)


def _numbers(value: Any, field: str, length: int) -> tuple[float, ...]:
    values = _list(value, field, "numbers")
    if len(values) != length:
        raise _Invalid(field, f"has {len(values)} values but completion_ids has {length}")
    return tuple(_float32(v, field, f"element {i}") for i, v in enumerate(values))


def _logprobs(value: Any, field: str, length: int) -> tuple[float, ...]:
    values = _numbers(value, field, length)
    for i, v in enumerate(values):
        if v > 0:
            raise _Invalid(field, f"element {i} is {v}, a log-probability must be <= 0")
    return values


def _finite(value: Any, field: str, what: str) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            pass
    if number is None or not math.isfinite(number):
        raise _Invalid(field, f"{what} is {_describe(value)}, expected a finite number")
    return number


def _float32(value: Any, field: str, what: str) -> float:
    number = _finite(value, field, what)
    if abs(number) > FLOAT32_MAX:
        raise _Invalid(field, f"{what} is {number!r}, {FLOAT32_RANGE}")
    return number


def _optional_number(raw: Mapping[str, Any], field: str) -> float | None:
    value = raw.get(field)
    return None if value is None else _finite(value, field, "value")


def _advantages(raw: Mapping[str, Any], length: int) -> tuple[float, ...] | None:
    scalar, per_token = raw.get("advantage"), raw.get("advantages")
    if scalar is not None and per_token is not None:
        raise _Invalid("advantage", "both 'advantage' and 'advantages' are given, give only one")
    if scalar is not None:
        return (_float32(scalar, "advantage", "value"),) * length
    if per_token is not None:
        return _numbers(per_token, "advantages", length)
    return None


def _group_id(raw: Mapping[str, Any]) -> str | int | None:
    value = raw.get("group_id")
    if value is not None and not (isinstance(value, str) or _is_int(value)):
        raise _Invalid("group_id", f"is {_describe(value)}, expected a string or an int")
    return value


def _completion_mask(raw: Mapping[str, Any], length: int) -> tuple[int, ...]:
    value = raw.get("completion_mask")
    if value is None:
        return (1,) * length
    values = _list(value, "completion_mask", "0/1 values")
    if len(values) != length:
        raise _Invalid("completion_mask", f"has {len(values)} values but completion_ids has {length}")
    for i, v in enumerate(values):
        # true/false are accepted too: Parquet writers often store a mask as booleans.
        if not (isinstance(v, bool) or (_is_int(v) and v in (0, 1))):
            raise _Invalid("completion_mask", f"element {i} is {_describe(v)}, expected 0 or 1")
    return tuple(int(v) for v in values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_KINDS = {
    bool: "a boolean",
    int: "an int",
    float: "a float",
    str: "a string",
    list: "a list",
    dict: "an object",
}


def _describe(value: Any) -> str:
    """A short description of a JSON value for error messages, e.g. ``3.0 (a float)``."""
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({_KINDS.get(type(value), type(value).__name__)})"
