"""The registry: one entry per (table, backend). It imports no measurement library; runners are named
by import string and loaded only when something is measured.

An entry supplies every part of a row's provenance except the shape and the GPU key: its `contract`
(algorithm, layout, numerics, timing method, profiler revision). Bumping `profiler_revision` makes the
rows measured under the old revision `stale`.
"""

from __future__ import annotations

from ..errors import UsageError
from ._entry import METRICS, Entry

__all__ = ["Entry", "METRICS", "REGISTRY", "lookup", "entries", "register"]


REGISTRY: dict[tuple[str, str], Entry] = {}


def register(entry: Entry) -> Entry:
    REGISTRY[(entry.table, entry.backend)] = entry
    return entry


def _load() -> None:
    if not REGISTRY:
        from .catalog import ENTRIES  # the catalog imports only the entry type, never this module

        for entry in ENTRIES:
            register(entry)


def entries() -> list[Entry]:
    _load()
    return sorted(REGISTRY.values(), key=lambda e: (e.table, e.backend))


def lookup(table: str, backend: str) -> Entry:
    _load()
    entry = REGISTRY.get((table, backend))
    if entry is not None:
        return entry
    tables = sorted({t for t, _ in REGISTRY})
    if table not in tables:
        raise UsageError(f"unknown table {table!r}; known tables: {', '.join(tables)} (see `kprof list`)")
    backends = sorted(b for t, b in REGISTRY if t == table)
    raise UsageError(f"table {table!r} has no backend {backend!r}; its backends: {', '.join(backends)} "
                     f"(see `kprof list`)")
