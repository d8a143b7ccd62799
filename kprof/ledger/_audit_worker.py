"""One shard of an audit, run in a process of the audit's pool (`main`); a damaged page that faults the reader
kills only that process, and the audit reports it as a finding.

Shard s of n owns the row keys whose first byte b has b * n // 256 == s, and the events of those keys. It
  - walks the sub-databases: the views keyed by row key over its key range as it compares them, the log whole
    (every shard needs it; shard 0 reports what is wrong with it), the event store in the events pass, the rest
    (scope index, meta, retractions, scopes) one shard each,
  - reads the event store once; for each event of its keys it recomputes the id (the bytes' hash) and the key
    (the provenance's), checks the provenance is in canonical form, and finds its place in the log,
  - replays its events, in log order, through the Reducer (the one code that says how an event changes the
    views) into memory, and compares its part of every view with that replay,
  - returns its partial scope accumulators, which the parent sums (the view root's hash is additive).
Every decoding is msgspec's: a key-only schema picks each event's shard without decoding the rest.
"""

from __future__ import annotations

import gc
from collections import defaultdict

import lmdb
import msgspec

from . import _codec
from ._reducer import REBUILT, Reducer, ScopeEntry, Store, opened, seq_of
from .events import EventAudit, EventKey, Provenance, Retracted

MAX_LISTED = 50
RANGED = ("current", "history", "failures")  # views keyed by the row key
WALKED_WHERE_READ = RANGED + ("log", "events")  # not walked again by `structure`
key_decoder = msgspec.msgpack.Decoder(EventKey)
audit_decoder = msgspec.msgpack.Decoder(EventAudit)
provenance_decoder = msgspec.msgpack.Decoder(Provenance)


class MemoryStore(Store):
    """The views as plain dicts, the log and events read from `txn`: a replay that does not touch the file."""

    def __init__(self, txn, dbs):
        self.txn, self.dbs = txn, dbs
        self.data: defaultdict[str, dict[bytes, bytes]] = defaultdict(dict)

    def get(self, db, k):
        return self.data[db].get(k)

    def put(self, db, k, v):
        self.data[db][k] = v

    def delete(self, db, k):
        self.data[db].pop(k, None)

    def logged(self, seq):
        return self.txn.get(seq, db=self.dbs["log"])

    def event(self, eid):
        return _codec.event_decoder.decode(self.txn.get(eid, db=self.dbs["events"]))


def replay_into(store: Store, events) -> None:
    """Applies (seq, event id, event), in log order, to a store."""
    reducer = Reducer(store)
    for seq, eid, event in events:
        reducer.apply(event, eid, seq)
    reducer.flush()


class Findings:
    def __init__(self):
        self.items: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, check: str, text: str) -> None:
        n = self.counts.get(check, 0)
        self.counts[check] = n + 1
        if n < MAX_LISTED:
            self.items.append(f"{check}: {text}")


def key_of_event(data: bytes | None) -> bytes | None:
    """The key an event's bytes carry (None where they do not decode as an event)."""
    try:
        return None if data is None else key_decoder.decode(data).key
    except msgspec.DecodeError:
        return None


