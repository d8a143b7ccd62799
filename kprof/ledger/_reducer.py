"""The one place that says how an event changes the views. Used by append, replay and audit alike.

Views (all rebuildable from the log):
  current      key -> kind byte (b"m" measured, b"f" failed) + event id (32) + Summary + digest (16; format 3):
               the row a reader sees; the digest, blake3 of ROW_TAG + key + the rest, is what a read checks
  scope_index  scope id (16) + shape id (16) + key -> b"": every key ever seen in a scope, by shape
  history      key -> status byte + seq (8, big-endian) of every event of the key, in log order (format 2;
               format 1 kept key + seq -> event id). The event ids are the log's entries at those seqs. The
               status byte is the kind of the key's current row: b"m" measured, b"f" failed, b"-" none (all
               retracted). `missing` asks this tree: ~50 bytes a key, where `current` holds ~330, so a bulk
               lookup's pages stay in the CPU caches (~0.7 µs less per key on a 1M-row view), and an append
               writes no more pages than the format-1 layout did
  failures     key -> event id of the key's latest (non-retracted) failure
  retracted    target event id -> retraction event id
  scopes       scope id -> ScopeEntry (table, backend, GPU key, rows, accumulator, contract ids seen)

Current row of a key: its latest non-retracted attempt, measured or failed (the row's status is
`failed` when the last attempt failed, as the contract defines; the earlier good row stays in history and
comes back if the failure is retracted). The scope's view root is an additive multiset hash over (key, current event id): it can be
updated in O(1) per change and does not depend on the order rows arrived in.
"""

from __future__ import annotations

import struct
from itertools import repeat

import msgspec
from blake3 import blake3

from ..errors import IntegrityError
from . import _codec
from .events import KIND, summary_of

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
    share a few)."""

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


DIGEST_FROM = 3  # the format from which current rows carry their digest


_ROW_HASHER = blake3(_codec.ROW_TAG)  # copied per row, never updated


def row_digest(key: bytes, body: bytes) -> bytes:
    """The digest that ends a current row of format 3: blake3(ROW_TAG + key + kind + event id + Summary), 16 bytes.
    It binds the row to its key: a row damaged, or moved under another key, fails it."""
    return _ROW_HASHER.copy().update(key).update(body).digest(16)


def row_digests(keys: list[bytes], bodies) -> list[bytes]:
    """row_digest of each (key, body), in bulk: chained maps over C methods, no Python frame per row."""
    n = len(keys)
    copies = map(blake3.copy, repeat(_ROW_HASHER, n))
    return list(map(blake3.digest, map(blake3.update, map(blake3.update, copies, keys), bodies), repeat(16, n)))


def current_row(kind: bytes, eid: bytes, event, key: bytes, digest: bool = True) -> bytes:
    """A `current` value: kind letter, event id, the event's Summary and (`digest`: format 3) the row's digest;
    what append, replay and audit store or expect."""
    body = kind + eid + _codec.encode(summary_of(event))
    return body + row_digest(key, body) if digest else body


def index_key(sid: bytes, shape: bytes, key: bytes) -> bytes:
    """A `scope_index` key: scope id, the id of the shape's canonical bytes, the row key."""
    return sid + _codec.shape_id(shape) + key


def history_seqs(value: bytes, start: int = 1) -> list[bytes]:
    """The 8-byte seqs (log keys) of a format-2 history value, oldest first (`start=0`: of a bare run of seqs)."""
    return [value[i:i + 8] for i in range(start, len(value), 8)]


# A `current` value's layout: kind letter, event id (32), Summary bytes, digest (16; format 3). Readers slice
# with these; the reducer's two accessors below use them too.
ROW_KIND, ROW_EVENT_ID, ROW_SUMMARY, ROW_BODY, ROW_DIGEST = (slice(0, 1), slice(1, 33), slice(33, -16),
                                                             slice(0, -16), slice(-16, None))


def row_kind(row: bytes) -> bytes:
    """A `current` value's kind letter (b"m" or b"f")."""
    return row[ROW_KIND]


def row_event_id(row: bytes) -> bytes:
    """A `current` value's event id."""
    return row[ROW_EVENT_ID]


def status_of(row: bytes | None) -> bytes:
    """A history's status for a key whose current row is `row` (None: no row)."""
    return NO_ROW if row is None else row_kind(row)


