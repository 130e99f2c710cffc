"""Faults injected into `rlcli train` runs through the config's ``callbacks`` list (test code only): the
one place the tests' faults live.

A test run adds e.g. ``callbacks_override("NanLossAt", step=2, rank=1)``, that is ``allow_targets=[fault_injection]
'callbacks=[{_target_: fault_injection.NanLossAt, step: 2, rank: 1}]'``, with this folder on ``PYTHONPATH``
(`FAULTS_ENV` in the run's environment).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import lightning as L
import torch

FAULTS_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}


def callbacks_override(target: str, **arguments) -> list[str]:
    """The overrides that add the callback ``fault_injection.<target>(**arguments)`` to a run; the arguments
    are numbers, strings or lists of them (written as Python literals, which Hydra reads alike)."""
    fields = ", ".join([f"_target_: fault_injection.{target}", *(f"{k}: {v!r}" for k, v in arguments.items())])
    return ["allow_targets=[fault_injection]", f"callbacks=[{{{fields}}}]"]


class NanLossAt(L.Callback):
    """Rank ``rank``'s loss (and so its gradient) is NaN in training step ``step``."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_start(self, trainer, pl_module) -> None:
        def poison(scorer, inputs, output):
            if pl_module.steps_done + 1 == self.step and pl_module.global_rank == self.rank:
                loss, partials = output
                return loss * math.nan, partials
            return output

        pl_module.scorer.register_forward_hook(poison)


class NanParametersAt(L.Callback):
    """Rank ``rank`` writes NaN into the first element it holds of every parameter (its local shards
    under FSDP2) after the optimizer update of training step ``step``, or before training with ``step=0``."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def poison(self, pl_module) -> None:
        if pl_module.steps_done == self.step and pl_module.global_rank == self.rank:
            held = (p.to_local() if hasattr(p, "to_local") else p for p in pl_module.scorer.parameters())
            with torch.no_grad():
                for tensor in held:
                    if tensor.numel():
                        tensor.view(-1)[0] = math.nan

    def on_train_start(self, trainer, pl_module) -> None:
        self.poison(pl_module)
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.poison(pl_module))


class KillDuringSave(L.Callback):
    """Every process dies once the checkpoint of training step ``step`` is written under its
    temporary name, before it is renamed: what a kill in the middle of a save leaves behind."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer, pl_module) -> None:
        save = trainer.save_checkpoint

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            if pl_module.steps_done == self.step:
                os._exit(137)

        trainer.save_checkpoint = save_then_die


class KillBeforeAcknowledge(L.Callback):
    """The process dies once the checkpoint of step ``step`` is durable, before the source acknowledges
    the records it holds (``data=stream``): the window where only the resumed run can acknowledge them."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer, pl_module) -> None:
        durable = pl_module.checkpoint_durable

        def die_first():
            if pl_module.steps_done == self.step:
                os._exit(137)
            durable()

        pl_module.checkpoint_durable = die_first


class EndsLate(L.Callback):
    """Rank ``rank`` ends ``seconds`` late: after its last collective it sleeps, then writes
    ``ended-<rank>`` into the run directory."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def teardown(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)
            (Path(trainer.default_root_dir) / f"ended-{self.rank}").touch()


class WaitForFile(L.Callback):
    """Every rank waits after training step ``steps[i]`` until the file ``paths[i]`` exists (at most 10 minutes),
    so that a test can signal the run at known steps: a signal sent in a wait after step s stops it after s + 1."""

    def __init__(self, steps: list[int], paths: list[str]) -> None:
        self.waits = dict(zip(steps, map(Path, paths), strict=True))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        path = self.waits.get(pl_module.steps_done)
        deadline = time.monotonic() + 600
        while path is not None and not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
