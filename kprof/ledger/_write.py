"""Writing a ledger: the reducer's Store over one LMDB write transaction, events in their canonical form, and
the rebuild of an older file's views (the upgrade a writer runs on open). `kprof.ledger.store` appends through
these.
"""

from __future__ import annotations

from typing import NamedTuple

import lmdb
import msgspec

from ..errors import UsageError
from . import _codec
from ._reducer import REBUILT, Reducer, pack_seq, seq_of
from .events import Retracted


class AppendResult(NamedTuple):
    added: list[bytes]  # event ids newly written, in log order
    existing: list[bytes]  # event ids that were already in the ledger (no-op)
    last_seq: int


_DELETED, _UNREAD = object(), object()


class TxnStore:
    """The reducer's Store over one LMDB write transaction, with the batch's writes buffered and then
    written per sub-database in key order (`putmulti`): sorted inserts touch each B-tree page once."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict):
        self.txn, self.dbs = txn, dbs
        self.pending: dict[str, dict] = {name: {} for name in dbs}
        self.deleting: set[str] = set()  # the dbs with a deletion pending
        self.known: dict[str, dict] = {}  # db -> {key read ahead: its value, or None where absent}

    def read_ahead(self, db: str, keys: list) -> None:
        """Reads `keys` (sorted, distinct) of `db` in one pass (sorted keys share B-tree pages: far fewer page
        visits than one random get each); later gets of these keys are answered from memory."""
        known = self.known[db] = dict.fromkeys(keys)
        known.update(self.txn.cursor(self.dbs[db]).getmulti(keys))

    def get(self, db, k):
        v = self.pending[db].get(k)
        if v is not None:
            return None if v is _DELETED else v
        v = self.known.get(db, {}).get(k, _UNREAD)
        return self.txn.get(k, db=self.dbs[db]) if v is _UNREAD else v

    def put(self, db, k, v):
        self.pending[db][k] = v

    def delete(self, db, k):
        self.pending[db][k] = _DELETED
        self.deleting.add(db)

    def flush(self) -> None:
        txn = self.txn
        for db, buf in self.pending.items():
            if not buf:
                continue
            handle = self.dbs[db]
            puts = sorted(buf.items())  # keys are unique: values are never compared
            if db in self.deleting:
                for k in [k for k, v in puts if v is _DELETED]:
                    txn.delete(k, db=handle)
                puts = [item for item in puts if item[1] is not _DELETED]
            if puts:
                txn.cursor(handle).putmulti(puts, append=db == "log")
            buf.clear()
        self.deleting.clear()
        self.known.clear()  # what was read ahead may have been written since: read the transaction again

    def logged(self, seq):
        return self.get("log", seq)

    def event(self, eid):
        data = self.get("events", eid)
        return None if data is None else _codec.event_decoder.decode(data)


def canonical(event, index: int):
    """(the event as the ledger reads it back, its canonical bytes). An event is stored as it decodes: checked
    against the schema (msgspec Structs do not validate when built), and with each value of the type its field
    declares (an int given for a float field is stored as that float), so appending the event that `ledger.event`
    returns is a no-op, and no event is stored that the ledger could not read back."""
    data = _codec.event_bytes(event)
    try:
        stored = _codec.event_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise UsageError(f"event {index} of the batch does not fit the event schema: {exc}; build events with "
                         f"kprof.ledger.build") from None
    again = _codec.event_bytes(stored)
    return (event, data) if again == data else (stored, again)


def rebuild_views(txn: lmdb.Transaction, dbs: dict, views: tuple) -> int:
    """Drops the `views` sub-databases and rebuilds them from the log through the Reducer, streamed, in `txn`, in
    the current format; returns the events replayed. The rebuild is counted (REBUILT), so a reader's memo of
    earlier answers does not outlive it (a repair can change rows the view root, read from `scopes`, does not
    name). Used by the opening of an older file (see `_codec.FORMAT_VERSION`) and by
    `Ledger.rebuild_views`, a repair."""
    for name in views:
        txn.drop(dbs[name], delete=False)
    reducer, events, n = Reducer(TxnStore(txn, dbs)), dbs["events"], 0
    for k, eid in txn.cursor(dbs["log"]):
        reducer.apply(_codec.stored_event(txn.get(eid, db=events) or b"", eid), eid, seq_of(k))
        n += 1
    reducer.flush()
    reducer.store.flush()
    try:
        count = msgspec.msgpack.decode(txn.get(REBUILT, db=dbs["meta"]) or b"\x00")
    except msgspec.DecodeError:
        count = 0
    txn.put(REBUILT, _codec.encode((count if type(count) is int and count > 0 else 0) + 1), db=dbs["meta"])
    return n


def append_events(txn, dbs: dict, prepared) -> AppendResult:
    """Appends through `Reducer.apply`, reading the batch's event ids and keys first: any batch (repeats,
    re-measurements, retractions)."""
    meta = dbs["meta"]
    seq = msgspec.msgpack.decode(txn.get(b"last_seq", db=meta))
    store = TxnStore(txn, dbs)
    reducer = Reducer(store)
    added, existing = [], []
    # What the batch reads (its event ids, its keys' rows and histories) is read in sorted passes, not one
    # random get each.
    store.read_ahead("events", sorted({eid for _e, _d, eid in prepared}))
    keys = sorted({event.key for event, _d, _eid in prepared})
    store.read_ahead("current", keys)
    store.read_ahead("history", keys)
    for event, data, eid in prepared:
        if store.get("events", eid) is not None:
            existing.append(eid)
            continue
        if type(event) is Retracted:
            target = store.event(event.target)
            if target is None or target.key != event.key:
                raise UsageError(f"retraction {eid.hex()[:16]} names event {event.target.hex()[:16]}, which "
                                 f"is not in this ledger under key {event.key.hex()[:16]}; append the target first")
            if type(target) is Retracted:
                raise UsageError(f"retraction {eid.hex()[:16]} names event {event.target.hex()[:16]}, itself a "
                                 f"retraction; retract a measured or failed event")
        store.put("events", eid, data)
        seq += 1
        store.put("log", pack_seq(seq), eid)
        reducer.apply(event, eid, seq)
        added.append(eid)
    reducer.flush()
    store.flush()
    txn.put(b"last_seq", _codec.encode(seq), db=meta)
    return AppendResult(added, existing, seq)

