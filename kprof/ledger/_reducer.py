"""The one place that says how an event changes the views. Used by append, replay and audit alike.

Views (all rebuildable from the log):
  current      key -> kind byte (b"m" measured, b"f" failed) + event id (32) + Summary: the row a reader sees
  scope_index  scope id (16) + shape id (16) + key -> b"": every key ever seen in a scope, by shape
  history      key -> status byte + seq (8, big-endian) of every event of the key, in log order (format 2;
               format 1 kept key + seq -> event id). The event ids are the log's entries at those seqs. The
               status byte is the kind of the key's current row: b"m" measured, b"f" failed, b"-" none (all
               retracted). `missing` asks this tree: ~50 bytes a key, where `current` holds ~330, so a bulk
               lookup's pages stay in the CPU caches (~0.7 µs less per key on a 1M-row view), and an append
               writes no more pages than the format-1 layout did
  failures     key -> event id of the key's latest (non-retracted) failure
  retracted    target event id -> retraction event id
  scopes       scope id -> msgpack [table, backend, gpu_key, rows, accumulator, contract ids seen]

Current row of a key: its latest non-retracted attempt, measured or failed (the row's status is
`failed` when the last attempt failed, as the contract defines; the earlier good row stays in history and
comes back if the failure is retracted). The scope's view root is an additive multiset hash over (key, current event id): it can be
updated in O(1) per change and does not depend on the order rows arrived in.
"""

from __future__ import annotations

import struct
from itertools import repeat
from typing import Callable, Iterable, NamedTuple

import msgspec
from blake3 import blake3

from ..errors import IntegrityError
from . import _codec
from .events import KIND, summary_of, summary_of_decoded

MEASURED, FAILED, RETRACTED = b"m", b"f", b"r"
NO_ROW = b"-"  # a history's status when the key has no current row (its every attempt retracted)
REBUILT = b"views_rebuilt"  # meta: how many times rebuild_views has rewritten the views (absent: never)
MOD = 1 << 256
_seq = struct.Struct(">Q")
pack_seq = _seq.pack
unpack_seq = _seq.unpack


def contract_id(prov) -> bytes:
    return blake3(_codec.encode(prov.contract)).digest()[:8]


class ProvenanceIds:
    """The scope id and contract id of provenances, each computed once per distinct value (a ledger's events
    share a few): the reducer, an all-new batch's rows and the audit's replay all take them from here."""

    def __init__(self):
        self._sids: dict[tuple, bytes] = {}
        self._cids: dict[tuple, bytes] = {}

    def scope(self, prov) -> bytes:
        names = (prov.table, prov.backend, prov.gpu_key)
        sid = self._sids.get(names)
        if sid is None:
            sid = self._sids[names] = _codec.scope_id(*names)
        return sid

    def contract(self, prov) -> bytes:
        contract = (prov.algorithm, prov.layout, prov.numerics, prov.timing, prov.profiler_revision)
        cid = self._cids.get(contract)
        if cid is None:
            cid = self._cids[contract] = contract_id(prov)
        return cid


def row_term(key: bytes, eid: bytes) -> int:
    """A current row's term in its scope's root accumulator (the sum of its rows' terms, mod MOD)."""
    return int.from_bytes(blake3(_codec.ROOT_TAG + key + eid).digest(), "big")


def row_terms(pairs: Iterable[bytes]) -> int:
    """The sum (not reduced) of row_term over rows given as key + event id, by C-level maps: no Python frame
    per row."""
    tagged = map(_codec.ROOT_TAG.__add__, pairs)
    return sum(map(int.from_bytes, map(blake3.digest, map(blake3, tagged)), repeat("big")))


def current_row(kind: bytes, eid: bytes, event, summarize=summary_of) -> bytes:
    """A `current` value: kind letter, event id, the event's Summary (what append, replay and audit store
    or expect). The audit passes `summary_of_decoded` for the events it decoded."""
    return kind + eid + _codec.encode(summarize(event))


def index_key(sid: bytes, shape: bytes, key: bytes) -> bytes:
    """A `scope_index` key: scope id, the id of the shape's canonical bytes, the row key."""
    return sid + _codec.shape_id(shape) + key


def history_seqs(value: bytes, start: int = 1) -> list[bytes]:
    """The 8-byte seqs (log keys) of a format-2 history value, oldest first (`start=0`: of a bare run of seqs)."""
    return [value[i:i + 8] for i in range(start, len(value), 8)]


