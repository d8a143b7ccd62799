"""The work behind every verb, callable from Python with the verbs' arguments.

    from kprof import api
    api.count_missing("single_gemm", "torch-cpu", specs)        # -> CountResult
    api.query("single_gemm", "torch-cpu", specs, db="profile.db") # -> QueryResult
    api.run("single_gemm", "torch-cpu", specs, mode="jit")        # -> QueryResult (exit code in .exit_code)
    api.query("single_gemm", "torch", specs, gpu_name="NVIDIA H200", timer="events", l2="warm")  # CUDA method
    api.run("single_gemm", "torch", prefill_specs, power="loaded")  # timed after heavy GEMMs, as in a prefill

CUDA rows are keyed by their timing method: `timer`, `l2`, `cuda_graph` and the power state `power` choose it,
each defaulting to its environment variable (KPROF_TIMER, KPROF_L2, KPROF_CUDA_GRAPH, KPROF_POWER); see
`effective_entry`.

query and count-missing never import torch, cupti or pynvml.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any, Callable, Literal

import msgspec

from .errors import KprofError, UsageError, measure_command, names_ledger
from .ledger import KeyMaker, Ledger, Row, citation, ledger_path
from .ledger._codec import encode, event_id, scope_id
from .ledger._reducer import root_of
from .ledger.events import Measured, Origin, summary_of
from .runners.registry import METRICS, lookup
from .method import effective_entry, refused, resolve_gpu_key
from .specs import ShapeCodec, is_text, spec_list, validate

__all__ = ["resolve_gpu_key", "effective_entry", "check_gpu_key", "view", "count_missing", "query", "run", "scopes",
           "show", "CountResult", "QueryResult", "Scope", "Mode"]

Mode = Literal["query", "jit", "force", "fresh"]


class CountResult(msgspec.Struct):
    table: str
    backend: str
    gpu_name: str
    db: str
    count: int
    missing_count: int
    missing: list[dict]

    def to_json(self) -> dict:
        """The document `kprof count-missing --json` prints."""
        return msgspec.to_builtins(self)


class QueryResult(msgspec.Struct):
    table: str
    backend: str
    gpu_name: str
    db: str
    mode: str
    count: int
    missing_count: int
    view_root: str
    results: list[dict]
    view_root_before: str | None = None
    exit_code: int = 0
    seconds: float = 0.0
    timed_seconds: float = 0.0
    measured: int = 0
    pool: dict | None = None  # where `run` measured: devices, whether forced, what the idle guard skipped
    host_busy: int = 0  # rows `run` measured while other work took the host's cores (their notes say host_busy)
    timed_rows: int = 0  # of `measured`, those that made a row (a failure times nothing)
    ceiling_note: str | None = None  # why ok rows have no ceiling: the calibration was timed another way (threads)

    def to_json(self) -> dict:
        doc = msgspec.to_builtins(self)
        for extra in ("view_root_before", "exit_code", "seconds", "timed_seconds", "measured", "pool", "host_busy",
                      "timed_rows", "ceiling_note"):
            doc.pop(extra)
        return doc


def _prepare(table, backend, specs, gpu_name, db, method: dict, measures: bool = False):
    entry = effective_entry(lookup(table, backend), **method)
    canonical = validate(entry.args, spec_list(specs), entry.table)
    return entry, canonical, resolve_gpu_key(entry, gpu_name, measures and gpu_name is None), ledger_path(db)


def view(ledger: Ledger, table: str, backend: str, gpu_key: str, *, timer: str | None = None, l2: str | None = None,
         cuda_graph: bool | None = None, power: str | None = None):
    """The read View of (table, backend, gpu_key) in an open ledger, under the registry entry's contract and
    KernelArgs type, timed by `timer`/`l2`/`cuda_graph`/`power` (see `effective_entry`)."""
    if not isinstance(ledger, Ledger):
        raise UsageError(f"api.view takes an open Ledger, not {type(ledger).__name__} {ledger!r}; open one first: "
                         f"with Ledger.open(path, readonly=True) as ledger: view = api.view(ledger, ...)")
    entry = effective_entry(lookup(table, backend), timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
    return ledger.view(table, backend, check_gpu_key(gpu_key), entry.contract, entry.args)


def check_gpu_key(gpu_key) -> str:
    """A GPU key as a view takes it: a non-empty str (None, an int or "" would read every spec as missing)."""
    if not isinstance(gpu_key, str) or not gpu_key.strip():
        raise UsageError(f"GPU key {gpu_key!r} is not a GPU key; pass one as a non-empty str, as `kprof scopes` lists "
                         f"them (for torch-cpu, this machine's CPU model)")
    if not is_text(gpu_key):  # a lone surrogate: a key hashes its UTF-8
        raise UsageError(f"GPU key {gpu_key!r} is not UTF-8 text (a lone surrogate, as Python reads a byte that is not "
                         f"UTF-8); pass it as text, as `kprof scopes` lists them")
    return gpu_key


def _open_for_read(db: str, missing_ok: bool = False) -> Ledger | None:
    """The ledger at db, read-only. No file there is a usage error naming the path (a mistyped --db must not read
    as "every row missing"); only `run --fresh`, which needs no ledger, passes missing_ok and gets None."""
    if missing_ok and not os.path.exists(db):
        return None
    return Ledger.open(db, readonly=True)


@names_ledger
def count_missing(table: str, backend: str, specs: list[Any], *, gpu_name: str | None = None,
                  db: str | None = None, timer: str | None = None, l2: str | None = None,
                  cuda_graph: bool | None = None, power: str | None = None) -> CountResult:
    """The specs without an ok row under the timing method `timer`/`l2`/`cuda_graph`/`power` (see
    `effective_entry`)."""
    entry, canonical, gpu_key, db = _prepare(table, backend, specs, gpu_name, db,
                                             dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power))
    with _open_for_read(db) as ledger:
        missing = ledger.view(table, backend, gpu_key, entry.contract, entry.args).missing(canonical)
    return CountResult(table, backend, gpu_key, db, len(canonical), len(missing), missing)


def _ordered(metrics: dict | None, family: str) -> dict | None:
    """Metrics in the contract's order for the family (stored maps are key-sorted)."""
    if metrics is None:
        return None
    out = {k: metrics[k] for k in METRICS[family] if k in metrics}
    out.update((k, v) for k, v in metrics.items() if k not in out)
    return out


