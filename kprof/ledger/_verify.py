"""Verified reads. A `current` value is trusted once its seal's digest over the key looked up and the row's bytes
matches; a key `current` lacks is missing only where `history` agrees (one damaged byte cannot make a row missing).
Any LMDB, decode or check error is an IntegrityError naming the key or sub-database (exit 3), never a wrong answer."""

from __future__ import annotations

from contextlib import contextmanager
from operator import attrgetter
from typing import Iterator

import lmdb
import msgspec

from ..errors import IntegrityError
from . import _codec
from ._reducer import NO_ROW, CurrentRow, HistoryEntry, RowHead, _decoders, _sealed, seal_digests

__all__ = ["AUDIT", "reading", "damaged", "rows", "event", "values"]

AUDIT = "run `kprof audit` for the full report"
# Decoding errors of bytes a damaged file holds: msgspec's (RecursionError: nested past its depth), and what
# unpacking a value of the wrong shape raises.
_DAMAGE = (lmdb.Error, msgspec.MsgspecError, RecursionError, ValueError, TypeError, IndexError, KeyError,
           AttributeError, OverflowError)


def damaged(path: str, what: str) -> IntegrityError:
    return IntegrityError(f"ledger {path} is damaged: {what}; {AUDIT}")


@contextmanager
def reading(path: str, db: str) -> Iterator[None]:
    """Turns an LMDB or decoding error raised while reading sub-database `db` into an IntegrityError naming it."""
    try:
        yield
    except IntegrityError:
        raise
    except _DAMAGE as exc:
        raise damaged(path, f"reading sub-database `{db}` failed ({type(exc).__name__}: {exc})") from None


def values(cursor: lmdb.Cursor, keys: list[bytes]) -> list:
    """Each key's value, or None, in input order. Looked up in sorted order: consecutive sorted keys share the
    B-tree's upper pages, which then stay in the CPU caches (about 2.5x faster than random order on 1M rows)."""
    return list(map(dict(zip(ordered := sorted(keys), map(cursor.get, ordered))).get, keys))


def event(path: str, eid: bytes, data: bytes | None, key: bytes | None = None):
    """The stored event `eid` (bytes `data`), decoded once they hash to `eid` (and its key, where given, is `key`)."""
    if data is None:
        raise damaged(path, f"event {eid.hex()} is not stored")
    if _codec.event_id(data) != eid:
        raise damaged(path, f"the bytes of event {eid.hex()} do not hash to its id")
    ev = _codec.stored_event(data, eid)
    if key is not None and ev.key != key:
        raise damaged(path, f"event {eid.hex()} belongs to key {ev.key.hex()}, not key {key.hex()}")
    return ev


def rows(txn, dbs, path: str, keys: list[bytes], summaries: bool = True, histories: dict | None = None,
         indexed: bool = False) -> list:
    """Per key, None or its verified current row (a CurrentRow; with `summaries=False` a RowHead). `histories` takes
    each key without one and its history value (a merge asks). Checks run per column; a failing one names the row."""
    with reading(path, "current"):
        stored = values(txn.cursor(dbs["current"]), keys)
    found = [i for i, v in enumerate(stored) if v is not None]
    fkeys = [keys[i] for i in found]
    sealed = _each(path, "current", fkeys, [stored[i] for i in found], _sealed)
    bodies = list(map(_body, sealed))
    digests = seal_digests(fkeys, bodies)
    if digests != list(map(_digest, sealed)):
        i = next(i for i, s in enumerate(sealed) if digests[i] != s.digest)
        raise damaged(path, f"the current row of key {fkeys[i].hex()} fails its digest")
    decoder = _decoders[CurrentRow if summaries else RowHead]
    out: list = [None] * len(keys)
    for i, row in zip(found, _each(path, "current", fkeys, bodies, decoder)):
        out[i] = row
    if len(found) < len(keys):
        absent = [keys[i] for i, v in enumerate(stored) if v is None]
        with reading(path, "history"):
            raws = values(txn.cursor(dbs["history"]), absent)
        present = [i for i, raw in enumerate(raws) if raw is not None]
        if indexed and len(present) < len(absent):  # keys read from scope_index: each was written, so has a history
            raise damaged(path, f"scope_index names key {absent[raws.index(None)].hex()}, which has no history")
        history = _decoders[HistoryEntry]
        entries = _each(path, "history", [absent[i] for i in present], [raws[i] for i in present], history)
        for i, entry in zip(present, entries):
            if entry.status != NO_ROW:
                raise damaged(path, f"key {absent[i].hex()} has no current row, but its history says it has one")
        if histories is not None:
            histories.update(zip(absent, raws))
    return out


def _each(path: str, db: str, keys: list[bytes], raws: list[bytes], decoder) -> list:
    """Each stored value decoded on its own (a damaged one cannot run into the next); the first that fails named."""
    try:
        return list(map(decoder.decode, raws))
    except _codec.UNDECODABLE:
        for key, raw in zip(keys, raws):
            try:
                decoder.decode(raw)
            except _codec.UNDECODABLE as exc:
                raise damaged(path, f"the {db} entry of key {key.hex()} cannot be decoded ({exc})") from None
        raise


_body, _digest = attrgetter("body"), attrgetter("digest")
