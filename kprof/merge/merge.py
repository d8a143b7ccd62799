"""Export a ledger's events to a segment, and merge segments into a ledger, conflict-checked and all-or-nothing.

    kprof export --table single_gemm --backend torch --gpu-name "NVIDIA H200" -o h200.kseg
    kprof merge h200.kseg other.kseg --db profile.db --output-dir merge-out

Merging runs in two streamed passes over the segments (neither is ever held whole):

1. Check. Every event decodes, is in canonical form, and its id and key are recomputed from its bytes; the
   segment's structure and digest are checked (kprof.merge.segment). Then, in order, each measured or failed
   event new to the ledger is held against the current row of its key: no row, the event's parent (a
   fast-forward), or a row an earlier event of the same segment made current (the segment's own history, in its
   log order) are fine; a row of this ledger or of another segment is a conflict. A retraction in a segment
   leaves its key unchecked from there on (which row it brings back depends on events the check does not replay).
2. Write, only where the check found nothing: the segments are read again and appended a batch of BATCH events
   per transaction, through the ledger's own append. Each batch must be the batch the check verified (a digest of
   its event ids): a file changed since stops the merge before that batch. A merge stopped half way (a kill, a
   full disk, a changed file) has written a verified prefix of a conflict-free merge; merging again completes it.
   One transaction for a whole segment would hold every dirty page of it in memory (2.4 GiB at 300,000 events).

A conflict or any damage merges nothing. A conflict writes `merge-report.json` to the output directory (each
conflicting key: both events, their metrics, the relative difference of time_ms) and raises MergeConflict (exit
3); a damaged, forged or incomplete segment raises SegmentError or UsageError (exit 2), naming what and where.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterable, Iterator, NamedTuple

import msgspec
from blake3 import blake3

from ..errors import MergeConflict, UsageError
from ..ledger import Ledger, _codec
from ..ledger.events import EventHead, Retracted
from . import segment
from .segment import SegmentError

__all__ = ["export", "merge", "merge_into", "Exported", "MergeResult", "BATCH"]

BATCH = 10_000  # events per append batch and per bulk lookup
_head_decoder = msgspec.msgpack.Decoder(EventHead)  # what the views need of an event; samples etc. skipped


class Exported(NamedTuple):
    path: str  # the segment written (named by its content when the output was a directory)
    ledger_id: str
    events: int


class MergeResult(NamedTuple):
    db: str
    segments: list[dict]  # per segment: path, source ledger id, events
    added: int  # events newly written
    existing: int  # events the ledger held already
    seconds: float

    def to_json(self) -> dict:
        return self._asdict()


def export(db: str | None, output: str, *, table: str | None = None, backend: str | None = None,
           gpu_name: str | None = None, since: int = 0) -> Exported:
    """Writes the ledger's events of sequence > `since` (of one table, backend and GPU key where given) to a new
    segment, in log order, from one snapshot. A retraction goes where the event it retracts would. `output` an existing
    directory: the segment is named by its content there (see kprof.merge.segment.write)."""
    if since < 0:
        raise UsageError(f"--since {since}: give a sequence number >= 0 (0: from the first event)")
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        events_db = ledger.dbs["events"]
        chosen: list[bytes] = []

        def wanted(prov) -> bool:
            return ((table is None or prov.table == table) and (backend is None or prov.backend == backend)
                    and (gpu_name is None or prov.gpu_key == gpu_name))

        for seq, eid, data in ledger.iter_log(txn):
            if seq <= since:
                continue
            event = _codec.stored_event(data, eid)
            if type(event) is Retracted:  # in the scope of the event it retracts
                target = txn.get(event.target, db=events_db)
                event = None if target is None else _codec.stored_event(target, event.target)
                if event is None or type(event) is Retracted:
                    continue
            if wanted(event.provenance):
                chosen.append(eid)
        written = segment.write(output, (txn.get(eid, db=events_db) for eid in chosen), ledger.ledger_id, len(chosen))
        return Exported(written, ledger.ledger_id, len(chosen))


def _events(paths: list[str], digests: list, checked: list | None = None
            ) -> Iterator[tuple[int, str, int, bytes, object, bytes]]:
    """(segment index, path, event index, event id, event, bytes) of every event of the segments, each checked:
    canonical bytes, and a key its provenance hashes to; each segment's digest is appended to `digests`.
    `checked`: the digests of a first pass that checked these events; the segments must still hold exactly those
    bytes (a file changed since is refused), the per-event checks are not repeated, and each event is decoded as
    far as the views need (its bytes are stored as they are)."""
    decoder = _codec.event_decoder if checked is None else _head_decoder  # checked: the views' fields suffice
    for s, path in enumerate(paths):
        for i, data in enumerate(segment.read(path, digests)):
            try:
                event = decoder.decode(data)
            except Exception as exc:  # noqa: BLE001 - any decoding failure names the event
                raise SegmentError(f"{path}: event {i} does not decode ({exc})") from None
            eid = _codec.event_id(data)
            if checked is not None:
                yield s, path, i, eid, event, data
                continue
            if _codec.encode(event) != data:
                raise SegmentError(f"{path}: event {i} is not in canonical form (not written by kprof)")
            if type(event) is not Retracted and _codec.provenance_key(event.provenance) != event.key:
                raise SegmentError(f"{path}: event {i} ({eid.hex()[:16]}) carries a key its provenance does not hash "
                                   f"to (forged)")
            yield s, path, i, eid, event, data


def _batch_digest(items: list) -> bytes:
    """A batch's events, as one digest of their ids (each the hash of the event's bytes)."""
    return blake3(b"".join(item[3] for item in items)).digest()


def _batches(items: Iterable) -> Iterator[list]:
    batch, n = [], BATCH
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class _Check:
    """Pass 1: the current event of every key the segments touch, as the merge would leave it, and the
    conflicts found on the way."""

    def __init__(self, ledger: Ledger, txn):
        self.ledger, self.txn = ledger, txn
        self.current: dict[bytes, bytes | None] = {}  # key -> current event id (None: no row)
        self.origin: dict[bytes, int] = {}  # key -> the segment whose event made it current (absent: the ledger)
        self.unchecked: set[bytes] = set()  # keys a segment's retraction touched
        self.seen: set[bytes] = set()  # event ids of the segments so far
        self.conflicts: list[dict] = []
        self.events = 0
        self.batch_digests: list[bytes] = []  # per batch of BATCH events, what the write pass must find again

    def batch(self, items: list) -> None:
        from ..ledger import _lookup, _verify

        self.batch_digests.append(_batch_digest(items))
        txn, dbs, led = self.txn, self.ledger.dbs, self.ledger
        new_keys = list({event.key for *_rest, event, _data in items} - self.current.keys())
        rows = _verify.rows(txn, dbs, led.path, new_keys, led.format_version >= 2, False, led.format_version)
        for key, row in zip(new_keys, rows):  # the rows here, verified as every read is
            self.current[key] = None if row is None else row[1]
        eids = [item[3] for item in items]
        stored = {e for e, v in zip(eids, _lookup.values(txn.cursor(dbs["events"]), eids)) if v is not None}
        for s, path, i, eid, event, _data in items:
            self.events += 1
            if eid in stored or eid in self.seen:
                continue
            self.seen.add(eid)
            key = event.key
            if type(event) is Retracted:
                if event.target not in self.seen and txn.get(event.target, db=dbs["events"]) is None:
                    raise UsageError(f"{path}: event {i} retracts event {event.target.hex()[:16]}, which neither this "
                                     f"ledger nor the segments before it hold; merge the segment that holds it first "
                                     f"(nothing was merged)")
                self.unchecked.add(key)
                continue
            if key in self.unchecked:
                continue
            here, origin = self.current[key], self.origin.get(key)
            if origin == s or here is None or here == eid or here == event.parent:
                self.current[key], self.origin[key] = eid, s
            else:
                self.conflicts.append({"segment": path, "index": i, "key": key, "incoming": eid, "current": here,
                                       "incoming_event": event})


def _report(ledger: Ledger, conflicts: list[dict]) -> dict:
    """The merge report: per conflicting key, both events, their metrics and the relative difference of time_ms."""
    rows = []
    for c in conflicts:
        here = ledger.event(c["current"])
        theirs = c["incoming_event"]
        mine_m, theirs_m = getattr(here, "metrics", None), getattr(theirs, "metrics", None)
        diff = None
        if mine_m and theirs_m and mine_m.get("time_ms") and theirs_m.get("time_ms") is not None:
            diff = theirs_m["time_ms"] / mine_m["time_ms"] - 1
        rows.append({"key": c["key"].hex(), "segment": c["segment"], "index": c["index"],
                     "provenance": msgspec.to_builtins(theirs.provenance),
                     "current": {"event": c["current"].hex(), "kind": type(here).__name__.lower(), "metrics": mine_m},
                     "incoming": {"event": c["incoming"].hex(), "kind": type(theirs).__name__.lower(),
                                  "parent": theirs.parent.hex() if theirs.parent else None, "metrics": theirs_m},
                     "time_ms_relative_difference": diff})
    return {"ledger": ledger.path, "conflicts": len(rows), "keys": rows}


def merge(paths: list[str], db: str | None = None, output_dir: str | None = None) -> MergeResult:
    """Merges the segments at `paths` into the ledger, all or nothing (see the module docstring)."""
    started = time.perf_counter()
    if not paths:
        raise UsageError("give at least one segment to merge")
    headers = [segment.header_of(p) for p in paths]
    with Ledger.open(db) as ledger:
        added, existing = merge_into(ledger, paths, output_dir)
        db_path = ledger.path
    segments = [{"path": p, "ledger_id": h.ledger_id, "events": h.events} for p, h in zip(paths, headers)]
    return MergeResult(db_path, segments, added, existing, time.perf_counter() - started)


def merge_into(ledger: Ledger, paths: list[str], output_dir: str | None = None) -> tuple[int, int]:
    """Merges the segments at `paths` into the open (writable) ledger, all or nothing: (events added, events the
    ledger held already). A conflict writes `merge-report.json` to `output_dir` (default: the working directory)
    and raises MergeConflict. The pool merges each worker's segments through it as they arrive."""
    out = output_dir or "."
    with ledger.read() as txn:
        check = _Check(ledger, txn)
        digests: list[bytes] = []
        for items in _batches(_events(paths, digests)):
            check.batch(items)
    if check.conflicts:
        report = _report(ledger, check.conflicts)
        os.makedirs(out, exist_ok=True)
        where = os.path.join(out, "merge-report.json")
        with open(where, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        first = report["keys"][0]
        raise MergeConflict(f"{len(check.conflicts)} incoming event(s) conflict with the ledger's current rows "
                            f"(first: key {first['key'][:16]}, current {first['current']['event'][:16]}, incoming "
                            f"{first['incoming']['event'][:16]}); nothing was merged; the conflicts are in "
                            f"{where}", report)
    added = existing = 0
    again: list[bytes] = []
    for n, items in enumerate(_batches(_events(paths, again, checked=digests))):
        verified = check.batch_digests[n] if n < len(check.batch_digests) else None
        if _batch_digest(items) != verified:  # a file changed since the check: stop before this batch
            raise SegmentError(f"{items[0][1]} changed while it was merged ({added + existing} event(s) before "
                               f"the change were merged); merge it again")
        result = ledger.append_checked([(event, data, eid) for _s, _p, _i, eid, event, data in items])
        added, existing = added + len(result.added), existing + len(result.existing)
    return added, existing