def _row_json(row: Row, family: str, spec: dict) -> dict:
    """A row as the contract's JSON: the spec in KernelArgs order, metrics in the family's order, and
    every provenance field (defaults included)."""
    doc = row.to_json()
    return {**doc, "spec": spec, "metrics": _ordered(doc["metrics"], family)}


def _error(s) -> dict | None:  # a row's error as the contract's JSON has it, from its summary (None: ok or missing)
    return {"kind": s.error_kind, "message": s.message} if s is not None and s.error_kind else None


def _keys(entry, gpu_key: str) -> KeyMaker:
    return KeyMaker(entry.table, entry.backend, gpu_key, entry.contract, ShapeCodec(entry.args, name=entry.table))


def _empty_root(entry, gpu_key: str) -> bytes:
    """The view root of a scope with no rows (a ledger file that does not exist yet)."""
    return root_of(scope_id(entry.table, entry.backend, gpu_key), 0, 0)


def _query(entry, canonical, gpu_key, db, ledger, mode, full: int | None = None) -> QueryResult:
    if ledger is None:
        keys = _keys(entry, gpu_key)
        root, rows = _empty_root(entry, gpu_key), [Row(s, "missing", keys.key(s)) for s in canonical]
    else:
        root, rows = ledger.view(entry.table, entry.backend, gpu_key, entry.contract, entry.args).query(canonical)
    result = _result(entry, gpu_key, db, mode, root, rows, canonical, full)
    if ledger is not None and entry.metric_family == "compute" and full is None:
        result.ceiling_note = _add_ceilings(entry, gpu_key, ledger, result.results)
    return result


