"""Back-to-back calls with no launch gaps, for energy: a CUDA graph of several calls, replayed.

Energy per call is the mean power over a window times the window over the calls. Launched one by one from
Python, a short kernel leaves the GPU idle between calls (~10-20 µs of host time for a ~5 µs kernel), and
that idle power lands in every call's energy: a decode GEMM read 16 % apart between a 0.2 s and a 5 s
window, each with its own host pace. Replaying a graph of calls keeps the GPU busy, so the energy is the
kernels' own.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["burst"]

_WARMUP = 3  # eager calls on a side stream before capture, as torch.cuda.graphs asks


def burst(fn: Callable[[], object], per_call_s: float, *, target_s: float = 0.002, max_calls: int = 256,
          max_bytes: float = 2 ** 30, call_bytes: float = 0.0) -> tuple[Callable[[], object], int, str]:
    """(replay, calls per replay, how): a graph of about target_s of calls of `fn` (at least 1, at most
    max_calls, and no more than max_bytes of outputs at call_bytes each), or (fn, 1, why) where `fn`
    cannot be captured."""
    import torch

    calls = max(1, min(max_calls, round(target_s / max(per_call_s, 1e-7))))
    if call_bytes > 0:
        calls = max(1, min(calls, int(max_bytes // call_bytes)))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a callable a graph cannot hold is timed eagerly, and says so
        torch.cuda.synchronize()
        return fn, 1, f"eager calls (graph capture failed: {type(e).__name__}: {str(e)[:200]})"
    return graph.replay, calls, f"CUDA graph of {calls} calls, replayed"
