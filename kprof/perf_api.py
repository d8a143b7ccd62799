"""Per-table read functions for simulators, generated from the registry:

    from kprof import perf_api
    row = perf_api.get_single_gemm(backend="torch", gpu_key="NVIDIA H200", m=1, n=8192, k=1024, dtype="bf16")
    n = perf_api.count_single_gemm([{...}, ...], backend="torch", gpu_key="NVIDIA H200")

`get_<table>` returns the ok Row, or None for a spec that is missing, stale or failed; a GPU key for which the
ledger has never held a row of that table/backend raises UnknownGpuKeyError (exit 2), naming the GPU keys it holds
(`kprof.api.scopes()` and `kprof scopes` list them all). `count_<table>` counts the specs without an ok row
(every spec, under a GPU key not yet measured). Ledgers and views are opened once per (db, table, backend,
gpu_key) and reused: a lookup costs one key hash and one B-tree read. Nothing here imports torch, cupti or pynvml.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from .ledger import Ledger, ledger_path
from .ledger.view import Row, View
from .runners.registry import entries, lookup

__all__: list[str] = ["view_for", "close_all"]

_lock = threading.Lock()
_ledgers: dict[str, Ledger] = {}
_views: dict[tuple, View] = {}


def view_for(table: str, backend: str, gpu_key: str | None = None, db: str | None = None) -> View:
    """The cached read view of (table, backend, gpu_key) in the ledger at db ($KPROF_DB, ./profile.db)."""
    from .api import effective_entry, resolve_gpu_key

    entry = effective_entry(lookup(table, backend))
    if gpu_key is None:
        gpu_key = resolve_gpu_key(entry, None)
    path = os.path.realpath(ledger_path(db))
    with _lock:
        view = _views.get((path, table, backend, gpu_key))
        if view is None:
            ledger = _ledgers.get(path)
            if ledger is None:
                ledger = _ledgers[path] = Ledger.open(path, readonly=True)
            view = _views[(path, table, backend, gpu_key)] = ledger.view(table, backend, gpu_key, entry.contract,
                                                                         entry.args)
    return view


def close_all() -> None:
    with _lock:
        for ledger in _ledgers.values():
            ledger.close()
        _ledgers.clear()
        _views.clear()


def _make(table: str) -> tuple[Callable, Callable]:
    def get(*, backend: str, gpu_key: str | None = None, db: str | None = None, **spec: Any) -> Row | None:
        return view_for(table, backend, gpu_key, db).get(**spec)

    def count(specs: list[dict], *, backend: str, gpu_key: str | None = None, db: str | None = None) -> int:
        return view_for(table, backend, gpu_key, db).count_missing(specs)

    get.__name__ = get.__qualname__ = f"get_{table}"
    count.__name__ = count.__qualname__ = f"count_{table}"
    get.__doc__ = (f"The ok row of one {table} spec (keyword arguments: its KernelArgs), or None (missing, stale "
                   f"or failed); UnknownGpuKeyError, naming the GPU keys held, where the ledger has no {table} rows "
                   f"of this backend and GPU key.")
    count.__doc__ = f"How many of the {table} specs have no ok row (missing, stale or failed)."
    return get, count


for _table in sorted({e.table for e in entries()}):
    _get, _count = _make(_table)
    globals()[_get.__name__], globals()[_count.__name__] = _get, _count
    __all__ += [_get.__name__, _count.__name__]
del _table, _get, _count
