"""The registry: one entry per (table, backend). It imports no measurement library; runners are named
by import string and loaded only when something is measured.

An entry supplies every part of a row's provenance except the shape and the GPU key: its `contract`
(algorithm, layout, numerics, timing method, profiler revision). Bumping `profiler_revision` makes the
rows measured under the old revision `stale`.
"""

from __future__ import annotations

import functools

from ..errors import UsageError
from ._entry import METRICS, Entry

__all__ = ["Entry", "METRICS", "REGISTRY", "lookup", "entries", "register", "or_on_cpu"]


REGISTRY: dict[tuple[str, str], Entry] = {}
# The keywords of kprof.perf_api's read functions (and kprof.api's gpu_name): no spec field may take one's name.
RESERVED = ("backend", "gpu_key", "gpu_name", "db", "timer", "l2", "cuda_graph", "power")


def register(entry: Entry) -> Entry:
    """Adds `entry` (a plugin's, from KPROF_RUNNERS). A UsageError where its (table, backend) is another runner's
    already (a built-in table, or another plugin's), or a KernelArgs field could not be stored in a row's shape."""
    held = REGISTRY.get((entry.table, entry.backend))
    if held is not None and held.runner != entry.runner:  # the same runner again: its module imported once more
        raise UsageError(f"table {entry.table!r} backend {entry.backend!r} is registered twice, by runner "
                         f"{held.runner!r} and by {entry.runner!r}; give one of them another table or backend name")
    _check_args(entry)
    REGISTRY[(entry.table, entry.backend)] = entry
    return entry


@functools.cache
def _checked_entry() -> type:
    """Entry's fields but `args` (a class, which msgspec does not convert), as a Struct to check an entry's values."""
    import msgspec

    return msgspec.defstruct("Entry", [(f.name, f.type) for f in msgspec.structs.fields(Entry) if f.name != "args"])


