"""The CUDA device's recipe for one row on a GPU that misbehaves, run on the CPU: NVML is pynvml with its device calls
faked (the real error classes), the timer a stand-in that runs the state protocol as time_gpu does, and torch.cuda
a stand-in; what is checked is what the row records."""

from __future__ import annotations

import math
import time
import types

import pytest

from kprof.measure import _nvml_access
from kprof.measure.gpu_timer import GpuTiming
from kprof.measure.stats import StopRule

pynvml = pytest.importorskip("pynvml")


class FakeGpu:
    """One H200 behind pynvml: `fail` maps a pynvml function's name to the NVML error code it raises from its
    `after`-th call on (0: always)."""

    def __init__(self, monkeypatch):
        self.fail: dict[str, tuple[int, int]] = {}
        self.calls: dict[str, int] = {}
        self.base, self.energy_w = time.perf_counter(), 300.0
        values = {
            "nvmlInit": lambda: None,
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda i: ("handle", i),
            "nvmlDeviceGetName": lambda h: "NVIDIA H200",
            "nvmlDeviceGetUUID": lambda h: "GPU-aaaa",
            "nvmlSystemGetDriverVersion": lambda: "580.159",
            "nvmlSystemGetCudaDriverVersion_v2": lambda: 13000,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
            "nvmlDeviceGetClockInfo": lambda h, c: 1980 if c == pynvml.NVML_CLOCK_SM else 2619,
            "nvmlDeviceGetMaxClockInfo": lambda h, c: 1980 if c == pynvml.NVML_CLOCK_SM else 2619,
            "nvmlDeviceGetTemperature": lambda h, s: 50,
            "nvmlDeviceGetPowerUsage": lambda h: 300_000,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0,
            "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: 0,
            "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=90, memory=10),
            # energy_w, stepping every 30 ms
            "nvmlDeviceGetTotalEnergyConsumption":
                lambda h: int(self.energy_w * math.floor((time.perf_counter() - self.base) / 0.03) * 30) + 10**9,
        }
        for name, fn in values.items():
            monkeypatch.setattr(pynvml, name, self._wrap(name, fn))
        monkeypatch.setattr(_nvml_access, "_init_pid", None)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def _wrap(self, name, fn):
        def call(*args):
            n = self.calls[name] = self.calls.get(name, 0) + 1
            code, after = self.fail.get(name, (None, 0))
            if code is not None and n > after:
                raise pynvml.NVMLError(code)
            return fn(*args)

        call.__name__ = name
        return call


class _Event:
    def record(self):
        pass

    def synchronize(self):
        pass


def fake_time_gpu(fn, rule, *, state=None, **kw):
    """time_gpu's use of the state protocol (settle, then a reading held per batch), samples of 10 µs."""
    if state is not None:
        state.settle(lambda chunk_s: None)
        for _ in range(4):
            state.hold(state.probe())
    notes = {"timer": "cupti", **(state.summary() if state is not None else {})}
    return GpuTiming([0.01] * 10, "converged", 3, 0.05, 1e-7, ("gemm",), 0, notes)


@pytest.fixture
def gpu(monkeypatch):
    from kprof.measure import _burst, gpu_timer

    monkeypatch.setattr(gpu_timer, "time_gpu", fake_time_gpu)
    monkeypatch.setattr(_burst, "burst", lambda fn, per_call, call_bytes=0.0: (fn, 1, "eager calls"))
    return FakeGpu(monkeypatch)


def device(energy_s: float = 0.0):
    """A CudaDevice over the fake GPU (made as __init__ makes it, past its torch checks)."""
    from kprof.measure.nvml import gpu_environment
    from kprof.runners.cuda_device import CudaDevice

    d = object.__new__(CudaDevice)
    d.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None, Event=_Event,
                                                               empty_cache=lambda: None))
    d.timer, d.cold, d.graph, d.power, d._heater = "cupti", False, False, "sustained", None
    d.energy_s, d.capped_sample_s = energy_s, (0.5, 3.0)
    d.env = gpu_environment()
    d.state_errors, d.start_notes, d._probe = {}, {}, None
    return d


def case():
    from kprof.runners._case import Case

    return Case(lambda: time.sleep(0.0005), lambda: None, flops=1e6, bytes=1e6)


RULE = StopRule(max_samples=10)


def test_an_nvml_refusal_in_one_row_is_not_reported_in_the_rows_after_it(gpu):
    """The state protocol's NVML errors were kept for the device's life: one Unknown Error from the SM clock in a
    row was written into the environment errors of every later row."""
    d = device()
    gpu.fail["nvmlDeviceGetClockInfo"] = (pynvml.NVML_ERROR_UNKNOWN, 3)
    *_, first, _ = d.measure(case(), RULE)
    assert first.errors["state.sm_mhz"] == "nvmlDeviceGetClockInfo: Unknown Error"
    gpu.fail.clear()
    *_, second, _ = d.measure(case(), RULE)
    assert not any(k.startswith(("state.", "telemetry.")) for k in second.errors), second.errors


