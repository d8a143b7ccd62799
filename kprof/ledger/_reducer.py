"""The one place that says how an event changes the views: append, rebuild and audit all apply events here.

Views (rebuildable from the log), every value a named msgspec Struct encoded as a msgpack array:
  current      key -> Sealed(CurrentRow(kind, event id, Summary)): a reader's row, sealed by a digest of key and bytes
  scope_index  scope id (16) + shape id (16) + key -> b"": every key ever seen in a scope, by shape
  history      key -> HistoryEntry(status, seqs): its current row's kind ("m", "f", "-": all retracted) and events'
               seqs; a key damaged out of `current` is not missing while its history says it has a row
  failures     key -> event id of the key's latest non-retracted failure
  retracted    target event id -> retraction event id
  scopes       scope id -> Sealed(ScopeEntry): the scope's names, row count, root accumulator and contract ids

A key's current row is its latest non-retracted attempt, measured or failed (a retracted failure brings the earlier
good row back). The view root, an additive multiset hash of (key, current event id), is O(1) per change, any order."""

from __future__ import annotations

import functools
from itertools import repeat
from typing import Literal

import msgspec
from blake3 import blake3

from ..errors import IntegrityError
from . import _codec
from .events import KIND, Contract, Summary, summary_of

MEASURED, FAILED, RETRACTED = "m", "f", "r"
NO_ROW = "-"  # a history's status when the key has no current row (its every attempt retracted)
REBUILT = b"views_rebuilt"  # meta: how many times rebuild_views has rewritten the views (absent: never)
MOD = 1 << 256


def pack_seq(seq: int) -> bytes:
    """A log key: the seq as 8 big-endian bytes (the log's keys sort in log order)."""
    return seq.to_bytes(8, "big")


def seq_of(log_key: bytes) -> int:
    return int.from_bytes(log_key, "big")


