"""The window of `kprof measure` on this machine's CUDA device 0: the checks of what the machine must have (CUDA in
torch, the GPU named, CUPTI, NVML where telemetry is sampled), the kernel built and checked, then the window
recorded (`kprof.measure._diagnostic_window`). torch is imported when a window is recorded."""

from __future__ import annotations

from ..errors import KprofError, UsageError
from .registry import Entry

__all__ = ["record"]


def record(entry: Entry, canonical: dict, gpu_key: str, duration_s: float, telemetry_hz: float, clear_l2: bool,
           graph: bool):
    """(window, device environment) measured on CUDA device 0. UsageError for what this machine lacks (CUDA in
    torch, CUPTI, NVML); DiagnosticError when the kernel cannot be built, checked or run."""
    import msgspec
    import torch

    from ..measure.diagnostic import DiagnosticError
    from ..measure.gpu_timer import cupti_available
    from ..measure.nvml import NvmlError, device_handle, gpu_environment

    if not torch.cuda.is_available():
        raise UsageError(f"measure needs a CUDA device and torch {torch.__version__} sees none; run it on a GPU "
                         f"machine with a CUDA build of torch")
    torch.cuda.set_device(0)
    actual = torch.cuda.get_device_name(0)
    if actual != gpu_key:
        raise UsageError(f"CUDA device 0 is {actual!r}, not {gpu_key!r}; set CUDA_VISIBLE_DEVICES to the GPU to "
                         f"measure")
    why = cupti_available()
    if why:
        raise UsageError(f"CUPTI is not usable here ({why}); measure records every launch with CUPTI: install "
                         f"cupti-python with nvidia-cuda-cupti")
    if telemetry_hz > 0:
        try:
            device_handle(0)
        except NvmlError as e:
            raise UsageError(f"measure samples NVML telemetry, and NVML is not usable here: {e}") from None
    device = msgspec.to_builtins(gpu_environment(0))
    try:
        case = entry.make_runner().build(msgspec.convert(canonical, entry.args), "cuda")
        case.check()
    except KprofError:
        raise
    except Exception as e:  # an OOM, a kernel the device lacks: one line, nothing written
        raise DiagnosticError(f"{entry.table}/{entry.backend} {canonical} could not be built or checked on "
                              f"{gpu_key}: {type(e).__name__}: {str(e)[:500]}; nothing was written") from e
    from ..measure._diagnostic_window import record_window

    try:
        window = record_window(case, duration_s=duration_s, telemetry_hz=telemetry_hz, clear_l2=clear_l2, graph=graph)
    except KprofError:
        raise
    except Exception as e:  # an OOM or a CUDA error while the window ran: one line, nothing written
        raise DiagnosticError(f"{entry.table}/{entry.backend} {canonical} could not be measured on {gpu_key}: "
                              f"{type(e).__name__}: {str(e)[:500]}; nothing was written") from e
    return window, device
