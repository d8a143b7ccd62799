"""`kprof audit`: verify every event, the log, the views and the file structure."""

from __future__ import annotations

from ..ledger import default_path
from ..ledger.audit import audit as run_audit
from ._options import Db, Json
from ._render import console, emit_json


def audit(*, db: Db = None, json: Json = False) -> int:
    """Recompute every event id and key, check the log, rebuild the views and compare; exit 3 on any finding."""
    report = run_audit(db or default_path())
    if json:
        emit_json(report.to_json())
    else:
        out = console()
        state = "[green]clean[/]" if report.ok else f"[red]{sum(report.counts.values())} finding(s)[/]"
        out.print(f"audit of {report.path}: {state} — {report.events} events, last seq {report.last_seq}, "
                  f"{report.seconds:.2f} s")
        for line in report.findings:
            out.print(f"  {line}", markup=False)
    return 0 if report.ok else 3
