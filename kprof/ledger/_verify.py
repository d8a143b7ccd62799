"""Verified reads: every row a read returns is checked, by its digest (format 3) or against the event it names.

From format 3 on, a `current` value (kind + event id + Summary + digest) is trusted once its digest, recomputed over
the key looked up and the value's bytes, matches. In older files (opened read-only; a writer upgrades them), a
`current` value (kind + event id + Summary) is trusted only once the event it names is read from `events`, its
bytes hash to that id (so they are the bytes appended), its key is the key looked up and its kind is the row's
kind; the row's Summary is then derived from that event (the stored one is what the audit compares). A key
`current` does not hold is taken as missing only where `history` agrees (no entry, or the status of a key whose
every attempt is retracted): one damaged byte in either tree cannot turn a row into a missing one. Any LMDB error,
decode error or failed check becomes an IntegrityError naming the key or the sub-database (exit 3), never a
traceback or a wrong answer.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import repeat
from operator import attrgetter, getitem
from typing import Iterator, Union

import lmdb
import msgspec
from blake3 import blake3

from ..errors import IntegrityError
from . import _codec, _lookup
from ._reducer import (DIGEST_FROM, FAILED, MEASURED, NO_ROW, ROW_BODY, ROW_DIGEST, ROW_EVENT_ID, ROW_KIND, ROW_SUMMARY,
                       row_digest, row_digests)
from .events import FailedHead, FailedKey, MeasuredHead, MeasuredKey, Summary, summary_of

__all__ = ["AUDIT", "reading", "damaged", "rows", "event"]

AUDIT = "run `kprof audit` for the full report"
_head_decoder = msgspec.msgpack.Decoder(list[Union[MeasuredHead, FailedHead]])
# Decoding errors of bytes a damaged file holds: msgspec's, and what unpacking a value of the wrong shape raises.
_DAMAGE = (lmdb.Error, msgspec.MsgspecError, ValueError, TypeError, IndexError, KeyError, AttributeError)


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


def event(path: str, eid: bytes, data: bytes | None, key: bytes | None = None):
    """The stored event `eid` (its bytes `data`), decoded once its bytes hash to `eid` (and its key, where given,
    is `key`)."""
    if data is None:
        raise damaged(path, f"event {eid.hex()} is not stored")
    if _codec.event_id(data) != eid:
        raise damaged(path, f"the bytes of event {eid.hex()} do not hash to its id")
    ev = _codec.stored_event(data, eid)
    if key is not None and ev.key != key:
        raise damaged(path, f"event {eid.hex()} belongs to key {ev.key.hex()}, not key {key.hex()}")
    return ev


def rows(txn, dbs, path: str, keys: list[bytes], check_absent: bool = True, summaries: bool = True,
         file_format: int = _codec.FORMAT_VERSION, histories: dict | None = None) -> list:
    """Per key, None (no current row) or (kind, event id, Summary or None) of its current row, verified: by each
    row's digest from format 3 on (`_by_digest`), by the event each row names in older files (`_by_event`).
    `check_absent`: ask `history` about the keys `current` does not hold (False only for a format-1 file, whose
    history keeps no status). `summaries=False` (a count of missing rows) gives None for each Summary.
    `histories` (with `check_absent`): each key without a current row is put in it, with its history's value (None:
    the key has no history; a merge asks whether its events can be stored already).

    The checks run over whole columns in C-level maps and compares (no Python frame per row); a column that
    differs is then walked to name the first damaged row."""
    with reading(path, "current"):
        values = _lookup.values(txn.cursor(dbs["current"]), keys)
    found = [i for i, v in enumerate(values) if v is not None]
    verify = _by_digest if file_format >= DIGEST_FROM else _by_event
    checked = verify(txn, dbs, path, [keys[i] for i in found], [values[i] for i in found], summaries)
    out: list = [None] * len(keys)
    for i, row in zip(found, checked):
        out[i] = row
    if check_absent and len(found) < len(keys):
        absent = [keys[i] for i, v in enumerate(values) if v is None]
        statuses = _absent_agree(txn, dbs, path, absent)
        if histories is not None:
            histories.update(zip(absent, statuses))
    return out


def _by_digest(txn, dbs, path: str, fkeys: list[bytes], cur: list[bytes], summaries: bool) -> list:
    """(kind, event id, Summary or None) of format-3 rows: each row's digest recomputed over the key looked up and
    the row's bytes (so a damaged row, or a row under another key, fails), its kind checked, its Summary decoded
    from the row."""
    if row_digests(fkeys, map(getitem, cur, repeat(ROW_BODY))) != list(map(getitem, cur, repeat(ROW_DIGEST))):
        i = next(i for i, v in enumerate(cur) if len(v) < 49 or row_digest(fkeys[i], v[ROW_BODY]) != v[ROW_DIGEST])
        raise damaged(path, f"the current row of key {fkeys[i].hex()} fails its digest")
    kinds = list(map(getitem, cur, repeat(ROW_KIND)))
    if not set(kinds) <= _ROW_KINDS:
        i = next(i for i, k in enumerate(kinds) if k not in _ROW_KINDS)
        raise damaged(path, f"the current row of key {fkeys[i].hex()} has kind {kinds[i]!r}")
    if summaries:
        try:
            decoded = _summaries_decoder.decode(_array(list(map(getitem, cur, repeat(ROW_SUMMARY)))))
        except msgspec.MsgspecError as exc:
            raise damaged(path, f"a current row's summary cannot be decoded ({exc})") from None
    else:
        decoded = [None] * len(cur)
    return list(zip(kinds, map(getitem, cur, repeat(ROW_EVENT_ID)), decoded))


def _absent_agree(txn, dbs, path: str, absent: list[bytes]) -> list:
    """Keys `current` does not hold are missing only where `history` agrees (no entry, or no row); their history
    values."""
    with reading(path, "history"):
        statuses = _lookup.values(txn.cursor(dbs["history"]), absent)
    for key, status in zip(absent, statuses):
        if status is not None and status[:1] != NO_ROW:
            raise damaged(path, f"key {key.hex()} has no current row, but its history says it has one")
    return statuses


def _by_event(txn, dbs, path: str, fkeys: list[bytes], cur: list[bytes], summaries: bool) -> list:
    """(kind, event id, Summary or None) of rows of an older file, each verified against the event it names (see
    the module docstring); the Summary is derived from the verified event (the stored one, which no hash covers,
    is not read: the same bytes where undamaged, as the audit checks, and cheaper than decoding and comparing
    it). `summaries=False` checks each event's id, key and kind but does not decode the summary."""
    eids = list(map(getitem, cur, repeat(ROW_EVENT_ID)))
    with reading(path, "events"):
        datas = _lookup.values(txn.cursor(dbs["events"]), eids)
    if None in datas:
        i = datas.index(None)
        raise damaged(path, f"the current row of key {fkeys[i].hex()} names event {eids[i].hex()}, which is not "
                            f"stored")
    if list(map(blake3.digest, map(blake3, map(_codec.EVENT_TAG.__add__, datas)))) != eids:
        i = next(i for i, data in enumerate(datas) if _codec.event_id(data) != eids[i])
        raise damaged(path, f"the current row of key {fkeys[i].hex()} names event {eids[i].hex()}, whose bytes do "
                            f"not hash to its id")
    try:
        heads = (_head_decoder if summaries else _key_decoder).decode(_array(datas))
    except msgspec.MsgspecError as exc:
        raise damaged(path, f"an event of sub-database `events` that a current row names cannot be decoded "
                            f"({exc})") from None
    kinds = list(map(_KINDS.__getitem__, map(type, heads)))
    derived = list(map(summary_of, heads)) if summaries else [None] * len(heads)
    if list(map(attrgetter("key"), heads)) != fkeys or list(map(getitem, cur, repeat(ROW_KIND))) != kinds:
        i = next(i for i, (v, h) in enumerate(zip(cur, heads)) if h.key != fkeys[i] or v[ROW_KIND] != kinds[i])
        raise damaged(path, f"the current row of key {fkeys[i].hex()} does not match its event {eids[i].hex()}")
    return list(zip(kinds, eids, derived))


def _array(parts: list[bytes]) -> bytes:
    """A msgpack array of the already-encoded items (decoded in one call, not one call per item)."""
    return b"\xdd" + len(parts).to_bytes(4, "big") + b"".join(parts)


_key_decoder = msgspec.msgpack.Decoder(list[Union[MeasuredKey, FailedKey]])  # skips every other field
_KINDS = {MeasuredHead: MEASURED, FailedHead: FAILED, MeasuredKey: MEASURED, FailedKey: FAILED}
_ROW_KINDS = {MEASURED, FAILED}
_summaries_decoder = msgspec.msgpack.Decoder(list[Summary])
