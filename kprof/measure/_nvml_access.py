"""NVML access for kprof.measure: the initialised pynvml module, device handles by CUDA ordinal, and the
readers the telemetry sampler, the state protocol and the energy method use. Public through
`kprof.measure.nvml`; this module imports nothing else of kprof.measure but the state's reading type."""

from __future__ import annotations

import os
import threading
from typing import Callable

from ..errors import KprofError
from ._state import StateReading
from .device_name import parse_visible_devices, resolve_visible

__all__ = ["NvmlError", "device_handle", "state_probe"]

Reading = tuple  # (sm_mhz, mem_mhz, power_w, temp_c, util_pct, reasons): a TelemetrySample without `t`


class NvmlError(KprofError):
    """NVML is not usable here (no library, no driver, no such device) or a query it needs failed."""


# --- NVML access ----------------------------------------------------------------------------------------

_init_lock = threading.Lock()
_init_pid: int | None = None  # NVML is initialised once per process (again in a forked child)


def _nvml():
    """The pynvml module, initialised. Raises NvmlError when the package, library or driver is missing."""
    global _init_pid
    try:
        import pynvml
    except ImportError as e:
        raise NvmlError("pynvml is not importable; pip install 'nvidia-ml-py>=12' (kprof's [measure] extra)") from e
    with _init_lock:
        if _init_pid != os.getpid():
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                raise NvmlError(f"NVML did not start ({e}); this host needs an NVIDIA GPU with its driver "
                                f"loaded") from e
            _init_pid = os.getpid()
    return pynvml


def _visible(nv) -> list[int]:
    entries = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    count = nv.nvmlDeviceGetCount()
    uuids: list[str] = []
    if entries and any(isinstance(e, str) for e in entries):
        uuids = [nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    return resolve_visible(entries, count, uuids)


def device_handle(index: int = 0):
    """The NVML handle of CUDA device `index` (a CUDA ordinal, after CUDA_VISIBLE_DEVICES)."""
    nv = _nvml()
    try:
        visible = _visible(nv)
        if not 0 <= index < len(visible):
            raise NvmlError(f"CUDA device {index} is not visible: {len(visible)} device(s) visible with "
                            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}; pass an index "
                            f"below {len(visible)} or widen CUDA_VISIBLE_DEVICES")
        return nv.nvmlDeviceGetHandleByIndex(visible[index])
    except nv.NVMLError as e:
        raise NvmlError(f"NVML could not open CUDA device {index}: {e}") from e


def _div(x, d):
    return None if x is None else x / d


def _reasons_reader(nv, h, errors: dict[str, str]) -> Callable[[], int | None]:
    """Reads the clock-event reasons; drivers before 535 only have the older Throttle name of the call, and so do
    nvidia-ml-py releases before 12.535 (no attribute of the newer name)."""
    newer = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
    calls = [c for c in (newer, nv.nvmlDeviceGetCurrentClocksThrottleReasons) if c is not None]

    def read() -> int | None:
        while calls:
            try:
                return calls[0](h)
            except nv.NVMLError as e:
                if e.value == nv.NVML_ERROR_FUNCTION_NOT_FOUND and len(calls) > 1:
                    calls.pop(0)
                    continue
                errors.setdefault("clock_event_reasons", f"{calls[0].__name__}: {e}")
                return None
        return None

    return read


# --- NVML readers for the sampler and the energy counter ------------------------------------------------

def _asker(nv, errors: dict[str, str]) -> Callable:
    """ask(key, fn, *args): fn(*args), or None with NVML's refusal kept in errors[key] (first one only)."""

    def ask(key: str, fn, *args):
        try:
            return fn(*args)
        except nv.NVMLError as e:
            errors.setdefault(key, f"{fn.__name__}: {e}")
            return None

    return ask


def _nvml_reading(index: int, errors: dict[str, str]) -> Callable[[], Reading]:
    nv = _nvml()
    h = device_handle(index)
    reasons = _reasons_reader(nv, h, errors)
    ask = _asker(nv, errors)

    def read() -> Reading:
        util = ask("util_pct", nv.nvmlDeviceGetUtilizationRates, h)
        return (ask("sm_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                ask("mem_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
                _div(ask("power_w", nv.nvmlDeviceGetPowerUsage, h), 1000),
                ask("temp_c", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                None if util is None else util.gpu,
                reasons())

    return read


def state_probe(index: int, errors: dict[str, str]) -> Callable[[], StateReading]:
    """A reader of what the thermal and power protocol holds a row to (`kprof.measure._state`): SM clock,
    power, temperature and clock-event reasons of CUDA device `index`. A field NVML cannot give is None, and
    why is in `errors`."""
    nv = _nvml()
    h = device_handle(index)
    reasons = _reasons_reader(nv, h, errors)
    ask = _asker(nv, errors)

    def read() -> StateReading:
        return StateReading(ask("sm_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                            _div(ask("power_w", nv.nvmlDeviceGetPowerUsage, h), 1000),
                            ask("temp_c", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                            reasons())

    return read


def _energy_counter(index: int) -> Callable[[], int]:
    nv = _nvml()
    h = device_handle(index)
    try:
        nv.nvmlDeviceGetTotalEnergyConsumption(h)
    except nv.NVMLError as e:
        if e.value == nv.NVML_ERROR_NOT_SUPPORTED:
            raise NvmlError(f"CUDA device {index} has no NVML energy counter ({e}); energy_j needs Volta or "
                            f"newer") from e
        raise NvmlError(f"NVML could not read the energy counter of CUDA device {index} ({e})") from e
    return lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h)
