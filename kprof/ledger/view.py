"""The read API simulators use: one scope's current rows, looked up by spec (`kprof.api.view(ledger, table, backend,
gpu_key)` makes one; the README's Python read API shows its calls). Every row a lookup returns is verified (see
_verify): a damaged ledger gives an IntegrityError (exit 3), never a wrong answer. The same specs asked again (a
simulator's loop) are answered from the ledger's memo of verified answers while the view root they were read under
stands (see _memo).
"""

from __future__ import annotations

import datetime as _dt
from contextlib import contextmanager
from itertools import compress
from operator import not_
from typing import Any, Iterable, Iterator, Mapping

import msgspec
from blake3 import blake3

from ..errors import UnknownGpuKeyError
from . import _codec, _verify
from ._reducer import MEASURED, REBUILT, ScopeEntry, contract_id, opened, root_of
from .events import Contract, Provenance, Stats, Summary
from ..specs import ShapeCodec, spec_list
from .keys import KeyMaker

__all__ = ["View", "Row", "STATUSES", "citation"]

STATUSES = ("ok", "missing", "stale", "failed", "error")


_MISSING = ("missing", None, None, None)  # (status, event id, summary, base) of a spec without a row


def citation(eid: bytes) -> str:
    return "kprof." + eid.hex()[:16]


class Row(msgspec.Struct, frozen=True, gc=False):
    """One spec's answer: status, and for ok / stale / failed rows the summary of the event behind it (the full
    event, environment and raw samples, is `ledger.event(row.event_id)`)."""

    spec: dict[str, Any]
    status: str
    key: bytes
    event_id: bytes | None = None
    summary: Summary | None = None
    base: Provenance | None = None  # the provenance without (or, for stale rows, with) its shape

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def metrics(self) -> dict[str, float | None] | None:
        return self.summary.metrics if self.summary is not None else None

    @property
    def stats(self) -> Stats | None:
        return self.summary.stats if self.summary is not None else None

    @property
    def provenance(self) -> Provenance | None:
        if self.base is None:
            return None
        return self.base if self.base.shape else msgspec.structs.replace(self.base, shape=self.spec)

    @property
    def citation(self) -> str | None:
        return citation(self.event_id) if self.event_id else None

    @property
    def measured_at(self) -> str | None:
        if self.summary is None:
            return None
        return _dt.datetime.fromtimestamp(self.summary.measured_at, _dt.timezone.utc).isoformat(timespec="seconds")

    def to_json(self) -> dict:
        s = self.summary
        return {
            "spec": self.spec,
            "status": self.status,
            "key": self.key.hex(),
            "event": self.event_id.hex() if self.event_id else None,
            "citation": self.citation,
            "metrics": self.metrics,
            "stats": msgspec.to_builtins(self.stats) if self.stats is not None else None,
            "provenance": msgspec.to_builtins(self.provenance) if self.base is not None else None,
            "measured_at": self.measured_at,
            "error": {"kind": s.error_kind, "message": s.message} if s is not None and s.error_kind else None,
        }