def _add_ceilings(entry, gpu_key: str, ledger, results: list[dict]) -> str | None:
    """Each ok row's fraction of the device's ceilings, as `ceiling` (only once `kprof calibrate` has
    measured them for this GPU key: before that the rows are exactly the contract's). Returns why a ceiling is
    absent where the ledger holds one timed another way only (a CPU calibration of another thread count)."""
    from .ceilings import annotate, ceilings, elsewhere

    timing, cuda = entry.contract.timing, entry.device == "cuda"  # the CPU's thread count: the note says it
    found = ceilings(entry.backend, gpu_key, ledger=ledger, timing=timing)
    annotate(results, found, ledger.path)
    absent = [m for m in ("tflops", "memory_bandwidth_gbps") if m not in {c.metric for c in found if c.dtype is None}]
    other = elsewhere(entry.backend, gpu_key, ledger, timing) if absent and any(
        r["status"] == "ok" for r in results) else []
    if not other:
        return None
    fix = ("; they are of an older profiler revision (stale):" if all(o.startswith(f"{timing} (") for o in other)
           else "; a torch-cpu timing names its torch threads ($MKL_NUM_THREADS, else $OMP_NUM_THREADS, else the "
           "physical cores): set OMP_NUM_THREADS to that count (MKL_NUM_THREADS unset) to read its rows and ceilings, "
           "or" if "threads=" in timing else "; with this read's --timer, --l2, --cuda-graph and --power,")
    return (f"note: no {' or '.join(absent)} ceiling for these rows: the calibration rows of {gpu_key!r} here were "
            f"timed {', '.join(other)}, not {timing} (profiler revision {entry.contract.profiler_revision}){fix} "
            f"`{measure_command('calibrate', entry.backend, ledger.path, cuda and timing)}` measures the ceilings "
            f"under this one")


def _result(entry, gpu_key, db, mode, root: bytes, rows: list[Row], canonical, full: int | None = None) -> QueryResult:
    results = [_row_json(row, entry.metric_family, spec) if full is None or i < full else
               {"spec": spec, "status": row.status, "error": _error(None if row.ok else row.summary)}
               for i, (row, spec) in enumerate(zip(rows, canonical))]
    missing = sum(r["status"] != "ok" for r in results)
    return QueryResult(entry.table, entry.backend, gpu_key, db, mode, len(results), missing, root.hex(), results)


@names_ledger
def query(table: str, backend: str, specs: list[Any], *, gpu_name: str | None = None,
          db: str | None = None, timer: str | None = None, l2: str | None = None,
          cuda_graph: bool | None = None, power: str | None = None, full: int | None = None) -> QueryResult:
    """The rows of the specs under the timing method `timer`/`l2`/`cuda_graph`/`power` (see `effective_entry`).
    `full`: only the first `full` rows as the contract's JSON, the others {spec, status, error}, and no ceilings."""
    if full is not None and (type(full) is not int or full < 0):  # a bool is no count; "50" failed in a comparison
        raise UsageError(f"full={full!r} is not a row count; pass an int >= 0, or omit it for every row's JSON")
    entry, canonical, gpu_key, db = _prepare(table, backend, specs, gpu_name, db,
                                             dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power))
    with _open_for_read(db) as ledger:
        return _query(entry, canonical, gpu_key, db, ledger, "query", full)


