"""NVML: the visible GPUs, the GPU environment, a telemetry sampler, energy per call, the idle guard's inventory.

pynvml (nvidia-ml-py) is imported inside functions only, so importing this module costs nothing on the
read path. Device indices are CUDA ordinals (torch's device 0, 1, ...), mapped onto NVML devices through
CUDA_VISIBLE_DEVICES. NVML numbers devices by PCI bus id; CUDA's default order (FASTEST_FIRST) agrees
on a host of identical GPUs, since it breaks ties by bus id. On a mixed host set
CUDA_DEVICE_ORDER=PCI_BUS_ID.

The sampler lives in `_nvml_telemetry` and the energy method in `_nvml_energy`; both are public here.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket

import msgspec

from .. import __version__
from .records import DeviceEnvironment
from ._nvml_access import NvmlError, _asker, _div, _nvml, _reasons_reader, _visible, device_handle, state_probe
from .device_name import parse_visible_devices, resolve_visible
from ._nvml_energy import (CounterPolls, EnergyResult, TickPoint, fit_power, measure_energy, settled_energy,
                           steady_points, tick_points)
from ._nvml_telemetry import REASON_BITS, Telemetry, TelemetrySample, decode_reasons, reasons_seen, summarize

__all__ = [
    "NvmlError",
    "parse_visible_devices",
    "resolve_visible",
    "device_handle",
    "gpu_names",
    "gpu_environment",
    "gpu_inventory",
    "gpu_topology",
    "GpuState",
    "REASON_BITS",
    "decode_reasons",
    "TelemetrySample",
    "Telemetry",
    "summarize",
    "reasons_seen",
    "with_telemetry",
    "state_probe",
    "EnergyResult",
    "TickPoint",
    "tick_points",
    "steady_points",
    "fit_power",
    "measure_energy",
    "settled_energy",
    "CounterPolls",
]


def gpu_names() -> list[str]:
    """Names of the CUDA-visible GPUs in ordinal order (e.g. ["NVIDIA H200"]), without importing torch.
    [] when there is no GPU, driver, NVML library or pynvml: never raises for "no GPU"."""
    try:
        nv = _nvml()
    except NvmlError:
        return []
    try:
        return [nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i)) for i in _visible(nv)]
    except nv.NVMLError:
        return []


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"  # NVML encodes 13.0 as 13000


def gpu_environment(index: int = 0) -> DeviceEnvironment:
    """The environment of CUDA device `index`. Whatever cannot be collected is named in `errors`, never raised.

    `cuda` is the CUDA runtime torch was built with, followed by the CUDA version the driver supports:
    "13.0 (driver 13.0)"; either part is left out when it cannot be read. `clocks` is a snapshot at the time of the call (an idle GPU reads idle clocks);
    `throttle` stays empty here: `with_telemetry` fills it from what was seen while the work ran.
    """
    errors: dict[str, str] = {}
    fields: dict = {"python": platform.python_version(), "kprof": __version__, "host": socket.gethostname()}
    runtime = ""
    try:
        import torch

        fields["torch"] = str(torch.__version__)
        runtime = torch.version.cuda or ""
        if not runtime:
            errors["cuda"] = f"torch {torch.__version__} was built without CUDA"
    except ImportError as e:
        errors["torch"] = f"torch is not importable: {e}"
    try:
        fields["cupti"] = importlib.metadata.version("cupti-python")
    except importlib.metadata.PackageNotFoundError:
        errors["cupti"] = "cupti-python is not installed (pip install cupti-python)"

    driver_cuda = ""
    clocks: dict[str, float] = {}
    try:
        nv = _nvml()
        h = device_handle(index)
    except NvmlError as e:
        errors["nvml"] = str(e)
    else:
        ask = _asker(nv, errors)
        fields["gpu_name"] = ask("gpu_name", nv.nvmlDeviceGetName, h) or ""
        fields["gpu_uuid"] = ask("gpu_uuid", nv.nvmlDeviceGetUUID, h) or ""
        fields["driver"] = ask("driver", nv.nvmlSystemGetDriverVersion) or ""
        v = ask("cuda_driver", nv.nvmlSystemGetCudaDriverVersion_v2)
        driver_cuda = _cuda_version(v) if v else ""
        limit = ask("power_limit", nv.nvmlDeviceGetEnforcedPowerLimit, h)
        if limit is None:  # the management limit is the configured one; the enforced one is what applies
            limit = ask("power_limit_configured", nv.nvmlDeviceGetPowerManagementLimit, h)
        fields["power_limit_w"] = limit / 1000 if limit is not None else None  # NVML reports mW
        snapshot = {
            "sm_mhz": ask("sm_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            "mem_mhz": ask("mem_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
            "sm_max_mhz": ask("sm_max_mhz", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
            "mem_max_mhz": ask("mem_max_mhz", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM),
            "temperature_c": ask("temperature_c", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            "power_w": _div(ask("power_w", nv.nvmlDeviceGetPowerUsage, h), 1000),
            "clock_event_reasons": _reasons_reader(nv, h, errors)(),
        }
        clocks = {k: float(v) for k, v in snapshot.items() if v is not None}
    fields["cuda"] = " ".join(filter(None, [runtime, f"(driver {driver_cuda})" if driver_cuda else ""]))
    return DeviceEnvironment(clocks=clocks, errors=errors, **fields)


def with_telemetry(env: DeviceEnvironment, telemetry: Telemetry) -> DeviceEnvironment:
    """`env` with the clocks and throttle reasons seen during the work (the measured regime, not a snapshot)."""
    s = telemetry.summary()
    seen = {k: s[k] for k in ("sm_mhz_min", "sm_mhz_median", "sm_mhz_max", "mem_mhz_median", "power_w_mean",
                              "temp_c_max") if s[k] is not None}
    errors = dict(env.errors)
    errors.update({f"telemetry.{k}": v for k, v in telemetry.errors.items()})
    return msgspec.structs.replace(env, clocks={**env.clocks, **{k: float(v) for k, v in seen.items()}},
                                   throttle=s["throttle"], errors=errors)


# --- idle GPUs ------------------------------------------------------------------------------------------

# The idle guard's thresholds: a GPU is idle with no compute process, at most this much memory in use (the
# driver's reserved memory excluded where it reports it; a bare H200 shows ~0.5 GiB used) and at most this
# utilization (NVML's last sample period, ~1 s). Processes in other containers may be invisible to NVML: the
# memory and utilization limits are what catch them.
IDLE_MAX_MEM_USED_MIB = 1024.0
IDLE_MAX_UTIL_PCT = 10.0


class GpuState(msgspec.Struct, frozen=True):
    """One visible GPU as the pool sees it: its CUDA ordinal, NVML identity, load, and why it is not idle."""

    ordinal: int
    uuid: str
    name: str
    processes: int
    used_mib: float
    util_pct: float
    busy: str = ""  # why the idle guard refuses it ("" when idle)

    @property
    def idle(self) -> bool:
        return not self.busy


def gpu_inventory(max_mem_used_mib: float = IDLE_MAX_MEM_USED_MIB, max_util: float = IDLE_MAX_UTIL_PCT
                  ) -> list[GpuState]:
    """Every visible GPU (CUDA ordinals, after CUDA_VISIBLE_DEVICES) with its load and the idle guard's verdict.
    Raises NvmlError without NVML. A GPU that cannot be queried is listed as busy, with the NVML error."""
    nv = _nvml()
    try:
        visible = _visible(nv)
    except nv.NVMLError as e:
        raise NvmlError(f"NVML could not list the GPUs: {e}") from e
    out = []
    for ordinal, nvml_index in enumerate(visible):
        uuid = name = ""
        try:
            h = nv.nvmlDeviceGetHandleByIndex(nvml_index)
            uuid, name = nv.nvmlDeviceGetUUID(h), nv.nvmlDeviceGetName(h)
            uuid, name = (x.decode() if isinstance(x, bytes) else x for x in (uuid, name))
            running = nv.nvmlDeviceGetComputeRunningProcesses(h)
            try:
                used = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2).used
            except nv.NVMLError:  # older drivers: v1 counts reserved memory as used
                used = nv.nvmlDeviceGetMemoryInfo(h).used
            util = nv.nvmlDeviceGetUtilizationRates(h).gpu
        except nv.NVMLError as e:
            out.append(GpuState(ordinal, uuid, name, 0, 0.0, 0.0, f"NVML could not query it ({e})"))
            continue
        # The calling process's own use is not another job's: a Python session that has used this GPU and then
        # calls run keeps it (its memory is not counted, nor the utilization its own kernels caused).
        own = [p for p in running if getattr(p, "pid", None) == os.getpid()]
        processes = len(running) - len(own)
        used -= sum(getattr(p, "usedGpuMemory", None) or 0 for p in own)
        used_mib = max(used, 0) / 2**20
        why = []
        if processes:
            why.append(f"{processes} compute process(es)")
        if used_mib > max_mem_used_mib:
            why.append(f"{used_mib:.0f} MiB in use > {max_mem_used_mib:.0f}")
        if util > max_util and not own:
            why.append(f"{util} % utilization > {max_util:.0f}")
        out.append(GpuState(ordinal, uuid, name, processes, used_mib, float(util), ", ".join(why)))
    return out


# --- topology --------------------------------------------------------------------------------------------

_PCIE_LEVELS = {0: "same board", 10: "PCIe switch", 20: "PCIe switches", 30: "PCIe host bridge", 40: "CPU (same NUMA node)",
           50: "CPU interconnect (across NUMA nodes)"}


def gpu_topology(n: int) -> tuple[str, str]:
    """For each pair of the first n CUDA devices: "NVLink" where NVML reports NVLink peer-to-peer, else the PCIe
    path (NVML's common ancestor); and each GPU's active NVLink count. ("", reason) without NVML."""
    try:
        nv = _nvml()
        handles = [device_handle(i) for i in range(n)]
        parts, why = [], []
        for i in range(n):
            for j in range(i + 1, n):
                try:
                    nvlink = nv.nvmlDeviceGetP2PStatus(handles[i], handles[j], nv.NVML_P2P_CAPS_INDEX_NVLINK) == \
                        nv.NVML_P2P_STATUS_OK
                    how = "NVLink" if nvlink else _PCIE_LEVELS.get(
                        int(nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])), "PCIe")
                except nv.NVMLError as e:
                    how, _ = "?", why.append(f"cuda:{i}-cuda:{j}: {e}")
                parts.append(f"cuda:{i}-cuda:{j} {how}")
        links = []
        for i, h in enumerate(handles):
            active = 0
            for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active += nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
                except nv.NVMLError:
                    break  # past the device's last link, or no NVLink
            links.append(f"cuda:{i} {active}")
        text = "; ".join(parts) + ("; " if parts else "") + "active NVLinks: " + ", ".join(links)
        return text, "; ".join(why)
    except Exception as e:  # noqa: BLE001 - best effort: recorded in the row's environment errors
        return "", f"{type(e).__name__}: {e}"
