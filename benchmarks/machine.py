"""Names of the machine a benchmark measured, for its table."""

from __future__ import annotations

import os
import platform

import torch


def cpu_name() -> str:
    """The CPU model and the number of CPUs."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def device_name(device: str | torch.device) -> str:
    """The GPU's name for a CUDA device, else the CPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return cpu_name()
