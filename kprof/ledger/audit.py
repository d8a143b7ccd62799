"""`kprof audit`: proves every row can be replayed from the log, or lists what cannot.

Two child processes share the work (one core each): the structure half walks every sub-database and
recomputes every event id and key; the views half checks the log's continuity and compares the stored
views with a replay of the log. A child killed by a signal (a damaged page faults the reader) is itself
a finding: the file's structure is damaged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

from ..errors import IntegrityError, LedgerError
from .store import Ledger

__all__ = ["audit", "AuditReport", "require_clean"]


class AuditReport(NamedTuple):
    path: str
    ok: bool
    events: int
    last_seq: int
    findings: list[str]
    counts: dict[str, int]  # findings per check
    seconds: float

    def to_json(self) -> dict:
        return self._asdict()


def _child(part: str, path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kprof.ledger._audit_worker", part, path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(part: str, proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return {"findings": [f"structure: the {part} walk crashed with {name}: the file's pages are damaged"],
                "counts": {"structure": 1}}
    try:
        return json.loads(out)
    except ValueError:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return {"findings": [f"structure: the {part} walk failed: {last}"], "counts": {"structure": 1}}


def audit(path: str) -> AuditReport:
    """Audits the ledger at `path`. Damage is reported as findings; a file that is absent raises."""
    started = time.perf_counter()
    if not os.path.isfile(path):
        raise LedgerError(f"no ledger file at {path}; pass --db or set KPROF_DB")
    Ledger.open(path, readonly=True).close()  # refuses, with its reason, a file that is not a readable ledger
    parts = {part: _child(part, path) for part in ("structure", "views")}
    results = {part: _result(part, proc) for part, proc in parts.items()}
    findings, counts = [], {}
    for res in results.values():
        findings += res["findings"]
        for check, n in res["counts"].items():
            counts[check] = counts.get(check, 0) + n
    views = results["views"]
    return AuditReport(path, not counts, views.get("events", 0), views.get("last_seq", 0), findings, counts,
                       time.perf_counter() - started)


def require_clean(path: str) -> AuditReport:
    report = audit(path)
    if not report.ok:
        raise IntegrityError(f"ledger {path} failed audit: " + "; ".join(report.findings[:5]))
    return report
