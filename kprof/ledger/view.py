"""The read API simulators use: one scope's current rows, looked up by spec.

    ledger = Ledger.open("profile.db", readonly=True)
    view = ledger.view("single_gemm", "torch", "NVIDIA H200")
    row = view.get(m=1, n=8192, k=1024, dtype="bf16")   # an ok Row, or None
    rows = view.get_many(specs)                          # one Row per spec, any status
    todo = view.missing(specs)                           # the specs without an ok row

Nothing here imports torch, cupti or pynvml.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Iterable, Iterator, Mapping

import msgspec

from . import _codec
from ._reducer import MEASURED, contract_id, root_of
from .events import Contract, Provenance, Stats, Summary
from .keys import KeyMaker, ShapeCodec

__all__ = ["View", "Row", "STATUSES", "citation"]

STATUSES = ("ok", "missing", "stale", "failed", "error")


_summary_decoder = msgspec.msgpack.Decoder(Summary)


def citation(eid: bytes) -> str:
    return "kprof." + eid.hex()[:16]


class Row(msgspec.Struct, frozen=True, gc=False):
    """One spec's answer: status, and for ok / stale / failed rows the summary of the event behind it.

    `provenance` is derived from the view's contract (or, for a stale row, read from its own event);
    the full event (environment, raw samples) is one `ledger.event(row.event_id)` away.
    """

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
    """The current rows of one (table, backend, gpu_key) under one provenance contract.

    Without an explicit contract and args type, both come from the registry entry for (table, backend).
    Each call reads one consistent snapshot; `query` returns the view root read in that same snapshot.
    """

    def __init__(self, ledger, table: str, backend: str, gpu_key: str, contract: Contract | None = None,
                 args_type: type | None = None):
        if contract is None or args_type is None:
            from ..runners.registry import lookup  # the registry imports no measurement library

            entry = lookup(table, backend)
            contract = contract or entry.contract
            args_type = args_type or entry.args
        self.ledger, self.table, self.backend, self.gpu_key = ledger, table, backend, gpu_key
        self.contract = contract
        self.shapes = ShapeCodec(args_type)
        self.keys = KeyMaker(table, backend, gpu_key, contract, self.shapes)
        self.scope = self.keys.scope
        self._contract_id = contract_id(self.keys.base)
        d = ledger.dbs
        self._current, self._events, self._index = d["current"], d["events"], d["scope_index"]

    # ---- lookups -----------------------------------------------------------------------------
    def get(self, **spec) -> Row | None:
        """The ok row for one spec, or None when it is missing, stale or failed."""
        row = self.get_many([spec])[0]
        return row if row.status == "ok" else None

    def get_many(self, specs: Iterable[Mapping[str, Any]]) -> list[Row]:
        """One Row per spec, in order, with status ok / missing / stale / failed."""
        with self.ledger.read() as txn:
            return self._rows(txn, specs)

    def query(self, specs: Iterable[Mapping[str, Any]]) -> tuple[bytes, list[Row]]:
        """(view root, rows) read from one snapshot, so the root names exactly the state the rows came from."""
        with self.ledger.read() as txn:
            return self._root(txn), self._rows(txn, specs)

    def _keys(self, specs: list) -> tuple[list, list, list[bytes], list[bytes], list[int]]:
        """(canonical specs as dicts, shapes, shape bytes, keys, lookup order). Keys are looked up in
        sorted order, so consecutive lookups land on neighbouring B-tree pages (fewer cache misses)."""
        shapes, exact = self.shapes.to_shapes(specs)
        encode, hasher = _codec.encode, self.keys._hasher
        shape_bytes = [encode(s) for s in shapes]
        keys = [hasher.copy().update(b).digest() for b in shape_bytes]
        order = sorted(range(len(keys)), key=keys.__getitem__)
        if exact and all(type(s) is dict for s in specs):
            spec_dicts = specs  # already canonical values; no copies
        else:
            asdict = msgspec.structs.asdict
            spec_dicts = [s if type(s) is dict else asdict(s) for s in shapes]
        return spec_dicts, shapes, shape_bytes, keys, order

    def missing(self, specs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The specs without an ok row (missing, stale and failed all count as missing), in input order."""
        specs = specs if isinstance(specs, list) else list(specs)
        shapes, exact = self.shapes.to_shapes(specs)
        encode, hasher = _codec.encode, self.keys._hasher
        keys = [hasher.copy().update(encode(s)).digest() for s in shapes]
        absent = []
        with self.ledger.read() as txn:
            get = txn.cursor(self._current).get
            for i in sorted(range(len(keys)), key=keys.__getitem__):
                v = get(keys[i])
                if v is None or v[:1] != MEASURED:
                    absent.append(i)
        absent.sort()
        return [specs[i] for i in absent]

    def count_missing(self, specs) -> int:
        return len(self.missing(specs))

    def _rows(self, txn, specs) -> list[Row]:
        specs = specs if isinstance(specs, list) else list(specs)
        spec_dicts, _shapes, shape_bytes, keys, order = self._keys(specs)
        decode, get = _summary_decoder.decode, txn.cursor(self._current).get
        base = self.keys.base
        maybe_stale = self._other_contracts(txn)
        rows: list = [None] * len(keys)
        for i in order:
            key = keys[i]
            v = get(key)
            if v is not None:
                rows[i] = Row(spec_dicts[i], "ok" if v[:1] == MEASURED else "failed", key, v[1:33],
                              decode(v[33:]), base)
            elif maybe_stale:
                rows[i] = self._stale_or_missing(txn, spec_dicts[i], key, shape_bytes[i])
            else:
                rows[i] = Row(spec_dicts[i], "missing", key)
        return rows

    def _other_contracts(self, txn) -> bool:
        """Whether this scope ever held rows of another contract (else no spec can be stale)."""
        raw = txn.get(self.scope, db=self.ledger.dbs["scopes"])
        return raw is not None and msgspec.msgpack.decode(raw)[5] != [self._contract_id]

    def _stale_or_missing(self, txn, spec, key, shape_b) -> Row:
        """A spec with no current row under this contract: stale if another contract's ok row exists."""
        prefix = self.scope + _codec.shape_id(shape_b)
        cursor = txn.cursor(self._index)
        best = None
        if cursor.set_range(prefix):
            for k in cursor.iternext(values=False):
                if not k.startswith(prefix):
                    break
                v = txn.get(k[32:], db=self._current)
                if v is not None and v[:1] == MEASURED:
                    summary = _summary_decoder.decode(v[33:])
                    if best is None or summary.measured_at > best[1].measured_at:
                        best = (v[1:33], summary)
        if best is None:
            return Row(spec, "missing", key)
        event = _codec.event_decoder.decode(txn.get(best[0], db=self._events))
        return Row(spec, "stale", key, best[0], best[1], event.provenance)

    # ---- whole view --------------------------------------------------------------------------
    def rows(self) -> Iterator[Row]:
        """Every current row of the scope, under any contract (rows of other contracts are `stale`)."""
        with self.ledger.read() as txn:
            cursor = txn.cursor(self._index)
            if not cursor.set_range(self.scope):
                return
            seen = set()
            for k, _ in cursor:
                if not k.startswith(self.scope):
                    break
                key = k[32:]
                if key in seen:
                    continue
                seen.add(key)
                v = txn.get(key, db=self._current)
                if v is None:
                    continue
                prov = _codec.event_decoder.decode(txn.get(v[1:33], db=self._events)).provenance
                current_contract = prov.contract == self.contract
                status = ("ok" if v[:1] == MEASURED else "failed") if current_contract else "stale"
                yield Row(dict(prov.shape), status, key, v[1:33], _summary_decoder.decode(v[33:]), prov)

    def _root(self, txn) -> bytes:
        raw = txn.get(self.scope, db=self.ledger.dbs["scopes"])
        if raw is None:
            return root_of(self.scope, 0, 0)
        _t, _b, _g, rows, acc, _c = msgspec.msgpack.decode(raw)
        return root_of(self.scope, rows, int.from_bytes(acc, "big"))

    @property
    def root(self) -> str:
        """Hex hash naming this scope's current rows (O(1); independent of the order they arrived in)."""
        with self.ledger.read() as txn:
            return self._root(txn).hex()
