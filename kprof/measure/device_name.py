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

__all__ = ["visible_gpus", "local_gpu_name"]

_PROC = "/proc/driver/nvidia/gpus"


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
    chosen = env.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return [name for name, _ in gpus]
    names = []
    for item in (part.strip() for part in chosen.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit():
            index = int(item)
            if not 0 <= index < len(gpus):
                break  # CUDA stops at the first invalid entry
            names.append(gpus[index][0])
        else:
            match = [name for name, uuid in gpus if uuid and (uuid == item or uuid.startswith(item))]
            if len(match) != 1:
                break
            names.append(match[0])
    return names


def local_gpu_name() -> str | None:
    """The model name of CUDA device 0 of this process, or None when no GPU is visible."""
    names = visible_gpus()
    return names[0] if names else None
