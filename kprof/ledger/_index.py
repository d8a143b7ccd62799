"""An in-memory index of the keys that have a current row, for a process that looks up many keys.

A bulk lookup through LMDB walks the `history` (or `current`) B-tree once per key: ~1 µs a key on the 2-core VM
even in sorted order, plus ~0.5 µs to sort the keys for that order. A process that has looked up about as many
keys as the ledger holds (a simulator asking for 100,000 specs again and again) instead reads `history` once, in
key order, into three numpy arrays (~40 bytes a key):

  keys      every key with a current row, as 4 native uint64 (its bytes, big-endian), in byte order
  measured  1 where that row is measured, 0 where it is failed (the status byte `history` keeps first)
  starts    where each bucket of keys begins: bucket = the key's first B bits, 2**B >= the keys held. blake3
            keys are uniform, so a bucket holds ~1 key, and a lookup is a gather or two per key, vectorized

It answers a later read transaction exactly, never approximately: the log says what changed since the index was
read. Every view change is an event's, logged at the next sequence number, except `rebuild_views`, which counts
its rebuilds in meta `views_rebuilt`. So for a transaction whose `last_seq` is at or past the index's, with the same
`views_rebuilt`, a key's status is the index's unless an event of that key was logged after it; those keys (the
`touched` set, read from the log's tail) are looked up in the transaction itself. A transaction older than the
index, or after a rebuild, is answered through LMDB.

When to read the index (a rent-or-buy rule): reading it costs ~0.6-0.7 µs per key held, and saves ~1.2 µs per key
looked up. It is read once the keys looked up through LMDB since the last index (this call's included) reach
BUILD_FRACTION of the keys held, so a process never spends more than about twice what the best choice in
hindsight would have: a CLI verb asking for a few thousand specs never reads it, a long-lived reader soon does.
Tails past a fraction of the index (a writer appending meanwhile) retire it, and the rule starts over. A lookup
split with the helper process (see _parallel) counts whole in the requesting process, and while that process holds
an index its requests ask the helper to read one too.

KPROF_KEY_INDEX=0 turns the index off (every key is looked up in the file); the lookup helper inherits it.
"""

from __future__ import annotations

import os
import threading
from itertools import islice
from operator import itemgetter
from typing import NamedTuple

import msgspec

from ..errors import UsageError
from . import _lookup
from ._reducer import MEASURED, NO_ROW, pack_seq
from .events import EventHead

BUILD_FRACTION = 0.5  # build cost ~0.6 µs a key held / saving ~1.2 µs a key looked up (2-core VM)
INDEX_FROM = 256  # shorter lookups go through LMDB (numpy's per-call costs exceed the saving), and pay no rent
MIN_RENT = 65_536  # below this many keys looked up, LMDB answers well enough (and numpy is not imported for it)
TAIL_FRACTION = 0.125  # a log tail past this fraction of the keys held retires the index
MEMORY_FRACTION = 1 / 16  # the index may take at most this share of the machine's memory
CHUNK = 65_536  # history entries read per step of the build (bounds its transient memory)
KEY_BYTES = 32
INDEX_BYTES_PER_KEY = KEY_BYTES + 1 + 16  # the key, its status, and up to two buckets' starts
REBUILT = b"views_rebuilt"  # meta: how many times rebuild_views has rewritten the views (absent: never)


_head = msgspec.msgpack.Decoder(EventHead)  # a tail's events are read for their keys


class _Tail(NamedTuple):
    """The keys of the events logged after the index, up to last_seq (a superset serves any older snapshot)."""

    last_seq: int
    keys: frozenset


