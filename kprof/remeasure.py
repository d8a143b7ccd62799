"""`kprof audit --remeasure N`: measure N random current rows of this machine's device again and report
each row's drift. Nothing is written: an audit checks the ledger, it does not change it.

A row drifts when |new time / stored time - 1| exceeds the tolerance on two measurements: a row over it is
measured once more, after the others, and drifts only if that one is over it too (`first_drift` keeps the
first). One re-measurement in 20 of a 10 µs decode GEMM read +4.7 % on an H200, right after a power-capped
GEMM, where four passes of it had agreed within 1 %: a transient does not repeat, a wrong row does. Rows are drawn from every
scope whose GPU key is the local device's (the CUDA GPU's name for CUDA backends, the CPU model for
torch-cpu), under the contract this process measures with (timer included), so each row is re-measured
exactly the way it was measured. An explicit CUDA timing method (`timer`, `l2`, `cuda_graph`, `power`, the
verb's --timer/--l2/--cuda-graph/--power) picks the CUDA rows of that method and leaves the CPU's rows out: they
were never timed that way. With KPROF_SPEC_TIMEOUT_S set, the rows are measured in a spawned worker that is
killed past it (the row fails as `timeout`), as `run` bounds a spec, and so with KPROF_POOL=on (a runner that crashes
its process fails its row alone); else in this process.
"""

from __future__ import annotations

import math
import numbers
import os
import random
import shlex
import time
from typing import NamedTuple

from .errors import LedgerPathError, UsageError

__all__ = ["remeasure", "Drift", "RemeasureReport"]


class Drift(NamedTuple):
    table: str
    backend: str
    spec: dict
    citation: str
    stored_ms: float | None  # None when the stored row holds no positive time
    new_ms: float | None  # None when the re-measurement failed
    drift: float | None  # new / stored - 1
    ok: bool
    error: str | None = None
    first_drift: float | None = None  # the first measurement's drift, where it was over the tolerance
    host_busy: str | None = None  # a CPU re-measurement's host_busy note: other work took its cores while it was timed
    stored_host_busy: str | None = None  # the stored row's own host_busy note: other work took its cores then

    @property
    def suspect(self) -> bool:
        """Drifted slower while other work took the host's cores (the host may be the cause: it only slows a row), or
        faster than a stored row timed while other work took them (that row may be the slow one)."""
        if self.ok or self.drift is None:
            return False
        return (self.host_busy if self.drift > 0 else self.stored_host_busy) is not None


class RemeasureReport(NamedTuple):
    db: str
    gpu_keys: list[str]
    tolerance: float
    candidates: int  # current ok rows of the local device
    rows: list[Drift]
    seconds: float
    seed: int = 0  # the draw's: the same seed on the same ledger draws the same rows
    unregistered: list[str] = []  # "table/backend" of local rows no registered runner measures (a plugin not loaded)
    older: int = 0  # local specs whose only rows are of an older profiler revision, timed as asked (stale: not drawn)

    @property
    def drifted(self) -> int:
        """Rows measured again whose time moved past the tolerance (twice)."""
        return sum(not r.ok and r.error is None for r in self.rows)

    @property
    def busy(self) -> int:
        """Rows whose drift other work on the host may explain (`suspect`): slower as it took the cores while they were
        re-measured, or faster than a stored row timed while it took them."""
        return sum(r.suspect for r in self.rows)

    @property
    def failed(self) -> int:
        """Rows whose re-measurement failed: not a drift (no time to compare), but a row that could not be checked."""
        return sum(r.error is not None for r in self.rows)

    def to_json(self) -> dict:
        return {"db": self.db, "gpu_keys": self.gpu_keys, "tolerance": self.tolerance, "candidates": self.candidates,
                "seed": self.seed, "checked": len(self.rows), "drifted": self.drifted, "failed": self.failed,
                "host_busy": self.busy,
                "seconds": round(self.seconds, 3), "unregistered": self.unregistered,
                "rows": [r._asdict() for r in self.rows]}


def _local_keys(devices: set[str]) -> dict[str, str]:
    """The GPU key of each local device kind that is present: cpu always, cuda when a GPU is visible."""
    from .measure.device_name import local_gpu_name
    from .measure.env import cpu_model

    keys = {"cpu": cpu_model()} if "cpu" in devices else {}
    if "cuda" in devices:
        name = local_gpu_name()
        if name:
            keys["cuda"] = name
    return keys


def _named(method: dict) -> str:
    """The flags a timing method was given by, as typed on the command line."""
    words = [f"--{name} {method[name]}" for name in ("timer", "l2") if method[name] is not None]
    if method["cuda_graph"] is not None:
        words.append("--cuda-graph" if method["cuda_graph"] else "--no-cuda-graph")
    if method["power"] is not None:
        words.append(f"--power {method['power']}")
    return " ".join(words)


