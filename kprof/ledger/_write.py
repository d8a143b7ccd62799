"""Writing a ledger, for `store`: the reducer's Store over a write transaction, canonical events, the views' rebuild."""

from __future__ import annotations

from typing import NamedTuple

import lmdb
import msgspec

from ..errors import UsageError
from . import _codec
from ._reducer import REBUILT, Reducer, Store, pack_seq, seq_of
from .events import Retracted


class AppendResult(NamedTuple):
    added: list[bytes]  # event ids newly written, in log order
    existing: list[bytes]  # event ids that were already in the ledger (no-op)
    last_seq: int


_DELETED, _UNREAD = object(), object()


class TxnStore(Store):
    """The reducer's Store over one LMDB write transaction, with the batch's writes buffered and then
    written per sub-database in key order (`putmulti`): sorted inserts touch each B-tree page once."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict):
        self.txn, self.dbs = txn, dbs
        self.pending: dict[str, dict] = {name: {} for name in dbs}
        self.deleting: set[str] = set()  # the dbs with a deletion pending
        self.known: dict[str, dict] = {}  # db -> {key read ahead: its value, or None where absent}

    def read_ahead(self, db: str, keys: list) -> None:
        """Reads sorted, distinct `keys` of `db` in one pass (they share B-tree pages) for later gets to answer."""
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
        for db, buf in self.pending.items():
            handle, puts = self.dbs[db], sorted(buf.items())  # keys are unique: values are never compared
            if db in self.deleting:
                for k in [k for k, v in puts if v is _DELETED]:
                    self.txn.delete(k, db=handle)
                puts = [item for item in puts if item[1] is not _DELETED]
            if puts:
                self.txn.cursor(handle).putmulti(puts, append=db == "log")
            buf.clear()
        self.deleting.clear()
        self.known.clear()  # what was read ahead may have been written since: read the transaction again


def meta_number(raw: bytes | None) -> int | None:
    """A stored format version or count (meta): None where absent, 0 where damaged (not a positive integer)."""
    try:
        found = None if raw is None else msgspec.msgpack.decode(raw)
    except _codec.UNDECODABLE:
        return 0
    return found if raw is None or (type(found) is int and found >= 1) else 0


def canonical(event, index: int):
    """(the event as the ledger reads it back, its canonical bytes), checked against the schema (msgspec Structs do not
    validate when built) as it decodes: appending what `ledger.event` returns is a no-op; nothing unreadable is kept."""
    data = _codec.encode(event)
    try:
        stored = _codec.event_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise UsageError(f"event {index} of the batch does not fit the event schema: {exc}; build events with "
                         f"kprof.ledger.build") from None
    return (event, data) if (again := _codec.encode(stored)) == data else (stored, again)


def rebuild_views(txn: lmdb.Transaction, dbs: dict, views: tuple) -> int:
    """Rebuilds the `views` from the log through the Reducer, streamed, in `txn` (an older file's upgrade on open, see
    `_codec.FORMAT_VERSION`; `Ledger.rebuild_views`, a repair); returns the events replayed. REBUILT counts it, so a
    reader's memo does not outlive a repair, which can change rows the view root (read from `scopes`) does not name."""
    for name in views:
        txn.drop(dbs[name], delete=False)
    reducer, events, n = Reducer(TxnStore(txn, dbs)), dbs["events"], 0
    for n, (k, eid) in enumerate(txn.cursor(dbs["log"]), 1):
        reducer.apply(_codec.stored_event(txn.get(eid, db=events) or b"", eid), eid, seq_of(k))
    reducer.flush()
    reducer.store.flush()
    count = meta_number(txn.get(REBUILT, db=dbs["meta"])) or 0  # absent or damaged: 0
    txn.put(REBUILT, _codec.encode(count + 1), db=dbs["meta"])
    return n


def append_events(txn, dbs: dict, prepared) -> AppendResult:
    """Appends any batch (repeats, re-measurements, retractions) through `Reducer.apply`, reading ahead, sorted."""
    seq = msgspec.msgpack.decode(txn.get(b"last_seq", db=dbs["meta"]))
    reducer = Reducer(TxnStore(txn, dbs))
    store, added, existing = reducer.store, [], []
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
        store.put("log", pack_seq(seq := seq + 1), eid)
        reducer.apply(event, eid, seq)
        added.append(eid)
    reducer.flush()
    store.flush()
    txn.put(b"last_seq", _codec.encode(seq), db=dbs["meta"])
    return AppendResult(added, existing, seq)

