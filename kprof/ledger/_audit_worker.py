"""The two halves of an audit, each run in its own child process (`python -m kprof.ledger._audit_worker
PART PATH`, printing one JSON document), so they use both cores and so that a damaged page that faults
the reader is reported as a finding instead of crashing the caller.

  structure  walks every sub-database (keys strictly increasing, entry count equal to the header's),
             and recomputes every event's id and key from its stored bytes
  views      checks the log (1..last_seq, each event once, each present), replays it into memory and
             compares every stored view with the replay
"""

from __future__ import annotations

import gc
import json
import sys

import lmdb
import msgspec

from . import _codec
from ._reducer import unpack_seq
from .events import Retracted
from .replay import MemoryStore, replay_into

MAX_LISTED = 50


class Findings:
    def __init__(self):
        self.items: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, check: str, text: str) -> None:
        n = self.counts.get(check, 0)
        self.counts[check] = n + 1
        if n < MAX_LISTED:
            self.items.append(f"{check}: {text}")


def structure(ledger, found: Findings) -> dict:
    dbs = ledger.dbs
    with ledger.read() as txn:
        for name, db in dbs.items():
            expected = txn.stat(db)["entries"]
            seen, last = 0, None
            cursor = txn.cursor(db)
            try:
                if name == "events":
                    seen = _events(cursor, found)
                else:
                    for key in cursor.iternext(values=False):
                        if last is not None and key <= last:
                            found.add("structure", f"{name}: keys out of order at entry {seen}")
                            break
                        last = key
                        seen += 1
            except lmdb.Error as exc:
                found.add("structure", f"{name}: walk failed at entry {seen}: {exc}")
                continue
            if seen != expected:
                found.add("structure", f"{name}: header counts {expected} entries, walk found {seen}")
    return {}


def _events(cursor, found: Findings) -> int:
    decode, event_id, key_of = _codec.event_decoder.decode, _codec.event_id, _codec.provenance_key
    n, last = 0, None
    for eid, data in cursor:
        if last is not None and eid <= last:
            found.add("structure", f"events: keys out of order at entry {n}")
        last = eid
        n += 1
        if event_id(data) != eid:
            found.add("events", f"event {eid.hex()[:16]}: stored bytes hash to another id (altered or damaged)")
            continue
        try:
            event = decode(data)
        except msgspec.DecodeError as exc:
            found.add("events", f"event {eid.hex()[:16]}: cannot be decoded ({exc})")
            continue
        if type(event) is not Retracted and key_of(event.provenance) != event.key:
            found.add("keys", f"event {eid.hex()[:16]}: key {event.key.hex()[:16]} does not match its provenance")
    return n


def views(ledger, found: Findings) -> dict:
    dbs = ledger.dbs
    decode = _codec.event_decoder.decode
    with ledger.read() as txn:
        raw_last = txn.get(b"last_seq", db=dbs["meta"])
        last_seq = msgspec.msgpack.decode(raw_last) if raw_last is not None else -1
        n_events = txn.stat(dbs["events"])["entries"]
        logged: set[bytes] = set()
        replay = []
        expect = 1
        events_db = dbs["events"]
        for k, eid in txn.cursor(dbs["log"]):
            seq = unpack_seq(k)[0] if len(k) == 8 else -1
            if seq != expect:
                found.add("log", f"sequence {expect} expected, found {seq}")
                expect = seq
            expect += 1
            if eid in logged:
                found.add("log", f"seq {seq}: event {eid.hex()[:16]} logged twice")
                continue
            logged.add(eid)
            data = txn.get(eid, db=events_db)
            if data is None:
                found.add("log", f"seq {seq}: event {eid.hex()[:16]} is not in the event store")
                continue
            try:
                replay.append((seq, eid, decode(data)))
            except msgspec.DecodeError:
                continue  # the structure half reports it
        if expect - 1 != last_seq:
            found.add("log", f"meta says last_seq {last_seq}, log ends at {expect - 1}")
        if len(logged) != n_events:
            found.add("log", f"{n_events} events are stored but {len(logged)} are logged")
        memory = MemoryStore(txn, dbs)
        replay_into(memory, replay)
        del replay
        for name, rebuilt in memory.data.items():
            _compare(found, name, txn.cursor(dbs[name]), rebuilt)
    return {"events": n_events, "last_seq": last_seq}


def _compare(found: Findings, name: str, cursor, rebuilt: dict[bytes, bytes]) -> None:
    matched = 0
    get = rebuilt.get
    for k, v in cursor:
        want = get(k)
        if want is None:
            found.add("views", f"{name}: stored entry {k.hex()[:24]} is not derivable from the log")
        elif want != v:
            found.add("views", f"{name}: entry {k.hex()[:24]} differs from the log's replay")
        else:
            matched += 1
    if matched != len(rebuilt):
        absent = [k for k in rebuilt if not cursor.set_key(k)]
        for k in absent[:MAX_LISTED]:
            found.add("views", f"{name}: entry {k.hex()[:24]} of the log's replay is not stored")


def main(part: str, path: str) -> None:
    from .store import Ledger

    gc.disable()  # bulk decoding: the objects made here hold no cycles
    found = Findings()
    ledger = Ledger.open(path, readonly=True)
    extra = {"structure": structure, "views": views}[part](ledger, found)
    print(json.dumps({"findings": found.items, "counts": found.counts, **extra}))


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception as exc:  # any failure is a finding for the parent to report, with its reason
        print(json.dumps({"findings": [f"{sys.argv[1]}: {type(exc).__name__}: {exc}"],
                          "counts": {sys.argv[1]: 1}, "fatal": True}))
