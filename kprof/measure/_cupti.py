"""CUPTI activity collection through cupti-python (`from cupti import cupti`), imported only when used.

One `Session` at a time enables CONCURRENT_KERNEL and MEMCPY (never the KERNEL kind, which serializes every kernel on
the GPU) plus EXTERNAL_CORRELATION, RUNTIME and DRIVER: external correlation records exist only for traced
API calls, and cuBLAS launches through the driver API, so both API layers are traced. The records are copied
into plain tuples inside the buffer-completed callback; no record object outlives it (they point into
CUPTI's buffer, and a binding built for another libcupti can misread fields it was not asked for).

Binding names used (cupti-python 13.x, checked against its cupti.pyi and docstrings):
activity_register_callbacks(func_buffer_requested, func_buffer_completed), activity_enable/disable(kind),
activity_flush_all(flag), activity_get_num_dropped_records(context, stream_id, dropped: address of a size_t),
activity_push_external_correlation_id(kind, id), activity_pop_external_correlation_id(kind) -> id,
get_timestamp(), ActivityKind, ActivityFlag.FLUSH_FORCED, ExternalCorrelationKind.CUSTOM2.
"""

from __future__ import annotations

import threading
from typing import Iterable

from ._attribution import Kernel, TimerError

__all__ = ["load", "copy_records", "Session"]

_BUFFER_BYTES = 8 << 20  # per CUPTI buffer; CUPTI asks for more buffers as they fill

_lock = threading.Lock()
_sink: dict[str, list] = {"kernels": [], "correlations": [], "errors": []}
# (CONCURRENT_KERNEL, EXTERNAL_CORRELATION, MEMCPY) as ints, set by Session
_kinds: tuple[int, int, int] = (-1, -1, -1)
_active = False
_registered = False


def load():
    """The cupti-python binding module; raises ImportError (or the binding's own error) when unusable."""
    from cupti import cupti

    return cupti


def copy_records(activities: Iterable, kernel_kind: int, external_kind: int, memcpy_kind: int = -1
                 ) -> tuple[list[Kernel], list[tuple[int, int]]]:
    """Copy the fields kprof needs out of CUPTI activity records into plain tuples: kernels as
    (name, start, end, correlation_id), external correlations as (correlation_id, external_id). Other kinds
    (the runtime and driver API records) are skipped."""
    kernels: list[Kernel] = []
    correlations: list[tuple[int, int]] = []
    for a in activities:
        kind = int(a.kind)
        if kind == kernel_kind:
            kernels.append((str(a.name), int(a.start), int(a.end), int(a.correlation_id)))
        elif kind == memcpy_kind:  # a copy engine's transfer (cudaMemcpyAsync) is GPU work of its call too
            kernels.append((f"[memcpy {int(getattr(a, 'copy_kind', 0))}]", int(a.start), int(a.end),
                            int(a.correlation_id)))
        elif kind == external_kind:
            correlations.append((int(a.correlation_id), int(a.external_id)))
    return kernels, correlations


def _buffer_requested():
    return _BUFFER_BYTES, 0  # (size, max records): 0 = as many as fit


def _buffer_completed(activities) -> None:
    # Runs on CUPTI's thread or inside activity_flush_all. An exception escaping here would be lost (or turn
    # into an unraisable-exception warning), so it is kept and raised by the next collect().
    try:
        kernels, correlations = copy_records(activities, *_kinds)
    except Exception as e:  # noqa: BLE001 - reported by Session.collect
        with _lock:
            _sink["errors"].append(f"{type(e).__name__}: {e}")
        return
    with _lock:
        _sink["kernels"].extend(kernels)
        _sink["correlations"].extend(correlations)


def _drain() -> tuple[list[Kernel], list[tuple[int, int]], list[str]]:
    with _lock:
        out = _sink["kernels"], _sink["correlations"], _sink["errors"]
        _sink["kernels"], _sink["correlations"], _sink["errors"] = [], [], []
    return out