def _check_args(entry: Entry) -> None:
    """The names every verb takes, and a spec's fields, which are a row's shape, whose values are bool, int, float or
    str: a field of another type (`int | None`) would be measured, then refused by the ledger with every row of its
    run."""
    import re

    import msgspec

    checked = _checked_entry()
    try:  # a Struct's fields are not checked when it is made: Entry(metric_family="bogus") or contract=None were taken
        msgspec.convert(msgspec.to_builtins({name: getattr(entry, name) for name in checked.__struct_fields__}),
                        checked)
    except (msgspec.ValidationError, TypeError) as e:
        raise UsageError(f"the Entry of table {entry.table!r} backend {entry.backend!r} does not fit: "
                         f"{str(e).replace('$.', 'Entry.')}; fix the value (see kprof.runners._entry.Entry)") from None
    if not (isinstance(entry.table, str) and entry.table and f"get_{entry.table}".isidentifier()):
        raise UsageError(f"table {entry.table!r} cannot name its read functions kprof.perf_api.get_<table> and "
                         f"count_<table>; use letters, digits and _ (e.g. "
                         f"{re.sub(r'[^0-9A-Za-z_]+', '_', str(entry.table)).strip('_') or 'my_kernel'!r})")
    if not (isinstance(entry.backend, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", entry.backend)):
        raise UsageError(f"table {entry.table!r}: backend {entry.backend!r} is not a name --backend can take; use "
                         f"letters, digits, _, - and . (e.g. 'torch-cpu')")
    if not (isinstance(entry.args, type) and issubclass(entry.args, msgspec.Struct)):
        raise UsageError(f"table {entry.table!r}: args is {entry.args!r}, not a KernelArgs Struct; subclass "
                         f"kprof.runners._args.KernelArgs")
    scalar = (msgspec.inspect.BoolType, msgspec.inspect.IntType, msgspec.inspect.FloatType, msgspec.inspect.StrType,
              msgspec.inspect.LiteralType)
    declared = {f.name: f.type for f in msgspec.structs.fields(entry.args)}
    taken = sorted(set(declared) & set(RESERVED))
    if taken:
        raise UsageError(f"table {entry.table!r}: field {taken[0]!r} of {entry.args.__name__} is a keyword of "
                         f"kprof.perf_api.get_{entry.table} and count_{entry.table} (as are {', '.join(RESERVED)}), "
                         f"which could not take it as a spec field; rename the field")
    for field in msgspec.inspect.type_info(entry.args).fields:
        if not isinstance(field.type, scalar):
            shown = getattr(declared[field.name], "__name__", None) or str(declared[field.name])
            raise UsageError(f"table {entry.table!r}: field {field.name!r} of {entry.args.__name__} is {shown}; a "
                             f"spec field is a bool, int, float or str (or a Literal of them), as a row's shape "
                             f"holds: a Literal for a set of choices (not an Enum), a default of the type for an "
                             f"optional value (e.g. 0, not None)")
        if field.default is not msgspec.NODEFAULT:  # a spec that leaves the field out is keyed and built with it
            try:
                msgspec.convert({field.name: field.default}, msgspec.defstruct("Default", [(field.name,
                                                                                           declared[field.name])]))
            except msgspec.ValidationError as e:
                raise UsageError(f"table {entry.table!r}: field {field.name!r} of {entry.args.__name__} defaults to "
                                 f"{field.default!r}, a value the field refuses ({str(e).split(' - at ')[0]}); give it "
                                 f"a default it takes") from None


# The KPROF_RUNNERS modules imported into REGISTRY: the variable is read at each lookup, so a module named after the
# first (or corrected after one failed) is imported then (read once, it stayed `unknown table` for the process's life)
_loaded: set[str] = set()


def _load() -> None:
    if not REGISTRY:
        from .catalog import ENTRIES  # the catalog imports only the entry type, never this module

        _loaded.clear()
        for entry in ENTRIES:
            register(entry)
    _load_plugins()


def _load_plugins() -> None:
    """Imports each module named in KPROF_RUNNERS (comma-separated) not imported yet: a module of runners of one's
    own, which calls `register(Entry(...))` when imported. Pool workers inherit the variable, so they know the same
    entries. One that fails raises at each lookup (and says why again), never answered without."""
    import importlib
    import os

    for name in filter(None, (n.strip() for n in os.environ.get("KPROF_RUNNERS", "").split(","))):
        if name in _loaded:
            continue
        if name.startswith("."):  # importlib would raise a TypeError: a relative name has no package to be under
            raise UsageError(f"KPROF_RUNNERS names module {name!r}, a relative name; give its full dotted name "
                             f"(e.g. mypkg.kernels)")
        _loaded.add(name)  # from now: a lookup of the module's own, while it is imported, imports it not again
        try:
            importlib.import_module(name)
        except BaseException as e:
            _loaded.discard(name)  # imported again at the next lookup (one that failed is not in sys.modules)
            if isinstance(e, ImportError):
                raise UsageError(f"KPROF_RUNNERS names module {name!r}, which does not import ({e}); fix the name "
                                 f"or put the module on PYTHONPATH") from None
            if isinstance(e, UsageError) or not isinstance(e, Exception):  # register() refusing an entry names it
                raise
            # the plugin's own code failed: where, not a traceback through kprof's
            raise UsageError(f"KPROF_RUNNERS module {name!r} raised {type(e).__name__} when imported ({e}) at "
                             f"{_where(e)}; fix the module") from None


def _where(exc: Exception) -> str:
    """file:line where `exc` was raised (a SyntaxError: where the bad line is)."""
    import traceback

    if isinstance(exc, SyntaxError):
        return f"{exc.filename}:{exc.lineno}"
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{frame.filename}:{frame.lineno}"


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
        raise UsageError(f"unknown table {table!r}; known tables: {', '.join(tables)} (see `kprof list`); a table "
                         f"of one's own runners is known where KPROF_RUNNERS names the module that registers it (a "
                         f"worker process imports only those)")
    backends = sorted(b for t, b in REGISTRY if t == table)
    raise UsageError(f"table {table!r} has no backend {backend!r}; its backends: {', '.join(backends)} "
                     f"(see `kprof list`)")


def or_on_cpu(entry: Entry) -> str:
    """", or use backend B" naming the table's own CPU backend (gloo for a collective), for a message refusing a CUDA
    backend where there is no GPU; "" where the table has none."""
    twins = [e.backend for e in entries() if e.table == entry.table and e.device == "cpu"]
    return f", or use backend {twins[0]}" if twins else ""
