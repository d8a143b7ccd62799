"""Per-table read functions for simulators, generated from the registry:

    from kprof import perf_api
    row = perf_api.get_single_gemm(backend="torch", gpu_key="NVIDIA H200", m=1, n=8192, k=1024, dtype="bf16")
    n = perf_api.count_single_gemm([{...}, ...], backend="torch", gpu_key="NVIDIA H200")
    prefill = perf_api.get_single_gemm(backend="torch", gpu_key="NVIDIA H200", power="loaded", m=4096, ...)

`get_<table>` returns the ok Row, or None for a spec that is missing, stale or failed; a GPU key for which the
ledger has never held a row of that table/backend raises UnknownGpuKeyError (exit 2), naming the GPU keys it holds
(`kprof.api.scopes()` and `kprof scopes` list them all). `count_<table>` counts the specs without an ok row (every
spec, under a GPU key not yet measured). Both read the rows of one timing method: `timer`, `l2`, `cuda_graph` and
`power` choose it as in `kprof.api` (each defaulting to its KPROF_* variable; see `kprof.method.effective_entry`).
Ledgers and views are opened once per (db, table, backend, gpu_key, method) and reused while the same file is at the
path (a file replaced there is opened again, as is an older-format file, read from an upgraded copy, once a writer
has written it); at most OPEN_LEDGERS (32) are held open, the least recently read closed first. A lookup reads the
timing method's variables from the environment, checks the file at the path (a stat) and the ledger's own file, then
hashes one key and reads its verified row from the B-tree: about 0.1 ms on a 2-core machine. The ledgers are closed
at exit. Nothing here imports torch, cupti or pynvml.
"""

from __future__ import annotations

import atexit
import os
import threading
from functools import partial
from typing import Any, Callable

from .api import check_gpu_key
from .errors import LedgerError, SpecError, names_ledger
from .ledger import Ledger, ledger_path
from .ledger.view import Row, View
from .method import effective_entry, resolve_gpu_key
from .runners.registry import RESERVED, entries, lookup
from .specs import spec_list

__all__: list[str] = ["view_for", "close_all"]

_lock = threading.Lock()
_ledgers: dict[str, tuple[Ledger, tuple, str]] = {}  # path -> (ledger, _identity of the file it opened, its realpath)
_views: dict[tuple, View] = {}
_ARGUMENTS = tuple(name for name in RESERVED if name != "gpu_name")  # the keywords of get_<table> and count_<table>
# The most ledgers held open at once, the least recently read closed first: a harness reading a ledger of each of its
# temporary directories held every one open (3 descriptors and a mapping each) after the directory was removed, until
# the process ran out of descriptors
OPEN_LEDGERS = 32


