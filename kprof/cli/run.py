"""`kprof run`: JIT fill (profile only what is missing), --force (re-measure all), --fresh (measure all,
write nothing). Exit 1 when rows remain missing or errored."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
import time
from typing import Annotated

from cyclopts import Group, Parameter, validators

from .. import __version__, api
from ..runners.registry import lookup
from ..specs import read_specs
from ._options import L2, Backend, CudaGraph, Db, GpuName, Json, OutputDir, Power, Spec, Specs, Table, Timer
from ._render import console, emit_json, results_table

modes = Group("Mode", validator=validators.MutuallyExclusive())


def _progress():
    if not sys.stderr.isatty():
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=console(stderr=True), transient=True)
    task = bar.add_task("measuring", total=None)

    def update(done, total, spec):
        bar.update(task, completed=done, total=total, description=f"measuring {spec}")

    return bar, update


def run(table: Table, *, backend: Backend, spec: Spec = None, specs: Specs = None,
        force: Annotated[bool, Parameter(group=modes, negative="", help="Re-measure every spec.")] = False,
        fresh: Annotated[bool, Parameter(group=modes, negative="",
                                         help="Measure every spec and write nothing.")] = False,
        output_dir: OutputDir = None, gpu_name: GpuName = None, db: Db = None, timer: Timer = None, l2: L2 = None,
        cuda_graph: CudaGraph = None, power: Power = None, json: Json = False) -> int:
    """Profile the specs that are missing (or all with --force / --fresh), then report every row."""
    started_at = _dt.datetime.now(_dt.timezone.utc)
    raw = read_specs(spec, specs)
    mode = "force" if force else "fresh" if fresh else "jit"
    if output_dir is not None:
        from ..artifacts import check_output_dir

        check_output_dir(output_dir)
    from . import invocation

    command = "kprof " + shlex.join(invocation)
    bar, update = _progress()
    t0 = time.perf_counter()
    options = dict(mode=mode, gpu_name=gpu_name, db=db, command=command, timer=timer, l2=l2, cuda_graph=cuda_graph,
                   power=power)
    if bar:
        with bar:
            res = api.run(table, backend, raw, progress=update, **options)
    else:
        res = api.run(table, backend, raw, **options)
    doc = res.to_json()
    if output_dir is not None:
        _snapshot(output_dir, table, backend, raw, mode, doc, res, started_at, time.perf_counter() - t0, command)
    if json:
        emit_json(doc)
    else:
        results_table(res)
        console().print(f"measured {res.measured} spec(s) in {res.seconds:.1f} s ({res.timed_seconds:.1f} s timed)",
                        markup=False)
    return res.exit_code


def _snapshot(path, table, backend, raw, mode, doc, res, started_at, seconds, command) -> None:
    from ..artifacts import write_snapshot

    entry = lookup(table, backend)
    versions = {"kprof": __version__, "python": platform.python_version()}
    try:
        import torch

        versions["torch"] = str(torch.__version__)
    except ImportError:
        pass
    request = {"table": table, "backend": backend, "mode": mode, "gpu_name": res.gpu_name, "db": res.db,
               "specs": raw}
    meta = {"command": command, "versions": versions, "host": platform.node(), "device": res.gpu_name,
            "mode": mode, "count": res.count, "missing_count": res.missing_count, "measured": res.measured,
            "exit_code": res.exit_code, "started_at": started_at.isoformat(timespec="seconds"),
            "duration_s": round(seconds, 3), "timed_s": round(res.timed_seconds, 3),
            "view_root_before": res.view_root_before, "view_root_after": res.view_root,
            "cwd": os.getcwd()}
    write_snapshot(path, request, doc, meta, list(entry.args.__struct_fields__))
