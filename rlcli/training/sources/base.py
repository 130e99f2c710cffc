"""The interfaces of step sources and of the data kinds that make them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from rlcli.modules.registry import Registry
from rlcli.training.collect import CollectedBatch

if TYPE_CHECKING:
    from rlcli.conf.schema import TrainConfig


class StepSource(ABC):
    """One rank's supply of batches. ``next_batch`` returns this rank's micro-batches of the next batch
    (an empty batch on every rank ends the run); a batch makes one or more training steps (optimizer
    updates, `rlcli.training.batches`). ``state_dict``/``load_state_dict`` hold what a checkpoint needs
    to continue exactly; ``after_update(step)`` is called on every rank after each training step
    (``step`` counts them as ``metrics.csv`` does: the policy's version), and ``checkpoint_durable()``
    once the checkpoint of the latest ``state_dict`` is safely on disk; ``interrupt()`` when a signal
    stops the run. A source whose ``ends_when_empty`` is False never runs out: an empty batch on every
    rank is a step with nothing to train on."""

    ends_when_empty: ClassVar[bool] = True

    @abstractmethod
    def next_batch(self, index: int, device: torch.device) -> CollectedBatch:
        """This rank's micro-batches of the next batch; ``index`` batches came before it."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (a ``state_dict`` of the same kind of source); nothing to restore here."""
        return None

    def after_update(self, step: int) -> None:
        """Nothing to do after a step unless the source says otherwise."""
        return None

    def checkpoint_durable(self) -> None:
        """Nothing to confirm to anyone unless the source says otherwise."""
        return None

    def interrupt(self) -> None:
        """A signal asked the run to stop (called from the signal handler): a source that waits for
        data stops waiting and ends the batch with what it has. Nothing to do for one that never waits."""
        return None


class DataKind(ABC):
    """A value of ``data.kind``: its config rules and how it makes step sources."""

    groups: ClassVar[tuple[str, ...]] = ()  # top-level config groups it reads besides `data`
    checks_read: ClassVar[tuple[str, ...]] = ()  # the top-level keys `check_config` reads besides `data`

    @staticmethod
    def check_config(cfg: TrainConfig, command: str) -> list[str]:
        """A ``"key: what is wrong"`` line for each rule of this kind that the typed ``cfg`` of a training
        ``command`` (`rlcli.conf.rules.TRAINING`) breaks; called once ``checks_read`` are valid. A kind
        without rules of its own has none."""
        return []

    def __init__(self, cfg: TrainConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir

    @property
    @abstractmethod
    def default_vocab_size(self) -> int:
        """The vocabulary of a tiny model whose ``model.vocab_size`` is null."""

    @abstractmethod
    def source_factory(self, policy: torch.nn.Module) -> Callable[[int, int], StepSource]:
        """``(rank, world_size) -> StepSource``, called on each rank once its process group exists."""


DATA_KINDS: Registry[type[DataKind]] = Registry("data kind")
"""The data kinds by ``data.kind``: a `DataKind` class registered with ``@DATA_KINDS.register(kind)``."""
