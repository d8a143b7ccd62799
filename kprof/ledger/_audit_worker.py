"""One audit shard, in a process of the audit's pool (`main`): a damaged page faulting the reader kills only it.
Shard s of n owns the row keys whose first byte b has b * n // 256 == s and their events: it recomputes their ids and
keys, replays them in log order through the Reducer, compares its part of every view (the parent sums accumulators)."""

from __future__ import annotations

import gc
from collections import Counter, defaultdict

import lmdb
import msgspec

from . import _codec
from ._reducer import REBUILT, Reducer, ScopeEntry, Store, opened, seq_of
from .events import EventAudit, EventKey, Provenance, Retracted, RetractedKey

MAX_LISTED = 50  # findings listed per check; all are counted
_NEWER = "(damaged, or a newer kprof's fields: audit it with that kprof)"
RANGED = ("current", "history", "failures")  # views keyed by the row key
WALKED_WHERE_READ = RANGED + ("log", "events")  # not walked again by `structure`
key_decoder = msgspec.msgpack.Decoder(EventKey)  # the key only: picks an event's shard without decoding the rest
audit_decoder = msgspec.msgpack.Decoder(EventAudit)
provenance_decoder = msgspec.msgpack.Decoder(Provenance)
META = (  # meta entries relied on, besides format_version (every open checks it): (name, valid value, what it is)
    (b"ledger_id", lambda v: type(v) is str and len(v) == 32 and set(v) <= set("0123456789abcdef"), "32 hex digits"),
    (b"last_seq", lambda v: type(v) is int and v >= 0, "a count"),
    (b"created_at", lambda v: type(v) is float, "a time"),
    (REBUILT, lambda v: type(v) is int and v > 0, "a count of rebuilds"),  # absent until the views are first rebuilt
)


class MemoryStore(Store):
    """The views as plain dicts, the log and events read from `txn`: a replay that does not touch the file."""

    def __init__(self, txn, dbs):
        self.txn, self.dbs, self.data = txn, dbs, defaultdict(dict)  # data: db -> {key: value}

    def get(self, db, k):
        return self.txn.get(k, db=self.dbs[db]) if db in ("log", "events") else self.data[db].get(k)

    def put(self, db, k, v):
        self.data[db][k] = v

    def delete(self, db, k):
        self.data[db].pop(k, None)


def replay_into(store: Store, events) -> None:
    """Applies (seq, event id, event), in log order, to a store."""
    reducer = Reducer(store)
    for seq, eid, event in events:
        reducer.apply(event, eid, seq)
    reducer.flush()


class Findings:
    def __init__(self):
        self.items, self.counts = [], Counter()

    def add(self, check: str, text: str) -> None:
        self.counts[check] += 1
        if self.counts[check] <= MAX_LISTED:
            self.items.append(f"{check}: {text}")


def key_of_event(data: bytes | None) -> bytes | None:
    """The key an event's bytes carry (None where they do not decode as an event)."""
    try:
        return None if data is None else key_decoder.decode(data).key
    except _codec.UNDECODABLE:
        return None