class KeyIndex:
    """The keys with a current row at one snapshot (immutable once built)."""

    def __init__(self, txn_id: int, last_seq: int, rebuilt: bytes | None, keys, measured):
        import numpy as np

        self.txn_id, self.last_seq, self.rebuilt = txn_id, last_seq, rebuilt
        self.keys, self.measured = keys, measured
        self.heads = keys[:, 0] if len(keys) else np.zeros(0, np.uint64)
        bits = max(1, (len(keys) - 1).bit_length())
        self.shift = np.uint64(64 - bits)
        counts = np.bincount((self.heads >> self.shift).astype(np.intp), minlength=1 << bits)
        self.starts = np.zeros((1 << bits) + 1, np.int64)
        np.cumsum(counts, out=self.starts[1:])
        self.tail = _Tail(last_seq, frozenset())

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.measured.nbytes + self.starts.nbytes

    def find(self, query):
        """The position in `keys` of each row of `query` ((n, 4) uint64), or -1 where the key is not held."""
        import numpy as np

        heads = query[:, 0]
        bucket = (heads >> self.shift).astype(np.intp)
        pos = np.full(len(query), -1, np.int64)
        cand = np.flatnonzero(self.starts[bucket] < self.starts[bucket + 1])
        at, end = self.starts[bucket[cand]], self.starts[bucket[cand] + 1]
        while cand.size:  # one round per key of a bucket (blake3 keys are uniform: ~1 a bucket, rarely 10)
            held = self.keys[at]
            same = (held == query[cand]).all(axis=1)
            pos[cand[same]] = at[same]
            go = ~same & (held[:, 0] <= heads[cand]) & (at + 1 < end)  # a bucket's keys are in order
            cand, at, end = cand[go], at[go] + 1, end[go]
        return pos


def as_rows(keys: list[bytes]):
    """The keys as an (n, 4) uint64 array of their big-endian words; None unless all are KEY_BYTES long."""
    import numpy as np

    blob = b"".join(keys)
    if len(blob) != KEY_BYTES * len(keys):
        return None
    return np.frombuffer(blob, ">u8").reshape(-1, 4).astype(np.uint64)


def _build(txn, history, meta) -> KeyIndex | None:
    """The index of a format-2 `history` as this transaction sees it; None where a key is not 32 bytes (a
    damaged file: the LMDB path answers, and the audit names it). The arrays are allocated once, at the size the
    transaction's own count of entries gives, and filled a chunk at a time: besides the index itself (~37 MB at
    1M keys), the build holds one chunk's bytes objects."""
    import numpy as np

    entries = txn.stat(history)["entries"]
    rows, status = np.empty((entries, 4), np.uint64), np.empty(entries, np.uint8)
    # Two cursors in step, keys and values apart: no (key, value) tuple per entry (~25% faster)
    key_run, value_run = txn.cursor(history).iternext(values=False), txn.cursor(history).iternext(keys=False)
    first = itemgetter(slice(0, 1))
    at = 0
    while blob := b"".join(islice(key_run, CHUNK)):
        kinds = b"".join(map(first, islice(value_run, CHUNK)))
        if len(blob) != KEY_BYTES * len(kinds) or at + len(kinds) > entries:
            return None
        rows[at:at + len(kinds)] = np.frombuffer(blob, ">u8").reshape(-1, 4)  # big-endian words, as integers
        status[at:at + len(kinds)] = np.frombuffer(kinds, np.uint8)
        at += len(kinds)
    if at != entries:
        return None
    held = status != NO_ROW[0]
    if not held.all():  # keys whose every attempt was retracted: no row
        rows, status = rows[held], status[held]
    measured = (status == MEASURED[0]).astype(np.uint8)
    last_seq = msgspec.msgpack.decode(txn.get(b"last_seq", db=meta))
    return KeyIndex(txn.id(), last_seq, txn.get(REBUILT, db=meta), rows, measured)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def enabled() -> bool:
    """Whether KPROF_KEY_INDEX (default 1) lets a process read the index."""
    value = os.environ.get("KPROF_KEY_INDEX", "").strip() or "1"
    if value not in ("0", "1"):
        raise UsageError(f"KPROF_KEY_INDEX={value!r} is not one of 0, 1; unset it, or set KPROF_KEY_INDEX=0 to "
                         f"look every key up in the ledger file")
    return value == "1"