def remeasure(db: str | None, n: int, tolerance: float = 0.05, *, timer: str | None = None, l2: str | None = None,
              cuda_graph: bool | None = None, power: str | None = None, seed: int | None = None,
              device: str | None = None) -> RemeasureReport:
    """Re-measures `n` random current ok rows of the local device(s) (`device` "cuda" or "cpu" narrows it),
    the CUDA rows under the timing method `timer`/`l2`/`cuda_graph`/`power` (see `kprof.api.effective_entry`)."""
    from .ledger import Ledger, ledger_path
    from .runners.registry import entries

    n, tolerance = _checked(n, tolerance, device)
    if n < 1:
        raise UsageError(f"--remeasure {n}: give the number of rows to re-measure, at least 1")
    if not 0 < tolerance < 1e6:
        raise UsageError(f"--tolerance {tolerance:g}: give a relative tolerance such as 0.05 (5%)")  # -1, not -1.0
    db = ledger_path(db)  # None: $KPROF_DB, else ./profile.db, as every verb's db
    if not os.path.isfile(db):
        raise LedgerPathError.absent(db)
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 32)  # reported, so the draw can be replayed with --seed
    elif type(seed) is not int or seed < 0:
        raise UsageError(f"--seed {seed!r}: give a whole number >= 0, e.g. the seed a report gave")
    from .runners.devices import pool_mode
    from .runners.fill import check_settings, spec_time_limit

    check_settings()  # every KPROF_* setting, as a run checks them: a bad one refused before anything is measured
    # KPROF_SPEC_TIMEOUT_S set: each scope's specs go to a worker it bounds, as in `run`; KPROF_POOL=on: to a worker too
    timed = spec_time_limit() or pool_mode() == "on"
    started = time.perf_counter()
    method = {"timer": timer, "l2": l2, "cuda_graph": cuda_graph, "power": power}
    explicit = any(v is not None for v in method.values())
    if explicit and device is None:
        device = "cuda"  # a CUDA method names CUDA rows
    if explicit and device == "cpu":  # (only a Python caller passes device) said of the rows, not of some CPU backend
        given = ", ".join(f"{name}={value!r}" for name, value in method.items() if value is not None)
        raise UsageError(f"{given} picks CUDA rows, and device='cpu' asks for the CPU's, which are timed by wall clock "
                         f"only; drop {given}, or pass device='cuda'")
    all_entries = [x for e in entries() if device in (None, e.device) and (x := _method_of(e, method))]
    keys = _local_keys({e.device for e in all_entries})
    if explicit and device == "cuda" and "cuda" not in keys:
        raise UsageError(f"{_named(method)} re-measures CUDA rows and no CUDA GPU is visible here; run on the GPU "
                         f"the rows were measured on, or drop {_named(method)}")
    candidates, older = [], 0
    with Ledger.open(db, readonly=True) as ledger:
        held = {(t, b, g) for t, b, g, _rows in ledger.scopes()}
        for entry in all_entries:
            gpu_key = keys.get(entry.device)
            if gpu_key is None or (entry.table, entry.backend, gpu_key) not in held:
                continue
            view = ledger.view(entry.table, entry.backend, gpu_key, entry.contract, entry.args)
            rows = list(view.rows())
            candidates += [(entry, gpu_key, row) for row in rows if row.status == "ok"]
            older += sum(r.status == "stale" and r.provenance.timing == entry.contract.timing
                         and r.provenance.profiler_revision < entry.contract.profiler_revision for r in rows)
    registered = {(e.table, e.backend) for e in entries()}
    unregistered = sorted({f"{t}/{b}" for t, b, g in held if g in keys.values() and (t, b) not in registered})
    rng = random.Random(seed)
    chosen = rng.sample(candidates, min(n, len(candidates)))
    with Ledger.open(db, readonly=True) as ledger:  # each stored row's own notes: one timed on a busy host says so
        stored = {row.citation: ledger.event(row.event_id) for _e, _g, row in chosen}  # (None: damage, audit names it)
    notes = {c: ev.method.notes for c, ev in stored.items() if ev is not None}
    by_entry: dict[tuple, list] = {}
    for entry, gpu_key, row in chosen:
        by_entry.setdefault((entry.table, entry.backend, gpu_key), []).append((entry, row))
    out: list[Drift] = _measure(by_entry, tolerance, timed, db)
    drifted = {d.citation for d in out if d.drift is not None and not d.ok}
    again = {k: [(e, r) for e, r in items if r.citation in drifted] for k, items in by_entry.items()}
    confirmed = {d.citation: d for d in _measure({k: v for k, v in again.items() if v}, tolerance, timed, db)}
    out = [d if d.citation not in confirmed else confirmed[d.citation]._replace(first_drift=d.drift) for d in out]
    out = [d._replace(stored_host_busy=notes.get(d.citation, {}).get("host_busy")) for d in out]
    return RemeasureReport(db, sorted(set(keys.values())), tolerance, len(candidates), out,
                           time.perf_counter() - started, seed, unregistered, older)


