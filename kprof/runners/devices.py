"""Which devices a run may use on this host, and how a spec needing several is given a group of them.

- A CUDA backend uses every GPU the idle guard accepts (`kprof.measure.nvml.gpu_inventory`: no compute process,
  at most IDLE_MAX_MEM_USED_MIB in use, at most IDLE_MAX_UTIL_PCT utilization) whose name is the run's GPU key.
  `KPROF_PROFILE_GPUS=0,1` (alias `VIBESIM_PROFILE_GPUS`) forces the set, as CUDA ordinals of this process,
  and bypasses the guard: it will measure on top of another job, so use it for GPUs that are yours.
- A CPU backend has KPROF_CPU_WORKERS worker slots (default 1: timings on a CPU share its cores, so parallel
  workers slow each other; each times on its key's torch threads, every core by default (kprof.method.cpu_threads),
  so more slots are for tests, or with OMP_NUM_THREADS set to the cores over the slots).
- `KPROF_POOL=auto` (the default) measures in this process when the one usable device is its own (CUDA device 0,
  or one CPU slot) and no spec needs more: a worker's start costs seconds a call. `KPROF_POOL=off` measures in
  this process, on CUDA device 0 (or the CPU), without the guard: debugging a runner, or a plain run to compare
  the pool's rows with. `KPROF_POOL=on` uses spawned workers even for one device.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from ..errors import UsageError
from ..settings import env_alias, environ
from .registry import Entry

__all__ = ["Device", "Devices", "usable_devices", "need_of", "pool_mode", "cpu_workers", "groups"]


class Device(NamedTuple):
    label: str  # "gpu0" (the CUDA ordinal in this process) or "cpu0"
    visible: str | None  # the worker's CUDA_VISIBLE_DEVICES (a GPU UUID or ordinal); None for a CPU slot


class Devices(NamedTuple):
    devices: list[Device]
    forced: str | None  # the environment variable that forced the set, or None (the idle guard chose)
    skipped: list[dict]  # GPUs the guard refused: {gpu, uuid, name, why}
    guarded: bool = False  # the idle guard chose them

    def describe(self) -> dict:
        return {"devices": [d.label for d in self.devices], "forced_by": self.forced, "idle_guard": self.guarded,
                "skipped": self.skipped}


def pool_mode() -> str:
    raw = environ().get("KPROF_POOL", "")
    mode = raw.strip().lower() or "auto"  # read as KPROF_TIMER is: blank is unset, ` On` is on
    if mode not in ("auto", "on", "off"):
        raise UsageError(f"KPROF_POOL={raw!r} is not one of auto, on, off (off: measure in this process), or unset it")
    return mode


def cpu_workers() -> int:
    """KPROF_CPU_WORKERS: the worker slots of a CPU backend (default 1), from 1 to this machine's cores."""
    raw = environ().get("KPROF_CPU_WORKERS", "")
    cores = os.cpu_count() or 1
    if not raw.strip():  # blank is unset, as for every numeric setting
        return 1
    if not raw.strip().isdecimal() or not 1 <= int(raw) <= cores:  # isdigit() takes "²", which int() refuses
        raise UsageError(f"KPROF_CPU_WORKERS={raw!r} is not a whole number from 1 to this machine's {cores} "
                         f"core(s); e.g. KPROF_CPU_WORKERS={min(2, cores)}")
    return int(raw)


def need_of(entry: Entry, spec: dict) -> int:
    """Devices one spec needs: the spec's `gpus_arg` field (a collective's world size) where the entry names one,
    else the entry's `gpus`. CPU slots are not counted: a CPU spec needs one."""
    if entry.device != "cuda":
        return 1
    return int(spec[entry.gpus_arg]) if entry.gpus_arg else entry.gpus


def _forced_var() -> str | None:
    return env_alias("KPROF_PROFILE_GPUS", "VIBESIM_PROFILE_GPUS")  # both set and differing: refused


def _parse_forced(name: str) -> list[int]:
    raw = environ()[name]
    try:
        ordinals = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        ordinals = []
    if not ordinals or any(o < 0 for o in ordinals) or len(set(ordinals)) != len(ordinals):
        raise UsageError(f"{name}={raw!r} is not a list of distinct CUDA ordinals; e.g. {name}=0,1")
    return ordinals


def usable_devices(entry: Entry, gpu_key: str) -> Devices:
    """The devices a run of `entry` may use on this host (see the module docstring)."""
    if entry.device != "cuda":
        return Devices([Device(f"cpu{i}", None) for i in range(cpu_workers())], None, [])
    from ..measure.nvml import NvmlError, gpu_inventory

    forced = _forced_var()
    try:
        inventory = gpu_inventory()
    except NvmlError as e:
        if forced is None:
            raise UsageError(f"the idle guard needs NVML to find idle GPUs ({e}); set KPROF_PROFILE_GPUS=0 to name "
                             f"the GPUs to use yourself, or KPROF_POOL=off to measure on CUDA device 0") from None
        inventory = None
    if forced is not None:
        ordinals = _parse_forced(forced)
        if inventory is not None:
            beyond = [o for o in ordinals if o >= len(inventory)]
            if beyond:
                raise UsageError(f"{forced}={environ()[forced]!r} names GPU {beyond[0]}, but this process sees "
                                 f"{len(inventory)} GPU(s) (ordinals 0-{len(inventory) - 1})")
            return Devices([Device(f"gpu{o}", inventory[o].uuid or str(o)) for o in ordinals], forced, [])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        parts = [p.strip() for p in visible.split(",")] if visible else None
        return Devices([Device(f"gpu{o}", parts[o] if parts and o < len(parts) else str(o)) for o in ordinals],
                       forced, [])
    devices, skipped = [], []
    for g in inventory:
        why = g.busy or (f"a {g.name}, not a {gpu_key}" if g.name and g.name != gpu_key else "")
        if why:
            skipped.append({"gpu": f"gpu{g.ordinal}", "uuid": g.uuid, "name": g.name, "why": why})
        else:
            devices.append(Device(f"gpu{g.ordinal}", g.uuid or str(g.ordinal)))
    return Devices(devices, None, skipped, True)


def groups(devices: list[Device], n: int) -> list[Device]:
    """The devices as groups of `n` (a spec needing n GPUs runs on one group): one Device per group, its label the
    members' joined by '+', its CUDA_VISIBLE_DEVICES theirs joined by ','. Devices left over sit the level out."""
    if n == 1:
        return list(devices)
    out = []
    for g in range(len(devices) // n):
        members = devices[g * n:(g + 1) * n]
        out.append(Device("+".join(d.label for d in members), ",".join(d.visible or "" for d in members)))
    return out
