"""`kprof calibrate`: measure the device's ceilings into the ledger as ordinary rows, each the best of a stated
set of shapes (`kprof.ceilings`, which reads them and says what a set is and why).

    kprof calibrate --backend torch          # GPU: 9 bf16 and 5 fp8 GEMMs; 1-4 GiB copies, 4 decode kernels
    kprof calibrate --backend torch-cpu      # CPU: 3 fp32 GEMMs; copies of 64-256 MiB and a matrix-vector product
"""

from __future__ import annotations

import os

from .ceilings import (BASE_BACKEND, CEILING_SETS, CEILING_SPECS, Ceiling, CeilingSet, _by_table, annotate,
                       applicable, ceilings, fractions, lookup_any)

__all__ = ["CEILING_SETS", "CEILING_SPECS", "BASE_BACKEND", "CeilingSet", "Ceiling", "calibrate", "complete",
           "ceilings", "applicable", "fractions", "annotate", "lookup_any"]


def calibrate(backend: str, *, gpu_name: str | None = None, db: str | None = None, force: bool = False,
              command: str = "", timer: str | None = None, l2: str | None = None,
              cuda_graph: bool | None = None, power: str | None = None) -> tuple[list, list[Ceiling]]:
    """Measures the calibration sets of the device `backend` runs on (only the rows missing, unless `force`),
    with the timing method named (`timer`, `l2`, `cuda_graph`, `power`; None: this process's default).
    Returns (one run result per table, the ceilings now in the ledger under that method)."""
    from . import api

    from .method import effective_entry, resolve_gpu_key
    from .runners.registry import lookup

    entry = lookup_any(backend)
    resolve_gpu_key(entry, gpu_name, measures=True)  # no device to measure on: said of `backend`, not of the base
    device = entry.device
    base = BASE_BACKEND[device]
    tables = _by_table(m for s in CEILING_SETS[device] for m in s.members)
    results = [api.run(table, base, specs, mode="force" if force else "jit", gpu_name=gpu_name, db=db,
                       command=command, timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
               for table, specs in tables.items()]
    # The ceilings are read back under the method the rows were measured with (the one asked for, not one read
    # off the rows: where every row errored, none says it), and every row is given its fractions of the final
    # ceilings: each run annotated its rows before the later tables were measured, citing ceilings since replaced.
    timing = effective_entry(lookup(next(iter(tables)), base), timer=timer, l2=l2, cuda_graph=cuda_graph,
                             power=power).contract.timing
    # no ledger where nothing was stored (every spec unavailable): no ceiling, not a ledger path error
    found = ceilings(backend, results[0].gpu_name, db=results[0].db, timing=timing) if os.path.exists(
        results[0].db) else []
    for r in results:
        for doc in r.results:
            doc.pop("ceiling", None)
        annotate(r.results, found, r.db)
    return results, found


def complete(backend: str, results: list, found: list[Ceiling]) -> bool:
    """Whether a calibration gave the device its ceilings: both metrics' ceilings of no particular dtype found, and
    every row of those sets ok. A set of one dtype is optional (fp8 GEMMs fail on a GPU without fp8)."""
    def canonical(table, spec):
        return table, tuple(sorted(spec.items()))

    required = {canonical(t, x) for s in CEILING_SETS[lookup_any(backend).device] if s.dtype is None
                for t, x in s.members}
    rows_ok = all(row["status"] == "ok" for r in results for row in r.results
                  if canonical(r.table, row["spec"]) in required)
    return rows_ok and {c.metric for c in found if c.dtype is None} == {"tflops", "memory_bandwidth_gbps"}