class Sealed(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A record's msgpack bytes and blake3(ROW_TAG + key + body)[:16]: damaged, or moved to another key, it fails."""

    body: msgspec.Raw
    digest: bytes


class CurrentRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A key's current row: its kind, the event behind it and that event's Summary."""

    kind: Literal["m", "f"]
    event_id: bytes
    summary: Summary


class RowHead(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A current row's kind and event id alone (decoding skips the Summary)."""

    kind: Literal["m", "f"]
    event_id: bytes


class HistoryEntry(msgspec.Struct, array_like=True, gc=False):
    """A `history` value: the kind of the key's current row (NO_ROW: none) and the seqs of its events."""

    status: Literal["m", "f", "-"]
    seqs: list[int]


class ScopeEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A `scopes` record: names, current rows, root accumulator (32 bytes big-endian, mod 2^256) and the ids of
    the contracts its events carried. Readers report the view root from it, so it is sealed like a row."""

    table: str
    backend: str
    gpu_key: str
    rows: int
    acc: bytes
    contracts: list[bytes]


_ROW_HASHER = blake3(_codec.ROW_TAG)  # copied per record, never updated
_sealed = msgspec.msgpack.Decoder(Sealed)
_decoders = {t: msgspec.msgpack.Decoder(t) for t in (CurrentRow, RowHead, HistoryEntry, ScopeEntry)}


def seal_digest(key: bytes, body) -> bytes:
    return _ROW_HASHER.copy().update(key).update(body).digest(16)


def seal_digests(keys: list[bytes], bodies) -> list[bytes]:
    """seal_digest of each (key, body), in bulk: chained maps over C methods, no Python frame per record."""
    n = len(keys)
    copies = map(blake3.copy, repeat(_ROW_HASHER, n))
    return list(map(blake3.digest, map(blake3.update, map(blake3.update, copies, keys), bodies), repeat(16, n)))


def seal(key: bytes, record) -> bytes:
    body = _codec.encode(record)
    return _codec.encode(Sealed(msgspec.Raw(body), seal_digest(key, body)))


def damaged_entry(db: str, key: bytes, why: str) -> IntegrityError:
    return IntegrityError(f"{db}: entry {key.hex()} is damaged: {why}; run `kprof audit` for the full report, and "
                          f"restore the file from a copy")


def opened(db: str, key: bytes, raw: bytes, record_type: type):
    """The `record_type` record the sealed value `raw` of `key` holds; IntegrityError naming it where it fails."""
    try:
        sealed = _sealed.decode(raw)
        if seal_digest(key, sealed.body) != sealed.digest:
            raise damaged_entry(db, key, "it fails its digest")
        return _decoders[record_type].decode(sealed.body)
    except _codec.UNDECODABLE as exc:
        raise damaged_entry(db, key, f"it cannot be decoded ({exc})") from None


def history_entry(key: bytes, raw: bytes | None) -> HistoryEntry:
    """A stored history value (None: an empty entry); IntegrityError naming it where damaged."""
    if raw is None:
        return HistoryEntry(NO_ROW, [])
    try:
        return _decoders[HistoryEntry].decode(raw)
    except _codec.UNDECODABLE as exc:
        raise damaged_entry("history", key, f"it cannot be decoded ({exc})") from None


def contract_id(prov) -> bytes:
    return _contract_id(prov.algorithm, prov.layout, prov.numerics, prov.timing, prov.profiler_revision)


@functools.lru_cache(maxsize=1024)  # a ledger's events share a few contracts
def _contract_id(*contract) -> bytes:
    return blake3(_codec.encode(Contract(*contract))).digest()[:8]


def row_term(key: bytes, eid: bytes) -> int:
    """A current row's term in its scope's root accumulator (the sum of its rows' terms, mod MOD)."""
    return int.from_bytes(blake3(_codec.ROOT_TAG + key + eid).digest(), "big")


class ScopeTotals(msgspec.Struct):
    """A scope's entry while a batch is applied: the accumulator an integer, the contract ids a set."""

    table: str
    backend: str
    gpu_key: str
    rows: int = 0
    acc: int = 0
    contracts: set = set()

    @classmethod
    def of(cls, prov) -> "ScopeTotals":
        return cls(prov.table, prov.backend, prov.gpu_key, contracts=set())

    @classmethod
    def stored(cls, entry: ScopeEntry) -> "ScopeTotals":
        return cls(entry.table, entry.backend, entry.gpu_key, entry.rows, int.from_bytes(entry.acc, "big"),
                   set(entry.contracts))

    def entry(self) -> ScopeEntry:
        return ScopeEntry(self.table, self.backend, self.gpu_key, self.rows, (self.acc % MOD).to_bytes(32, "big"),
                          sorted(self.contracts))

    def add(self, other: "ScopeTotals") -> None:
        self.rows, self.acc = self.rows + other.rows, self.acc + other.acc
        self.contracts |= other.contracts


def root_of(scope: bytes, rows: int, acc: int) -> bytes:
    return blake3(_codec.ROOT_TAG + scope + rows.to_bytes(8, "big") + acc.to_bytes(32, "big")).digest()


class Store:
    """The views as the reducer sees them; LMDB and in-memory implementations provide get, put and delete."""

    def get(self, db: str, k: bytes) -> bytes | None: ...
    def put(self, db: str, k: bytes, v: bytes) -> None: ...
    def delete(self, db: str, k: bytes) -> None: ...

    def event(self, eid: bytes):
        data = self.get("events", eid)
        return None if data is None else _codec.event_decoder.decode(data)


class Reducer:
    """Applies events (records or their heads: events.KIND) to a Store; scope entries are flushed once per batch.
    What it reads back is checked as a reader checks it: a write into a damaged ledger is an IntegrityError, aborted."""

    def __init__(self, store: Store):
        self.store, self._put, self._get = store, store.put, store.get
        self._scopes: dict[bytes, ScopeTotals] = {}

    def _scope(self, prov) -> tuple[bytes, ScopeTotals]:
        sid = _codec.scope_id(prov.table, prov.backend, prov.gpu_key)
        entry = self._scopes.get(sid)
        if entry is None:
            raw = self.store.get("scopes", sid)
            entry = ScopeTotals.of(prov) if raw is None else ScopeTotals.stored(opened("scopes", sid, raw, ScopeEntry))
            self._scopes[sid] = entry
        return sid, entry

    def apply(self, event, eid: bytes, seq: int) -> None:
        put, encode, key = self._put, _codec.encode, event.key
        history = history_entry(key, self._get("history", key))
        history.seqs.append(seq)
        kind = KIND[type(event)]
        if kind == RETRACTED:
            self._retract(event, eid, history)
            return
        prov = event.provenance
        sid, entry = self._scope(prov)
        put("scope_index", sid + _codec.shape_id(encode(prov.shape)) + key, b"")  # see the module
        entry.contracts.add(contract_id(prov))
        if kind == FAILED:
            put("failures", key, eid)
        self._set_current(entry, key, self._get("current", key), CurrentRow(kind, eid, summary_of(event)), history)

    def _set_current(self, entry: ScopeTotals, key: bytes, old: bytes | None, new: CurrentRow | None,
                     history: HistoryEntry) -> None:
        """Makes `new` (or none) the key's current row, and writes the key's `history` with its kind as status."""
        store, history.status = self.store, NO_ROW if new is None else new.kind
        store.put("history", key, _codec.encode(history))
        stored = None if new is None else seal(key, new)
        if old == stored:
            return
        if old is not None:
            entry.acc = (entry.acc - row_term(key, opened("current", key, old, RowHead).event_id)) % MOD
            entry.rows -= 1
        if new is not None:
            entry.acc = (entry.acc + row_term(key, new.event_id)) % MOD
            entry.rows += 1
            store.put("current", key, stored)
        else:
            store.delete("current", key)

    def _retract(self, event, eid: bytes, history: HistoryEntry) -> None:
        """The key's current row becomes its latest attempt not retracted (or none)."""
        s = self.store
        s.put("retracted", event.target, eid)
        target = s.event(event.target)
        if target is None or KIND[type(target)] == RETRACTED:  # appends refuse these: such a log was not appended
            raise IntegrityError(f"retraction {eid.hex()[:16]} names event {event.target.hex()[:16]}, which is "
                                 f"{'not stored' if target is None else 'a retraction'}; restore the file from a copy")
        _sid, entry = self._scope(target.provenance)
        key, latest, latest_failed = event.key, None, None
        for hid in (s.get("log", pack_seq(seq)) for seq in reversed(history.seqs)):
            if s.get("retracted", hid) is not None:
                continue
            ev = s.event(hid)
            kind = KIND[type(ev)]
            if kind == RETRACTED:
                continue
            if latest is None:
                latest = CurrentRow(kind, hid, summary_of(ev))
            if kind == FAILED:
                latest_failed = hid
                break
        self._set_current(entry, key, s.get("current", key), latest, history)
        if latest_failed is None:
            s.delete("failures", key)
        else:
            s.put("failures", key, latest_failed)

    def flush(self) -> None:
        for sid, entry in self._scopes.items():
            self.store.put("scopes", sid, seal(sid, entry.entry()))
        self._scopes.clear()
