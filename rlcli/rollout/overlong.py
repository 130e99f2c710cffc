"""DAPO's overlong shaping of sampled completions (math.md#overlong-shaping): the overlong reward
``R_len`` (``reward.overlong_buffer``, ``reward.overlong_penalty``) and the masking of truncated
completions (``rollout.mask_truncated``). `rlcli.rollout.onpolicy.OnPolicyRollouts` applies both, for
the trainer's own sampling and for ``rlcli sample``'s alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["NO_SHAPING", "Overlong", "overlong_reward"]


def overlong_reward(length: int, max_new_tokens: int, buffer: int) -> float:
    """``R_len``: 0 up to ``max_new_tokens - buffer`` tokens, then falling linearly to -1 at
    ``max_new_tokens``, and -1 beyond it."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_new_tokens:
        return (start - length) / buffer
    return -1.0


@dataclass(frozen=True)
class Overlong:
    """What to do with long completions: ``buffer`` (``L_c``; None: no overlong reward) and ``penalty``
    (``p``) of the overlong reward, and whether truncated completions are dropped (``mask_truncated``)."""

    buffer: int | None = None
    penalty: float = 1.0
    mask_truncated: bool = False

    def __post_init__(self) -> None:
        if self.buffer is not None and self.buffer < 1:
            raise ValueError(f"overlong buffer must be >= 1, got {self.buffer}")
        if self.penalty < 0:
            raise ValueError(f"overlong penalty must be >= 0, got {self.penalty}")

    @classmethod
    def of(cls, reward: Any, rollout: Any) -> Overlong:
        """The shaping the ``reward`` and ``rollout`` config groups ask for."""
        return cls(reward.overlong_buffer, reward.overlong_penalty, rollout.mask_truncated)


NO_SHAPING = Overlong()
