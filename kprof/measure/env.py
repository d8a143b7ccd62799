"""Environment fingerprints. What cannot be collected is recorded in `errors`, never raised."""

from __future__ import annotations

import os
import platform
import socket

from .. import __version__
from .records import DeviceEnvironment

__all__ = ["cpu_model", "cpu_environment", "torch_version", "host_notes"]


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


def host_notes(before: float, taken: list[str] = (), threads: int = 0) -> dict[str, str]:
    """A CPU row's notes on its host: the load average (the larger of `before` the row and now) as host_load_1m, and
    host_busy where it passed the cores or `taken` names other signs of other work taking them (its switches). A
    row's own `threads` are in the load (each runnable one counts 1: 8 on 2 cores took a quiet host's load from 0.9
    to 5.9 over a minute's rows), so a row of more threads than cores is busy where the load passes its threads."""
    load, cores = max(before, os.getloadavg()[0]), os.cpu_count() or 1
    busy = [f"load {load:.2f} over {cores} cores"] * (load > max(cores, threads)) + list(taken)
    notes = {"host_load_1m": f"{load:.2f}"}
    if busy:
        notes["host_busy"] = f"{'; '.join(busy)}: other work shared them"
    return notes