class ScopeEntry(msgspec.Struct, array_like=True):
    """A `scopes` value (a msgpack array on disk): the scope's names, how many current rows it has, its root
    accumulator (32 bytes, big-endian, reduced mod 2^256) and the ids of the contracts its events carried. From
    format 3 on the array has a seventh item, a digest of the scope id and these six, which every read checks
    (`decode_scope`): the view root a reader reports comes from this entry, and one damaged bit of it must not read
    as another root."""

    table: str
    backend: str
    gpu_key: str
    rows: int
    acc: bytes
    contracts: list[bytes]

    @property
    def root_acc(self) -> int:
        return int.from_bytes(self.acc, "big")


def _scope_digest(sid: bytes, fields: list) -> bytes:
    return blake3(_codec.ROW_TAG + sid + _codec.encode(fields)).digest(16)


def encode_scope(sid: bytes, entry: ScopeEntry, digest: bool = True) -> bytes:
    """The stored bytes of scope `sid`'s entry, with its digest unless the file's format keeps none."""
    fields = [entry.table, entry.backend, entry.gpu_key, entry.rows, entry.acc, entry.contracts]
    return _codec.encode(fields + [_scope_digest(sid, fields)] if digest else fields)


class ScopeTotals(msgspec.Struct):
    """A scope's entry as the reducer keeps it while it applies a batch: the accumulator as an integer (terms
    are added without the modulo until `entry`), the contract ids as a set."""

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
        return cls(entry.table, entry.backend, entry.gpu_key, entry.rows, entry.root_acc, set(entry.contracts))

    def entry(self) -> ScopeEntry:
        return ScopeEntry(self.table, self.backend, self.gpu_key, self.rows, (self.acc % MOD).to_bytes(32, "big"),
                          sorted(self.contracts))

    def add(self, other: "ScopeTotals") -> None:
        self.rows += other.rows
        self.acc += other.acc
        self.contracts |= other.contracts


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

    def __init__(self, store: Store, file_format: int = _codec.FORMAT_VERSION):
        self.store = store
        self._digest = file_format >= DIGEST_FROM  # rows as the file's format keeps them (the audit of an old file)
        self._put, self._get = store.put, store.get
        self._scopes: dict[bytes, ScopeTotals] = {}
        self._ids = ProvenanceIds()

    def _scope(self, prov) -> tuple[bytes, ScopeTotals]:
        sid = self._ids.scope(prov)
        entry = self._scopes.get(sid)
        if entry is None:
            raw = self.store.get("scopes", sid)
            entry = ScopeTotals.of(prov) if raw is None else ScopeTotals.stored(decode_scope(raw, sid))
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
        entry.contracts.add(self._ids.contract(prov))
        if kind == FAILED:
            put("failures", key, eid)
        new = current_row(kind, eid, event, key, digest=self._digest)
        old = self._get("current", key)
        if old is None:  # a new row: the common case, inline
            entry.acc += row_term(key, eid)
            entry.rows += 1
            put("current", key, new)
            put("history", key, kind + history[1:])
        else:
            put("history", key, history)
            self._set_current(entry, key, old, new)

    def _set_current(self, entry: ScopeTotals, key: bytes, old: bytes | None, new: bytes | None) -> None:
        """Makes `new` (or none) the key's current row, and its kind the status of the key's history."""
        if old == new:
            return
        store = self.store
        if old is not None:
            entry.acc = (entry.acc - row_term(key, row_event_id(old))) % MOD
            entry.rows -= 1
        if new is not None:
            entry.acc = (entry.acc + row_term(key, row_event_id(new))) % MOD
            entry.rows += 1
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
        new = None if latest is None else current_row(*latest, key, digest=self._digest)
        self._set_current(entry, key, s.get("current", key), new)
        if latest_failed is None:
            s.delete("failures", key)
        else:
            s.put("failures", key, latest_failed)

    def flush(self) -> None:
        for sid, entry in self._scopes.items():
            self.store.put("scopes", sid, encode_scope(sid, entry.entry(), self._digest))
        self._scopes.clear()


def decode_scope(raw: bytes, sid: bytes) -> ScopeEntry:
    """A stored `scopes` value, its digest checked where it has one (format 3); IntegrityError naming the scope
    where its bytes do not fit ScopeEntry or fail the digest."""
    why = None
    try:
        fields = msgspec.msgpack.decode(raw)
        if type(fields) is not list or len(fields) not in (6, 7):
            why = "it is not an entry of six or seven items"
        else:
            entry = msgspec.convert(fields[:6], ScopeEntry)
            if len(fields) == 7 and fields[6] != _scope_digest(sid, fields[:6]):
                why = "it fails its digest"
    except msgspec.MsgspecError as exc:
        why = f"it cannot be decoded ({exc})"
    if why:
        raise IntegrityError(f"scopes: entry {sid.hex()} is damaged: {why}; run `kprof audit` for the full report, "
                             f"and restore the file from a copy")
    return entry