class Session:
    """Activity collection for one time_gpu call: `with Session() as s:` ... `s.collect()`."""

    def __init__(self):
        self.cupti = load()
        k = self.cupti.ActivityKind
        self._enable = (k.CONCURRENT_KERNEL, k.MEMCPY, k.EXTERNAL_CORRELATION, k.RUNTIME, k.DRIVER)
        # CUSTOM0 and CUSTOM1 are what PyTorch's profiler (Kineto) pushes; CUSTOM2 keeps clear of them.
        self._ext_kind = self.cupti.ExternalCorrelationKind.CUSTOM2
        self._forced = int(self.cupti.ActivityFlag.FLUSH_FORCED)
        self._enabled: list = []
        self.dropped = 0

    def __enter__(self) -> "Session":
        global _active, _kinds, _registered
        if _active:
            raise TimerError("a CUPTI timing session is already open in this process; time_gpu is not reentrant")
        cupti = self.cupti
        _kinds = (int(cupti.ActivityKind.CONCURRENT_KERNEL), int(cupti.ActivityKind.EXTERNAL_CORRELATION),
                  int(cupti.ActivityKind.MEMCPY))
        try:
            # Registered at every session: a profiler that ran in between (or its cuptiFinalize) replaces or
            # drops the callbacks. A refusal after a first success is harmless: ours are still the ones held.
            try:
                cupti.activity_register_callbacks(_buffer_requested, _buffer_completed)
                _registered = True
            except Exception:
                if not _registered:
                    raise
            for kind in self._enable:
                cupti.activity_enable(kind)
                self._enabled.append(kind)
            cupti.activity_flush_all(self._forced)
            self._read_dropped()  # reset the count: only this session's drops are ours
        except Exception as e:
            self._close()
            raise TimerError(f"CUPTI activity tracing could not start ({type(e).__name__}: {e}); "
                             f"use timer='events', or fix the cupti-python install") from e
        _drain()  # whatever an earlier session left behind
        _active = True
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = False
        self._close()

    def _close(self) -> None:
        for kind in reversed(self._enabled):
            try:
                self.cupti.activity_disable(kind)
            except Exception:  # noqa: BLE001 - closing must not hide the error that got us here
                pass
        self._enabled.clear()
        try:
            self.cupti.activity_flush_all(self._forced)
        except Exception:  # noqa: BLE001
            pass
        _drain()

    def push(self, external_id: int) -> None:
        self.cupti.activity_push_external_correlation_id(self._ext_kind, external_id)

    def pop(self, external_id: int) -> None:
        got = self.cupti.activity_pop_external_correlation_id(self._ext_kind)
        if got is not None and int(got) != external_id:
            raise TimerError(f"CUPTI external correlation stack out of balance: pushed {external_id}, popped "
                             f"{got}; the callable must pop every external correlation id it pushes")

    def timestamp(self) -> int:
        """CUPTI's clock, the one kernel records' start/end use (ns)."""
        return int(self.cupti.get_timestamp())

    def _read_dropped(self) -> int:
        import ctypes

        # The count for the global queue (context NULL, stream 0), reset by each read; the binding writes it
        # through the address it is given.
        out = ctypes.c_size_t(0)
        self.cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(out))
        return int(out.value)

    def collect(self) -> tuple[list[Kernel], list[tuple[int, int]]]:
        """Deliver every record so far (call after torch.cuda.synchronize()): kernels and correlations.
        Raises TimerError when CUPTI dropped records or the callback failed."""
        self.cupti.activity_flush_all(self._forced)
        kernels, correlations, errors = _drain()
        dropped = self._read_dropped()
        self.dropped += dropped
        if errors:
            raise TimerError(f"reading CUPTI activity records failed: {errors[0]}; the cupti-python binding may "
                             f"not match the installed libcupti")
        if dropped:
            raise TimerError(f"CUPTI dropped {dropped} activity records (no buffer space), so some kernels are "
                             f"missing; rerun, and report it if it persists")
        return kernels, correlations
