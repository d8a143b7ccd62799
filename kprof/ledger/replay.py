"""Rebuilding the views from the log: the log and the event bodies are the truth, views are derived."""

from __future__ import annotations

from . import _codec, _write
from ._reducer import Reducer, Store
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


def replay_into(store: Store, events) -> None:
    """Applies (seq, event id, event) in log order to a store."""
    reducer = Reducer(store)
    for seq, eid, event in events:
        reducer.apply(event, eid, seq)
    reducer.flush()
    store.flush()


def rebuild_views(ledger: Ledger) -> int:
    """Drops every view and rebuilds it from the log in one write transaction. Returns events replayed."""
    return ledger.write(lambda txn: _write.rebuild_views(txn, ledger.dbs, VIEW_DBS))
