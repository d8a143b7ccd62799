"""`kprof count-missing` and `kprof query`: read-only, never profile; a valid request exits 0."""

from __future__ import annotations

from .. import api
from ..specs import read_specs
from ._options import L2, Backend, CudaGraph, Db, GpuName, Json, Power, Spec, Specs, Table, Timer
from ._render import console, emit_json, results_table


def count_missing(table: Table, *, backend: Backend, spec: Spec = None, specs: Specs = None,
                  gpu_name: GpuName = None, db: Db = None, timer: Timer = None, l2: L2 = None,
                  cuda_graph: CudaGraph = None, power: Power = None, json: Json = False) -> int:
    """Count the specs without an ok row (missing, stale or failed). Never profiles."""
    res = api.count_missing(table, backend, read_specs(spec, specs), gpu_name=gpu_name, db=db, timer=timer, l2=l2,
                            cuda_graph=cuda_graph, power=power)
    if json:
        emit_json({"table": res.table, "backend": res.backend, "gpu_name": res.gpu_name, "db": res.db,
                   "count": res.count, "missing_count": res.missing_count, "missing": res.missing})
    else:
        console().print(f"{res.missing_count} of {res.count} {table}/{backend} spec(s) missing for "
                        f"{res.gpu_name!r} in {res.db}", markup=False)
    return 0


def query(table: Table, *, backend: Backend, spec: Spec = None, specs: Specs = None, gpu_name: GpuName = None,
          db: Db = None, timer: Timer = None, l2: L2 = None, cuda_graph: CudaGraph = None, power: Power = None,
          json: Json = False) -> int:
    """Read the rows of the given specs. Never profiles; missing rows are reported, not an error."""
    res = api.query(table, backend, read_specs(spec, specs), gpu_name=gpu_name, db=db, timer=timer, l2=l2,
                    cuda_graph=cuda_graph, power=power)
    if json:
        emit_json(res.to_json())
    else:
        results_table(res)
    return 0
