"""Resolving a citation, event id or key (or a unique hex prefix of one) to its event and history."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import SettingError, UsageError
from . import _verify


class Resolved(NamedTuple):
    kind: str  # "event" or "key"
    key: bytes
    event_id: bytes | None  # the event asked for, or the key's current event
    history: list[tuple[int, bytes, object]]  # (seq, event id, event), oldest first
    current: bytes | None  # the key's current event id


def _by_prefix(txn, db, prefix_hex: str) -> list[bytes]:
    """The db's keys that start with the hex prefix, up to two (two are enough to call it ambiguous)."""
    out, cursor = [], txn.cursor(db)
    if cursor.set_range(bytes.fromhex(prefix_hex[: len(prefix_hex) // 2 * 2])):
        for k in cursor.iternext(values=False):
            if len(out) == 2 or not k.hex().startswith(prefix_hex):
                break
            out.append(k)
    return out


def resolve(ledger, ref: str) -> Resolved:
    """The event or key `ref` names, its history and its current event, every event re-hashed (see _verify)."""
    text = ref.strip().lower().removeprefix("kprof.") if isinstance(ref, str) else ""  # not a str: refused below
    if not 8 <= len(text) <= 64 or any(c not in "0123456789abcdef" for c in text):  # an id or key: 64 hex digits
        raise UsageError(f"{ref!r} is not a citation, event id or key; pass `kprof.<hex>` or 8 to 64 hex digits")
    dbs, path = ledger.dbs, ledger.path
    with _verify.reading(path, "the file"), ledger.read() as txn:
        with _verify.reading(path, "events"):
            events = _by_prefix(txn, dbs["events"], text)
        with _verify.reading(path, "history"):
            keys = _by_prefix(txn, dbs["history"], text)  # every key ever written, current or all retracted
        found = [("event", e) for e in events] + [("key", k) for k in keys]
        if not found:
            with _verify.reading(path, "events"):
                _check_neighbours(txn, dbs["events"], path, text)
            raise SettingError(*(f"nothing in {path} matches {ref!r}; check {db} and the reference (a `run "
                                 f"--fresh` stores no event)" for db in ("db", "the --db")))
        if len(found) > 1:
            raise UsageError(f"{ref!r} is ambiguous in {path}; give more hex digits")
        kind, raw = found[0]
        with _verify.reading(path, "events"):
            event = _verify.event(path, raw, txn.get(raw, db=dbs["events"])) if kind == "event" else None
            key, eid = (raw, None) if event is None else (event.key, raw)
            with _verify.reading(path, "history"):
                seqs = ledger.history_of(txn, key)
            history = [(seq, hid, _verify.event(path, hid, txn.get(hid, db=dbs["events"]), key)) for seq, hid in seqs]
        current = getattr(_verify.rows(txn, dbs, path, [key], summaries=False)[0], "event_id", None)  # None: no row
        if {eid, current} - {None, *(hid for _seq, hid, _event in history)}:  # a damaged history key: not retracted
            raise _verify.damaged(path, f"the history of key {key.hex()} lacks its event(s)")
        return Resolved(kind, key, eid if eid is not None else current, history, current)


def _check_neighbours(txn, db, path: str, prefix_hex: str) -> None:
    """Where no event id has the prefix, the ids either side must hash from their bytes (else damage reads as none)."""
    even, cursor, items = prefix_hex[: len(prefix_hex) // 2 * 2], txn.cursor(db), []
    if cursor.set_range(bytes.fromhex(even)):
        items.append(cursor.item())
        if cursor.prev():
            items.append(cursor.item())
            if cursor.key() >= bytes.fromhex(even):  # the lookup skipped it: a damaged branch page misroutes lookups
                raise _verify.damaged(path, f"looking up {prefix_hex} in `events` skips event {cursor.key().hex()}")
    elif cursor.last():
        items.append(cursor.item())
    for eid, data in items:
        _verify.event(path, eid, data)