class Shard:
    def __init__(self, ledger, shard: int, shards: int, found: Findings):
        self.ledger, self.shard, self.shards, self.found = ledger, shard, shards, found
        self.walked: dict[str, int] = {}  # entries of each ranged view walked over this shard's range
        # the smallest first byte each shard owns (see `mine`): ceil(s * 256 / shards)
        self.lo = bytes([-(-shard * 256 // shards)]) if shard else b""
        self.hi = bytes([-(-(shard + 1) * 256 // shards)]) if shard + 1 < shards else None

    def mine(self, k: bytes | None) -> bool:
        """Whether this shard owns a row key (an empty or absent one, from damage, is shard 0's)."""
        return (k[0] if k else 0) * self.shards // 256 == self.shard

    def _range(self, cursor, name: str):
        """(key, value) of a cursor over this shard's key range, counted into `walked` and checked in order."""
        hi, seen, last = self.hi, 0, None
        try:
            if not (cursor.set_range(self.lo) if self.lo else cursor.first()):
                return
            for k, v in cursor:
                if hi is not None and k >= hi:
                    return
                if last is not None and k <= last:
                    self.found.add("structure", f"{name}: keys out of order after {last.hex()[:24]}")
                last, seen = k, seen + 1
                yield k, v
        except lmdb.Error as exc:
            self.found.add("structure", f"{name}: walk failed after {seen} entries of shard {self.shard}'s "
                                        f"range: {exc}")
        finally:
            self.walked[name] = seen

    def structure(self, txn) -> None:
        """Walks this shard's share of the sub-databases not walked where they are read: keys strictly
        increasing, as many as the header counts."""
        rest = [(name, db) for name, db in sorted(self.ledger.dbs.items()) if name not in WALKED_WHERE_READ]
        for i, (name, db) in enumerate(rest):
            if i % self.shards != self.shard:
                continue
            expected, seen, last = txn.stat(db)["entries"], 0, None
            try:
                for key in txn.cursor(db).iternext(values=False):
                    if last is not None and key <= last:
                        self.found.add("structure", f"{name}: keys out of order at entry {seen}")
                        break
                    last, seen = key, seen + 1
            except lmdb.Error as exc:
                self.found.add("structure", f"{name}: walk failed at entry {seen}: {exc}")
                continue
            if seen != expected:
                self.found.add("structure", f"{name}: header counts {expected} entries, walk found {seen}")

    def _report(self, check: str, text: str) -> None:
        """A finding of what every shard reads whole (the log, the meta): shard 0 reports it, once."""
        if self.shard == 0:
            self.found.add(check, text)

    def log(self, txn) -> tuple[dict[bytes, int], int, int]:
        """(event id -> seq of every logged event, last_seq, log entries walked). The log's keys must be the
        sequence numbers 1..last_seq in order, each event logged once."""
        report = self._report
        last_seq = self._meta(txn)
        seqs: dict[bytes, int] = {}
        expect, walked = 1, 0
        try:
            for k, eid in txn.cursor(self.ledger.dbs["log"]):
                walked += 1
                if len(k) != 8:
                    report("log", f"entry {k.hex()[:24]} after seq {expect - 1}: a key of {len(k)} bytes, not a "
                                  f"sequence number (8)")
                    continue
                seq = seq_of(k)
                if seq != expect:
                    report("log", f"sequence {expect} expected, found {seq}")
                    expect = seq
                expect += 1
                if eid in seqs:
                    report("log", f"seq {seq}: event {eid.hex()[:16]} logged twice")
                    continue
                seqs[eid] = seq
        except lmdb.Error as exc:
            report("structure", f"log: walk failed after {walked} entries: {exc}")
        expected = txn.stat(self.ledger.dbs["log"])["entries"]
        if walked != expected:
            report("structure", f"log: header counts {expected} entries, walk found {walked}")
        if expect - 1 != last_seq:
            report("log", f"meta says last_seq {last_seq}, log ends at {expect - 1}")
        return seqs, last_seq, walked

    def _meta(self, txn) -> int:
        """Checks the meta entries a reader or writer relies on (shard 0 reports); returns last_seq, or -1 where
        it is not a count."""
        meta, report = self.ledger.dbs["meta"], self._report
        values = {}
        for name, valid, fix in ((b"format_version", lambda v: type(v) is int and v > 0, "a positive integer"),
                                 (b"ledger_id", lambda v: type(v) is str and len(v) == 32
                                  and all(c in "0123456789abcdef" for c in v), "32 hex digits"),
                                 (b"last_seq", lambda v: type(v) is int and v >= 0, "a count"),
                                 (b"created_at", lambda v: type(v) is float, "a time"),
                                 (REBUILT, lambda v: type(v) is int and v > 0, "a count of rebuilds")):
            raw = txn.get(name, db=meta)
            if raw is None and name == REBUILT:  # absent until the views are first rebuilt
                continue
            try:
                value = None if raw is None else msgspec.msgpack.decode(raw)
            except msgspec.DecodeError:
                report("meta", f"{name.decode()}: its bytes do not decode ({raw.hex()[:32]})")
                continue
            if raw is None:
                report("meta", f"{name.decode()} is missing")
            elif not valid(value):
                report("meta", f"{name.decode()} is {value!r}, not {fix}")
            else:
                values[name] = value
        return values.get(b"last_seq", -1)

    def events(self, txn, seqs: dict[bytes, int]) -> tuple[int, int, list]:
        """One pass over the event store: each event of this shard's keys checked (id, key, canonical
        provenance, logged) and kept for the replay as (seq, event id, event). Returns (events owned, of which
        logged, kept). The parent checks that the shards' logged counts add up to the log's length."""
        add, event_id, encode, key_of = self.found.add, _codec.event_id, _codec.encode, _codec.key_of
        n, logged, kept, unlogged, last = 0, 0, [], 0, None
        try:
            for eid, data in txn.cursor(self.ledger.dbs["events"]):
                if self.shard == 0:
                    if last is not None and eid <= last:
                        add("structure", f"events: keys out of order at {eid.hex()[:16]}")
                    last = eid
                if not self.mine(key_of_event(data)):
                    continue
                n += 1
                seq = seqs.get(eid)
                logged += seq is not None
                if event_id(data) != eid:
                    add("events", f"event {eid.hex()[:16]}: stored bytes hash to another id (altered or damaged)")
                    continue
                try:
                    event = audit_decoder.decode(data)
                    if type(event) is not Retracted:
                        prov = provenance_decoder.decode(event.provenance)
                except msgspec.DecodeError as exc:
                    add("events", f"event {eid.hex()[:16]}: cannot be decoded ({exc})")
                    continue
                if type(event) is not Retracted:
                    canonical = encode(prov)
                    if key_of(canonical) != event.key:
                        add("keys", f"event {eid.hex()[:16]}: key {event.key.hex()[:16]} does not match its "
                                    f"provenance")
                    if canonical != bytes(event.provenance):
                        add("events", f"event {eid.hex()[:16]}: its provenance is not in canonical form")
                    event = msgspec.structs.replace(event, provenance=prov)  # the reducer reads its fields
                if seq is None:
                    unlogged += 1
                    if unlogged <= MAX_LISTED:
                        add("log", f"event {eid.hex()[:16]} is stored but not in the log")
                    continue
                if type(event) is not Retracted or self._retraction_ok(txn, eid, event):
                    kept.append((seq, eid, event))
        except lmdb.Error as exc:
            add("structure", f"events: walk failed after {n} events of shard {self.shard}: {exc}")
        return n, logged, kept

    def _retraction_ok(self, txn, eid: bytes, event) -> bool:
        """Whether a logged retraction names an event an append would accept: one stored, of its own key, not
        itself a retraction. One that does not is named, and left out of the replay (which could not apply
        it); the views it touched then differ from the replay, and are named too."""
        data = txn.get(event.target, db=self.ledger.dbs["events"])
        try:
            target = None if data is None else key_decoder.decode(data)
        except msgspec.DecodeError:
            target = None
        problem = None
        if target is None:
            problem = "which is not stored" if data is None else "which cannot be decoded"
        elif target.key != event.key:
            problem = "of another key"
        elif type(target).__name__ == "RetractedKey":
            problem = "itself a retraction"
        if problem is not None:
            self.found.add("events", f"retraction {eid.hex()[:16]} names event {event.target.hex()[:16]}, {problem}")
        return problem is None

    def views(self, txn, kept: list) -> dict:
        """Replays this shard's events through the Reducer, in log order, and compares its part of every view
        with the result; returns the replay's partial scope entries."""
        dbs, get = self.ledger.dbs, txn.get
        kept.sort(key=lambda item: item[0])
        memory = MemoryStore(txn, dbs)
        replay_into(memory, kept)
        rebuilt = memory.data
        owned = {
            "current": lambda: self._range(txn.cursor(dbs["current"]), "current"),
            "history": lambda: self._range(txn.cursor(dbs["history"]), "history"),
            "failures": lambda: self._range(txn.cursor(dbs["failures"]), "failures"),
            # scope id (16) + shape id (16) + row key: owned by the row key
            "scope_index": lambda: ((k, v) for k, v in txn.cursor(dbs["scope_index"]) if self.mine(k[32:])),
            # target event id -> retraction id: owned by the target's key
            "retracted": lambda: ((k, v) for k, v in txn.cursor(dbs["retracted"])
                                  if self.mine(key_of_event(get(k, db=dbs["events"])))),
        }
        for name, walk in owned.items():
            try:
                stored = dict(walk())
            except lmdb.Error as exc:
                self.found.add("structure", f"{name}: read failed in shard {self.shard}: {exc}")
                continue
            self._compare(name, stored, rebuilt[name])
        return {sid: opened("scopes", sid, v, ScopeEntry) for sid, v in rebuilt["scopes"].items()}

    def _compare(self, name: str, stored: dict[bytes, bytes], rebuilt: dict[bytes, bytes]) -> None:
        if stored == rebuilt:
            return
        add = self.found.add
        for k, v in stored.items():
            want = rebuilt.get(k)
            if want is None:
                add("views", f"{name}: stored entry {k.hex()[:24]} is not derivable from the log")
            elif want != v:
                add("views", f"{name}: entry {k.hex()[:24]} differs from the log's replay")
        for k in rebuilt.keys() - stored.keys():
            add("views", f"{name}: entry {k.hex()[:24]} of the log's replay is not stored")

    def stored_scopes(self, txn) -> dict[bytes, bytes]:
        """The stored scopes view, for the parent to compare with the sum of the shards' replays: read here,
        where a damaged page faults a shard's process, not the parent."""
        try:
            return dict(txn.cursor(self.ledger.dbs["scopes"]))
        except lmdb.Error as exc:
            self.found.add("structure", f"scopes: read failed: {exc}")
            return {}


def main(shard: int, shards: int, path: str) -> dict:
    from .store import Ledger

    gc.disable()  # bulk decoding: the objects made here hold no cycles
    found = Findings()
    ledger = Ledger.open(path, readonly=True, readahead=True)  # whole-file scans: let the kernel read ahead
    work = Shard(ledger, shard, shards, found)
    with ledger, ledger.read() as txn:
        work.structure(txn)
        seqs, last_seq, log_entries = work.log(txn)
        header_events = txn.stat(ledger.dbs["events"])["entries"]
        view_entries = {name: txn.stat(ledger.dbs[name])["entries"] for name in RANGED}
        n_events, n_logged, kept = work.events(txn, seqs)
        del seqs
        scopes = work.views(txn, kept)
        stored_scopes = work.stored_scopes(txn) if shard == 0 else {}
    return {"stored_scopes": stored_scopes, "findings": found.items, "counts": found.counts, "events": n_events,
            "header_events": header_events, "last_seq": last_seq, "logged": n_logged, "log_entries": log_entries,
            "walked": work.walked, "view_entries": view_entries, "scopes": scopes}
