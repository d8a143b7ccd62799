"""`kprof scopes`: every (table, backend, GPU key) a ledger holds, with its row count."""

from __future__ import annotations

from .. import api
from ..ledger import ledger_path
from ._options import Db, Json
from ._render import console, emit_json


def scopes(*, db: Db = None, json: Json = False) -> int:
    """List every table/backend/GPU key of the ledger with its current rows, one per key (a spec measured under two
    profiler revisions or timing methods has two; `count-missing` says how many of given specs are missing)."""
    found = api.scopes(db)
    path = ledger_path(db)
    if json:
        emit_json({"db": path, "scopes": found})
        return 0
    out = console()
    if not found:
        out.print(f"ledger {path} holds no rows; `kprof run` fills it", markup=False)
        return 0
    from rich.table import Column, Table

    # Nothing is cut on a narrow terminal (rich's default ends a cell with "…"): these are the names to pass back.
    whole = {"table": max(len(s.table) for s in found), "backend": max(len(s.backend) for s in found)}
    table = Table(*(Column(name, overflow="fold", min_width=whole.get(name))
                    for name in ("table", "backend", "gpu_name", "rows")), title=f"scopes of {path}")
    for s in found:
        table.add_row(s.table, s.backend, s.gpu_name, str(s.rows))
    out.print(table)
    out.print(f"{len(found)} scope(s), {sum(s.rows for s in found)} row(s); read one with --gpu-name (query, "
              f"count-missing) or gpu_key= (kprof.perf_api)", markup=False)
    return 0