def _identity(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _stands(path: str, ledger: Ledger, identity: tuple, real: str) -> bool:
    """Whether a cached ledger still reads the file at `path`: the same file (not replaced in place), and where it
    reads an upgraded copy of an older-format file (which holds the file as it was when opened), one not written
    since (a writer upgrades the file in place, then appends). One a caller closed (`view_for(...).ledger`) is opened
    again: no Ledger.open of the caller's can reopen perf_api's."""
    if ledger.closed:
        return False
    now = _identity(path)
    return now == identity if ledger.real_path != real else now[:2] == identity[:2]


@names_ledger
def view_for(table: str, backend: str, gpu_key: str | None = None, db: str | None = None, *, timer: str | None = None,
             l2: str | None = None, cuda_graph: bool | None = None, power: str | None = None) -> View:
    """The cached read view of (table, backend, gpu_key) in the ledger at db ($KPROF_DB, ./profile.db), timed by
    `timer`/`l2`/`cuda_graph`/`power` (see `kprof.method.effective_entry`); gpu_key None: this machine's device."""
    entry = effective_entry(lookup(table, backend), timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
    given = ledger_path(db)
    # The key: the path as given, from the working directory now (not normalized: `link/../x` is not always `x`).
    # Not realpath, which reads every directory of the path on each lookup: _stands finds the file that is there.
    path = given if os.path.isabs(given) else os.path.join(os.getcwd(), given)
    cached = (path, table, backend, gpu_key, entry.contract)  # gpu_key None: the view holds the key resolved once
    with _lock:
        held = _ledgers.get(path)
        if held is not None and not _stands(path, *held):  # replaced in place, or an older file written: read it now
            identity = _identity(path)
            # Opened before the earlier file is closed: the open refuses while a read of this process (another
            # thread's) is in that file, which closing it would end under the read; otherwise the open closes it.
            fresh = Ledger.open(given, readonly=True)
            _drop(path)
            _ledgers[path] = (fresh, identity, os.path.realpath(given))
        if held is not None:
            _ledgers[path] = _ledgers.pop(path)  # the most recently read last
        view = _views.get(cached)
        if view is None:
            if path not in _ledgers:
                _close_least_read()
                identity = _identity(path)  # before opening: a file replaced meanwhile is opened again next time
                _ledgers[path] = (Ledger.open(given, readonly=True), identity, os.path.realpath(given))
            key = resolve_gpu_key(entry, None, keyword="gpu_key") if gpu_key is None else check_gpu_key(gpu_key)
            view = _views[cached] = _ledgers[path][0].view(table, backend, key, entry.contract, entry.args)
    return view


def _drop(path: str) -> None:
    """Closes the ledger at `path` and forgets its views."""
    _ledgers.pop(path)[0].close()
    for cached in [cached for cached in _views if cached[0] == path]:
        del _views[cached]


def _close_least_read() -> None:
    """Closes ledgers past OPEN_LEDGERS - 1, those whose file is gone or replaced first, then the least recently read,
    where no thread's read is in them (Ledger.close_if_idle)."""
    excess = len(_ledgers) - OPEN_LEDGERS + 1
    for path in sorted(_ledgers, key=lambda path: _stands(path, *_ledgers[path])):  # (stable: the least read first)
        if excess > 0 and _ledgers[path][0].close_if_idle():
            _drop(path)
            excess -= 1


def close_all() -> None:
    with _lock:
        for path in list(_ledgers):
            _drop(path)


atexit.register(close_all)


def _placed(exc: SpecError, table: str, function: str) -> SpecError:
    """A spec field that is an argument of `function` (or gpu_name, kprof.api's name for gpu_key): where it goes."""
    name = "gpu_key" if exc.field == "gpu_name" else exc.field
    if name not in _ARGUMENTS:
        return exc
    return SpecError(f'field "{exc.field}" is not a KernelArgs field of {table}; pass {name}= to {function}'
                     + (" once, not in the specs" if function.startswith("count_") else ""), index=exc.index,
                     field=exc.field, value=exc.value)


def _answer(function: str, table: str, cached_view: Callable[[], View], read: Callable[[View], Any]) -> Any:
    """read() of the cached view; where another thread found the file replaced meanwhile (closing the earlier file
    under this call: "was replaced ... open it again"), read() of the new file's view."""
    view = cached_view()
    try:
        while True:
            try:
                return read(view)
            except LedgerError:
                view, failed = cached_view(), view
                if view is failed:  # not a replacement: the view cached still stands
                    raise
    except SpecError as exc:  # gpu_name=, as kprof.api has it, or an argument of this call, read as a spec field
        raise _placed(exc, table, function) from None


def _make(table: str) -> tuple[Callable, Callable]:
    def get(*, backend: str, gpu_key: str | None = None, db: str | None = None, timer: str | None = None,
            l2: str | None = None, cuda_graph: bool | None = None, power: str | None = None,
            **spec: Any) -> Row | None:
        cached = partial(view_for, table, backend, gpu_key, db, timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
        return _answer(f"get_{table}", table, cached, lambda view: view.get(**spec))

    def count(specs: list[dict], *, backend: str, gpu_key: str | None = None, db: str | None = None,
              timer: str | None = None, l2: str | None = None, cuda_graph: bool | None = None,
              power: str | None = None) -> int:
        cached = partial(view_for, table, backend, gpu_key, db, timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
        listed = spec_list(specs)  # once: a read retried on the file found replaced (_answer) reads them again
        return _answer(f"count_{table}", table, cached, lambda view: view.count_missing(listed))

    get.__name__ = get.__qualname__ = f"get_{table}"
    count.__name__ = count.__qualname__ = f"count_{table}"
    get.__doc__ = (f"The ok row of one {table} spec (keyword arguments: its KernelArgs), or None (missing, stale "
                   f"or failed) under the timing method timer/l2/cuda_graph/power (as in kprof.api); "
                   f"UnknownGpuKeyError, naming the GPU keys held, where the ledger has no {table} rows of this "
                   f"backend and GPU key.")
    count.__doc__ = (f"How many of the {table} specs have no ok row (missing, stale or failed) under the timing "
                     f"method timer/l2/cuda_graph/power (as in kprof.api).")
    return names_ledger(get), names_ledger(count)  # (see kprof.errors.names_ledger)


for _table in sorted({e.table for e in entries()}):
    _get, _count = _make(_table)
    globals()[_get.__name__], globals()[_count.__name__] = _get, _count
    __all__ += [_get.__name__, _count.__name__]
del _table, _get, _count


def __getattr__(name: str) -> Callable:
    """get_<table>/count_<table> of a table registered since this module was imported (a runner module imported
    after it), made now; of a table no runner registers, an AttributeError naming the tables there are."""
    verb, _, table = name.partition("_")
    if verb not in ("get", "count") or not table:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    tables = sorted({e.table for e in entries()})
    if table not in tables:
        raise AttributeError(f"kprof.perf_api has no {name}: no runner registers table {table!r}; its tables: "
                             f"{', '.join(tables)} (see `kprof list`; a table of one's own runners is known where "
                             f"KPROF_RUNNERS names the module that registers it)")
    with _lock:
        functions = _make(table)
        for function in functions:
            globals().setdefault(function.__name__, function)
    return globals()[name]