class View:
    """The current rows of one (table, backend, gpu_key) under one contract. The caller supplies the contract and
    the KernelArgs type (the ledger knows no registry). Each call reads one consistent snapshot."""

    def __init__(self, ledger, table: str, backend: str, gpu_key: str, contract: Contract, args_type: type):
        self.ledger, self.table, self.backend, self.gpu_key = ledger, table, backend, gpu_key
        self.contract = contract
        self.shapes = ShapeCodec(args_type, strict=True)  # as every spec input: 64.0 for an int field is refused
        self.keys = KeyMaker(table, backend, gpu_key, contract, self.shapes)
        self.scope = self.keys.scope
        self._contract_id = contract_id(self.keys.base)
        self._events, self._index = ledger.dbs["events"], ledger.dbs["scope_index"]
        self._memo_id = _codec.encode(self.keys.base)  # names this view's answers in the ledger's memo

    def get(self, **spec) -> Row | None:
        """The ok row for one spec, or None when it is missing, stale or failed. A scope the ledger never held raises
        UnknownGpuKeyError naming the GPU keys it holds (a mistyped key would read as missing rows; the bulk calls
        answer "missing", as a caller asks them before anything is measured)."""
        shapes, exact = self.shapes.to_shapes([spec])
        with self._read() as txn:
            columns = self._columns(txn, shapes)
            row = Row(self._spec_dicts([spec], shapes, exact)[0], *(column[0] for column in columns))
            with _verify.reading(self.ledger.path, "scopes"):
                unknown = row.status == "missing" and txn.get(self.scope, db=self.ledger.dbs["scopes"]) is None
        if unknown:
            with _verify.reading(self.ledger.path, "scopes"):
                known = sorted((g, rows) for t, b, g, rows in self.ledger.scopes()
                               if (t, b) == (self.table, self.backend))
            raise UnknownGpuKeyError(self.table, self.backend, self.gpu_key, self.ledger.path, known)
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
        memo = self.ledger.memo
        found = memo.get(self._memo_id, stamp, op, digest)
        if found is None:
            found = answer(txn, shapes)
            memo.put(self._memo_id, stamp, op, digest, len(shapes), found)
        return found

    def _shape_flags(self, txn, shapes: list) -> bytes:
        """One byte per shape: 1 where its current row (read from `current`, verified) is measured, else 0."""
        rows = self._verified(txn, self.keys.keys_of(shapes), summaries=False)
        return bytes(row is not None and row.kind == MEASURED for row in rows)

    def _verified(self, txn, keys: list[bytes], summaries: bool = True) -> list:
        return _verify.rows(txn, self.ledger.dbs, self.ledger.path, keys, summaries)

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
        asdict = msgspec.structs.asdict
        return [s if type(s) is dict else asdict(s) for s in shapes]

    def _columns(self, txn, shapes: list) -> tuple[list, list, list, list, list]:
        """(status, key, event id, summary, base) of each canonical shape's row: the Row fields after `spec`."""
        keys = self.keys.keys_of(shapes)
        values = self._verified(txn, keys)
        base = self.keys.base
        statuses = ["missing" if v is None else "ok" if v.kind == MEASURED else "failed" for v in values]
        eids = [None if v is None else v.event_id for v in values]
        summaries = [None if v is None else v.summary for v in values]
        bases = [None if v is None else base for v in values]
        if self._other_contracts(txn):  # a spec without a row of this contract may have another's: stale
            for i in [i for i, v in enumerate(values) if v is None]:
                statuses[i], eids[i], summaries[i], bases[i] = self._stale_or_missing(txn, shapes[i])
        return statuses, keys, eids, summaries, bases

    def _other_contracts(self, txn) -> bool:
        """Whether this scope ever held rows of another contract (else no spec can be stale)."""
        with _verify.reading(self.ledger.path, "scopes"):
            raw = txn.get(self.scope, db=self.ledger.dbs["scopes"])
            return raw is not None and opened("scopes", self.scope, raw, ScopeEntry).contracts != [self._contract_id]

    def _stale_or_missing(self, txn, shape) -> tuple:
        """(status, event id, summary, base) of a shape without a row of this contract: stale where another
        contract's of this or an older profiler revision is measured."""
        best = None
        for row in self._verified(txn, self._indexed(txn, self.scope + _codec.shape_id(_codec.encode(shape)))):
            if row is None or row.kind != MEASURED or best and row.summary.measured_at <= best[0].summary.measured_at:
                continue
            with _verify.reading(self.ledger.path, "events"):
                prov = _verify.event(self.ledger.path, row.event_id, txn.get(row.event_id, db=self._events)).provenance
            if prov.profiler_revision <= self.contract.profiler_revision:  # a newer kprof's row is not stale here
                best = (row, prov)
        return _MISSING if best is None else ("stale", best[0].event_id, best[0].summary, best[1])

    def _indexed(self, txn, prefix: bytes) -> list[bytes]:
        """The row keys `scope_index` holds under `prefix` (a scope id, or a scope id and a shape id)."""
        with _verify.reading(self.ledger.path, "scope_index"):
            cursor, keys = txn.cursor(self._index), []
            if cursor.set_range(prefix):
                for k in cursor.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    keys.append(k[32:])
        return keys

    def rows(self) -> Iterator[Row]:
        """Every current row of the scope: this contract's (ok or failed), other contracts' measured ones as stale."""
        path = self.ledger.path
        with self._read() as txn:
            keys = list(dict.fromkeys(self._indexed(txn, self.scope)))
            for key, row in zip(keys, self._verified(txn, keys)):
                if row is None:
                    continue
                kind, eid, summary = row.kind, row.event_id, row.summary
                with _verify.reading(path, "events"):
                    prov = _verify.event(path, eid, txn.get(eid, db=self._events), key).provenance
                if prov.contract == self.contract:
                    status = "ok" if kind == MEASURED else "failed"
                elif kind == MEASURED and prov.profiler_revision <= self.contract.profiler_revision:
                    status = "stale"
                else:
                    continue
                yield Row(dict(prov.shape), status, key, eid, summary, prov)

    def _root(self, txn) -> bytes:
        with _verify.reading(self.ledger.path, "scopes"):
            raw = txn.get(self.scope, db=self.ledger.dbs["scopes"])
            if raw is None:
                return root_of(self.scope, 0, 0)
            entry = opened("scopes", self.scope, raw, ScopeEntry)
            return root_of(self.scope, entry.rows, int.from_bytes(entry.acc, "big"))

    @property
    def root(self) -> str:
        """Hex hash naming this scope's current rows (O(1); independent of the order they arrived in)."""
        with self._read() as txn:
            return self._root(txn).hex()
