"""The read API simulators use: one scope's current rows by spec (`kprof.api.view(ledger, table, backend, gpu_key)`;
see the README's Python read API). Every row is verified (_verify): a damaged ledger is an IntegrityError (exit 3),
never a wrong answer. Specs asked again are answered from the ledger's memo while their view root stands (_memo)."""

from __future__ import annotations

import datetime as _dt
from contextlib import contextmanager
from itertools import compress, groupby, takewhile
from operator import not_
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping

import msgspec
from blake3 import blake3

from ..errors import UnknownGpuKeyError
from . import _codec, _verify
from ._reducer import MEASURED, REBUILT, ScopeEntry, contract_id, opened, root_of
from .events import Contract, Provenance, StatsHead, Summary
from ..specs import ShapeCodec, spec_list
from .keys import KeyMaker

__all__ = ["View", "Row", "STATUSES", "citation"]

STATUSES = ("ok", "missing", "stale", "failed", "error")


def citation(eid: bytes) -> str:
    return "kprof." + eid.hex()[:16]


class Row(msgspec.Struct, frozen=True, gc=False):
    """One spec's answer: status, and for ok / stale / failed rows its event's summary (the event, with environment and
    samples, is `ledger.event(row.event_id)`). Shared with the memo: `metrics` is read-only, `summary` a copy."""

    spec: dict[str, Any]
    status: str
    key: bytes
    event_id: bytes | None = None
    _summary: Summary | None = None
    _base: Provenance | None = None  # the provenance without (or, for stale rows, with) its shape

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def summary(self) -> Summary | None:
        s = self._summary
        return s if s is None or s.metrics is None else msgspec.structs.replace(s, metrics=dict(s.metrics))

    @property
    def metrics(self) -> Mapping[str, float | None] | None:
        s = self._summary
        return None if s is None or s.metrics is None else MappingProxyType(s.metrics)

    @property
    def stats(self) -> StatsHead | None:
        return self._summary.stats if self._summary is not None else None

    @property
    def provenance(self) -> Provenance | None:
        base = self._base
        return None if base is None else msgspec.structs.replace(base, shape=dict(base.shape or self.spec))

    @property
    def citation(self) -> str | None:
        return citation(self.event_id) if self.event_id else None

    @property
    def measured_at(self) -> str | None:
        s = self._summary
        return s and _dt.datetime.fromtimestamp(s.measured_at, _dt.timezone.utc).isoformat(timespec="seconds")

    def __repr__(self) -> str:  # what a reader asks for: not the key's bytes, the raw samples or the provenance
        time_ms = "" if self.metrics is None else f", time_ms={self.metrics.get('time_ms')!r}"
        return f"Row(spec={self.spec!r}, status={self.status!r}, citation={self.citation!r}{time_ms})"

    def to_json(self) -> dict:
        s, stats, metrics = self._summary, self.stats, self.metrics
        return {"spec": self.spec, "status": self.status, "key": self.key.hex(),
                "event": self.event_id.hex() if self.event_id else None, "citation": self.citation,
                "metrics": None if metrics is None else dict(metrics),
                "stats": None if stats is None else msgspec.to_builtins(stats),
                "provenance": None if self._base is None else msgspec.structs.asdict(self.provenance),
                "measured_at": self.measured_at,
                "error": {"kind": s.error_kind, "message": s.message} if s is not None and s.error_kind else None}


