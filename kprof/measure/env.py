"""Environment fingerprints. What cannot be collected is recorded in `errors`, never raised."""

from __future__ import annotations

import os
import platform
import socket

from .. import __version__
from .records import DeviceEnvironment

__all__ = ["cpu_model", "cpu_environment", "torch_version"]


def cpu_model() -> str:
    """The CPU's model name: the GPU key of CPU-backend rows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def torch_version() -> str | None:
    """The version of the torch this process imports; None where it has none."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def cpu_environment() -> DeviceEnvironment:
    import torch

    errors = {"energy": "no energy counter on the CPU backend; energy_j is null"}
    return DeviceEnvironment(gpu_name=cpu_model(), gpu_uuid="", driver="", cuda="", torch=str(torch.__version__), cupti="",
                       python=platform.python_version(), kprof=__version__, host=socket.gethostname(),
                       clocks={"threads": float(torch.get_num_threads()), "cpus": float(os.cpu_count() or 0)},
                       errors=errors)
