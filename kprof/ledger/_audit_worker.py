"""One shard of an audit, run in its own child process: `python -m kprof.ledger._audit_worker SHARD
SHARDS PATH` prints one JSON document. The parent runs one shard per core; a damaged page that faults the
reader kills only the child and is reported as a finding.

Shard s owns the keys whose first byte b has b * SHARDS // 256 == s, and the events of those keys. It
  - walks its share of the sub-databases (keys strictly increasing, counts equal to the headers'),
  - reads the event store once, in order, and for each event of its keys recomputes the id and key and
    collects it for the replay (which needs log order only within a key, so the shard sorts its events
    by sequence number instead of reading them in log order, which would be random reads),
  - replays them and compares its part of every view with what is stored,
  - returns its partial scope accumulators, which the parent sums (the view root's hash is additive),
and shard 0 also checks the log: 1..last_seq, each event once, each present.
"""

from __future__ import annotations

import gc
import json
from itertools import islice
import os
import sys

import lmdb
import msgspec

from . import _codec
from ._reducer import FAILED, MOD, contract_id, pack_seq, row_term, unpack_seq
from .events import KIND, EventHead, Retracted, summary_of
from .replay import MemoryStore, replay_into

MAX_LISTED = 50
RANGED = ("current", "history", "failures")  # views keyed by the row key (history: key + seq)
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


