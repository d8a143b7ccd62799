"""Rebuilding the views from the log: the log and the event bodies are the truth, views are derived."""

from __future__ import annotations

import msgspec

from . import _codec
from ._reducer import REBUILT, Reducer, Store
from ._write import TxnStore
from .store import VIEW_DBS, Ledger

__all__ = ["rebuild_views", "MemoryStore", "replay_into"]


class MemoryStore(Store):
    """The views as plain dicts (used by audit to rebuild without touching the file)."""

    def __init__(self, txn, dbs):
        self.txn, self.dbs = txn, dbs
        self.data: dict[str, dict[bytes, bytes]] = {name: {} for name in VIEW_DBS}

    def get(self, db, k):
        return self.data[db].get(k)

    def put(self, db, k, v):
        self.data[db][k] = v

    def logged(self, seq):
        return self.txn.get(seq, db=self.dbs["log"])

    def delete(self, db, k):
        self.data[db].pop(k, None)

    def flush(self) -> None:
        pass

    def event(self, eid):
        return _codec.event_decoder.decode(self.txn.get(eid, db=self.dbs["events"]))


def replay_into(store: Store, events, file_format: int = _codec.FORMAT_VERSION) -> None:
    """Applies (seq, event id, event) in log order to a store, deriving rows as `file_format` keeps them."""
    reducer = Reducer(store, file_format)
    for seq, eid, event in events:
        reducer.apply(event, eid, seq)
    reducer.flush()
    store.flush()


def rebuild_views(ledger: Ledger) -> int:
    """Drops every view and rebuilds it from the log in one write transaction. Returns events replayed."""

    def work(txn):
        for name in VIEW_DBS:
            txn.drop(ledger.dbs[name], delete=False)
        decode = _codec.event_decoder.decode
        events = [(seq, eid, decode(data)) for seq, eid, data in ledger.iter_log(txn)]
        replay_into(TxnStore(txn, ledger.dbs), events)
        # Counted, so a reader's memo of earlier answers (see _memo) knows the views were rewritten without an
        # event (a repair can change rows the view root, read from `scopes`, does not name).
        meta = ledger.dbs["meta"]
        try:
            count = msgspec.msgpack.decode(txn.get(REBUILT, db=meta) or b"\x00")
        except msgspec.DecodeError:
            count = 0
        txn.put(REBUILT, _codec.encode((count if type(count) is int and count > 0 else 0) + 1), db=meta)
        return len(events)

    return ledger.write(work)

