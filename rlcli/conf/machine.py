"""Config rules that depend on this machine: the GPUs torch can use and the optional packages installed.

Checked with every other rule (`rlcli.conf.rules`), so that a run that cannot start here is told
so before anything is built. A run on other machines (a Slurm job) checks them where it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcli.conf.schema import TrainerConfig

# the least memory one sampler process takes (Python, torch and the tiny default model; a larger model takes more)
SAMPLER_MEMORY = 2**29


def gpus() -> tuple[str | None, int]:
    """The GPUs Lightning's ``accelerator=gpu`` picks here: ``("mps", 1)`` on Apple silicon, else
    ``("cuda", count)``, or ``(None, 0)`` without any. Asked of torch, as Lightning does, without
    importing Lightning (seconds a config error need not wait)."""
    import torch

    if torch.backends.mps.is_available():
        return "mps", 1
    count = torch.cuda.device_count()
    return ("cuda", count) if count else (None, 0)


def machine_problems(trainer: TrainerConfig, strategy, model) -> Iterator[str]:
    """A ``"key: what is wrong"`` line for each thing the typed ``trainer``, ``strategy`` and ``model``
    groups ask of this machine that it lacks."""
    kind, count = gpus()
    accelerator = trainer.accelerator
    on_gpu = count > 0 and accelerator in ("auto", "gpu")
    on_cuda = on_gpu and kind == "cuda"
    if accelerator == "gpu" and count == 0:
        yield ("trainer.accelerator: gpu, but torch finds no GPU on this machine "
               "(torch.cuda.is_available() is False); use trainer.accelerator=cpu or auto")
    devices = trainer.devices
    if on_gpu and devices > count:
        yield f"trainer.devices: {devices} processes need a GPU each, this machine has {count}"
    elif not on_gpu and devices > (os.cpu_count() or 1):
        yield f"trainer.devices: {devices} processes on CPU, more than the {os.cpu_count()} cores of this machine"
    if strategy.name == "fsdp" and not on_cuda:
        yield "strategy: fsdp needs CUDA GPUs; on CPU use strategy=fsdp2 (FSDP2 over gloo)"
    if getattr(strategy, "process_group_backend", None) == "nccl" and not on_cuda:  # auto has none
        yield "strategy.process_group_backend: nccl connects CUDA GPUs; on CPU use gloo (or null)"
    if model.attn_implementation == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            yield ("model.attn_implementation: flash_attention_2 needs the flash_attn package (>= 2.3.3) "
                   "and a CUDA GPU, which this machine lacks; use sdpa or varlen")
        elif not on_cuda:
            yield ("model.attn_implementation: flash_attention_2 runs on GPUs only, not with "
                   f"trainer.accelerator={accelerator}; use sdpa or varlen")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory that new processes can have without swapping (Linux's MemAvailable); None elsewhere."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)


def sampler_problems(workers: int) -> Iterator[str]:
    """A ``"sample.workers: ..."`` line when ``workers`` sampler processes are more than this machine's cores
    or memory can run (`SAMPLER_MEMORY` each at least)."""
    if workers > cores():
        yield f"sample.workers: {workers} sampler processes, more than the {cores()} cores this process may use"
        return
    memory = available_memory()
    if memory is not None and workers * SAMPLER_MEMORY > memory:
        yield (f"sample.workers: {workers} sampler processes need at least {workers * SAMPLER_MEMORY / 2**30:.1f} GiB "
               f"of memory ({SAMPLER_MEMORY / 2**30:g} GiB each), more than the {memory / 2**30:.1f} GiB available")