class Shard:
    def __init__(self, ledger, shard: int, shards: int, found: Findings):
        self.ledger, self.shard, self.shards, self.found = ledger, shard, shards, found
        self.walked: dict[str, int] = {}  # entries counted per ranged view and events; the parent sums them
        # what every shard reads whole (the log, the meta) is reported by shard 0 alone
        self._report = found.add if shard == 0 else lambda check, text: None
        # [lo, hi): the keys `mine` says are this shard's; lo is ceil(s * 256 / shards)
        self.lo = bytes([-(-shard * 256 // shards)]) if shard else b""
        self.hi = bytes([-(-(shard + 1) * 256 // shards)]) if shard + 1 < shards else None

    def mine(self, k: bytes | None) -> bool:
        """Whether this shard owns a row key (an empty or absent one, from damage, is shard 0's)."""
        return (k[0] if k else 0) * self.shards // 256 == self.shard

    def _range(self, cursor, name: str, whole: bool = False):
        """(key, value) over this shard's key range (`whole`: every key), counted into `walked`, each key checked to
        follow the last."""
        (lo, hi), seen, last, add = (b"", None) if whole else (self.lo, self.hi), 0, None, self.found.add
        try:
            if not (cursor.set_range(lo) if lo else cursor.first()):
                return
            for k, v in cursor:
                if hi is not None and k >= hi:
                    return
                if last is not None and k <= last:
                    add("structure", f"{name}: keys out of order after {last.hex()[:24]}")
                last, seen = k, seen + 1
                yield k, v
        except lmdb.Error as exc:
            where = "" if whole else f" of shard {self.shard}'s range"
            add("structure", f"{name}: walk failed after {seen} entries{where}: {exc}")
        finally:
            self.walked[name] = seen

    def structure(self, txn) -> None:
        """Walks its share of the other sub-databases whole: keys strictly increasing, as many as the header counts."""
        rest = [(name, db) for name, db in sorted(self.ledger.dbs.items()) if name not in WALKED_WHERE_READ]
        for name, db in rest[self.shard::self.shards]:
            expected, seen = txn.stat(db)["entries"], sum(1 for _entry in self._range(txn.cursor(db), name, True))
            if seen != expected:
                self.found.add("structure", f"{name}: header counts {expected} entries, walk found {seen}")

    def log(self, txn) -> tuple[dict[bytes, int], int, int]:
        """(event id -> seq, last_seq, log entries walked); the log's keys must be 1..last_seq, each event once."""
        report, last_seq = self._report, self._meta(txn)
        seqs, expect, walked = {}, 1, 0
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
        """Checks the META entries (shard 0 reports); returns last_seq, or -1 where it is not a count."""
        report, last_seq = self._report, -1
        for name, valid, fix in META:
            raw = txn.get(name, db=self.ledger.dbs["meta"])
            if raw is None:
                if name != REBUILT:
                    report("meta", f"{name.decode()} is missing")
                continue
            try:
                value = msgspec.msgpack.decode(raw)
            except _codec.UNDECODABLE:
                report("meta", f"{name.decode()}: its bytes do not decode ({raw.hex()[:32]})")
                continue
            if not valid(value):
                report("meta", f"{name.decode()} is {value!r}, not {fix}")
            elif name == b"last_seq":
                last_seq = value
        return last_seq

    def events(self, txn, seqs: dict[bytes, int]) -> tuple[int, int, list]:
        """Checks each event of this shard's keys (id, key, canonical provenance, logged) in one pass over the store.
        Returns (events owned, of which logged, (seq, event id, event) kept for the replay)."""
        add, event_id, encode, key_of = self.found.add, _codec.event_id, _codec.encode, _codec.key_of
        n, logged, kept, last = 0, 0, [], None
        try:
            for eid, data in txn.cursor(self.ledger.dbs["events"]):
                if self.shard == 0 and last is not None and eid <= last:
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
                    prov = None if type(event) is Retracted else provenance_decoder.decode(event.provenance)
                except _codec.UNDECODABLE as exc:
                    add("events", f"event {eid.hex()[:16]}: cannot be decoded ({exc})")
                    continue
                if prov is not None:
                    canonical = encode(prov)
                    if key_of(canonical) != event.key and key_of(bytes(event.provenance)) != event.key:
                        add("keys", f"event {eid.hex()[:16]}: key {event.key.hex()[:16]} does not match its provenance")
                    if canonical != bytes(event.provenance):  # or holds fields this kprof lacks: `canonical` drops them
                        add("events", f"event {eid.hex()[:16]}: its provenance is not in canonical form {_NEWER}")
                    event = msgspec.structs.replace(event, provenance=prov)  # the reducer reads its fields
                if seq is None:
                    add("log", f"event {eid.hex()[:16]} is stored but not in the log")
                    continue
                if type(event) is not Retracted or self._retraction_ok(txn, eid, event):
                    kept.append((seq, eid, event))
        except lmdb.Error as exc:
            add("structure", f"events: walk failed after {n} events of shard {self.shard}: {exc}")
        self.walked["events"] = n
        return n, logged, kept

    def _retraction_ok(self, txn, eid: bytes, event) -> bool:
        """Whether a logged retraction names an event an append would accept (stored, of its own key, not itself a
        retraction). One that does not is named and left out of the replay, which could not apply it."""
        data = txn.get(event.target, db=self.ledger.dbs["events"])
        try:
            target = None if data is None else key_decoder.decode(data)
        except _codec.UNDECODABLE:
            target = None
        problem = ("which is not stored" if data is None else "which cannot be decoded" if target is None
                   else "of another key" if target.key != event.key
                   else "itself a retraction" if type(target) is RetractedKey else None)
        if problem is not None:
            self.found.add("events", f"retraction {eid.hex()[:16]} names event {event.target.hex()[:16]}, {problem}")
        return problem is None

    def views(self, txn, kept: list) -> dict:
        """Compares this shard's part of every view with its events' replay; returns the replay's scope entries."""
        dbs = self.ledger.dbs
        kept.sort(key=lambda item: item[0])
        rebuilt = MemoryStore(txn, dbs)
        replay_into(rebuilt, kept)
        owned = {name: lambda name=name: self._range(txn.cursor(dbs[name]), name) for name in RANGED}
        # scope id (16) + shape id (16) + row key: owned by the row key
        owned["scope_index"] = lambda: ((k, v) for k, v in txn.cursor(dbs["scope_index"]) if self.mine(k[32:]))
        # target event id -> retraction id: owned by the target's key
        owned["retracted"] = lambda: ((k, v) for k, v in txn.cursor(dbs["retracted"])
                                      if self.mine(key_of_event(txn.get(k, db=dbs["events"]))))
        for name, walk in owned.items():
            try:
                stored = dict(walk())
            except lmdb.Error as exc:
                self.found.add("structure", f"{name}: read failed in shard {self.shard}: {exc}")
                continue
            self._compare(name, stored, rebuilt.data[name])
        return {sid: opened("scopes", sid, v, ScopeEntry) for sid, v in rebuilt.data["scopes"].items()}

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
        """The stored scopes view for the parent (shard 0's): read here, where a damaged page faults a shard."""
        try:
            return dict(txn.cursor(self.ledger.dbs["scopes"])) if self.shard == 0 else {}
        except lmdb.Error as exc:
            self.found.add("structure", f"scopes: read failed: {exc}")
            return {}


def main(shard: int, shards: int, path: str) -> dict:
    from .store import Ledger

    gc.disable()  # bulk decoding: the objects made here hold no cycles
    ledger = Ledger.open(path, readonly=True, readahead=True)  # whole-file scans: let the kernel read ahead
    work = Shard(ledger, shard, shards, Findings())
    with ledger, ledger.read() as txn:
        work.structure(txn)
        seqs, last_seq, log_entries = work.log(txn)
        entries = {name: txn.stat(ledger.dbs[name])["entries"] for name in ("events",) + RANGED}
        n_events, n_logged, kept = work.events(txn, seqs)
        del seqs
        scopes, stored_scopes = work.views(txn, kept), work.stored_scopes(txn)
        snapshot = txn.id()  # the last write committed before this read: shards agree only on one state
    return {"stored_scopes": stored_scopes, "findings": work.found.items, "counts": work.found.counts,
            "snapshot": snapshot, "events": n_events, "last_seq": last_seq, "logged": n_logged, "log_entries": log_entries,
            "walked": work.walked, "entries": entries, "scopes": scopes}
