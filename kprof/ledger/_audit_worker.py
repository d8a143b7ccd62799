"""One shard of an audit, run in its own child process: `python -m kprof.ledger._audit_worker SHARD
SHARDS PATH` prints one JSON document. The parent runs one shard per core; a damaged page that faults the
reader kills only the child and is reported as a finding.

Shard s owns the keys whose first byte b has b * SHARDS // 256 == s, and the events of those keys. It
  - walks the sub-databases (keys strictly increasing, counts equal to the headers'), those it reads anyway
    where it reads them: the views keyed by row key over its key range as it compares them, the log whole (it
    needs all of it), the event store in the events pass; the rest (scope index, meta, scopes, retractions)
    are walked by one shard each,
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
from operator import lt
from typing import NamedTuple

import lmdb
import msgspec

from . import _codec
from ._lookup import KEY_BYTES, key_order, sorted_keys
from ._reducer import (FAILED, MOD, REBUILT, ProvenanceIds, current_row, history_from_v1, history_seqs, index_key,
                       row_terms, status_of, unpack_seq)
from .events import KIND, EventAudit, EventHead, Provenance, Retracted, Scalar, summary_of_decoded
from .replay import MemoryStore, replay_into

MAX_LISTED = 50
RANGED = ("current", "history", "failures")  # views keyed by the row key
WALKED_WHERE_READ = RANGED + ("log", "events")  # not walked again by `structure`
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
        self._keys: dict[bytes, list] = {}  # key -> [latest seq, scope id, its event id, its current row, all seqs]
        self.scope_index: dict[bytes, bytes] = {}
        self._failures: dict[bytes, tuple] = {}
        self._scopes: dict[bytes, list] = {}  # scope id -> [names, contract ids]
        self._info: tuple | None = None  # the last scope info added (most events share the one before's object)

    def add(self, seq: bytes, eid: bytes, event, info: tuple, shape: bytes) -> None:
        key, sid = event.key, info[1]
        if info is not self._info:
            scope = self._scopes.get(sid)
            if scope is None:
                scope = self._scopes[sid] = [info[0], set()]
            scope[1].add(info[2])
            self._info = info
        self.scope_index[index_key(sid, shape, key)] = b""
        kind = KIND[type(event)]
        entry = self._keys.get(key)
        # the row, as bytes: the event (and the bytes it was read from) can go
        if entry is None:
            self._keys[key] = [seq, sid, eid, current_row(kind, eid, event, summary_of_decoded), seq]
        else:
            entry[4] += seq
            if seq > entry[0]:
                entry[:4] = seq, sid, eid, current_row(kind, eid, event, summary_of_decoded)
        if kind == FAILED:
            failed = self._failures.get(key)
            if failed is None or seq > failed[0]:
                self._failures[key] = (seq, eid)

    def logged(self) -> list[bytes]:
        """The seqs of the events added."""
        return [seq for entry in self._keys.values() for seq in history_seqs(entry[4], 0)]

    def result(self) -> tuple[dict[str, dict], dict[bytes, list]]:
        entries = self._keys
        current = {key: entry[3] for key, entry in entries.items()}
        history = {key: entry[3][:1] + (entry[4] if len(entry[4]) == 8 else b"".join(sorted(history_seqs(entry[4], 0))))
                   for key, entry in entries.items()}
        rows: dict[bytes, list] = {sid: [] for sid in self._scopes}  # scope id -> its rows' key + event id
        if len(rows) == 1:
            rows[next(iter(rows))] = [key + entry[2] for key, entry in entries.items()]
        else:
            for key, entry in entries.items():
                rows[entry[1]].append(key + entry[2])
        scopes = {sid: [*names, len(rows[sid]), (row_terms(rows[sid]) % MOD).to_bytes(32, "big"), sorted(contracts)]
                  for sid, (names, contracts) in self._scopes.items()}
        data = {"current": current, "history": history, "scope_index": self.scope_index,
                "failures": {key: eid for key, (_seq, eid) in self._failures.items()}, "retracted": {}}
        return data, scopes


class LogIndex(NamedTuple):
    """The logged event ids, concatenated in byte order (the event store's order), and the seq (8-byte log key)
    of each at the same position, concatenated: two bytes objects, not a dict of a million entries."""

    eids: bytes
    seqs: bytes

    @classmethod
    def of(cls, seqs: dict[bytes, bytes]) -> "LogIndex":
        """From event id -> seq (entries of other lengths, from damage, are left out: their event, if stored, is
        reported as not logged)."""
        ordered = sorted_keys([eid for eid, seq in seqs.items() if len(eid) == KEY_BYTES and len(seq) == 8])
        return cls(b"".join(ordered), b"".join(map(seqs.__getitem__, ordered)))

    def find(self, eid: bytes) -> int:
        """The position of the first logged id >= eid (bisection over the fixed-width ids)."""
        lo, hi = 0, len(self.eids) // KEY_BYTES
        while lo < hi:
            mid = (lo + hi) // 2
            if self.eids[mid * KEY_BYTES:(mid + 1) * KEY_BYTES] < eid:
                lo = mid + 1
            else:
                hi = mid
        return lo


class Shard:
    def __init__(self, ledger, shard: int, shards: int, found: Findings, detailed: bool = False):
        self.ledger, self.shard, self.shards, self.found = ledger, shard, shards, found
        self.detailed = detailed  # compare every view entry by entry (the parent asks when counts disagree)
        self.rebuilt: dict[str, int] = {}  # entries of each view this shard's replay derives
        self.subset_ok = True  # every rebuilt entry was found stored as rebuilt
        self.walked: dict[str, int] = {}  # entries of each ranged view walked over this shard's range
        self.lo = bytes([shard * 256 // shards]) if shard else b""
        self.hi = bytes([(shard + 1) * 256 // shards]) if shard + 1 < shards else None

    def mine(self, k: bytes) -> bool:
        """Whether this shard owns a row key (an empty one, from a damaged entry, is shard 0's)."""
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
        """Walks this shard's share of the sub-databases not walked where they are read (see the module's
        docstring): the scope index, meta, retracted, scopes."""
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
            if name == "scope_index" and any(txn.cursor(db).iternext(keys=False, values=True)):
                # every entry's value is empty; the shards test only their entries' presence (see _looked_up),
                # so a value here sends every shard through the detailed pass, which names the entry
                self.subset_ok = False

    def log(self, txn) -> tuple[LogIndex, int]:
        """The log's event ids in byte order with their seqs (see LogIndex), and last_seq. Read by C-level
        iteration, which is also the log's structure walk: its keys must be exactly 1..n in order (compared
        with numpy's in one test), n its header's count, and its n event ids distinct (adjacent once sorted).
        The entry by entry walk runs only when the quick checks fail, and shard 0 reports gaps, repeats, the
        header's and the meta's mismatch it finds."""
        import numpy as np

        dbs = self.ledger.dbs
        last_seq = self._meta(txn)
        seq_keys = b"".join(txn.cursor(dbs["log"]).iternext(keys=True, values=False))
        eids = b"".join(txn.cursor(dbs["log"]).iternext(keys=False, values=True))
        n, expected = len(seq_keys) // 8, txn.stat(dbs["log"])["entries"]
        if n != expected and self.shard == 0:
            self.found.add("structure", f"log: header counts {expected} entries, walk found {n}")
        if n == last_seq == len(eids) // KEY_BYTES and len(eids) % KEY_BYTES == 0 and \
                seq_keys == np.arange(1, n + 1, dtype=">u8").tobytes():
            order = key_order(eids, KEY_BYTES, exact=True)
            ordered = np.frombuffer(eids, f"S{KEY_BYTES}")[order]
            if not (ordered[1:] == ordered[:-1]).any():  # none logged twice
                return LogIndex(ordered.tobytes(), (order + 1).astype(">u8").tobytes()), last_seq
        return LogIndex.of(self._log_detailed(txn, last_seq)), last_seq

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

    def _report(self, check: str, text: str) -> None:
        """A finding of what every shard reads whole (the log, the meta): shard 0 reports it, once."""
        if self.shard == 0:
            self.found.add(check, text)

    def _log_detailed(self, txn, last_seq: int) -> dict[bytes, bytes]:
        report = self._report
        seqs: dict[bytes, bytes] = {}
        expect = 1
        for k, eid in txn.cursor(self.ledger.dbs["log"]):
            if len(k) != 8:
                report("log", f"entry {k.hex()[:24]} after seq {expect - 1}: a key of {len(k)} bytes, not a "
                              f"sequence number (8)")
                continue
            seq = unpack_seq(k)[0]
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

    def events(self, txn, index: LogIndex) -> tuple[int, int, PlainReplay, list]:
        """One sequential pass over the event store. Each event belongs to the shard of its key's first byte
        (an event too short to hold a key belongs to shard 0), so each is hashed and decoded once, by one
        shard: its id and key are recomputed, and it is replayed into the views. Returns (events owned, of
        which logged, the replay of the retraction-free events, the logged retractions as (seq, event id)).
        Only owned events are looked up in the log: the parent checks that the shards' logged counts add up
        to the log's length (else some logged event is not stored).

        The store is read in event id order, the order of `index`: while the two hold the same events, the
        event at position `pos` of the store is the log's at `pos + shift` (a merge, not a hash lookup per
        event); an event out of step (not logged, or a logged one absent before it) is found by bisection."""
        event_id, decode, shards, shard = _codec.event_id, audit_decoder.decode, self.shards, self.shard
        add, key_of, plain, provenances = self.found.add, _codec.key_of, PlainReplay(), Provenances()
        n, logged, last, unlogged, retractions = 0, 0, None, 0, []
        replay, ids, seqs, shift = plain.add, index.eids, index.seqs, 0
        for pos, (eid, data) in enumerate(txn.cursor(self.ledger.dbs["events"])):
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
            j = pos + shift
            if ids[j * KEY_BYTES:(j + 1) * KEY_BYTES] == eid:
                seq = seqs[j * 8:j * 8 + 8]
            else:
                j = index.find(eid)
                shift = j - pos
                seq = seqs[j * 8:j * 8 + 8] if ids[j * KEY_BYTES:(j + 1) * KEY_BYTES] == eid else None
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
                if self._retraction_ok(txn, eid, event):
                    retractions.append((seq, eid))
            else:
                replay(seq, eid, event, info, shape)
        return n, logged, plain, retractions

    def stored_scopes(self, txn) -> dict[str, str]:
        """The stored scopes view (hex), for the parent to compare with the sum of the shards' replays: read
        here, where a damaged page faults a child, not the parent."""
        try:
            return {k.hex(): v.hex() for k, v in txn.cursor(self.ledger.dbs["scopes"])}
        except lmdb.Error as exc:
            self.found.add("structure", f"scopes: read failed: {exc}")
            return {}

    def _retraction_ok(self, txn, eid: bytes, event) -> bool:
        """Whether a logged retraction names an event an append would accept: one stored, of its own key, not
        itself a retraction. One that does not is named, and left out of the replay (which could not apply
        it); the views it touched then differ from the replay, and are named too."""
        data = txn.get(event.target, db=self.ledger.dbs["events"])
        try:  # retractions are few: their targets are decoded (a damaged one is named as an event of its own)
            target = None if data is None else audit_decoder.decode(data)
        except msgspec.DecodeError:
            target = None
        problem = None
        if target is None:
            problem = "which is not stored" if data is None else "which cannot be decoded"
        elif target.key != event.key:
            problem = "of another key"
        elif type(target) is Retracted:
            problem = "itself a retraction"
        if problem is not None:
            self.found.add("events", f"retraction {eid.hex()[:16]} names event {event.target.hex()[:16]}, {problem}")
        return problem is None

    def views(self, txn, plain: PlainReplay, retractions: list) -> dict:
        """Compares this shard's part of every view with its replay; returns partial scope accumulators.
        With a retraction among the shard's events the generic Reducer replays them, in log order."""
        dbs = self.ledger.dbs
        get, events_db, decode, mine = txn.get, dbs["events"], head_decoder.decode, self.mine
        if retractions:
            memory = MemoryStore(txn, dbs)
            memory.event = lambda eid: None if (data := get(eid, db=events_db)) is None else decode(data)
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
            "current": lambda: self._range(txn.cursor(dbs["current"]), "current"),
            "history": lambda: self._range(txn.cursor(dbs["history"]), "history"),
            "failures": lambda: self._range(txn.cursor(dbs["failures"]), "failures"),
            "scope_index": lambda: ((k, v) for k, v in txn.cursor(dbs["scope_index"]) if mine(k[32:])),
            "retracted": lambda: ((k, v) for k, v in txn.cursor(dbs["retracted"])  # owned by the target's key
                                  if mine(key_of_bytes(get(k, db=events_db) or b"") or b"\0")),
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
            fast = (self._subset(txn.cursor(dbs[name]), data[name], name) if name in RANGED else
                    self._looked_up(txn.cursor(dbs[name]), data[name], name == "scope_index"))
            if self.detailed or not fast:
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
            for k, eid in self._range(txn.cursor(dbs["history"]), "history"):
                entries += 1
                if len(k) != 40:
                    self.found.add("views", f"history: entry {k.hex()[:24]} has {len(k)} bytes where the file's "
                                            f"format 1 keeps key + seq (40)")
                    continue
                if get(k[32:], db=dbs["log"]) != eid:
                    self.found.add("views", f"history: entry {k.hex()[:24]} names an event the log does not hold there")
                yield k

        stored = history_from_v1(checked(), lambda key: status_of(get(key, db=dbs["current"])))
        self.rebuilt["history"] = entries  # the parent compares it with the stored entries: one per event
        if self.detailed or stored != rebuilt or entries != sum((len(v) - 1) // 8 for v in rebuilt.values()):
            self.subset_ok = False
            self._compare("history", stored.items(), rebuilt)

    def _subset(self, cursor, rebuilt: dict[bytes, bytes], name: str) -> bool:
        """Whether this shard's part of a view keyed by the row key is stored exactly as rebuilt, by C-level
        operations over this shard's key range: as many entries as the replay rebuilt, in strictly increasing
        order, then the next key must lie past the range, so an extra stored entry in the range fails the test.
        It is the view's structure walk too: on success its range holds exactly len(rebuilt) entries; on failure
        the caller walks the range entry by entry, which counts them and names each difference."""
        if not (cursor.set_range(self.lo) if self.lo else cursor.first()):
            self.walked[name] = 0
            return not rebuilt
        stored = dict(islice(cursor, len(rebuilt)))
        following = cursor.key() if len(stored) == len(rebuilt) and cursor.next() else None
        past = following is None or (self.hi is not None and following >= self.hi)
        if not (past and rebuilt == stored):  # compared in C, no item tuples
            return False
        keys = list(stored)
        if not all(map(lt, keys, islice(keys, 1, None))):
            return False
        self.walked[name] = len(keys)
        return True

    @staticmethod
    def _looked_up(cursor, rebuilt: dict[bytes, bytes], keys_only: bool) -> bool:
        """Whether every rebuilt entry of a view keyed otherwise (the scope index, the retractions) is stored as
        rebuilt, looked up in key order (each page visited once); the parent's count check rules out stored
        extras. `keys_only`: the scope index's values, all empty, are checked by the shard walking its structure
        (its entries are spread over all of it; looking up half is cheaper than reading it all)."""
        ordered = sorted_keys(list(rebuilt))
        if keys_only:
            return all(map(cursor.set_key, ordered))
        return dict(zip(ordered, map(cursor.get, ordered))) == rebuilt

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
        index, last_seq = work.log(txn)
        log_entries = len(index.seqs) // 8
        header_events = txn.stat(ledger.dbs["events"])["entries"]
        txn_entries = {name: txn.stat(db)["entries"] for name, db in ledger.dbs.items()}
        n_events, n_logged, plain, retractions = work.events(txn, index)
        del index
        scopes = work.views(txn, plain, retractions)
        stored_scopes = work.stored_scopes(txn) if shard == 0 else {}
    return {"stored_scopes": stored_scopes,
            "findings": found.items, "counts": found.counts, "events": n_events, "header_events": header_events,
            "last_seq": last_seq, "logged": n_logged, "log_entries": log_entries, "rebuilt": work.rebuilt,
            "subset_ok": work.subset_ok, "walked": work.walked,
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
