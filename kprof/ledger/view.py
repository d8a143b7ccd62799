"""The read API simulators use: one scope's current rows, looked up by spec.

    ledger = Ledger.open("profile.db", readonly=True)
    view = ledger.view("single_gemm", "torch", "NVIDIA H200")
    row = view.get(m=1, n=8192, k=1024, dtype="bf16")   # an ok Row, or None (a GPU key it never held raises)
    rows = view.get_many(specs)                          # one Row per spec, any status
    todo = view.missing(specs)                           # the specs without an ok row

Nothing here imports torch, cupti or pynvml.
"""

from __future__ import annotations

import datetime as _dt
from functools import partial
from itertools import compress, repeat
from operator import getitem, not_
from typing import Any, Iterable, Iterator, Mapping

import msgspec

from ..errors import UnknownGpuKeyError
from . import _codec, _index, _lookup, _parallel
from ._reducer import MEASURED, contract_id, root_of
from .events import Contract, Provenance, Stats, Summary
from .keys import KeyMaker, ShapeCodec

__all__ = ["View", "Row", "STATUSES", "citation"]

STATUSES = ("ok", "missing", "stale", "failed", "error")


_summary_decoder = msgspec.msgpack.Decoder(Summary)
_summaries_decoder = msgspec.msgpack.Decoder(list[Summary])
_tail_decoder = msgspec.msgpack.Decoder(tuple[list[bytes], list[bytes | None], list[Summary]])


class _NotCanonical(Exception):
    """Specs that are not all canonical dicts: their rows carry converted spec dicts, which only the
    serial path builds."""


def _summary_array(values: Iterable[bytes | None]) -> bytes:
    """The Summaries of the found current values (kind + event id + Summary) as one msgpack array."""
    parts = list(map(getitem, filter(None, values), repeat(slice(33, None))))
    return b"\xdd" + len(parts).to_bytes(4, "big") + b"".join(parts)


