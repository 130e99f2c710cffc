"""`sample.workers` of `rlcli loop` is bounded by this machine's cores and memory (issue 32, item 13:
``sample.workers=100000`` exhausted the machine's memory). Before the fix any number was accepted."""

from __future__ import annotations

import os

import psutil
import pytest

from rlcli.conf import machine
from rlcli.conf.validate import ConfigError, validate_config
from train_helpers import compose_train_config

CORES = len(os.sched_getaffinity(0))


def loop_problems(workers: int) -> list[str]:
    try:
        validate_config(compose_train_config(["data=stream", f"sample.workers={workers}"]), command="loop")
    except ConfigError as err:
        return err.problems
    return []


@pytest.mark.parametrize("workers", [CORES + 1, 100_000])
def test_more_samplers_than_cores_is_a_config_error(workers):
    assert loop_problems(workers) == [f"sample.workers: {workers} sampler processes, more than the {CORES} cores "
                                      "this process may use"]


def test_as_many_samplers_as_cores_are_accepted_and_other_commands_are_not_bounded():
    assert loop_problems(CORES) == []
    # rlcli sample is one sampler: sample.workers counts those of every machine
    validate_config(compose_train_config(["data=stream", "data.url=redis://h:1/0", "sample.workers=100000"]),
                    command="sample")


def test_more_samplers_than_the_memory_holds_is_a_config_error(monkeypatch):
    """The machine's memory is set to hold one sampler less than the cores allow (at least one sampler)."""
    workers = max(CORES, 2)
    monkeypatch.setattr(machine, "cores", lambda: workers)
    monkeypatch.setattr(machine, "available_memory", lambda: (workers - 1) * 2**29 + 2**20)
    [problem] = loop_problems(workers)
    assert problem.startswith(f"sample.workers: {workers} sampler processes need at least {workers * 0.5:.1f} GiB")
    assert loop_problems(workers - 1) == []


def test_the_available_memory_is_the_systems():
    """Linux's MemAvailable, as psutil reads it too (within what other processes take meanwhile)."""
    assert machine.available_memory() == pytest.approx(psutil.virtual_memory().available, rel=0.1)