@names_ledger
def run(table: str, backend: str, specs: list[Any], *, mode: Mode = "jit", gpu_name: str | None = None,
        db: str | None = None, progress: Callable[[int, int, dict], None] | None = None,
        watch: Callable[[str, dict | None], None] | None = None, conflict_dir: str | None = None,
        command: str = "", timer: str | None = None, l2: str | None = None,
        cuda_graph: bool | None = None, power: str | None = None,
        waiting: Callable[[int], None] | None = None) -> QueryResult:
    """JIT fill (mode "jit": measure what is missing), refresh ("force": measure all), or look without
    writing ("fresh": measure all, store nothing), timed by `timer`/`l2`/`cuda_graph`/`power` (see
    `effective_entry`). Every spec and the method are validated before anything is measured. `waiting(n)` is told,
    every half second or so while it lasts, that n of the specs are another run's to measure (waited for, then read)."""
    if mode not in ("jit", "force", "fresh"):
        raise UsageError(f"mode {mode!r} is not one of jit, force, fresh")
    started = time.perf_counter()
    entry, canonical, gpu_key, db = _prepare(table, backend, specs, gpu_name, db,
                                             dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power),
                                             measures=True)
    if gpu_name is not None:
        local = resolve_gpu_key(entry, None, measures=True)
        if local != gpu_name:
            raise refused(lambda arg: f"{arg('gpu_name', gpu_name, typed=True)} differs from the device this run "
                                       f"would measure on ({local!r}); omit {arg('gpu_name')}, or run on a machine "
                                       f"with that device")
    from .runners.fill import check_settings, fill

    check_settings()
    origin = Origin(ledger_id="", run_id=uuid.uuid4().hex, host=os.uname().nodename, command=command)
    filled = fill(entry, canonical, gpu_key, db, mode, origin, progress=progress, watch=watch,
                  conflict_dir=conflict_dir, waiting=waiting)
    ledger = _open_for_read(db, missing_ok=True)  # None: nothing was written (a fresh run, or nothing measurable)
    try:
        if mode == "fresh":
            root = filled.root_before or _empty_root(entry, gpu_key)
            result = _fresh_result(entry, canonical, gpu_key, db, [filled.fresh.get(k) for k in filled.spec_keys],
                                   filled.spec_keys, root)
            if ledger is not None and entry.metric_family == "compute":  # stored or not, a row has its fractions
                result.ceiling_note = _add_ceilings(entry, gpu_key, ledger, result.results)
        else:
            result = _query(entry, canonical, gpu_key, db, ledger, mode)
        for doc, k in zip(result.results, filled.spec_keys):
            if k in filled.errored:
                doc["status"] = "error"
                doc["error"] = filled.errored[k]
        result.missing_count = sum(r["status"] != "ok" for r in result.results)
        result.view_root_before = filled.root_before.hex() if filled.root_before is not None else None
        result.exit_code = 1 if result.missing_count else 0
        result.seconds = time.perf_counter() - started
        result.timed_seconds = filled.timed_seconds
        result.measured = filled.measured
        result.pool, result.host_busy, result.timed_rows = filled.pool, filled.host_busy, filled.timed_rows
        return result
    finally:
        if ledger is not None:
            ledger.close()


def _fresh_result(entry, canonical, gpu_key, db, events, spec_keys: list[bytes], root: bytes) -> QueryResult:
    """Rows straight from this run's measurements (None: not measured); nothing was written, so no row is
    citable."""
    rows = [Row(spec, "missing", k) if ev is None else
            Row(spec, "ok" if type(ev) is Measured else "error", ev.key, event_id(encode(ev)), summary_of(ev),
                ev.provenance) for spec, ev, k in zip(canonical, events, spec_keys)]
    result = _result(entry, gpu_key, db, "fresh", root, rows, canonical)
    for doc in result.results:
        doc["citation"] = None
    return result


class Scope(msgspec.Struct, frozen=True):
    """One (table, backend, GPU key) a ledger holds. `gpu_name` is the key that `query(gpu_name=...)`,
    `perf_api.get_<table>(gpu_key=...)` and `Ledger.view` take; `rows` counts its current rows of any status (ok,
    failed, or of another profiler revision or timing method, which read as stale)."""

    table: str
    backend: str
    gpu_name: str
    rows: int

    def to_json(self) -> dict:
        """One entry of `kprof scopes --json`'s "scopes"."""
        return msgspec.to_builtins(self)


@names_ledger
def scopes(db: str | None = None) -> list[Scope]:
    """Every scope of the ledger at db ($KPROF_DB, else ./profile.db), sorted by table, backend and GPU key: what
    it holds and under which GPU keys to read it. A file that does not exist is a LedgerError (exit 2)."""
    with Ledger.open(ledger_path(db), readonly=True) as ledger:
        return [Scope(*s) for s in sorted(ledger.scopes())]


