"""The measure diagnostic's checks and failures on this machine's CUDA device 0, with torch.cuda, CUPTI, NVML and the
window faked (no GPU needed)."""

import types

import pytest
import torch

from kprof.measure.diagnostic import DiagnosticError
from kprof.runners import diagnose
from kprof.runners.registry import lookup


def test_an_oom_while_the_window_runs_is_one_line_not_a_traceback(monkeypatch):
    """A CUDA OOM (or CUDA error) inside the window escaped `kprof measure` as a traceback; a failure to build or
    check the kernel was already one line."""
    from kprof.measure import _diagnostic_window, gpu_timer, nvml
    from kprof.measure.records import DeviceEnvironment
    from kprof.runners._entry import Entry

    def window(case, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 240.00 MiB")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(gpu_timer, "cupti_available", lambda: None)
    monkeypatch.setattr(nvml, "gpu_environment", lambda i: DeviceEnvironment())
    monkeypatch.setattr(Entry, "make_runner", lambda self: types.SimpleNamespace(
        build=lambda spec, device: types.SimpleNamespace(check=lambda: None)))
    monkeypatch.setattr(_diagnostic_window, "record_window", window)
    spec = {"m": 8, "n": 8, "k": 8, "dtype": "bf16"}
    with pytest.raises(DiagnosticError, match="could not be measured on NVIDIA H200: OutOfMemoryError: CUDA out"):
        diagnose.record(lookup("single_gemm", "torch"), spec, "NVIDIA H200", 1.0, 0.0, True, False)