class Indexer:
    """One ledger's index, read when lookups have earned it (see the module's docstring). Thread-safe: the index
    and its tail are replaced whole, never changed in place; a thread that finds another building or extending
    answers through LMDB meanwhile."""

    def __init__(self, ledger):
        self.ledger = ledger
        self.index: KeyIndex | None = None
        self.rent = 0  # keys looked up through LMDB since the last index (or since opening)
        self.builds = 0  # indexes read (tests read it)
        # Set in the lookup helper while its requester holds an index: the requester's rent (which counts the
        # helper's share of its lookups too, see charge) has paid for this process's as well.
        self.requested = False
        self.enabled = enabled()
        self._lock = threading.Lock()

    def usable(self, txn, n: int) -> tuple[KeyIndex, frozenset] | None:
        """(index, keys to look up in txn instead) for a lookup of n keys in txn, or None: look them all up
        through LMDB (the call is counted as rent, and may get the index read first)."""
        if n < INDEX_FROM or not self.enabled or self.ledger.format_version < 2:
            return None
        dbs = self.ledger.dbs
        meta = dbs["meta"]
        index = self.index
        if index is not None:
            if txn.id() == index.txn_id:
                return index, frozenset()
            rebuilt, last_seq = txn.get(REBUILT, db=meta), msgspec.msgpack.decode(txn.get(b"last_seq", db=meta))
            limit = max(CHUNK, TAIL_FRACTION * len(index.keys))  # past it, the tail retires the index
            if rebuilt == index.rebuilt and 0 <= last_seq - index.last_seq <= limit:
                tail = index.tail if last_seq <= index.tail.last_seq else self._extend(txn, index, last_seq)
                return None if tail is None else (index, tail.keys)  # None: another thread is extending it
            if last_seq < index.last_seq:
                return None  # an older snapshot than the index's (another thread's): not rent, nor a reason to drop it
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if index is not None and self.index is index:
                self.index = None  # views rebuilt, or a tail too long: retired
            self.rent += n
            entries = txn.stat(dbs["history"])["entries"]
            if not self.requested and self.rent < max(MIN_RENT, BUILD_FRACTION * entries):
                return None
            budget = _memory_bytes() * MEMORY_FRACTION
            if budget and entries * INDEX_BYTES_PER_KEY > budget:
                return None
            built = _build(txn, dbs["history"], meta)
            self.ledger.mapped.read_keys(entries)
            if built is None:  # a damaged history: not tried again by this ledger object (the audit names it)
                self.enabled = False
                return None
            self.index, self.rent = built, 0
            self.builds += 1
            return built, frozenset()
        finally:
            self._lock.release()

    def charge(self, n: int) -> None:
        """Counts n keys that the lookup helper looks up for this process as this process's rent: a split
        lookup's keys all count, so both processes read their index after the same lookups."""
        if self.enabled and self.index is None:
            self.rent += n

    def _extend(self, txn, index: KeyIndex, last_seq: int) -> _Tail | None:
        """The index's tail extended to last_seq (read from txn's log), or None: another thread is extending it."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            tail = index.tail
            if last_seq <= tail.last_seq:  # another thread extended it meanwhile
                return tail
            dbs = self.ledger.dbs
            log, events = txn.cursor(dbs["log"]), dbs["events"]
            keys = set(tail.keys)
            if log.set_key(pack_seq(tail.last_seq + 1)):
                for _seq, eid in islice(log.iternext(), last_seq - tail.last_seq):
                    keys.add(_head.decode(txn.get(eid, db=events)).key)
            tail = index.tail = _Tail(last_seq, frozenset(keys))
            return tail
        finally:
            self._lock.release()


def status_flags(index: KeyIndex, keys: list[bytes], touched: frozenset, history) -> bytes | None:
    """One byte per key, 1 where its current row is measured (see _lookup.status_flags), from the index; the
    touched keys from `history` (a cursor of the transaction). None where a key is not 32 bytes."""
    import numpy as np

    query = as_rows(keys)
    if query is None:
        return None
    pos = index.find(query)
    flags = np.zeros(len(keys), np.uint8)
    hit = pos >= 0
    flags[hit] = index.measured[pos[hit]]
    if touched:
        at = np.flatnonzero(np.fromiter(map(touched.__contains__, keys), bool, len(keys)))
        flags[at] = np.frombuffer(_lookup.status_flags(history, [keys[i] for i in at.tolist()]), np.uint8)
    return flags.tobytes()


def values(index: KeyIndex, keys: list[bytes], touched: frozenset, current) -> list | None:
    """Each key's current value or None (see _lookup.values): only the keys the index holds, and the touched
    ones, are read from `current` (a cursor), in key order. None where a key is not 32 bytes."""
    import numpy as np

    query = as_rows(keys)
    if query is None:
        return None
    pos = index.find(query)
    read = pos >= 0
    if touched:
        read |= np.fromiter(map(touched.__contains__, keys), bool, len(keys))
    at = np.flatnonzero(read)
    order = at[np.argsort(np.where(pos[at] >= 0, pos[at], len(index.keys)))]  # key order; touched keys not held last
    out = [None] * len(keys)
    if len(order):
        get = itemgetter(*order.tolist())
        wanted = get(keys) if len(order) > 1 else (get(keys),)
        found = list(map(current.get, wanted))
        for i, v in zip(order.tolist(), found):
            out[i] = v
    return out