def replay_plain(replay: list) -> tuple[dict[str, dict], dict[bytes, list]]:
    """The views and scope entries a Reducer builds from (seq, event id, event head), in any order, for
    events none of which is a retraction: then a key's current row is simply its latest event, rows are
    never removed, and each scope's root accumulator is the sum over its keys' latest events. Equal to
    `replay_into(MemoryStore)` of the same events in log order (a test holds the two equal); several times
    faster, and it needs no sort."""
    history, scope_index, failures, last = {}, {}, {}, {}
    sids, cids, contracts = {}, {}, {}
    encode, shape_id, pack = _codec.encode, _codec.shape_id, pack_seq
    for seq, eid, event in replay:
        key, prov = event.key, event.provenance
        history[key + pack(seq)] = eid
        names = (prov.table, prov.backend, prov.gpu_key)
        sid = sids.get(names)
        if sid is None:
            sid = sids[names] = _codec.scope_id(*names)
            contracts[sid] = set()
        scope_index[sid + shape_id(encode(prov.shape)) + key] = b""
        contract = (prov.algorithm, prov.layout, prov.numerics, prov.timing, prov.profiler_revision)
        cid = cids.get(contract)
        if cid is None:
            cid = cids[contract] = contract_id(prov)
        contracts[sid].add(cid)
        latest = last.get(key)
        if latest is None or seq > latest[0]:
            last[key] = (seq, sid, eid, event)
        if KIND[type(event)] == FAILED:
            failed = failures.get(key)
            if failed is None or seq > failed[0]:
                failures[key] = (seq, eid)
    failures = {key: eid for key, (_seq, eid) in failures.items()}
    current, totals = {}, {sid: [0, 0] for sid in contracts}
    for key, (_seq, sid, eid, event) in last.items():
        current[key] = KIND[type(event)] + eid + encode(summary_of(event))
        total = totals[sid]
        total[0] += 1
        total[1] += row_term(key, eid)
    scopes = {sid: [*names, totals[sid][0], (totals[sid][1] % MOD).to_bytes(32, "big"), sorted(contracts[sid])]
              for names, sid in sids.items()}
    data = {"current": current, "history": history, "failures": failures, "scope_index": scope_index,
            "retracted": {}}
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

    def log(self, txn) -> tuple[dict[bytes, int], int]:
        """The log as event id -> seq, and last_seq. Shard 0 reports gaps, repeats and the meta mismatch."""
        dbs = self.ledger.dbs
        report = self.found.add if self.shard == 0 else (lambda *_: None)
        raw_last = txn.get(b"last_seq", db=dbs["meta"])
        last_seq = msgspec.msgpack.decode(raw_last) if raw_last is not None else -1
        seqs: dict[bytes, int] = {}
        expect = 1
        for k, eid in txn.cursor(dbs["log"]):
            seq = unpack_seq(k)[0] if len(k) == 8 else -1
            if seq != expect:
                report("log", f"sequence {expect} expected, found {seq}")
                expect = seq
            expect += 1
            if eid in seqs:
                report("log", f"seq {seq}: event {eid.hex()[:16]} logged twice")
                continue
            seqs[eid] = seq
        if expect - 1 != last_seq:
            report("log", f"meta says last_seq {last_seq}, log ends at {expect - 1}")
        return seqs, last_seq

    def events(self, txn, seqs: dict[bytes, int]) -> tuple[int, int, list]:
        """One sequential pass over the event store. Each event belongs to the shard of its key (an event
        whose key cannot be read belongs to shard 0), so each is hashed and decoded once, by one shard:
        its id and key are recomputed, and it is collected for the replay. Returns (events owned, of
        which logged, replay list in log order). Only owned events are looked up in the log: the parent
        checks that the shards' logged counts add up to the log's length (else some logged event is not
        stored)."""
        event_id, key_of, decode, shards, shard = _codec.event_id, _codec.provenance_key, head_decoder.decode, \
            self.shards, self.shard
        add = self.found.add
        n, last, replay, unlogged = 0, None, [], 0
        pop = seqs.pop
        append = replay.append
        for eid, data in txn.cursor(self.ledger.dbs["events"]):
            if shard == 0:
                if last is not None and eid <= last:
                    add("structure", f"events: keys out of order at {eid.hex()[:16]}")
                last = eid
            key = key_of_bytes(data)
            if key is None:
                if shard != 0:
                    continue
            elif key[0] * shards // 256 != shard:
                continue
            n += 1
            seq = pop(eid, None)
            if event_id(data) != eid:
                add("events", f"event {eid.hex()[:16]}: stored bytes hash to another id (altered or damaged)")
                continue
            try:
                event = decode(data)
            except msgspec.DecodeError as exc:
                add("events", f"event {eid.hex()[:16]}: cannot be decoded ({exc})")
                continue
            if type(event) is not Retracted and key_of(event.provenance) != event.key:
                add("keys", f"event {eid.hex()[:16]}: key {event.key.hex()[:16]} does not match its provenance")
            if seq is None:
                unlogged += 1
                if unlogged <= MAX_LISTED:
                    add("log", f"event {eid.hex()[:16]} is stored but not in the log")
                continue
            append((seq, eid, event))
        return n, len(replay), replay  # in event-id order; the generic replay sorts it by seq

    def views(self, txn, replay: list) -> dict:
        """Replays this shard's keys and compares the stored views; returns partial scope accumulators."""
        dbs = self.ledger.dbs
        get, events_db, decode, mine = txn.get, dbs["events"], head_decoder.decode, self.mine
        if any(type(item[2]) is Retracted for item in replay):
            memory = MemoryStore(txn, dbs)
            memory.event = lambda eid: decode(get(eid, db=events_db))
            replay.sort(key=lambda item: item[0])  # the Reducer applies events in log order
            replay_into(memory, replay)
            data = memory.data
            scopes = {sid: msgspec.msgpack.decode(v) for sid, v in data["scopes"].items()}
        else:  # the common case, no retraction: the same views as the Reducer builds, in one tight loop
            data, scopes = replay_plain(replay)
        walks = {
            "current": lambda: self._range(txn.cursor(dbs["current"])),
            "history": lambda: self._range(txn.cursor(dbs["history"])),
            "failures": lambda: self._range(txn.cursor(dbs["failures"])),
            "scope_index": lambda: ((k, v) for k, v in txn.cursor(dbs["scope_index"]) if mine(k[32:])),
            "retracted": lambda: ((k, v) for k, v in txn.cursor(dbs["retracted"])
                                  if mine(key_of_bytes(get(v, db=events_db) or b"") or b"\0")),
        }
        for name, walk in walks.items():
            self.rebuilt[name] = len(data[name])
            # Fast: every rebuilt entry is stored as rebuilt (a C-level subset test over the whole stored
            # view); the parent checks that the shards' counts add up to the view's entries, which rules out
            # stored entries no replay derives. A failing check, or the parent's detailed pass, walks the
            # shard's part entry by entry and lists each difference.
            if self.detailed or not self._subset(txn.cursor(dbs[name]), data[name], ranged=name in RANGED):
                self.subset_ok = False  # the parent runs every shard in detail, so all differences get listed
                self._compare(name, walk(), data[name])
        return {sid.hex(): list(v) for sid, v in scopes.items()}

    def _subset(self, cursor, rebuilt: dict[bytes, bytes], ranged: bool) -> bool:
        """Whether every rebuilt entry is stored as rebuilt, by C-level dict operations. A view keyed by the
        row key (`ranged`) is read over this shard's key range only: as many entries as the replay rebuilt,
        then the next key must lie past the range, so an extra stored entry in the range fails the test."""
        if not ranged:
            return rebuilt.items() <= dict(cursor).items()
        if not (cursor.set_range(self.lo) if self.lo else cursor.first()):
            return not rebuilt
        stored = dict(islice(cursor, len(rebuilt)))
        following = cursor.key() if len(stored) == len(rebuilt) and cursor.next() else None
        past = following is None or (self.hi is not None and following >= self.hi)
        return past and rebuilt.items() <= stored.items()

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
        n_events, n_logged, replay = work.events(txn, seqs)
        header_events = txn.stat(ledger.dbs["events"])["entries"]
        txn_entries = {name: txn.stat(db)["entries"] for name, db in ledger.dbs.items()}
        del seqs
        scopes = work.views(txn, replay)
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