class View:
    """The current rows of one (table, backend, gpu_key) under the caller's contract; each call reads one snapshot."""

    def __init__(self, ledger, table: str, backend: str, gpu_key: str, contract: Contract, args_type: type):
        self.ledger, self.table, self.backend, self.gpu_key, self.contract = ledger, table, backend, gpu_key, contract
        self.shapes = ShapeCodec(args_type, strict=True, name=table)  # as every spec input: 64.0 for an int is refused
        self.keys = KeyMaker(table, backend, gpu_key, contract, self.shapes)
        self.scope = self.keys.scope
        self._contract_id = contract_id(self.keys.base)
        self._events, self._index = ledger.dbs["events"], ledger.dbs["scope_index"]
        self._memo_id = _codec.encode(self.keys.base)  # names this view's answers in the ledger's memo

    def get(self, **spec) -> Row | None:
        """The ok row for one spec, or None (missing, stale or failed). A scope never held raises UnknownGpuKeyError
        naming the GPU keys held (a mistyped key); bulk calls answer "missing", asked before anything is measured."""
        shapes, exact = self.shapes.to_shapes([spec])
        with self._read() as txn:
            row = Row(self._spec_dicts([spec], shapes, exact)[0], *(column[0] for column in self._columns(txn, shapes)))
            unknown = row.status == "missing" and self._entry(txn) is None
        if unknown:
            with _verify.reading(self.ledger.path, "scopes"):
                held = self.ledger.scopes()
            raise UnknownGpuKeyError(self.table, self.backend, self.gpu_key, self.ledger.path, [s[2:] for s in sorted(
                held) if s[:2] == (self.table, self.backend)], held, row.spec, self.contract.timing)
        return row if row.status == "ok" else None

    def get_many(self, specs: Iterable[Mapping[str, Any]]) -> list[Row]:
        """One Row per spec, in order, with status ok / missing / stale / failed."""
        return self.query(specs)[1]

    def query(self, specs: Iterable[Mapping[str, Any]]) -> tuple[bytes, list[Row]]:
        """(view root, rows) read from one snapshot, so the root names exactly the state the rows came from."""
        specs = spec_list(specs)
        shapes, exact = self.shapes.to_shapes(specs)
        with self._read() as txn:
            root = self._root(txn)
            columns = self._remembered(txn, root, "rows", shapes, self._columns)
        return root, list(map(Row, self._spec_dicts(specs, shapes, exact), *columns))

    def missing(self, specs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The specs without an ok row (missing, stale and failed all count as missing), in input order."""
        specs = spec_list(specs)
        shapes, _exact = self.shapes.to_shapes(specs)
        with self._read() as txn:
            ok = self._remembered(txn, self._root(txn), "flags", shapes, self._shape_flags)
        return list(compress(specs, map(not_, ok)))

    def count_missing(self, specs) -> int:
        return len(self.missing(specs))

    def _remembered(self, txn, root: bytes, op: str, shapes: list, answer):
        """answer(txn, shapes), or the memo's answer for these shapes under this snapshot's view root (see _memo)."""
        try:
            digest = blake3(_codec.encode(shapes)).digest()
        except OverflowError:  # an int no key can hold: answer() names it
            return answer(txn, shapes)
        with _verify.reading(self.ledger.path, "meta"):
            stamp = root + (txn.get(REBUILT, db=self.ledger.dbs["meta"]) or b"")
        found = self.ledger.memo.get(self._memo_id, stamp, op, digest)
        if found is None:
            found = answer(txn, shapes)
            self.ledger.memo.put(self._memo_id, stamp, op, digest, len(shapes), found)
        return found

    def _shape_flags(self, txn, shapes: list) -> bytes:
        """One byte per shape: 1 where its current row (read from `current`, verified) is measured, else 0."""
        rows = self._verified(txn, self.keys.keys_of(shapes), summaries=False)
        return bytes(row is not None and row.kind == MEASURED for row in rows)

    def _verified(self, txn, keys: list[bytes], summaries: bool = True, indexed: bool = False) -> list:
        return _verify.rows(txn, self.ledger.dbs, self.ledger.path, keys, summaries, indexed=indexed)

    @contextmanager
    def _read(self):
        """A read snapshot whose LMDB and decoding errors become IntegrityErrors (see _verify)."""
        with _verify.reading(self.ledger.path, "the file"), self.ledger.read() as txn:
            yield txn

    @staticmethod
    def _spec_dicts(specs: list, shapes: list, exact: bool) -> list[dict]:
        """Each row's spec: the caller's dicts where already canonical (no copies), else the shapes as dicts."""
        if exact and all(type(s) is dict for s in specs):
            return specs
        return [s if type(s) is dict else msgspec.structs.asdict(s) for s in shapes]

    def _columns(self, txn, shapes: list) -> tuple[list, list, list, list, list]:
        """(status, key, event id, summary, base) of each canonical shape's row: the Row fields after `spec`."""
        values = self._verified(txn, keys := self.keys.keys_of(shapes))
        statuses = ["missing" if v is None else "ok" if v.kind == MEASURED else "failed" for v in values]
        eids = [None if v is None else v.event_id for v in values]
        summaries = [None if v is None else v.summary for v in values]
        bases = [None if v is None else self.keys.base for v in values]
        absent = [i for i, v in enumerate(values) if v is None]  # each may have a row of another contract
        if absent and (entry := self._entry(txn)) is not None and entry.contracts != [self._contract_id]:
            for i in absent:  # (one contract's scope, or all found: no spec can be stale)
                held = [k[32:] for k in self._indexed(txn, self.scope + _codec.shape_id(_codec.encode(shapes[i])))]
                if found := self._pick(txn, held, self._verified(txn, held, indexed=True)):
                    statuses[i], _key, eids[i], summaries[i], bases[i] = found
        return statuses, keys, eids, summaries, bases

    def _pick(self, txn, keys: list[bytes], rows: list) -> tuple | None:
        """(status, key, event id, summary, provenance) or None: this contract's row, else a stale one, of the highest
        revision not past this contract's, of those the one of this timing where one is, the newest (whatever order
        they came in: a view past every revision, as the newer-revision note reads, finds the newest kprof's row)."""
        path, best = self.ledger.path, None
        for key, row in zip(keys, rows):
            if row is None:
                continue
            with _verify.reading(path, "events"):
                prov = _verify.event(path, row.event_id, txn.get(row.event_id, db=self._events), key).provenance
            if _codec.provenance_key(prov) != key:  # fields this kprof lacks dropped (a newer kprof's row): not ours
                continue
            if prov.contract == self.contract:
                return "ok" if row.kind == MEASURED else "failed", key, row.event_id, row.summary, prov
            rank = (prov.profiler_revision, prov.timing == self.contract.timing, row.summary.measured_at)
            if row.kind == MEASURED and rank[0] <= self.contract.profiler_revision and (best is None or rank > best[0]):
                best = rank, ("stale", key, row.event_id, row.summary, prov)
        return best and best[1]

    def _indexed(self, txn, prefix: bytes) -> list[bytes]:
        """The `scope_index` keys (scope id, shape id: 16 bytes each; row key) under a scope id or scope + shape id.
        Where a shape has none, no key either side may be a few bits from it: that is its key, damaged (a flipped bit
        moved it to another shape, leaving its stale row to read missing); two shapes' ids differ in about 64 bits."""
        with _verify.reading(self.ledger.path, "scope_index"):
            cursor = txn.cursor(self._index)
            found = cursor.set_range(prefix)
            keys = list(takewhile(lambda k: k.startswith(prefix), cursor.iternext(values=False))) if found else []
            around = [] if keys or len(prefix) < 32 else [cursor.key(), cursor.key() if cursor.prev() else b""]
        for k in around:
            if (int.from_bytes(k[:32], "big") ^ int.from_bytes(prefix, "big")).bit_count() <= 8:
                raise _verify.damaged(self.ledger.path, f"scope_index entry {k.hex()} is under a damaged shape id")
        return keys

    def rows(self) -> Iterator[Row]:
        """Every current row of the scope, one per shape, as get_many answers it (see `_pick`; others' read stale)."""
        with self._read() as txn:
            indexed = self._indexed(txn, self.scope)  # sorted: the keys of one shape are adjacent
            rows = self._verified(txn, keys := [k[32:] for k in indexed], indexed=True)
            for shape, group in groupby(range(len(keys)), lambda i: indexed[i][:32]):
                at = list(group)
                if found := self._pick(txn, [keys[i] for i in at], [rows[i] for i in at]):
                    if shape != self.scope + _codec.shape_id(_codec.encode(found[4].shape)):  # else yielded twice
                        raise _verify.damaged(self.ledger.path, f"scope_index entry {(shape + found[1]).hex()} is not "
                                                                f"under its row's shape")
                    yield Row(dict(found[4].shape), *found)

    def _entry(self, txn) -> ScopeEntry | None:
        """The scope's `scopes` entry (verified), or None where the ledger never held a row of it (nor its index)."""
        with _verify.reading(self.ledger.path, "scopes"):
            raw = txn.get(self.scope, db=self.ledger.dbs["scopes"])
            if raw is None and self._indexed(txn, self.scope):  # a damaged entry key: not the root of no rows
                raise _verify.damaged(self.ledger.path, f"scope {self.scope.hex()} has rows and no `scopes` entry")
            return None if raw is None else opened("scopes", self.scope, raw, ScopeEntry)

    def _root(self, txn) -> bytes:
        entry = self._entry(txn)
        return root_of(self.scope, *((0, 0) if entry is None else (entry.rows, int.from_bytes(entry.acc, "big"))))

    @property
    def root(self) -> str:
        """Hex hash naming this scope's current rows (O(1); independent of the order they arrived in)."""
        with self._read() as txn:
            return self._root(txn).hex()
