"""`kprof audit`: proves every row can be replayed from the log, or lists what cannot.

The work is sharded by row key over `jobs` processes of a process pool (see _audit_worker): each walks its share of
the sub-databases (the parent adds up the counts of the views walked by key range), recomputes its events' ids
and keys, replays its events through the Reducer and compares its part of every view; the parent sums their
scope accumulators (the view root is an additive hash) and compares the scopes view.
A shard's process killed by the OS (a damaged page faults the reader) is itself a finding: the file's structure
is damaged.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import lmdb

from ..errors import IntegrityError, LedgerError, UsageError
from . import _audit_worker
from ._audit_worker import MAX_LISTED, RANGED
from ._reducer import ScopeTotals, seal
from .store import Ledger

__all__ = ["audit", "AuditReport", "JOBS"]


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


JOBS = min(8, os.cpu_count() or 2)  # the default: a shard process per core, up to 8; each replays 1/jobs of the keys


def _shards(path: str, jobs: int, work=_audit_worker.main) -> list[dict]:
    """Every shard's result (`work(shard, jobs, path)`), each in a spawned process (LMDB handles cannot cross a
    fork). Where one dies, each shard not finished is reported as killed: the pool cannot say which one the OS
    stopped."""
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(work, shard, jobs, path) for shard in range(jobs)]
        out = []
        for shard, future in enumerate(futures):
            try:
                out.append(future.result())
            except BrokenProcessPool:
                out.append({"findings": [f"structure: shard {shard}'s process was killed while it read the file: "
                                         f"the file's pages are damaged"], "counts": {"structure": 1}, "fatal": True})
            except Exception as exc:  # noqa: BLE001 - any other failure is a finding, with its reason
                out.append({"findings": [f"structure: shard {shard}: {type(exc).__name__}: {exc}"],
                            "counts": {"structure": 1}, "fatal": True})
        return out


def _scopes(results: list[dict], add) -> None:
    """Sums the shards' partial scope entries and compares them with the stored scopes view."""
    combined: dict[bytes, ScopeTotals] = {}
    for res in results:
        for sid, part in res["scopes"].items():
            combined.setdefault(sid, ScopeTotals.of(part)).add(ScopeTotals.stored(part))
    stored = dict(results[0]["stored_scopes"])
    for sid, entry in combined.items():
        have = stored.pop(sid, None)
        if have is None:
            add("views", f"scopes: entry {sid.hex()} of the log's replay is not stored")
        elif have != seal(sid, entry.entry()):
            add("views", f"scopes: entry {sid.hex()} ({entry.table}/{entry.backend}/{entry.gpu_key}) differs from "
                         f"the log's replay")
    for sid in stored:
        add("views", f"scopes: stored entry {sid.hex()} is not derivable from the log")


def _unstored(path: str, add) -> None:
    """Lists the logged events missing from the event store (run only when the shards' counts say some are)."""
    ledger = Ledger.open(path, readonly=True)
    try:
        with ledger.read() as txn:
            events, listed = ledger.dbs["events"], 0
            for k, eid in txn.cursor(ledger.dbs["log"]):
                if txn.get(eid, db=events) is None:
                    add("log", f"seq {int.from_bytes(k, 'big')}: event {eid.hex()[:16]} is not in the event store")
                    listed += 1
                    if listed >= MAX_LISTED:
                        break
    except lmdb.Error as exc:  # the shards' walks name the damage; this listing stops at it
        add("structure", f"log: listing the events missing from the store failed: {exc}")
    finally:
        ledger.close()


def audit(path: str, jobs: int = JOBS) -> AuditReport:
    """Audits the ledger at `path` in `jobs` shard processes. Damage is reported as findings; a file that is absent
    raises."""
    started = time.perf_counter()
    if type(jobs) is not int or not 1 <= jobs <= 256:
        raise UsageError(f"--jobs {jobs!r}: the audit runs 1 to 256 shard processes; pass e.g. --jobs {JOBS}")
    if not os.path.isfile(path):
        raise LedgerError(f"no ledger file at {path}; pass --db or set KPROF_DB")
    try:
        Ledger.open(path, readonly=True).close()
    except IntegrityError as exc:  # a file damaged past opening (truncated, header or format version damaged)
        return AuditReport(path, False, 0, 0, [f"structure: {exc}"], {"structure": 1}, time.perf_counter() - started)
    results = _shards(path, jobs)
    findings: list[str] = []
    counts: dict[str, int] = {}

    def add(check: str, text: str) -> None:
        counts[check] = counts.get(check, 0) + 1
        findings.append(f"{check}: {text}")

    for res in results:
        findings += res["findings"]
        for check, n in res["counts"].items():
            counts[check] = counts.get(check, 0) + n
    fatal = any(res.get("fatal") for res in results)
    n_events = 0 if fatal else sum(res["events"] for res in results)
    if not fatal:
        if n_events != results[0]["header_events"]:
            add("structure", f"events: header counts {results[0]['header_events']} entries, walk found {n_events}")
        entries = results[0]["view_entries"]
        for name in RANGED:  # each shard walked its key range of these views as it compared them
            walked = sum(res["walked"].get(name, 0) for res in results)
            if walked != entries[name]:
                add("structure", f"{name}: header counts {entries[name]} entries, walk found {walked}")
        _scopes(results, add)
        if sum(res["logged"] for res in results) != results[0]["log_entries"]:
            _unstored(path, add)
    last_seq = results[0].get("last_seq") or 0
    return AuditReport(path, not counts, n_events, last_seq, findings, counts, time.perf_counter() - started)
