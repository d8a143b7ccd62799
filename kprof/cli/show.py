"""`kprof show`: one row's provenance, metrics and full history, by citation, key or event id."""

from __future__ import annotations

import datetime as _dt
from typing import Annotated

import msgspec
from cyclopts import Parameter

from ..ledger import Ledger, ledger_path
from ..ledger.view import citation
from ._options import Db, Json
from ._render import console, emit_json


def _builtins(obj):
    """An event as JSON values, every field present: msgspec.to_builtins leaves out fields at their default
    (the event Structs omit them when encoded), and writes bytes (ids) as base64 where they read as hex
    everywhere else."""
    if isinstance(obj, msgspec.Struct):
        config = obj.__struct_config__
        doc = {} if config.tag is None else {config.tag_field: config.tag}
        doc.update((name, _builtins(getattr(obj, name))) for name in obj.__struct_fields__)
        return doc
    if isinstance(obj, dict):
        return {k: _builtins(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_builtins(v) for v in obj]
    return obj.hex() if isinstance(obj, bytes) else obj


def _event_json(seq, eid, event, current) -> dict:
    doc = {"seq": seq, "event": eid.hex(), "citation": citation(eid), "current": eid == current}
    doc.update(_builtins(event))
    return doc


def show(ref: Annotated[str, Parameter(help="A citation (kprof.<hex>), an event id or a key, or a unique "
                                        "prefix of at least 8 hex digits.")], *,
         db: Db = None, json: Json = False) -> int:
    """Show a row's provenance, metrics and full history."""
    ledger = Ledger.open(ledger_path(db), readonly=True)
    try:
        found = ledger.resolve(ref)
    finally:
        ledger.close()
    history = [_event_json(seq, eid, ev, found.current) for seq, eid, ev in found.history]
    chosen = next((h for h in history if h["event"] == (found.event_id or b"").hex()), None)
    doc = {"ref": ref, "resolved_as": found.kind, "key": found.key.hex(),
           "current": found.current.hex() if found.current else None, "event": chosen, "history": history}
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

