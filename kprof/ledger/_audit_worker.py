"""One shard of an audit, run in its own child process: `python -m kprof.ledger._audit_worker SHARD
SHARDS PATH` prints one JSON document. The parent runs one shard per core; a damaged page that faults the
reader kills only the child and is reported as a finding.

Shard s owns the keys whose first byte b has b * SHARDS // 256 == s, and the events of those keys. It
  - walks its share of the sub-databases (keys strictly increasing, counts equal to the headers'),
  - reads the event store once, in order, and for each event of its keys recomputes the id and key and
    replays it into the views at once (a retraction-free replay needs no log order: a key's row is its
    latest event; with a retraction the shard replays its events again, in log order, by the Reducer),
  - compares its part of every view with its replay,
  - returns its partial scope accumulators, which the parent sums (the view root's hash is additive),
and shard 0 also checks the log: 1..last_seq, each event once, each present.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from itertools import islice

import lmdb
import msgspec

from . import _codec
from ._lookup import sorted_keys
from ._reducer import (FAILED, MOD, ProvenanceIds, current_row, history_from_v1, history_seqs, index_key, pack_seq,
                       row_terms, status_of, unpack_seq)
from .events import KIND, EventAudit, EventHead, Provenance, Retracted, Scalar, summary_of_decoded
from .replay import MemoryStore, replay_into

MAX_LISTED = 50
RANGED = ("current", "history", "failures")  # views keyed by the row key
head_decoder = msgspec.msgpack.Decoder(EventHead)


class Findings:
    def __init__(self):
        self.items: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, check: str, text: str) -> None:
        n = self.counts.get(check, 0)
        self.counts[check] = n + 1
        if n < MAX_LISTED:
            self.items.append(f"{check}: {text}")


def key_of_bytes(data: bytes) -> bytes | None:
    """The key of an event from its canonical bytes without decoding them: every event kind encodes as a
    map whose first two entries are `type` (the tag) and `key` (32 bytes), in that order."""
    try:
        at = 6 + 1 + (data[6] & 0x1F) + 4 + 2  # map header, "type", tag string, "key", bin8 header
        return data[at:at + 32] if data[at - 6:at - 2] == b"\xa3key" else None
    except IndexError:
        return None


class NotDerivable(ValueError):
    """A provenance whose bytes cannot be decoded."""


class Provenances:
    """What the views need of a provenance, read from its canonical bytes: (scope names, scope id, contract
    id) and the shape's bytes. The shape is the last field of the encoding, so the bytes before it (table,
    backend, GPU, contract) are one of the few prefixes a ledger's events share: each prefix is decoded,
    validated and checked canonical once, and per event only the shape is."""

    _SHAPE = b"\xa5shape"  # the msgpack string "shape": the last map key of a provenance that has a shape

    def __init__(self):
        self._prefixes: dict[bytes, tuple] = {}
        self._ids = ProvenanceIds()
        self._hit: tuple | None = None  # (prefix, info) of the last provenance read: most share the one before's

    def read(self, pb: bytes) -> tuple[tuple, bytes, bytes]:
        """(info, canonical shape bytes, canonical provenance bytes); info is (names, scope id, contract id).
        Raises NotDerivable for bytes that do not decode to a Provenance."""
        hit = self._hit
        if hit is not None and pb.startswith(hit[0]):
            cut, info = len(hit[0]), hit[1]
        else:
            cut = pb.rfind(self._SHAPE) + len(self._SHAPE)
            info = self._prefixes.get(pb[:cut]) if cut >= len(self._SHAPE) else None
            if info is None:  # a new prefix, or "shape" also occurs inside the shape: decode it all
                return self._first(pb)
            self._hit = (pb[:cut], info)
        # pb = a verified prefix + the rest, which must decode as exactly one msgpack value (no trailing bytes)
        # for pb to be a provenance: the shape
        shape = pb[cut:]
        try:
            canonical = _codec.encode(shape_decoder.decode(shape))
        except msgspec.DecodeError as exc:
            raise NotDerivable(str(exc)) from None
        return info, canonical, pb if canonical == shape else pb[:cut] + canonical

    def _first(self, pb: bytes) -> tuple[tuple, bytes, bytes]:
        try:
            prov = provenance_decoder.decode(pb)
        except msgspec.DecodeError as exc:
            raise NotDerivable(str(exc)) from None
        info = ((prov.table, prov.backend, prov.gpu_key), self._ids.scope(prov), self._ids.contract(prov))
        canonical, shape = _codec.encode(prov), _codec.encode(prov.shape)
        if canonical == pb and prov.shape:
            self._prefixes[pb[:-len(shape)]] = info
        return info, shape, canonical


provenance_decoder = msgspec.msgpack.Decoder(Provenance)
shape_decoder = msgspec.msgpack.Decoder(dict[str, Scalar])
audit_decoder = msgspec.msgpack.Decoder(EventAudit)


class PlainReplay:
    """The views and scope entries a Reducer builds from events none of which is a retraction, derived in
    any order: a key's current row is simply its latest event, rows are never removed, and each scope's
    root accumulator is the sum over its keys' latest events. Equal to `replay_into(MemoryStore)` of the
    same events in log order (a test holds the two equal); several times faster, and it needs no sort.

    `add` takes the sequence number as its 8 big-endian bytes (the log's key), which order as the numbers do.
    """

    def __init__(self):
        self._seqs: dict[bytes, bytes] = {}  # key -> its events' seqs, in the order added
        self.scope_index: dict[bytes, bytes] = {}
        self._failures: dict[bytes, tuple] = {}
        self._last: dict[bytes, tuple] = {}
        self._scopes: dict[bytes, list] = {}  # scope id -> [names, contract ids]

    def add(self, seq: bytes, eid: bytes, event, info: tuple, shape: bytes) -> None:
        key = event.key
        seqs = self._seqs.get(key)
        self._seqs[key] = seq if seqs is None else seqs + seq
        names, sid, cid = info
        scope = self._scopes.get(sid)
        if scope is None:
            scope = self._scopes[sid] = [names, set()]
        scope[1].add(cid)
        self.scope_index[index_key(sid, shape, key)] = b""
        kind = KIND[type(event)]
        latest = self._last.get(key)
        if latest is None or seq > latest[0]:  # the row, as bytes: the event (and the bytes it was read from) can go
            self._last[key] = (seq, sid, eid, current_row(kind, eid, event, summary_of_decoded))
        if kind == FAILED:
            failed = self._failures.get(key)
            if failed is None or seq > failed[0]:
                self._failures[key] = (seq, eid)

    def logged(self) -> list[bytes]:
        """The seqs of the events added."""
        return [seq for seqs in self._seqs.values() for seq in history_seqs(seqs, 0)]

    def result(self) -> tuple[dict[str, dict], dict[bytes, list]]:
        current, history, rows = {}, {}, {sid: [] for sid in self._scopes}  # scope id -> its rows' key + event id
        seqs_of = self._seqs
        for key, (_seq, sid, eid, row) in self._last.items():
            current[key] = row
            seqs = seqs_of[key]
            history[key] = row[:1] + (seqs if len(seqs) == 8 else b"".join(sorted(history_seqs(seqs, 0))))
            rows[sid].append(key + eid)
        scopes = {sid: [*names, len(rows[sid]), (row_terms(rows[sid]) % MOD).to_bytes(32, "big"), sorted(contracts)]
                  for sid, (names, contracts) in self._scopes.items()}
        data = {"current": current, "history": history, "scope_index": self.scope_index,
                "failures": {key: eid for key, (_seq, eid) in self._failures.items()}, "retracted": {}}
        return data, scopes


class Shard:
    def __init__(self, ledger, shard: int, shards: int, found: Findings, detailed: bool = False):
        self.ledger, self.shard, self.shards, self.found = ledger, shard, shards, found
        self.detailed = detailed  # compare every view entry by entry (the parent asks when counts disagree)
        self.rebuilt: dict[str, int] = {}  # entries of each view this shard's replay derives
        self.subset_ok = True  # every rebuilt entry was found stored as rebuilt
        self.lo = bytes([shard * 256 // shards]) if shard else b""
        self.hi = bytes([(shard + 1) * 256 // shards]) if shard + 1 < shards else None

    def mine(self, k: bytes) -> bool:
        return k[0] * self.shards // 256 == self.shard

    def _range(self, cursor):
        """(key, value) of a cursor over this shard's key range."""
        ok = cursor.set_range(self.lo) if self.lo else cursor.first()
        if not ok:
            return
        hi = self.hi
        for k, v in cursor:
            if hi is not None and k >= hi:
                return
            yield k, v

    def structure(self, txn) -> None:
        """Walks this shard's share of the sub-databases other than events (see `events`)."""
        for i, (name, db) in enumerate(sorted(self.ledger.dbs.items())):
            if name == "events" or i % self.shards != self.shard:
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
            if name == "scope_index" and any(txn.cursor(db).iternext(keys=False, values=True)):
                # every entry's value is empty; the shards test only their entries' presence (see _subset), so
                # a value here sends every shard through the detailed pass, which names the entry
                self.subset_ok = False

    def log(self, txn) -> tuple[dict[bytes, bytes], int]:
        """The log as event id -> seq (its 8-byte key), and last_seq. Built by C-level iteration; the entry by
        entry walk runs only when the quick checks fail, and shard 0 reports gaps, repeats and the meta
        mismatch it finds."""
        dbs = self.ledger.dbs
        raw_last = txn.get(b"last_seq", db=dbs["meta"])
        last_seq = msgspec.msgpack.decode(raw_last) if raw_last is not None else -1
        seq_keys = list(txn.cursor(dbs["log"]).iternext(keys=True, values=False))
        seqs = dict(zip(txn.cursor(dbs["log"]).iternext(keys=False, values=True), seq_keys))
        n = len(seq_keys)
        # n distinct 8-byte keys in B-tree order (the structure walk checks the order) running from 1 to n
        # are exactly 1..n; and n distinct event ids means none is logged twice
        if n == len(seqs) == last_seq and set(map(len, seq_keys)) <= {8} and \
                (n == 0 or (seq_keys[0] == pack_seq(1) and seq_keys[-1] == pack_seq(n))):
            return seqs, last_seq
        return self._log_detailed(txn, last_seq), last_seq

    def _log_detailed(self, txn, last_seq: int) -> dict[bytes, bytes]:
        report = self.found.add if self.shard == 0 else (lambda *_: None)
        seqs: dict[bytes, bytes] = {}
        expect = 1
        for k, eid in txn.cursor(self.ledger.dbs["log"]):
            seq = unpack_seq(k)[0] if len(k) == 8 else -1
            if seq != expect:
                report("log", f"sequence {expect} expected, found {seq}")
                expect = seq
            expect += 1
            if eid in seqs:
                report("log", f"seq {seq}: event {eid.hex()[:16]} logged twice")
                continue
            seqs[eid] = k
        if expect - 1 != last_seq:
            report("log", f"meta says last_seq {last_seq}, log ends at {expect - 1}")
        return seqs

    def events(self, txn, seqs: dict[bytes, bytes]) -> tuple[int, int, PlainReplay, list]:
        """One sequential pass over the event store. Each event belongs to the shard of its key's first byte
        (an event too short to hold a key belongs to shard 0), so each is hashed and decoded once, by one
        shard: its id and key are recomputed, and it is replayed into the views. Returns (events owned, of
        which logged, the replay of the retraction-free events, the logged retractions as (seq, event id)).
        Only owned events are looked up in the log: the parent checks that the shards' logged counts add up
        to the log's length (else some logged event is not stored)."""
        event_id, decode, shards, shard = _codec.event_id, audit_decoder.decode, self.shards, self.shard
        add, key_of, plain, provenances = self.found.add, _codec.key_of, PlainReplay(), Provenances()
        n, logged, last, unlogged, retractions = 0, 0, None, 0, []
        pop, replay = seqs.pop, plain.add
        for eid, data in txn.cursor(self.ledger.dbs["events"]):
            if shard == 0:
                if last is not None and eid <= last:
                    add("structure", f"events: keys out of order at {eid.hex()[:16]}")
                last = eid
            try:  # where the key starts, and its first byte (see key_of_bytes), inline: this loop sees every event
                at = 13 + (data[6] & 0x1F)
                owner = data[at] * shards // 256
            except IndexError:
                at, owner = 0, 0
            if owner != shard:
                continue
            n += 1
            seq = pop(eid, None)
            if event_id(data) != eid:
                add("events", f"event {eid.hex()[:16]}: stored bytes hash to another id (altered or damaged)")
                continue
            if not at or data[at - 6:at - 2] != b"\xa3key":  # key_of_bytes(data) is None
                add("events", f"event {eid.hex()[:16]}: its bytes do not begin with a type and a key")
                continue
            try:
                event = decode(data)
                if type(event) is not Retracted:
                    stored = bytes(event.provenance)
                    info, shape, canonical = provenances.read(stored)
            except (msgspec.DecodeError, NotDerivable) as exc:
                add("events", f"event {eid.hex()[:16]}: cannot be decoded ({exc})")
                continue
            if type(event) is not Retracted:
                if key_of(canonical) != event.key:
                    add("keys", f"event {eid.hex()[:16]}: key {event.key.hex()[:16]} does not match its provenance")
                if canonical != stored:
                    add("events", f"event {eid.hex()[:16]}: its provenance is not in canonical form")
            if seq is None:
                unlogged += 1
                if unlogged <= MAX_LISTED:
                    add("log", f"event {eid.hex()[:16]} is stored but not in the log")
                continue
            logged += 1
            if type(event) is Retracted:
                retractions.append((seq, eid))
            else:
                replay(seq, eid, event, info, shape)
        return n, logged, plain, retractions

    def views(self, txn, plain: PlainReplay, retractions: list) -> dict:
        """Compares this shard's part of every view with its replay; returns partial scope accumulators.
        With a retraction among the shard's events the generic Reducer replays them, in log order."""
        dbs = self.ledger.dbs
        get, events_db, decode, mine = txn.get, dbs["events"], head_decoder.decode, self.mine
        if retractions:
            memory = MemoryStore(txn, dbs)
            memory.event = lambda eid: decode(get(eid, db=events_db))
            log = dbs["log"]
            replay = [(unpack_seq(seq)[0], eid, decode(get(eid, db=events_db)))
                      for seq, eid in ((seq, get(seq, db=log)) for seq in plain.logged())]
            replay += [(unpack_seq(seq)[0], eid, decode(get(eid, db=events_db))) for seq, eid in retractions]
            replay.sort(key=lambda item: item[0])  # the Reducer applies events in log order
            replay_into(memory, replay)
            data = memory.data
            scopes = {sid: msgspec.msgpack.decode(v) for sid, v in data["scopes"].items()}
        else:  # the common case, no retraction: the same views as the Reducer builds
            data, scopes = plain.result()
        walks = {
            "current": lambda: self._range(txn.cursor(dbs["current"])),
            "history": lambda: self._range(txn.cursor(dbs["history"])),
            "failures": lambda: self._range(txn.cursor(dbs["failures"])),
            "scope_index": lambda: ((k, v) for k, v in txn.cursor(dbs["scope_index"]) if mine(k[32:])),
            "retracted": lambda: ((k, v) for k, v in txn.cursor(dbs["retracted"])
                                  if mine(key_of_bytes(get(v, db=events_db) or b"") or b"\0")),
        }
        for name, walk in walks.items():
            if name == "history" and self.ledger.format_in(txn) < 2:
                self._history_v1(txn, data[name])
                continue
            self.rebuilt[name] = len(data[name])
            # Fast: every rebuilt entry is stored as rebuilt (a C-level subset test over the whole stored
            # view); the parent checks that the shards' counts add up to the view's entries, which rules out
            # stored entries no replay derives. A failing check, or the parent's detailed pass, walks the
            # shard's part entry by entry and lists each difference.
            if self.detailed or not self._subset(txn.cursor(dbs[name]), data[name], ranged=name in RANGED):
                self.subset_ok = False  # the parent runs every shard in detail, so all differences get listed
                self._compare(name, walk(), data[name])
        return {sid.hex(): list(v) for sid, v in scopes.items()}

    def _history_v1(self, txn, rebuilt: dict[bytes, bytes]) -> None:
        """A format-1 file's history (key + seq -> event id), read read-only as it is: its shard's part is put in
        format 2's layout (each event id checked against the log; the status from the stored current row, which
        is checked itself) and compared with the replay's."""
        dbs, get = self.ledger.dbs, txn.get
        entries = 0

        def checked():
            nonlocal entries
            for k, eid in self._range(txn.cursor(dbs["history"])):
                entries += 1
                if get(k[32:], db=dbs["log"]) != eid:
                    self.found.add("views", f"history: entry {k.hex()[:24]} names an event the log does not hold there")
                yield k

        stored = history_from_v1(checked(), lambda key: status_of(get(key, db=dbs["current"])))
        self.rebuilt["history"] = entries  # the parent compares it with the stored entries: one per event
        if self.detailed or stored != rebuilt or entries != sum((len(v) - 1) // 8 for v in rebuilt.values()):
            self.subset_ok = False
            self._compare("history", stored.items(), rebuilt)

    def _subset(self, cursor, rebuilt: dict[bytes, bytes], ranged: bool) -> bool:
        """Whether every rebuilt entry is stored as rebuilt, by C-level operations. A view keyed by the row key
        (`ranged`) is read over this shard's key range only: as many entries as the replay rebuilt, then the
        next key must lie past the range, so an extra stored entry in the range fails the test. Another view
        (the scope index, keyed by scope and shape first) has this shard's entries spread over all of it:
        they are looked up, in key order, rather than the whole view read."""
        if not ranged:  # the scope index: every value is empty, which the shard walking its structure checks
            return all(map(cursor.set_key, sorted_keys(list(rebuilt))))  # in B-tree order: each page visited once
        if not (cursor.set_range(self.lo) if self.lo else cursor.first()):
            return not rebuilt
        stored = dict(islice(cursor, len(rebuilt)))
        following = cursor.key() if len(stored) == len(rebuilt) and cursor.next() else None
        past = following is None or (self.hi is not None and following >= self.hi)
        return past and rebuilt == stored  # as many read as rebuilt: subset means equal (compared in C, no item tuples)

    def _compare(self, name: str, stored, rebuilt: dict[bytes, bytes]) -> None:
        matched = 0
        get = rebuilt.get
        for k, v in stored:
            want = get(k)
            if want is None:
                self.found.add("views", f"{name}: stored entry {k.hex()[:24]} is not derivable from the log")
            elif want != v:
                self.found.add("views", f"{name}: entry {k.hex()[:24]} differs from the log's replay")
            else:
                matched += 1
        if matched != len(rebuilt):
            db, absent = self.ledger.dbs[name], 0
            with self.ledger.read() as txn:
                for k in rebuilt:
                    if txn.get(k, db=db) is None:
                        absent += 1
                        self.found.add("views", f"{name}: entry {k.hex()[:24]} of the log's replay is not stored")
                        if absent >= MAX_LISTED:
                            break


def main(shard: int, shards: int, path: str, detailed: bool = False) -> dict:
    from .store import Ledger

    gc.disable()  # bulk decoding: the objects made here hold no cycles
    found = Findings()
    ledger = Ledger.open(path, readonly=True, readahead=True)  # whole-file scans: let the kernel read ahead
    work = Shard(ledger, shard, shards, found, detailed)
    with ledger.read() as txn:
        work.structure(txn)
        seqs, last_seq = work.log(txn)
        log_entries = len(seqs)
        header_events = txn.stat(ledger.dbs["events"])["entries"]
        txn_entries = {name: txn.stat(db)["entries"] for name, db in ledger.dbs.items()}
        n_events, n_logged, plain, retractions = work.events(txn, seqs)
        del seqs
        scopes = work.views(txn, plain, retractions)
    return {"findings": found.items, "counts": found.counts, "events": n_events, "header_events": header_events,
            "last_seq": last_seq, "logged": n_logged, "log_entries": log_entries, "rebuilt": work.rebuilt,
            "subset_ok": work.subset_ok,
            "view_entries": {name: txn_entries[name] for name in work.rebuilt},
            "scopes": {k: [v[0], v[1], v[2], v[3], v[4].hex(), v[5]] for k, v in scopes.items()}}


if __name__ == "__main__":
    part = sys.argv[1]
    try:
        out = main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:5] == ["detailed"])
    except Exception as exc:  # any failure is a finding for the parent to report, with its reason
        out = {"findings": [f"structure: shard {part}: {type(exc).__name__}: {exc}"], "counts": {"structure": 1},
               "fatal": True}
    print(json.dumps(out, default=lambda b: b.hex()), flush=True)
    os._exit(0)  # skip freeing millions of objects one by one: the process is done