def test_a_gpu_without_an_energy_counter_fails_the_row_as_a_crash_naming_the_way_round(gpu):
    """NVML's "Not Supported" from the energy counter read as the kernel being unsupported (error kind
    `unsupported`), and the message did not say that KPROF_ENERGY_S=0 measures without it."""
    from kprof.runners.worker import classify

    gpu.fail["nvmlDeviceGetTotalEnergyConsumption"] = (pynvml.NVML_ERROR_NOT_SUPPORTED, 0)
    with pytest.raises(Exception) as exc:
        device(energy_s=0.25).measure(case(), RULE)
    assert classify(exc.value) == "crash"
    assert "no NVML energy counter (Not Supported)" in str(exc.value) and "KPROF_ENERGY_S=0" in str(exc.value)


def test_an_energy_settle_without_an_sm_clock_notes_n_a_not_the_text_none(gpu):
    """NVML giving no SM clock made the energy settle's note read "None" (beside settled_sm_mhz "n/a"), a value no
    reader of the note takes for a missing clock."""
    gpu.fail["nvmlDeviceGetClockInfo"] = (pynvml.NVML_ERROR_NOT_SUPPORTED, 0)
    d = device(energy_s=0.25)
    d.capped_sample_s = (0.5, 0.5)
    _stats, method, _energy, _env, _ = d.measure(case(), RULE)
    assert method.notes["energy_settled_sm_mhz"] == "n/a" == method.notes["settled_sm_mhz"]


def test_a_rows_telemetry_is_of_its_work_not_of_the_cooldown_before_it(gpu, monkeypatch):
    """A GPU hotter than the protocol's start temperature is left idle until it cools; the sampler ran through that
    wait, so the row's environment (the clocks and reasons "seen while the work ran") was the idle GPU's."""
    d, cooled = device(), math.inf

    def hot():
        return time.perf_counter() < cooled

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", gpu._wrap("temp", lambda h, s: 85 if hot() else 50))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetClockInfo", gpu._wrap(
        "clock", lambda h, c: (345 if hot() else 1980) if c == pynvml.NVML_CLOCK_SM else 2619))
    cooled = time.perf_counter() + 0.8
    _stats, method, _energy, env, _ = d.measure(case(), RULE)
    assert float(method.notes["cooldown_s"]) > 0 and method.notes["start_temp_c"] == "85.0"
    assert env.clocks["sm_mhz_min"] == 1980


def test_a_stuck_energy_counter_fails_the_row_rather_than_storing_an_energy(gpu):
    gpu.energy_w = 0.0
    with pytest.raises(Exception, match="did not advance.*KPROF_ENERGY_S=0") as exc:
        device(energy_s=0.25).measure(case(), RULE)
    from kprof.runners.worker import classify

    assert classify(exc.value) == "crash"


def test_a_gpu_nvml_cannot_open_is_refused_before_any_spec(gpu, monkeypatch):
    """NVML refusing the device (Insufficient Permissions) made the device anyway, and every spec then failed in
    turn on the telemetry's NvmlError, each a failed row; the device is refused up front (exit 2, nothing written)."""
    import msgspec
    import torch

    from kprof.errors import UsageError
    from kprof.runners.cuda_device import CudaDevice
    from kprof.runners.registry import lookup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(CudaDevice, "_wake", lambda self: pytest.fail("woke a device NVML cannot read"))
    entry = lookup("single_gemm", "torch")
    contract = msgspec.structs.replace(entry.contract, timing="events;l2=cold;eager")
    entry = msgspec.structs.replace(entry, contract=contract)
    gpu.fail["nvmlDeviceGetHandleByIndex"] = (pynvml.NVML_ERROR_NO_PERMISSION, 0)
    with pytest.raises(UsageError, match="NVML cannot read CUDA device 0 .*Insufficient Permissions"):
        CudaDevice(entry, "NVIDIA H200", None)


def test_an_energy_counter_nvml_refuses_is_not_called_missing(gpu):
    """Insufficient Permissions on the energy counter read "has no NVML energy counter; energy_j needs Volta or
    newer", a wrong cause on an H200."""
    gpu.fail["nvmlDeviceGetTotalEnergyConsumption"] = (pynvml.NVML_ERROR_NO_PERMISSION, 0)
    with pytest.raises(Exception) as exc:
        device(energy_s=0.25).measure(case(), RULE)
    message = str(exc.value)
    assert "could not read the energy counter of CUDA device 0 (Insufficient Permissions)" in message
    assert "Volta" not in message and "KPROF_ENERGY_S=0" in message


def test_a_worker_on_a_gpu_of_another_model_names_the_gpu_setting(gpu, monkeypatch):
    """KPROF_PROFILE_GPUS naming an A100 on a host whose device 0 (the key's) is an H200: the worker's refusal
    said only "omit gpu_name=", which the run was never given."""
    import msgspec
    import torch

    from kprof.errors import SettingError
    from kprof.runners.cuda_device import CudaDevice
    from kprof.runners.registry import lookup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    entry = lookup("single_gemm", "torch")
    with pytest.raises(SettingError, match="differs from CUDA device 0 .*A100.*KPROF_PROFILE_GPUS") as exc:
        CudaDevice(entry, "NVIDIA H200", None)
    assert exc.value.cli.endswith("or omit --gpu-name")
