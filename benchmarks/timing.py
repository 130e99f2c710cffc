"""Timing several ways of doing the same work in turns, so that a change in the machine's load shows in all."""

from __future__ import annotations

from collections.abc import Callable

import torch


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device`` to finish its queued work: `torch.cuda.synchronize` on a GPU, nothing on a CPU
    (the ``sync`` of `time_in_turns`)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def time_in_turns(steps: dict[str, Callable[[], None]], repeats: int, clock, sync, *,
                  warm_up: bool = True) -> dict[str, list[float]]:
    """Each step's ``repeats`` times by ``clock`` (after a warm-up run of each, unless ``warm_up`` is false),
    the steps run one after the other in every round; ``sync`` waits for the device after each run."""
    if warm_up:
        for fn in steps.values():
            fn()
            sync()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            start = clock()
            fn()
            sync()
            times[name].append(clock() - start)
    return times
