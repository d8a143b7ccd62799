"""`kprof audit`: proves every row can be replayed from the log, or lists what cannot. The work is sharded by row key
over `jobs` processes (see _audit_worker); the parent adds up their counts against the headers', sums their scope
accumulators (the view root is an additive hash) and compares the scopes view."""

from __future__ import annotations

import time
from collections import Counter
from itertools import islice
from typing import NamedTuple

import lmdb

from .._children import Faulted, cpus, in_processes
from ..errors import IntegrityError, UsageError
from . import _audit_worker
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
    shards: int = 0  # the shard processes it ran (see audit)


JOBS = min(8, len(cpus()))  # the default: a shard process per usable CPU, up to 8; each replays 1/jobs of the keys


def _shards(path: str, jobs: int, work=_audit_worker.main) -> list[dict]:
    """Every shard's `work(shard, jobs, path)`, each in a process of its own (see kprof._children)."""
    outs = in_processes(work, jobs, path, found=lambda res: bool(res["findings"]))  # (a shard not done: see _fatal)
    return [_fatal(i, out) if isinstance(out, Exception) else out for i, out in enumerate(outs)]


def _fatal(shard: int, exc: Exception) -> dict:
    text = (f"shard {shard}'s process was killed by {exc} while it read the file: the file's pages are damaged"
            if isinstance(exc, Faulted) else f"shard {shard}: {type(exc).__name__}: {exc}")
    return {"findings": [f"structure: {text}"], "counts": {"structure": 1}, "fatal": True}


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
    try:
        with Ledger.open(path, readonly=True) as ledger, ledger.read() as txn:
            log, events = ledger.dbs["log"], ledger.dbs["events"]  # a key not of 8 bytes: the log's walk names it
            missing = ((k, eid) for k, eid in txn.cursor(log) if len(k) == 8 and txn.get(eid, db=events) is None)
            for k, eid in islice(missing, _audit_worker.MAX_LISTED):
                add("log", f"seq {int.from_bytes(k, 'big')}: event {eid.hex()[:16]} is not in the event store")
    except lmdb.Error as exc:  # the shards' walks name the damage; this listing stops at it
        add("structure", f"log: listing the events missing from the store failed: {exc}")


def _consistent(path: str, jobs: int, attempts: int = 3) -> list[dict]:
    """The shards' results from one state of the file: where a writer committed between their snapshots, taken
    again (counts would disagree with no damage); after `attempts`, in one shard (one snapshot)."""
    for results in (_shards(path, jobs) for _ in range(attempts)):
        if len({res["snapshot"] for res in results if "snapshot" in res}) <= 1:
            return results
    return _shards(path, 1)


def audit(path: str, jobs: int = JOBS) -> AuditReport:
    """Audits the ledger at `path` in at most `jobs` shard processes, one per CPU this process may use and per row key
    (past those a shard only queues, or has no key: 256 on 2 CPUs took 50 s). Damage is a finding; no file raises."""
    started = time.perf_counter()
    if type(jobs) is not int or not 1 <= jobs <= 256:
        raise UsageError(f"--jobs {jobs!r}: the audit runs 1 to 256 shard processes; pass e.g. --jobs {JOBS}")
    try:
        with Ledger.open(path, readonly=True) as ledger, ledger.read() as txn:
            jobs = max(1, min(jobs, len(cpus()), txn.stat(ledger.dbs["current"])["entries"]))
    except IntegrityError as exc:  # a file damaged past opening (truncated, header or format version damaged)
        return AuditReport(path, False, 0, 0, [f"structure: {exc}"], {"structure": 1}, time.perf_counter() - started)
    results = _consistent(path, jobs)
    findings = [text for res in results for text in res["findings"]]
    counts = sum((Counter(res["counts"]) for res in results), Counter())

    def add(check: str, text: str) -> None:
        counts[check] += 1
        findings.append(f"{check}: {text}")

    n_events = 0
    if not any(res.get("fatal") for res in results):
        n_events = sum(res["events"] for res in results)
        entries = results[0]["entries"]
        for name in ("events",) + _audit_worker.RANGED:  # each shard counted its share of these as it read them
            walked = sum(res["walked"].get(name, 0) for res in results)
            if walked != entries[name]:
                add("structure", f"{name}: header counts {entries[name]} entries, walk found {walked}")
        _scopes(results, add)
        if sum(res["logged"] for res in results) != results[0]["log_entries"]:
            _unstored(path, add)
    last_seq = results[0].get("last_seq") or 0
    return AuditReport(path, not counts, n_events, last_seq, findings, dict(counts), time.perf_counter() - started,
                       jobs)
