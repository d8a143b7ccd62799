"""Resolving a citation, event id or key (or a unique hex prefix of one) to its event and history."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import UsageError
from . import _codec


class Resolved(NamedTuple):
    kind: str  # "event" or "key"
    key: bytes
    event_id: bytes | None  # the event asked for, or the key's current event
    history: list[tuple[int, bytes, object]]  # (seq, event id, event), oldest first
    current: bytes | None  # the key's current event id


def _by_prefix(txn, db, prefix_hex: str, width: int = 32) -> list[bytes]:
    """The distinct first `width` bytes of the db's keys that start with the hex prefix, up to two (two are
    enough to call it ambiguous)."""
    even = prefix_hex[: len(prefix_hex) // 2 * 2]
    start = bytes.fromhex(even)
    out: list[bytes] = []
    cursor = txn.cursor(db)
    if cursor.set_range(start):
        for k in cursor.iternext(values=False):
            if not k.hex().startswith(prefix_hex):
                break
            if not out or out[-1] != k[:width]:  # format 1 keeps one history entry per event: key + seq
                out.append(k[:width])
            if len(out) > 1:
                break
    return out


def resolve(ledger, ref: str) -> Resolved:
    text = ref.strip().lower()
    if text.startswith("kprof."):
        text = text[len("kprof."):]
    if len(text) < 8 or any(c not in "0123456789abcdef" for c in text):
        raise UsageError(f"{ref!r} is not a citation, event id or key; pass `kprof.<hex>` or at least 8 hex digits")
    dbs = ledger.dbs
    with ledger.read() as txn:
        events = _by_prefix(txn, dbs["events"], text)
        keys = _by_prefix(txn, dbs["history"], text)  # every key ever written, current or all retracted
        found = [("event", e) for e in events] + [("key", k) for k in keys]
        if not found:
            raise UsageError(f"nothing in {ledger.path} matches {ref!r}; check the --db and the reference")
        if len(found) > 1:
            raise UsageError(f"{ref!r} is ambiguous in {ledger.path}; give more hex digits")
        kind, raw = found[0]
        if kind == "event":
            event = _codec.stored_event(txn.get(raw, db=dbs["events"]), raw)
            key, eid = event.key, raw
        else:
            key, eid = raw, None
        history = [(seq, hid, _codec.stored_event(txn.get(hid, db=dbs["events"]), hid))
                   for seq, hid in ledger.history_of(txn, key)]
        cur = txn.get(key, db=dbs["current"])
        current = cur[1:33] if cur is not None else None
        return Resolved(kind, key, eid if eid is not None else current, history, current)
