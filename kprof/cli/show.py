"""`kprof show`: one row's provenance, metrics and full history, by citation, key or event id."""

from __future__ import annotations

import datetime as _dt
from typing import Annotated

from cyclopts import Parameter

from .. import api
from ._options import Db, Json
from ._render import console, emit_json


def show(ref: Annotated[str, Parameter(help="A citation (kprof.<hex>), an event id or a key, or a unique "
                                        "prefix of at least 8 hex digits; or a measure artifact's citation "
                                        "(kmeasure.<hex>).")], *,
         db: Db = None, json: Json = False,
         search_dir: Annotated[list[str] | None, Parameter(name="--dir", consume_multiple=False, help=(
             "Where to look for a kmeasure.<hex> citation: a `kprof measure` output directory, or a directory "
             "holding some; repeatable. Default: ./measure_*/ and the current directory."))] = None) -> int:
    """Show a row's provenance, metrics and full history; or what a measure artifact is and where it lies."""
    if ref.strip().lower().startswith("kmeasure."):
        return _show_measure(ref, search_dir, json)
    if search_dir:
        from ..errors import UsageError

        raise UsageError("--dir is where kmeasure.<hex> citations are looked for; a kprof.<hex> citation, event id "
                         "or key is read from the ledger (--db)")
    doc = api.show(ref, db=db)
    chosen, history = doc["event"], doc["history"]
    if json:
        emit_json(doc)
        return 0
    out = console()
    out.print(f"key {doc['key']}", markup=False)
    if chosen is not None:
        prov = chosen.get("provenance") or {}
        out.print("provenance: " + ", ".join(f"{k}={v}" for k, v in prov.items()), markup=False)
        if chosen["type"] == "measured":
            out.print("metrics: " + ", ".join(f"{k}={v}" for k, v in chosen["metrics"].items()), markup=False)
    from rich.table import Column, Table

    # The citations are printed whole at any width, to be copied back into `kprof show`: the other columns fold,
    # and " (current)" wraps below its citation.
    width = max((len(h["citation"]) for h in history), default=None)
    table = Table(*(Column(name, overflow="fold", min_width=width if name == "event" else None)
                    for name in ("seq", "event", "kind", "at", "detail")), title="history")
    for h in history:
        detail = {"measured": lambda: f"time_ms={h['metrics'].get('time_ms')}",
                  "failed": lambda: f"{h['error_kind']}: {h['message']}",
                  "retracted": lambda: f"retracts {h['target'][:16]}: {h['reason']}"}[h["type"]]()
        mark = " (current)" if h["current"] else ""
        at = _dt.datetime.fromtimestamp(h["measured_at"], _dt.timezone.utc).isoformat(timespec="seconds")
        table.add_row(str(h["seq"]), h["citation"] + mark, h["type"], at, detail)
    out.print(table)
    return 0



def _show_measure(ref: str, dirs: list[str] | None, json: bool) -> int:
    """A kmeasure.<hex> citation: the artifact's path and what it holds (its bytes hashed again on the way)."""
    from ..measure.diagnostic_files import find_artifact

    doc = find_artifact(ref, dirs)
    if json:
        emit_json(doc)
        return 0
    out = console()
    out.print(f"{doc['ref']}: {doc['path']}", markup=False)
    out.print(f"{doc['artifact']}: {doc['what']} ({doc['bytes']} bytes, blake3 {doc['blake3']})", markup=False)
    mode = doc.get("mode") or {}
    out.print(f"measure of {doc['table']}/{doc['backend']} {doc['spec']} on {doc['gpu_name']}: L2 {mode.get('l2')}, "
              f"{'graph' if mode.get('graph') else 'eager'}, {mode.get('duration_s')} s; summary {doc['summary']}",
              markup=False)
    return 0