def _summaries(values: list[bytes | None]) -> list[Summary]:
    """The Summaries of the found values, decoded in one call (not one call and one slice per row)."""
    return _summaries_decoder.decode(_summary_array(values))


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
        self._failures, self._history = d["failures"], d["history"]

    # ---- lookups -----------------------------------------------------------------------------
    def get(self, **spec) -> Row | None:
        """The ok row for one spec, or None when it is missing, stale or failed. Raises UnknownGpuKeyError,
        naming the GPU keys the ledger holds for this table/backend, when it has never held a row of this scope:
        a wrong GPU key would otherwise read as a missing row for every spec. (`get_many`, `missing` and
        `count_missing` answer "missing" as usual: a JIT caller asks them before anything is measured.)"""
        with self.ledger.read() as txn:
            row = self._rows(txn, [spec])[0]
            unknown = row.status == "missing" and txn.get(self.scope, db=self.ledger.dbs["scopes"]) is None
        if unknown:
            known = sorted((g, rows) for t, b, g, rows in self.ledger.scopes() if (t, b) == (self.table, self.backend))
            raise UnknownGpuKeyError(self.table, self.backend, self.gpu_key, self.ledger.path, known)
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
        """The specs without an ok row (missing, stale and failed all count as missing), in input order."""
        specs = specs if isinstance(specs, list) else list(specs)
        with self.ledger.read() as txn:
            halves = self._split(txn, "flags", specs, partial(self._ok_flags, txn))
            # Answered here alone, or redone whole when the helper did not answer: an invalid spec is then
            # named by its index in the whole list.
            ok = self._ok_flags(txn, specs) if halves is None else halves[0] + halves[1]
        return list(compress(specs, map(not_, ok)))

    def count_missing(self, specs) -> int:
        return len(self.missing(specs))

    def _ok_flags(self, txn, specs: list) -> bytes:
        """One byte per spec: 1 where its current row is measured (ok), else 0."""
        return self._shape_flags(txn, self.shapes.to_shapes(specs)[0])

    def _shape_flags(self, txn, shapes: list) -> bytes:
        keys = self.keys.keys_of(shapes)
        if self.ledger.format_version < 2:  # opened read-only: its history has no status byte (if a writer has
            # upgraded it since, `current` and `failures` still give the same answer)
            return _lookup.measured_flags(txn.cursor(self._current), txn.cursor(self._failures), keys)
        return self._look_up(txn, keys, self._history, _index.status_flags, _lookup.status_flags)

    def _values(self, txn, specs: list) -> tuple[list, bool, list[bytes], list]:
        """(shapes, exact, keys, current value or None), one of each per spec."""
        shapes, exact = self.shapes.to_shapes(specs)
        return (shapes, exact, *self._shape_values(txn, shapes))

    def _shape_values(self, txn, shapes: list) -> tuple[list[bytes], list]:
        """(keys, current value or None) of canonical shapes."""
        keys = self.keys.keys_of(shapes)
        return keys, self._look_up(txn, keys, self._current, _index.values, _lookup.values)

    def _look_up(self, txn, keys: list[bytes], db, by_index, through_lmdb):
        """by_index(index, keys, touched keys, cursor) from the key index where this process holds a usable one
        (None from it: a key not 32 bytes), else through_lmdb(cursor, keys); counted for the index's rent and
        the mapping's trims."""
        cursor = txn.cursor(db)
        self.ledger.mapped.read_keys(len(keys))
        usable = self.ledger.indexer.usable(txn, len(keys))
        found = None if usable is None else by_index(usable[0], keys, usable[1], cursor)
        return through_lmdb(cursor, keys) if found is None else found

    def _split(self, txn, op: str, specs: list, head):
        """(head(first part of the specs), the lookup helper's answer for the rest), or None: answer them all
        here (see _parallel.split). Only a view whose args type the helper can import by name is split."""
        args = self.shapes.args_type
        if not _parallel.worth_it(len(specs)) or args is None or "<locals>" in args.__qualname__:
            return None
        # The snapshot, named so the helper can tell it sees the very same one: this file (its ledger id, a
        # file put in its place has another), at this transaction, holding this many events.
        meta = self.ledger.dbs["meta"]
        snapshot = [txn.get(b"ledger_id", db=meta), txn.id(), txn.get(b"last_seq", db=meta)]
        indexer = self.ledger.indexer
        request = [op, snapshot, self.table, self.backend, self.gpu_key, _codec.encode(self.contract),
                   args.__module__, args.__qualname__, indexer.index is not None]
        return _parallel.split(self.ledger.real_path, specs, head, request, indexer.charge)

    def _head_rows(self, txn, specs: list) -> list[Row]:
        """This process's share of a split get_many, built into rows while the helper answers the rest. The
        specs are dicts (see _split_rows); raises _NotCanonical where one holds a value to convert."""
        _shapes, exact, keys, values = self._values(txn, specs)
        if not exact:
            raise _NotCanonical
        return self._build(txn, specs, keys, values, _summaries(values))

    def _tail(self, txn, shapes: list) -> bytes:
        """The lookup helper's share of a get_many (canonical shapes) as it sends it: keys, each value's head
        (kind + event id; None stays None) and the found summaries spliced in as they are stored, so the
        requester decodes all in one call."""
        keys, values = self._shape_values(txn, shapes)
        return _codec.encode((keys, [v and v[:33] for v in values], msgspec.Raw(_summary_array(values))))

    def _split_rows(self, txn, specs: list) -> list[Row] | None:
        """The rows, the tail's looked up by the lookup helper while this process builds the head's; None
        where the serial path must answer (not split, specs not all canonical dicts, or no answer)."""
        if not _parallel.worth_it(len(specs)) or set(map(type, specs)) != {dict}:
            return None  # rows of specs that are not dicts carry converted dicts, which only the serial path builds
        try:
            halves = self._split(txn, "tail", specs, partial(self._head_rows, txn))
        except _NotCanonical:
            return None
        if halves is None:
            return None
        rows, tail = halves
        keys, heads, summaries = _tail_decoder.decode(tail)
        return rows + self._build(txn, specs[len(rows):], keys, heads, summaries)

    def _rows(self, txn, specs) -> list[Row]:
        specs = specs if isinstance(specs, list) else list(specs)
        rows = self._split_rows(txn, specs)
        if rows is not None:
            return rows
        shapes, exact, keys, values = self._values(txn, specs)
        if exact and all(type(s) is dict for s in specs):
            spec_dicts = specs  # already canonical values; no copies
        else:
            asdict = msgspec.structs.asdict
            spec_dicts = [s if type(s) is dict else asdict(s) for s in shapes]
        return self._build(txn, spec_dicts, keys, values, _summaries(values))

    def _build(self, txn, spec_dicts: list, keys: list[bytes], values: list, summaries: list[Summary]) -> list[Row]:
        """Rows from current values (or their first 33 bytes: kind + event id) and the found ones' summaries."""
        base, maybe_stale = self.keys.base, self._other_contracts(txn)
        summary = iter(summaries).__next__  # the found values' summaries, in the same order
        rows: list = []
        append = rows.append
        for spec, key, v in zip(spec_dicts, keys, values):
            if v is not None:
                append(Row(spec, "ok" if v[:1] == MEASURED else "failed", key, v[1:33], summary(), base))
            elif maybe_stale:
                append(self._stale_or_missing(txn, spec, key))
            else:
                append(Row(spec, "missing", key))
        return rows

    def _other_contracts(self, txn) -> bool:
        """Whether this scope ever held rows of another contract (else no spec can be stale)."""
        raw = txn.get(self.scope, db=self.ledger.dbs["scopes"])
        return raw is not None and msgspec.msgpack.decode(raw)[5] != [self._contract_id]

    def _stale_or_missing(self, txn, spec, key) -> Row:
        """A spec with no current row under this contract: stale if another contract's ok row exists."""
        prefix = self.scope + _codec.shape_id(self.keys.shape_bytes(spec))
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
        """Every current row of the scope: this contract's (ok or failed), and other contracts' measured rows
        as `stale`. As in `get_many`, another contract's failed attempt is no row of this view."""
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
                if prov.contract == self.contract:
                    status = "ok" if v[:1] == MEASURED else "failed"
                elif v[:1] == MEASURED:
                    status = "stale"
                else:
                    continue
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
