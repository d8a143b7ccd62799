"""`kprof audit`: proves every row can be replayed from the log, or lists what cannot.

Checks, each listed as findings: the LMDB structure (in a child process), every event id and key
recomputed from the stored bytes, the log's continuity (1..last_seq, each event logged exactly once),
and the stored views against views rebuilt in memory from the log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import msgspec

from ..errors import IntegrityError, KprofError, LedgerError
from . import _codec
from ._reducer import unpack_seq
from .events import Retracted
from .replay import MemoryStore, replay_into
from .store import VIEW_DBS, Ledger

__all__ = ["audit", "AuditReport"]

MAX_LISTED = 50  # findings listed per check; the count is always exact


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


class _Findings:
    def __init__(self):
        self.items: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, check: str, text: str) -> None:
        n = self.counts.get(check, 0)
        self.counts[check] = n + 1
        if n < MAX_LISTED:
            self.items.append(f"{check}: {text}")


def _structure(path: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "kprof.ledger._verify", path], capture_output=True, text=True)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return [f"the LMDB walk crashed with {name}: the file's page structure is damaged"]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"the LMDB walk failed: {last}"]
    return json.loads(proc.stdout)


def audit(path: str) -> AuditReport:
    """Audits the ledger at `path`. Damage is reported as findings; only an unreadable file raises."""
    started = time.perf_counter()
    if not os.path.isfile(path):
        raise LedgerError(f"no ledger file at {path}; pass --db or set KPROF_DB")
    found = _Findings()
    for problem in _structure(path):
        found.add("structure", problem)
    if found.counts:
        return AuditReport(path, False, 0, 0, found.items, found.counts, time.perf_counter() - started)
    ledger = Ledger.open(path, readonly=True)
    try:
        n_events, last_seq = _audit_open(ledger, found)
    finally:
        ledger.close()
    return AuditReport(path, not found.counts, n_events, last_seq, found.items, found.counts,
                       time.perf_counter() - started)


def _audit_open(ledger: Ledger, found: _Findings) -> tuple[int, int]:
    dbs = ledger.dbs
    decode = _codec.event_decoder.decode
    with ledger.read() as txn:
        # 1. events: recompute every id and key.
        decoded: dict[bytes, object] = {}
        for eid, data in txn.cursor(dbs["events"]):
            if _codec.event_id(data) != eid:
                found.add("events", f"event {eid.hex()[:16]}: stored bytes hash to another id (altered or damaged)")
                continue
            try:
                event = decode(data)
            except msgspec.DecodeError as exc:
                found.add("events", f"event {eid.hex()[:16]}: cannot be decoded ({exc})")
                continue
            if type(event) is not Retracted and _codec.provenance_key(event.provenance) != event.key:
                found.add("keys", f"event {eid.hex()[:16]}: key {event.key.hex()[:16]} does not match its provenance")
            decoded[eid] = event
        # 2. the log: contiguous 1..last_seq, each event exactly once.
        raw_last = txn.get(b"last_seq", db=dbs["meta"])
        last_seq = msgspec.msgpack.decode(raw_last) if raw_last is not None else -1
        logged: set[bytes] = set()
        replay = []
        expect = 1
        for k, eid in txn.cursor(dbs["log"]):
            seq = unpack_seq(k)[0] if len(k) == 8 else -1
            if seq != expect:
                found.add("log", f"sequence {expect} expected, found {seq}")
                expect = seq
            expect += 1
            if eid in logged:
                found.add("log", f"seq {seq}: event {eid.hex()[:16]} logged twice")
            logged.add(eid)
            event = decoded.get(eid)
            if event is None:
                if txn.get(eid, db=dbs["events"]) is None:
                    found.add("log", f"seq {seq}: event {eid.hex()[:16]} is not in the event store")
                continue
            replay.append((seq, eid, event))
        if expect - 1 != last_seq:
            found.add("log", f"meta says last_seq {last_seq}, log ends at {expect - 1}")
        for eid in decoded.keys() - logged:
            found.add("log", f"event {eid.hex()[:16]} is stored but not in the log")
        # 3. views: rebuild in memory, compare with what is stored.
        memory = MemoryStore(txn, dbs)
        try:
            replay_into(memory, replay)
        except KprofError as exc:
            found.add("views", f"replay failed: {exc}")
            return len(decoded), last_seq
        for name in VIEW_DBS:
            _compare(found, name, txn.cursor(dbs[name]), memory.data[name])
        return len(decoded), last_seq


def _compare(found: _Findings, name: str, cursor, rebuilt: dict[bytes, bytes]) -> None:
    seen = 0
    for k, v in cursor:
        want = rebuilt.get(k)
        if want is None:
            found.add("views", f"{name}: stored entry {k.hex()[:24]} is not derivable from the log")
        elif want != v:
            found.add("views", f"{name}: entry {k.hex()[:24]} differs from the log's replay")
        else:
            seen += 1
    if seen != len(rebuilt):
        missing = len(rebuilt) - seen
        stored = None
        for k in rebuilt:
            if cursor.set_key(k) is False:
                stored = k
                break
        where = f", e.g. {stored.hex()[:24]}" if stored else ""
        found.add("views", f"{name}: {missing} entries of the log's replay are absent or different{where}")


def require_clean(path: str) -> AuditReport:
    report = audit(path)
    if not report.ok:
        raise IntegrityError(f"ledger {path} failed audit: " + "; ".join(report.findings[:5]))
    return report
