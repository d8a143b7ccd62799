"""The name of the GPU a run would measure on, without importing torch or pynvml (the read path resolves
the GPU key with it, and must start fast on any machine).

The NVIDIA driver lists each GPU under /proc/driver/nvidia/gpus/<PCI bus id>/information ("Model:" and
"GPU UUID:" lines). CUDA_VISIBLE_DEVICES picks among them by index or by UUID; indices are taken in PCI
bus order, which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID and, on a machine of one GPU model,
names the same model either way. Without /proc, `nvidia-smi` answers the same question.
"""

from __future__ import annotations

import glob
import os
import subprocess
from typing import Sequence

__all__ = ["visible_gpus", "local_gpu_name", "parse_visible_devices", "resolve_visible"]

_PROC = "/proc/driver/nvidia/gpus"


def parse_visible_devices(value: str | None) -> list[int | str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: None when unset (every device), else the entries before the
    first invalid one (empty, negative, repeated, or neither an integer nor a `GPU-`/`MIG-` UUID)."""
    if value is None:
        return None
    out: list[int | str] = []
    for token in value.split(","):
        token = token.strip()
        if token.isdigit():
            entry: int | str = int(token)
        elif token[:4].upper() in ("GPU-", "MIG-") and len(token) > 4:
            entry = token
        else:
            break
        if entry in out:
            break
        out.append(entry)
    return out


def resolve_visible(entries: list[int | str] | None, count: int, uuids: Sequence[str] = ()) -> list[int]:
    """Indices, in the driver's (PCI bus) order that NVML and /proc share, of the CUDA-visible devices, in
    CUDA ordinal order. `count` is the driver's device count; `uuids` (same order) is needed only for UUID
    entries, which may be any unique prefix of a GPU's UUID.
    As in CUDA, an entry that names no device ends the list; MIG instances are not resolved (no energy or
    clock counters of their own) and end it too."""
    if entries is None:
        return list(range(count))
    out: list[int] = []
    for entry in entries:
        if isinstance(entry, int):
            index = entry if entry < count else None
        elif entry[:4].upper() == "GPU-":
            hits = [i for i, u in enumerate(uuids) if u.lower().startswith(entry.lower())]
            index = hits[0] if len(hits) == 1 else None
        else:
            index = None
        if index is None or index in out:
            break
        out.append(index)
    return out


def _proc_gpus(root: str = _PROC) -> list[tuple[str, str]]:
    """(model name, UUID) of every GPU the driver lists, in PCI bus order."""
    out = []
    for info in sorted(glob.glob(os.path.join(root, "*", "information"))):
        fields = {}
        try:
            with open(info) as f:
                for line in f:
                    name, _, value = line.partition(":")
                    fields[name.strip()] = value.strip()
        except OSError:
            continue
        if fields.get("Model"):
            out.append((fields["Model"], fields.get("GPU UUID", "")))
    return out


def _smi_gpus() -> list[tuple[str, str]]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    rows = [line.rsplit(",", 1) for line in done.stdout.strip().splitlines() if "," in line]
    return [(name.strip(), uuid.strip()) for name, uuid in rows]


def visible_gpus(root: str = _PROC, env: dict | None = None) -> list[str]:
    """Model names of the GPUs CUDA would number 0, 1, ... in this process."""
    env = os.environ if env is None else env
    gpus = _proc_gpus(root) if os.path.isdir(root) else []
    if not gpus and root == _PROC:
        gpus = _smi_gpus()
    chosen = resolve_visible(parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES")), len(gpus),
                             [uuid for _name, uuid in gpus])
    return [gpus[i][0] for i in chosen]


def local_gpu_name() -> str | None:
    """The model name of CUDA device 0 of this process, or None when no GPU is visible."""
    names = visible_gpus()
    return names[0] if names else None
