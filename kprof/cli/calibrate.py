"""`kprof calibrate`: measure the device's ceilings (a large GEMM, a large device-to-device copy) into the
ledger; `query --json` then reports each compute row's fraction of them."""

from __future__ import annotations

import shlex
from typing import Annotated

from cyclopts import Parameter

from ..calibrate import calibrate as run_calibrate
from ._options import Backend, Db, GpuName, Json
from ._render import console, emit_json


def calibrate(*, backend: Backend = "torch", force: Annotated[bool, Parameter(negative="", help=(
        "Measure the ceilings again even when they are in the ledger."))] = False,
              gpu_name: GpuName = None, db: Db = None, json: Json = False) -> int:
    """Measure the ceilings of the device BACKEND runs on (8192^3 bf16 GEMM and a 4 GiB copy on a GPU)."""
    from . import invocation

    results, found = run_calibrate(backend, gpu_name=gpu_name, db=db, force=force,
                                   command="kprof " + shlex.join(invocation))
    rows = [r.results[0] for r in results]
    if json:
        emit_json({"backend": backend, "gpu_name": results[0].gpu_name, "db": results[0].db,
                   "ceilings": [{"metric": c.metric, "value": c.value, "table": c.table, "spec": c.spec,
                                 "citation": c.citation} for c in found],
                   "rows": rows})
    else:
        out = console()
        for c in found:
            unit = "TFLOP/s" if c.metric == "tflops" else "GB/s"
            out.print(f"{c.metric}: {c.value:,.1f} {unit}  ({c.table} {c.spec}, {c.citation})", markup=False)
        for r in rows:
            if r["status"] != "ok":
                out.print(f"{r['spec']}: {r['status']} {r.get('error') or ''}", markup=False)
    return 0 if len(found) == len(rows) else 1
