"""`kprof scopes`: every (table, backend, GPU key) a ledger holds, with the specs it answers."""

from __future__ import annotations

from .. import api
from ..ledger import ledger_path
from ._options import Db, Json
from ._render import console, emit_json


def scopes(*, db: Db = None, json: Json = False) -> int:
    """List every table/backend/GPU key of the ledger with its number of specs that `query` reads as ok, stale
    and failed (under the default timing method; stale and failed count as missing). A spec with rows of several
    profiler revisions or timing methods counts once; `--json`'s `rows` counts current rows, one per key."""
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
    whole = {"table": max(len(s.table) for s in found), "backend": max(len(s.backend) for s in found),
             "gpu_name": max(len(word) for s in found for word in s.gpu_name.split() or [""])}  # words kept whole
    table = Table(*(Column(name, overflow="fold", min_width=whole.get(name))
                    for name in ("table", "backend", "gpu_name", "ok", "stale", "failed")), title=f"scopes of {path}")
    for s in found:
        table.add_row(s.table, s.backend, s.gpu_name, *("?" if n is None else str(n) for n in (s.ok, s.stale, s.failed)))
    out.print(table)
    counts = ", ".join(f"{sum(getattr(s, k) or 0 for s in found)} {k}" for k in ("ok", "stale", "failed"))
    unknown = "; ? a table or backend this kprof does not know" if any(s.ok is None for s in found) else ""
    out.print(f"{len(found)} scope(s), spec(s) {counts} (stale and failed read as missing{unknown}); read one with "
              f"--gpu-name (query, count-missing) or gpu_key= (kprof.perf_api)", markup=False)
    return 0
