"""The device's ceilings: a large GEMM (arithmetic) and a large device-to-device copy (memory), measured
into the ledger as rows of their own, and each compute row's fraction of them.

    kprof calibrate --backend torch          # on the GPU: 8192^3 bf16 GEMM, 4 GiB copy
    kprof calibrate --backend torch-cpu      # on the CPU: 1024^3 fp32 GEMM, 256 MiB copy

The ceilings are ordinary rows of `single_gemm` and `memcpy` under the device's base backend, found again
by their fixed specs; `query --json` cites them beside every fraction it reports. Reading them imports no
measurement library.
"""

from __future__ import annotations

from typing import NamedTuple

from .runners.registry import lookup

__all__ = ["CEILING_SPECS", "Ceiling", "calibrate", "ceilings", "fractions", "lookup_any"]

# (table, spec, metric) per device: the rows whose metric is the device's ceiling for that metric.
CEILING_SPECS = {
    "cuda": [("single_gemm", {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"}, "tflops"),
             ("memcpy", {"bytes": 4 << 30}, "memory_bandwidth_gbps")],
    "cpu": [("single_gemm", {"m": 1024, "n": 1024, "k": 1024, "dtype": "fp32"}, "tflops"),
            ("memcpy", {"bytes": 256 << 20}, "memory_bandwidth_gbps")],
}
BASE_BACKEND = {"cuda": "torch", "cpu": "torch-cpu"}


class Ceiling(NamedTuple):
    metric: str  # "tflops" or "memory_bandwidth_gbps"
    value: float
    table: str
    spec: dict
    citation: str


def lookup_any(backend: str):
    """Any registry entry of `backend` (they all measure on one device kind)."""
    from .errors import UsageError
    from .runners.registry import entries

    for entry in entries():
        if entry.backend == backend:
            return entry
    known = sorted({e.backend for e in entries()})
    raise UsageError(f"unknown backend {backend!r}; known backends: {', '.join(known)} (see `kprof list`)")


def calibrate(backend: str, *, gpu_name: str | None = None, db: str | None = None, force: bool = False,
              command: str = "") -> tuple[list, list[Ceiling]]:
    """Measures the ceiling rows of the device `backend` runs on (only those missing, unless `force`).
    Returns (the run results, the ceilings now in the ledger)."""
    from . import api

    device = lookup_any(backend).device
    base = BASE_BACKEND[device]
    results = [api.run(table, base, [spec], mode="force" if force else "jit", gpu_name=gpu_name, db=db,
                       command=command) for table, spec, _metric in CEILING_SPECS[device]]
    gpu_key = results[0].gpu_name
    return results, ceilings(backend, gpu_key, db=db)


def ceilings(backend: str, gpu_key: str, *, db: str | None = None, ledger=None) -> list[Ceiling]:
    """The ceilings measured for the device of `backend` under `gpu_key` (those not measured are absent)."""
    import os

    from .api import effective_entry
    from .ledger import Ledger, default_path

    device = lookup_any(backend).device
    base = BASE_BACKEND[device]
    own = ledger is None
    if own:
        path = os.fspath(db or default_path())
        if not os.path.exists(path):
            return []
        ledger = Ledger.open(path, readonly=True)
    try:
        out = []
        for table, spec, metric in CEILING_SPECS[device]:
            entry = effective_entry(lookup(table, base))
            row = ledger.view(table, base, gpu_key, entry.contract, entry.args).get(**spec)
            if row is not None and row.metrics and row.metrics.get(metric):
                out.append(Ceiling(metric, row.metrics[metric], table, spec, row.citation))
        return out
    finally:
        if own:
            ledger.close()


def fractions(metrics: dict | None, found: list[Ceiling]) -> dict[str, float] | None:
    """A compute row's fraction of each ceiling (None when the row has no metrics or no ceiling exists)."""
    if not metrics or not found:
        return None
    out = {}
    for c in found:
        value = metrics.get(c.metric)
        if value is not None:
            out[c.metric] = value / c.value
    return out or None
