"""`kprof show`: one row's provenance, metrics and full history, by citation, key or event id."""

from __future__ import annotations

import datetime as _dt
from typing import Annotated

from cyclopts import Parameter

from .. import api
from ._options import Db, Json
from ._render import console, emit_json


def show(ref: Annotated[str, Parameter(help="A citation (kprof.<hex>), an event id or a key, or a unique "
                                        "prefix of at least 8 hex digits.")], *,
         db: Db = None, json: Json = False) -> int:
    """Show a row's provenance, metrics and full history."""
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
    from rich.table import Table

    table = Table("seq", "event", "kind", "at", "detail", title="history")
    for h in history:
        detail = {"measured": lambda: f"time_ms={h['metrics'].get('time_ms')}",
                  "failed": lambda: f"{h['error_kind']}: {h['message']}",
                  "retracted": lambda: f"retracts {h['target'][:16]}: {h['reason']}"}[h["type"]]()
        mark = " (current)" if h["current"] else ""
        at = _dt.datetime.fromtimestamp(h["measured_at"], _dt.timezone.utc).isoformat(timespec="seconds")
        table.add_row(str(h["seq"]), h["citation"] + mark, h["type"], at, detail)
    out.print(table)
    return 0