def status_of(row: bytes | None) -> bytes:
    """A history's status for a key whose current row is `row` (None: no row)."""
    return NO_ROW if row is None else row[:1]


def history_from_v1(keys: Iterable[bytes], status: Callable[[bytes], bytes]) -> dict[bytes, bytes]:
    """Format 2's history entries, in key order, of a format-1 history's keys (key + seq, in key order): each
    key's status (`status(key)`), then its seqs. The upgrade writes them; the audit of a format-1 file compares
    them with its replay."""
    out: dict[bytes, bytes] = {}
    for k in keys:
        if len(k) != 40:
            raise IntegrityError(f"the file says format 1, but its history holds a key of {len(k)} bytes where "
                                 f"format 1 keeps key + seq (40); restore the file from a copy")
        key = k[:32]
        value = out.get(key)
        out[key] = status(key) + k[32:] if value is None else value + k[32:]
    return out


def root_of(scope: bytes, rows: int, acc: int) -> bytes:
    return blake3(_codec.ROOT_TAG + scope + rows.to_bytes(8, "big") + acc.to_bytes(32, "big")).digest()


class Store:
    """The views as the reducer sees them; LMDB and in-memory implementations provide these."""

    def get(self, db: str, k: bytes) -> bytes | None: ...
    def put(self, db: str, k: bytes, v: bytes) -> None: ...
    def delete(self, db: str, k: bytes) -> None: ...
    def logged(self, seq: bytes) -> bytes: ...  # the event id the log holds at seq (8 bytes)
    def event(self, eid: bytes): ...  # decoded event
    def flush(self) -> None: ...  # writes what is buffered


class Reducer:
    """Applies events to a Store. Scope accumulators are cached and flushed once per batch.

    Events may be the full records or their heads (events.KIND maps each type to its kind letter):
    the views need only the key, provenance, summary fields and retraction target.
    """

    def __init__(self, store: Store):
        self.store = store
        self._put, self._get = store.put, store.get
        self._scopes: dict[bytes, list] = {}  # scope -> [table, backend, gpu_key, rows, acc, contracts]
        self._ids = ProvenanceIds()

    def _scope(self, prov) -> tuple[bytes, list]:
        sid = self._ids.scope(prov)
        entry = self._scopes.get(sid)
        if entry is None:
            raw = self.store.get("scopes", sid)
            if raw is None:
                entry = [prov.table, prov.backend, prov.gpu_key, 0, 0, []]
            else:
                t, b, g, rows, acc, contracts = msgspec.msgpack.decode(raw)
                entry = [t, b, g, rows, int.from_bytes(acc, "big"), contracts]
            self._scopes[sid] = entry
        return sid, entry

    def apply(self, event, eid: bytes, seq: int) -> None:
        put, encode = self._put, _codec.encode
        key = event.key
        history = (self._get("history", key) or NO_ROW) + pack_seq(seq)  # status as it was; set below
        kind = KIND[type(event)]
        if kind == RETRACTED:
            put("history", key, history)
            self._retract(event, eid)
            return
        prov = event.provenance
        sid, entry = self._scope(prov)
        put("scope_index", index_key(sid, encode(prov.shape), key), b"")
        cid = self._ids.contract(prov)
        if cid not in entry[5]:
            entry[5] = sorted(entry[5] + [cid])
        if kind == FAILED:
            put("failures", key, eid)
        new = current_row(kind, eid, event)
        old = self._get("current", key)
        if old is None:  # a new row: the common case, inline
            entry[4] += row_term(key, eid)
            entry[3] += 1
            put("current", key, new)
            put("history", key, kind + history[1:])
        else:
            put("history", key, history)
            self._set_current(entry, key, old, new)

    def _set_current(self, entry, key: bytes, old: bytes | None, new: bytes | None) -> None:
        """Makes `new` (or none) the key's current row, and its kind the status of the key's history."""
        if old == new:
            return
        store = self.store
        if old is not None:
            entry[4] = (entry[4] - row_term(key, old[1:33])) % MOD
            entry[3] -= 1
        if new is not None:
            entry[4] = (entry[4] + row_term(key, new[1:33])) % MOD
            entry[3] += 1
            store.put("current", key, new)
        else:
            store.delete("current", key)
        status = status_of(new)
        history = store.get("history", key)
        if history[:1] != status:
            store.put("history", key, status + history[1:])

    def _retract(self, event, eid: bytes) -> None:
        """The key's current row becomes its latest attempt that is not retracted (or none)."""
        s = self.store
        s.put("retracted", event.target, eid)
        target = s.event(event.target)
        if target is None or KIND[type(target)] == RETRACTED:  # appends refuse these: such a log was not appended
            raise IntegrityError(f"retraction {eid.hex()[:16]} names event {event.target.hex()[:16]}, which is "
                                 f"{'not stored' if target is None else 'a retraction'}; restore the file from a copy")
        _sid, entry = self._scope(target.provenance)
        key = event.key
        latest = latest_failed = None
        for hid in map(s.logged, reversed(history_seqs(s.get("history", key)))):
            if s.get("retracted", hid) is not None:
                continue
            ev = s.event(hid)
            kind = KIND[type(ev)]
            if kind == RETRACTED:
                continue
            if latest is None:
                latest = (kind, hid, ev)
            if kind == FAILED:
                latest_failed = hid
                break
        new = None if latest is None else current_row(*latest)
        self._set_current(entry, key, s.get("current", key), new)
        if latest_failed is None:
            s.delete("failures", key)
        else:
            s.put("failures", key, latest_failed)

    def flush(self) -> None:
        for sid, (t, b, g, rows, acc, contracts) in self._scopes.items():
            self.store.put("scopes", sid, scope_value(t, b, g, rows, acc, contracts))
        self._scopes.clear()