def _builtins(obj):
    """An event as JSON values, every field present: msgspec.to_builtins leaves out fields at their default
    (the event Structs omit them when encoded), and writes bytes (ids) as base64 where they read as hex
    everywhere else."""
    if isinstance(obj, msgspec.Struct):
        config = obj.__struct_config__
        doc = {} if config.tag is None else {config.tag_field: config.tag}
        doc.update((name, _builtins(getattr(obj, name))) for name in obj.__struct_fields__)
        return doc
    if isinstance(obj, dict):
        return {k: _builtins(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_builtins(v) for v in obj]
    return obj.hex() if isinstance(obj, bytes) else obj


def _event_json(seq, eid, event, current) -> dict:
    """An event as `show --json` lists it: its fields, and `canonical`, the hex of its stored bytes (the event id is
    their hash; the fields alone cannot give it back: a field at its default value may or may not be in them)."""
    data = encode(event)  # the stored bytes: a ledger takes an event only in its canonical form
    doc = {"seq": seq, "event": eid.hex(), "citation": citation(eid), "current": eid == current,
           "canonical": data.hex() if event_id(data) == eid else None}
    doc.update(_builtins(event))
    if doc.get("metrics") is not None:  # in the family's order, as `query` lists them (the stored map is sorted)
        with contextlib.suppress(UsageError):  # a table or backend this kprof does not know: as stored
            doc["metrics"] = _ordered(doc["metrics"], lookup(doc["provenance"]["table"],
                                                             doc["provenance"]["backend"]).metric_family)
    return doc


@names_ledger
def show(ref: str, *, db: str | None = None) -> dict:
    """What `kprof show` prints: the row a citation, event id or key (or a unique hex prefix of 8+) names, as
    {ref, resolved_as, key, current, status, revision, timing, event, history, parent_elsewhere}, each event in it
    re-hashed to its id. `status` is the key's row as `query` reads it (`_key_status`), `revision` the profiler
    revision this kprof measures its table and backend at, `timing` the method `query` reads it in, `parent_elsewhere`
    the key and provenance of the event's parent held here under another key (None: in its history, absent, none)."""
    with Ledger.open(ledger_path(db), readonly=True) as ledger:
        found = ledger.resolve(ref)
        history = [_event_json(seq, eid, ev, found.current) for seq, eid, ev in found.history]
        chosen = next((h for h in history if h["event"] == (found.event_id or b"").hex()), None)
        # A parent outside the key's history: a row of another key here (the stale row a run re-measured), or
        # none here (a merged segment left it out)
        parent = (chosen or {}).get("parent")
        other = None if parent in {None, *(h["event"] for h in history)} else ledger.event(bytes.fromhex(parent))
    current = next((h for h in history if h["current"]), None)
    return {"ref": ref, "resolved_as": found.kind, "key": found.key.hex(),
            "current": found.current.hex() if found.current else None, "status": _key_status(current),
            "revision": getattr(_ours(current), "profiler_revision", None), "timing": _timing(current),
            "event": chosen, "history": history,
            "parent_elsewhere": other and {"key": other.key.hex(),
                                           "provenance": _builtins(getattr(other, "provenance", None))}}


def _ours(current: dict | None):
    """The contract (algorithm, layout, numerics, profiler revision) this kprof measures the current row's table and
    backend at (None: none current, or a table or backend it does not know)."""
    with contextlib.suppress(UsageError):
        return current and lookup(current["provenance"]["table"], current["provenance"]["backend"]).contract


def _timing(current: dict | None) -> str | None:
    """The timing method a `query` of this process reads the current row's table and backend in, without flags
    ($KPROF_TIMER, ...; a torch-cpu backend's thread count); None: none current, an unknown table or backend, or a
    setting refused (the verbs that read rows say which)."""
    if current is None:
        return None
    try:
        return effective_entry(lookup(current["provenance"]["table"], current["provenance"]["backend"])).contract.timing
    except KprofError:
        return None


def _key_status(current: dict | None) -> str:
    """The key's row as a `query` of this process without flags reads it: ok or failed (a row of this kprof's contract,
    `_ours`, and this process's default timing, `_timing`), stale (a measured row of an older revision, or of this one
    of another algorithm, layout, numerics or timing), else missing (every event retracted, a newer kprof's row, or a
    failed row of another contract: query reads no row of the key)."""
    if current is None:
        return "missing"
    ours, timing, prov = _ours(current), _timing(current), current["provenance"]
    fields = ("algorithm", "layout", "numerics", "profiler_revision")
    if all(prov[f] == getattr(ours, f, prov[f]) for f in fields) and timing in (None, prov["timing"]):
        return "ok" if current["type"] == "measured" else "failed"
    newer = prov["profiler_revision"] > getattr(ours, "profiler_revision", prov["profiler_revision"])
    return "stale" if current["type"] == "measured" and not newer else "missing"
