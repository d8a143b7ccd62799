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
from ._reducer import FAILED, MEASURED, root_of
from .events import Contract, Failed, Measured
from .keys import KeyMaker, ShapeCodec

__all__ = ["View", "Row", "STATUSES", "citation"]

STATUSES = ("ok", "missing", "stale", "failed", "error")


def citation(eid: bytes) -> str:
    return "kprof." + eid.hex()[:16]


class Row(msgspec.Struct, frozen=True):
    """One spec's answer. `event` is the measured (ok/stale) or failed event behind it, if any."""

    spec: dict[str, Any]
    status: str
    key: bytes
    event_id: bytes | None = None
    event: Measured | Failed | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def metrics(self) -> dict[str, float | None] | None:
        return self.event.metrics if type(self.event) is Measured else None

    @property
    def stats(self):
        return self.event.stats if type(self.event) is Measured else None

    @property
    def provenance(self):
        return self.event.provenance if self.event is not None else None

    @property
    def citation(self) -> str | None:
        return citation(self.event_id) if self.event_id else None

    @property
    def measured_at(self) -> str | None:
        if self.event is None:
            return None
        return _dt.datetime.fromtimestamp(self.event.measured_at, _dt.timezone.utc).isoformat(timespec="seconds")

    def to_json(self) -> dict:
        ev = self.event
        return {
            "spec": self.spec,
            "status": self.status,
            "key": self.key.hex(),
            "event": self.event_id.hex() if self.event_id else None,
            "citation": self.citation,
            "metrics": self.metrics,
            "stats": msgspec.to_builtins(self.stats) if self.stats is not None else None,
            "provenance": msgspec.to_builtins(ev.provenance) if ev is not None else None,
            "measured_at": self.measured_at,
            "error": {"kind": ev.error_kind, "message": ev.message} if type(ev) is Failed else None,
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

    def missing(self, specs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The specs without an ok row (missing, stale and failed all count as missing)."""
        to_shape, encode, prefix = self.shapes.to_shape, _codec.encode, self.keys._prefix
        hasher = _codec.blake3
        out = []
        with self.ledger.read() as txn:
            get = txn.get
            cur = self._current
            for i, spec in enumerate(specs):
                v = get(hasher(prefix + encode(to_shape(spec, i))).digest(), db=cur)
                if v is None or v[:1] != MEASURED:
                    out.append(spec)
        return out

    def count_missing(self, specs) -> int:
        return len(self.missing(specs))

    def _rows(self, txn, specs) -> list[Row]:
        to_shape, encode, prefix = self.shapes.to_shape, _codec.encode, self.keys._prefix
        hasher, decode, get = _codec.blake3, _codec.event_decoder.decode, txn.get
        cur_db, ev_db = self._current, self._events
        asdict = msgspec.structs.asdict
        rows = []
        for i, spec in enumerate(specs):
            shape = to_shape(spec, i)
            shape_b = encode(shape)
            key = hasher(prefix + shape_b).digest()
            spec_out = asdict(shape) if isinstance(shape, msgspec.Struct) else shape
            v = get(key, db=cur_db)
            if v is not None:
                eid = v[1:]
                status = "ok" if v[:1] == MEASURED else "failed"
                rows.append(Row(spec_out, status, key, eid, decode(get(eid, db=ev_db))))
                continue
            rows.append(self._stale_or_missing(txn, spec_out, key, shape_b))
        return rows

    def _stale_or_missing(self, txn, spec, key, shape_b) -> Row:
        """A spec with no current row under this contract: stale if another contract's row exists."""
        prefix = self.scope + _codec.shape_id(shape_b)
        cursor = txn.cursor(self._index)
        best = None
        if cursor.set_range(prefix):
            for k, _ in cursor:
                if not k.startswith(prefix):
                    break
                v = txn.get(k[32:], db=self._current)
                if v is not None and v[:1] == MEASURED:
                    ev = _codec.event_decoder.decode(txn.get(v[1:], db=self._events))
                    if best is None or ev.measured_at > best[1].measured_at:
                        best = (v[1:], ev)
        if best is None:
            return Row(spec, "missing", key)
        return Row(spec, "stale", key, best[0], best[1])

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
                ev = _codec.event_decoder.decode(txn.get(v[1:], db=self._events))
                current_contract = ev.provenance.contract == self.contract
                status = ("ok" if v[:1] == MEASURED else "failed") if current_contract else "stale"
                yield Row(dict(ev.provenance.shape), status, key, v[1:], ev)

    def _root(self, txn) -> bytes:
        raw = txn.get(self.scope, db=self.ledger.dbs["scopes"])
        if raw is None:
            return root_of(self.scope, 0, 0)
        _t, _b, _g, rows, acc = msgspec.msgpack.decode(raw)
        return root_of(self.scope, rows, int.from_bytes(acc, "big"))

    @property
    def root(self) -> str:
        """Hex hash naming this scope's current rows (O(1); independent of the order they arrived in)."""
        with self.ledger.read() as txn:
            return self._root(txn).hex()