def _method_of(entry, method: dict):
    """The entry under the timing method asked for, or None for a collective that is never timed so (a graph, a
    loaded power state: no row of it can exist to draw)."""
    from .method import effective_entry

    try:
        return effective_entry(entry, **method)
    except UsageError:
        if entry.metric_family != "comm" or entry.device != "cuda":
            raise
        effective_entry(entry, **dict(method, cuda_graph=False, power="sustained"))  # another setting's refusal: raised
        return None


def _checked(n, tolerance, device) -> tuple[int, float]:
    """(n, tolerance) as numbers, or a UsageError naming the argument as a Python caller passed it (the verb's
    flags are converted already): a float or bool row count, a tolerance given as text, a device not known."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise UsageError(f"n={n!r} is not a whole number; give the number of rows to re-measure, e.g. n=20")
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real):
        raise UsageError(f"tolerance={tolerance!r} is not a number; give a relative tolerance such as "
                         f"tolerance=0.05 (5%)")
    if device not in (None, "cuda", "cpu"):
        raise UsageError(f"device={device!r} is not a device kind; pass device='cuda' or device='cpu', or omit it "
                         f"to re-measure the rows of both")
    return int(n), float(tolerance)


def _in_worker(entry, specs: list, gpu_key: str):
    """(index, event) of each spec, measured in a spawned worker on this process's device (CUDA device 0, or the
    CPU) that the pool kills past KPROF_SPEC_TIMEOUT_S: that spec fails as `timeout` and a fresh worker takes the
    rest, as in `run`. Its one-event segments stay in the pool's scratch directory, removed with it."""
    from .ledger.build import failed
    from .ledger.events import Origin
    from .ledger.keys import KeyMaker
    from .runners.devices import Device
    from .runners.pool import Pool
    from .specs import ShapeCodec

    keys = KeyMaker(entry.table, entry.backend, gpu_key, entry.contract, ShapeCodec(entry.args, name=entry.table))

    def failed_event(i, kind, message, environment):
        return failed(keys.provenance(specs[i], i), kind, message[:2000], environment=environment)

    with Pool(entry, gpu_key, [Device("cpu" if entry.device == "cpu" else "cuda:0", None)]) as pool:
        for res in pool.measure([(i, spec, None) for i, spec in enumerate(specs)], Origin(), failed_event):
            yield res.index, res.event


def _measure(by_entry: dict[tuple, list], tolerance: float, timed: bool, db: str) -> list[Drift]:
    """Each (entry, stored row) measured again, grouped by scope, as a Drift; `timed`: in a worker, bounded by
    KPROF_SPEC_TIMEOUT_S where it is set; `db`: the ledger's path, which a Drift's command names."""
    from .errors import SpecError
    from .runners.worker import measure_specs
    from .specs import validate

    out: list[Drift] = []
    for (_t, _b, gpu_key), held in by_entry.items():
        entry = held[0][0]
        items = []
        for e, row in held:  # a row that cannot be compared or re-measured fails alone; the others are measured
            stored = row.metrics.get("time_ms")
            if not (isinstance(stored, float) and 0 < stored < math.inf):  # a merged row may hold any float
                out.append(Drift(entry.table, entry.backend, row.spec, row.citation, None, None, None, False,
                                 f"not comparable: the stored time_ms is {stored}, not a positive time; "
                                 f"`kprof show {row.citation} --db {shlex.quote(db)}` shows where the row came from"))
                continue
            try:
                validate(entry.args, [row.spec], entry.table)
            except SpecError as exc:
                out.append(Drift(entry.table, entry.backend, row.spec, row.citation, stored, None,
                                 None, False, f"not re-measurable: backend {entry.backend} now refuses this "
                                              f"spec ({exc})"))
            else:
                items.append((e, row))
        specs = [row.spec for _e, row in items]
        if not items:
            continue
        outcomes = _in_worker(entry, specs, gpu_key) if timed else (
            (o.index, o.event) for o in measure_specs(entry, specs, gpu_key))
        for index, event in outcomes:
            _e, row = items[index]
            old = row.metrics["time_ms"]
            if hasattr(event, "metrics"):
                new = event.metrics["time_ms"]
                drift = new / old - 1
                out.append(Drift(entry.table, entry.backend, row.spec, row.citation, old, new, drift,
                                 abs(drift) <= tolerance, host_busy=event.method.notes.get("host_busy")))
            else:
                out.append(Drift(entry.table, entry.backend, row.spec, row.citation, old, None, None, False,
                                 f"{event.error_kind}: {event.message}"))
    return out