def scope_value(table: str, backend: str, gpu_key: str, rows: int, acc: int, contracts: list) -> bytes:
    """A `scopes` entry; `acc` may be unreduced (new rows add their terms without the modulo)."""
    return _codec.encode([table, backend, gpu_key, rows, (acc % MOD).to_bytes(32, "big"), contracts])


class NewRows(NamedTuple):
    """What a batch of new events of distinct keys writes, computed before any transaction: what
    `Reducer.apply` does for an event whose id and key are not in the ledger, done for a whole batch.

    Only the sequence numbers depend on the ledger (the log and history keys take them in the transaction),
    and the scope entries, to which `scopes` adds its rows, terms and contract ids. A property test holds
    batches appended this way equal to the same events appended one by one through `Reducer.apply`.
    """

    eids: list[bytes]  # log order
    events: list[tuple[bytes, bytes]]  # (event id, bytes), sorted: each B-tree page is visited once
    current: list[tuple[bytes, bytes]]  # (key, row), sorted
    history: list[tuple[bytes, int, bytes]]  # (key, position in the batch from 1, status byte), by key
    scope_index: list[tuple[bytes, bytes]]  # sorted
    failures: list[tuple[bytes, bytes]]  # sorted
    scopes: dict[bytes, list]  # scope id -> [table, backend, gpu_key, rows added, terms added, contract ids]


def new_rows(prepared: list[tuple]) -> NewRows | None:
    """The NewRows of (event, bytes, event id) triples; None when the batch holds a retraction, or an
    event id or key twice (those batches go through `Reducer.apply`, reading the ledger first)."""
    encode = _codec.encode
    eids = [eid for _e, _d, eid in prepared]
    keys = [event.key for event, _d, _eid in prepared]
    if len(set(keys)) != len(keys) or len(set(eids)) != len(eids):
        return None
    current, scope_index, failures, kinds = [], [], [], []
    scopes: dict[bytes, list] = {}
    ids = ProvenanceIds()
    for event, _data, eid in prepared:
        kind = KIND[type(event)]
        if kind == RETRACTED:
            return None
        kinds.append(kind)
        prov, key = event.provenance, event.key
        sid = ids.scope(prov)
        entry = scopes.get(sid)
        if entry is None:
            entry = scopes[sid] = [prov.table, prov.backend, prov.gpu_key, 0, 0, set()]
        entry[5].add(ids.contract(prov))
        entry[3] += 1
        entry[4] += row_term(key, eid)
        scope_index.append((index_key(sid, encode(prov.shape), key), b""))
        if kind == FAILED:
            failures.append((key, eid))
        # appended events are as they decode (see store._canonical): their float fields hold floats already
        current.append((key, current_row(kind, eid, event, summary_of_decoded)))
    by_key = sorted(range(len(keys)), key=keys.__getitem__)
    return NewRows(eids, sorted(zip(eids, [data for _e, data, _eid in prepared])), sorted(current),
                   [(keys[i], i + 1, kinds[i]) for i in by_key], sorted(scope_index), sorted(failures), scopes)
