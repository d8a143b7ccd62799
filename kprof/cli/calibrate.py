"""`kprof calibrate`: measure the device's ceilings (the best of a set of large GEMMs, of copies) into the
ledger; `query --json` then reports each compute row's fraction of them."""

from __future__ import annotations

import math
import shlex
from typing import Annotated

from cyclopts import Parameter

from ..calibrate import calibrate as run_calibrate
from ..calibrate import complete
from ..ledger import ledger_path
from ._options import L2, Backend, CudaGraph, Db, GpuName, Json, Power, Timer
from ._render import console, emit_json, stdout_to_stderr, typed_as


def _figure(value: float) -> str:
    """A ceiling with at least 4 significant digits and one decimal, never as an exponent: a CPU's 0.04570 TFLOP/s
    must not read 0.0, a GPU's 989.4 TFLOP/s or 4,812.3 GB/s read as before."""
    digits = max(1, 3 - math.floor(math.log10(abs(value)))) if value else 1
    return f"{value:,.{digits}f}"


def calibrate(*, backend: Backend = "torch", force: Annotated[bool, Parameter(negative="", help=(
        "Measure the ceilings again even when they are in the ledger."))] = False,
              gpu_name: GpuName = None, db: Db = None, timer: Timer = None, l2: L2 = None,
              cuda_graph: CudaGraph = None, power: Power = None, json: Json = False) -> int:
    """Measure the ceilings of the device BACKEND runs on: each the best of a stated shape set (on a GPU, nine
    large bf16 GEMMs and five fp8 ones for TFLOP/s; 1-4 GiB copies, two decode GEMMs and two decode attentions for
    bandwidth)."""
    from . import invocation

    with stdout_to_stderr(json):  # what a runner prints while measuring: stdout is the document's alone
        results, found = run_calibrate(backend, gpu_name=gpu_name, db=db, force=force,
                                       command=shlex.join(invocation), timer=timer, l2=l2,
                                       cuda_graph=cuda_graph, power=power)
    rows = [row for r in results for row in r.results]
    if json:
        emit_json({"backend": backend, "gpu_name": results[0].gpu_name, "db": results[0].db,
                   "ceilings": [{"metric": c.metric, "dtype": c.dtype, "value": c.value, "table": c.table,
                                 "spec": c.spec, "citation": c.citation, "method": c.method} for c in found],
                   "rows": rows})
    else:
        out = console()
        for c in found:
            unit = "TFLOP/s" if c.metric == "tflops" else "GB/s"
            of = f" ({c.dtype} rows)" if c.dtype else ""
            out.print(f"{c.metric}{of}: {_figure(c.value)} {unit}  ({c.table} {c.spec}, {c.citation})", markup=False)
            if (c.method or {}).get("summary"):
                out.print(f"  {c.method['summary']}", markup=False)
        for r in results:
            for row in r.results:
                if row["status"] != "ok":
                    out.print(f"{r.table} {row['spec']}: {row['status']}{_why(row.get('error'))}", markup=False)
        if not found:
            out.print("no ceiling: no row of a calibration set is ok; the same command measures the rows that are "
                      "not", markup=False)
        measured = sum(r.measured for r in results)
        if rows and not measured:  # a second calibration reads the first's rows: say so, and how to measure anew
            out.print(f"measured nothing: all {len(rows)} calibration spec(s) have rows in the ledger; --force "
                      f"measures them again", markup=False)
        elif rows:
            out.print(f"measured {measured} of {len(rows)} calibration spec(s) in {sum(r.seconds for r in results):.1f}"
                      f" s", markup=False)
    busy = [f"{c.metric} {c.method['host_busy']} of {c.method['measured']}" for c in found
            if (c.method or {}).get("host_busy")]
    if busy:  # a CPU ceiling is only as high as the host let it run: a low one puts every row's fraction too high
        from ..method import thread_variable  # a CPU ceiling's timing names its thread count, as this variable chose it
        from ..settings import environ

        threads = [f"{n}={shlex.quote(environ()[n].strip())}" for n in [thread_variable()] if n]
        again = " ".join(threads + [shlex.join([*typed_as, "calibrate", "--backend", backend, "--db", ledger_path(db),
                                                "--force"])])
        console(stderr=True).print(
            f"note: other work took the host's cores while rows behind these ceilings were timed ({', '.join(busy)} "
            f"row(s), their notes say host_busy): the ceilings may be low, and rows read above them; measure them "
            f"again on a quieter host with `{again}`", markup=False)
    return 0 if complete(backend, results, found) else 1


def _why(error) -> str:
    """A failed row's error as words (a run gives {kind, message}), not its dict's repr."""
    if isinstance(error, dict):
        return f" ({error.get('kind')}: {error.get('message')})"
    return f" ({error})" if error else ""
