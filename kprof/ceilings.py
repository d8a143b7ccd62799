"""The device's ceilings: the best arithmetic rate and the best memory bandwidth measured over a stated set
of shapes, stored in the ledger as ordinary rows, and each compute row's fraction of them.

    kprof calibrate --backend torch          # GPU: 9 large bf16 GEMMs; copies of 1-4 GiB and 2 decode GEMMs
    kprof calibrate --backend torch-cpu      # CPU: 3 fp32 GEMMs; copies of 64-256 MiB and a matrix-vector product

Why a set. One shape is not the device's best: on an H200 the 8192^3 bf16 GEMM runs at the 700 W power
cap (~690 TFLOP/s) while 4096^3 runs nearer boost clock (~775 TFLOP/s), so a ceiling taken from 8192^3 alone
put a 4096^3 row at 110 %. Nor is a copy the best a memory stream does: it reads and writes in equal parts,
while a decode GEMM only reads its weights. The ceiling of a metric is the maximum of that metric over its
set (`CEILING_SETS`), every row measured the same way: the timing method of this process (or the one
named), one row per shape, found again by its table and spec. A `Ceiling` names the row holding the maximum
(its citation), the whole set and which of it is in the ledger, and how the set was measured: the rows'
timing string and, read from the rows' own events, the SM clock range, power, temperature and throttle
reasons seen, or on the CPU the host's load average and the rows timed while it passed the cores (`method`;
`method["summary"]` is the same in one line).

The arithmetic ceiling is taken at the max SM clock: each GEMM row's TFLOP/s times the device's max SM clock
over the clock it was timed at, where its event says both (`_clock_scale`; `method["clock_scaled"]`). The set's
GEMMs run power-capped at clocks that differ from pass to pass, so their best as measured did not bound rows
timed a moment nearer boost; per clock, it does. Bandwidth ceilings are not scaled (HBM has its own clock).

A set may bound the rows of one dtype only (`CeilingSet.dtype`): on the GPU, fp8_e4m3 GEMMs run about twice
as fast as bf16 ones and have their own arithmetic set, while the bf16 set bounds every other dtype's rows
(fp32 on the CPU). A row is given, per metric, the ceiling of its own dtype where the ledger holds one, else the
ceiling of no particular dtype. Without an fp8 set, fp8 rows read 170 % of the bf16 ceiling on an H200.

What `query --json` adds to each ok compute row once the ceilings exist (`annotate`):

    ceiling: {fraction: {tflops: row / ceiling, memory_bandwidth_gbps: ...},
              values: {metric: the ceiling},
              citations: {metric: citation of the row holding the ceiling},
              method: {metric: how the ceiling was measured, in one line},
              above_ceiling: true, why: {metric: why the row may beat it, and what to do}}

`above_ceiling` and `why` are present only when a fraction exceeds 1: the row beat every row of the
calibration set. Such a fraction is reported as it is, never capped, and never silently: `why` names the first
of these the row and the ceiling show (`_why`): a set measured in part; a dtype no set holds (a CPU's bf16 rows
against its fp32 set); a working set smaller than any of the set's, which a cache serves (a CPU's rows are
timed warm, and its bandwidth ceiling is memory's); else a calibration measured in another state (clocks,
power, other work on the host) or a shape faster than the set's. Reading ceilings imports no measurement
library. This module reads them; `kprof.calibrate` measures them.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import measure_command
from .runners.registry import lookup

__all__ = ["CEILING_SETS", "CEILING_SPECS", "BASE_BACKEND", "CeilingSet", "Ceiling", "ceilings", "elsewhere",
           "applicable", "fractions", "annotate", "lookup_any"]


class CeilingSet(NamedTuple):
    metric: str  # "tflops" or "memory_bandwidth_gbps"
    members: tuple  # ((table, spec), ...): the stated shapes; the ceiling is the metric's maximum over their rows
    about: str  # what the set is, for people
    dtype: str | None = None  # the one dtype whose rows it bounds (an optional set), or None: any other row


def _gemms(dtype: str, *mnk: tuple[int, int, int]) -> tuple:
    return tuple(("single_gemm", {"m": m, "n": n, "k": k, "dtype": dtype}) for m, n, k in mnk)


def _copies(*sizes: int) -> tuple:
    return tuple(("memcpy", {"bytes": b}) for b in sizes)


def _decode_attention(*batch_kv: tuple[int, int]) -> tuple:
    return tuple(("attention_decode", {"batch": b, "kv_len": kv, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                                       "dtype": "bf16"}) for b, kv in batch_kv)


# Per device kind. Arithmetic: GEMMs large enough to fill every SM many times over, from 2048x4096x4096 (~0.09
# ms) to 8192^3 (~1.6 ms, power-capped), square-ish and long in k (the down projections of 7-8B models, k =
# 14336, ran at 100.2-103.3 % of a square-only set on an H200), so the best of them bounds the prefill-sized
# GEMMs of real models. Bandwidth: copies of 1-4 GiB, far past the L2 (60 MiB on an H200), and
# two decode GEMMs (m = 1) whose weights (235 and 537 MB) stream from HBM once per call. A copy reads and writes
# in equal parts; a decode GEMM only reads, and on an H200 the 1x28672x4096 one already streams within 1 % of
# the copy rate: without it in the set, decode rows would sit at or above "100 %" of a copy-only ceiling.
# Decode attention over a 1-4 GiB KV cache streams it faster still (102.6 % of copies and decode GEMMs on an H200,
# 2026-12-02), so two of them are members too. fp8_e4m3 GEMMs have their own arithmetic set (see the module).
# On the CPU, copies of 64 MiB and more (source and destination together twice that) and a 64 MiB
# matrix-vector product are past most last-level caches, so the best of them is a memory bandwidth, not a
# cache's.
CEILING_SETS = {
    "cuda": [
        CeilingSet("tflops", _gemms("bf16", (2048, 4096, 4096), (2048, 4096, 14336), (4096, 4096, 4096),
                                    (4096, 4096, 14336), (4096, 8192, 4096), (8192, 8192, 4096),
                                    (4096, 8192, 8192), (6144, 6144, 6144), (8192, 8192, 8192)),
                   "bf16 GEMMs"),
        CeilingSet("tflops", _gemms("fp8_e4m3", (2048, 4096, 14336), (4096, 4096, 4096), (4096, 4096, 14336),
                                    (6144, 6144, 6144), (8192, 8192, 8192)), "fp8_e4m3 GEMMs", "fp8_e4m3"),
        CeilingSet("memory_bandwidth_gbps", _copies(1 << 30, 2 << 30, 4 << 30)
                   + _gemms("bf16", (1, 28672, 4096), (1, 16384, 16384)) + _decode_attention((32, 8192), (128, 8192)),
                   "device-to-device copies, weight-streaming bf16 decode GEMMs and decode attention"),
    ],
    "cpu": [
        CeilingSet("tflops", _gemms("fp32", (512, 512, 512), (768, 768, 768), (1024, 1024, 1024)), "fp32 GEMMs"),
        CeilingSet("memory_bandwidth_gbps", _copies(64 << 20, 128 << 20, 256 << 20) + _gemms("fp32", (1, 4096, 4096)),
                   "host memory copies and an fp32 matrix-vector product"),
    ],
}
# (table, spec, metric) of every calibration row, flat.
CEILING_SPECS = {device: [(table, spec, s.metric) for s in sets for table, spec in s.members]
                 for device, sets in CEILING_SETS.items()}
BASE_BACKEND = {"cuda": "torch", "cpu": "torch-cpu"}


def _by_table(members) -> dict[str, list[dict]]:
    """The members' specs grouped by table, in order of first appearance, each spec once."""
    out: dict[str, list[dict]] = {}
    for table, spec in members:
        if spec not in out.setdefault(table, []):
            out[table].append(spec)
    return out


class Ceiling(NamedTuple):
    metric: str  # "tflops" or "memory_bandwidth_gbps"
    value: float  # the maximum over the set's rows in the ledger
    table: str  # the table of the row holding the maximum
    spec: dict  # its spec
    citation: str  # its citation
    shapes: tuple = ()  # {table, spec} of every member of the stated set, measured or not
    rows: tuple = ()  # {table, spec, value, citation} of each member found, in set order
    method: dict = {}  # how the rows were measured (timing, clocks, power, throttle) and how many were found
    dtype: str | None = None  # the set's dtype: the ceiling bounds rows of that dtype only (None: any other)


def lookup_any(backend: str):
    """A compute registry entry of `backend` (they all measure on one device kind). A backend of collectives only
    (nccl, gloo) has no ceilings: they are compute and memory ceilings, measured by a compute backend."""
    from .errors import UsageError
    from .runners.registry import entries

    mine = [e for e in entries() if e.backend == backend]
    for entry in mine:
        if entry.metric_family == "compute":
            return entry
    takes = " or ".join(BASE_BACKEND.values())
    if mine:
        raise UsageError(f"backend {backend!r} measures collectives ({', '.join(e.table for e in mine)}); ceilings "
                         f"are compute and memory ceilings: pass a compute backend, e.g. --backend {takes}")
    known = sorted({e.backend for e in entries()})
    raise UsageError(f"unknown backend {backend!r}; known backends: {', '.join(known)} (see `kprof list`)")


def _entry(table: str, backend: str, timing: str | None):
    """The registry entry with the timing method rows are read under: `timing` when given (a torch-cpu timing names
    its torch threads), else this process's (`kprof.api.effective_entry`)."""
    import msgspec

    from .method import effective_entry

    entry = lookup(table, backend)
    if timing:  # named: no KPROF_* variable or thread count is read (an explicit method beats them)
        return msgspec.structs.replace(entry, contract=msgspec.structs.replace(entry.contract, timing=timing))
    return effective_entry(entry)


def ceilings(backend: str, gpu_key: str, *, db: str | None = None, ledger=None,
             timing: str | None = None) -> list[Ceiling]:
    """The ceilings of the device of `backend` under `gpu_key`, from the calibration rows measured with
    `timing` (a contract timing string such as "cupti;l2=cold;eager", or "cpu-wall;l2=warm;eager;threads=8"; None:
    this process's method). A metric none of whose set is in the ledger is absent; a `db` that names no ledger raises
    LedgerPathError, as every read does (a mistyped path must not read as "never calibrated")."""
    from .ledger import Ledger, ledger_path

    device = lookup_any(backend).device
    base = BASE_BACKEND[device]
    own = ledger is None
    if own:
        ledger = Ledger.open(ledger_path(db), readonly=True)
    try:
        out, views = [], {}  # a table's view serves each set it is in (a view's make costs ~0.5 ms)
        for s in CEILING_SETS[device]:
            found, timings = [], set()  # (table, row) of each member with an ok row
            for table, specs in _by_table(s.members).items():
                entry = _entry(table, base, timing)
                timings.add(entry.contract.timing)
                if table not in views:
                    views[table] = ledger.view(table, base, gpu_key, entry.contract, entry.args)
                found += [(table, row) for row in views[table].get_many(specs)
                          if row.status == "ok" and row.metrics and (row.metrics.get(s.metric) or 0) > 0]
            if not found:
                continue
            events = [ledger.event(row.event_id) for _t, row in found]
            scales = [_clock_scale(e) if s.metric == "tflops" else None for e in events]
            values = [row.metrics[s.metric] * (k or 1.0) for (_t, row), k in zip(found, scales)]
            i = max(range(len(found)), key=values.__getitem__)
            best_table, best = found[i]
            rows = tuple({"table": t, "spec": dict(row.spec), "value": row.metrics[s.metric], "citation": row.citation,
                          **({"at_max_clock": v} if k else {})}
                         for (t, row), k, v in zip(found, scales, values))
            method = _method(s, ";".join(sorted(timings)), found, [e for e in events if e is not None],
                             (best_table, best), scaled=[k for k in scales if k])
            out.append(Ceiling(s.metric, values[i], best_table, dict(best.spec), best.citation,
                               tuple({"table": t, "spec": dict(x)} for t, x in s.members), rows, method, s.dtype))
        return out
    finally:
        if own:
            ledger.close()


def elsewhere(backend: str, gpu_key: str, ledger, timing: str | None = None) -> list[str]:
    """The timings (and revisions) of `gpu_key`'s calibration rows that `timing` reads stale: no ceiling under it."""
    device, seen = lookup_any(backend).device, set()
    for table, specs in _by_table(m for s in CEILING_SETS[device] for m in s.members).items():
        entry = _entry(table, BASE_BACKEND[device], timing)
        seen.update((r.provenance.timing, r.provenance.profiler_revision) for r in ledger.view(
            table, BASE_BACKEND[device], gpu_key, entry.contract, entry.args).get_many(specs) if r.status == "stale")
    return [f"{t} (profiler revision {n})" for t, n in sorted(seen)]


def _label(table: str, spec: dict) -> str:
    if "bytes" in spec:
        b = spec["bytes"]
        size = f"{b / (1 << 30):g} GiB" if b >= 1 << 30 else f"{b / (1 << 20):g} MiB"
        return f"{table} {size}"
    if all(a in spec for a in ("m", "n", "k")):
        return f"{table} " + "x".join(str(spec[a]) for a in ("m", "n", "k"))
    return f"{table} " + ",".join(f"{k}={v}" for k, v in spec.items() if k != "dtype")


def _span(values: list[float]) -> list[float] | None:
    return [min(values), max(values)] if values else None


def _clock_scale(event) -> float | None:
    """The device's max SM clock over the SM clock the row was timed at (>= 1), or None where the row does not
    say both (the CPU; rows timed without the state protocol's readings and without telemetry).

    Why the arithmetic ceiling is scaled to the max clock: the large GEMMs of the set run at the power cap,
    whose clock swings from row to row and pass to pass (1395-1980 MHz on an H200), so a maximum taken at the
    clocks they happened to get is not a bound: a long-k GEMM measured a moment nearer boost read 103 % of it.
    Throughput per clock is the shape's own; times the max clock it is what no row of that efficiency can
    pass, whatever its clock."""
    env = getattr(event, "environment", None)
    if env is None:
        return None
    top = env.clocks.get("sm_max_mhz")
    timed = None
    try:  # the SM clock its timed calls ran at, where its method says it (a Failed event has none)
        timed = float(event.method.notes.get("timed_sm_mhz_median", ""))
    except (AttributeError, ValueError):
        pass
    timed = timed or env.clocks.get("sm_mhz_median")
    if not top or not timed or timed <= 0:
        return None
    return max(1.0, top / timed)


def _method(s: CeilingSet, timing: str, found: list, events: list, best: tuple, scaled: list | None = None) -> dict:
    """How a ceiling's rows were measured, from their events: timing, the range over the rows of each clock
    and power reading their environments hold, every throttle reason seen, the stop reasons."""
    clocks: dict[str, list[float]] = {}
    throttle, stops, limits, timers, loads, busy = set(), set(), set(), set(), [], 0
    for e in events:
        env = getattr(e, "environment", None)
        if env is not None:
            for k, v in env.clocks.items():
                clocks.setdefault(k, []).append(v)
            throttle.update(env.throttle)
            if env.power_limit_w is not None:
                limits.add(env.power_limit_w)
        m = getattr(e, "method", None)
        if m is not None:
            stops.add(m.stop_reason)
            timers.add(f"{m.timer};l2={m.l2};{'graph' if m.graph else 'eager'}")
            try:  # a CPU row's host load: other work on the host slows every sample alike
                loads.append(float(m.notes["host_load_1m"]))
            except (KeyError, ValueError):
                pass
            busy += "host_busy" in m.notes
    measured = [(t, dict(row.spec)) for t, row in found]
    out = {"set": f"max of {s.metric} over {s.about}: {', '.join(_label(t, x) for t, x in s.members)}",
           "measured": len(found), "of": len(s.members),
           "missing": [{"table": t, "spec": dict(x)} for t, x in s.members if (t, x) not in measured],
           "at": _label(best[0], best[1].spec), "timing": timing, "timers_seen": sorted(timers),
           "clocks": {k: _span(v) for k, v in sorted(clocks.items())}, "throttle": sorted(throttle),
           "power_limit_w": sorted(limits), "stop_reasons": sorted(stops)}
    if loads:
        out["host_load_1m"], out["host_busy"] = _span(loads), busy
    moved = [b for _t, row in found for b in [_bytes(row.metrics or {}, s.metric)] if b]
    if moved:
        out["bytes_per_call"] = _span(moved)
    if scaled:
        top = sorted(clocks.get("sm_max_mhz", []))
        out["clock_scaled"] = (f"{len(scaled)} of {len(found)} rows' {s.metric} x the max SM clock"
                               f"{f' ({top[-1]:.0f} MHz)' if top else ''} / the SM clock each was timed at "
                               f"(x{min(scaled):.3f}-{max(scaled):.3f})")
    out["summary"] = _summary(out)
    return out


def _summary(m: dict) -> str:
    """The method in one line, e.g. "max over 6/6 shapes (at single_gemm 4096x4096x4096); cupti;l2=cold;eager;
    SM 1530-1980 MHz; 640-700 W; throttle power_cap"."""
    parts = [f"max over {m['measured']}/{m['of']} shapes (at {m['at']})", m["timing"]]
    if m.get("clock_scaled"):
        parts[0] += ", scaled to the max SM clock"
    c = m["clocks"]
    sm = [v for k, i in (("sm_mhz_min", 0), ("sm_mhz_max", 1)) if c.get(k) for v in [c[k][i]]]
    if sm:
        parts.append(f"SM {min(sm):.0f}-{max(sm):.0f} MHz")
    if c.get("power_w_mean"):
        lo, hi = c["power_w_mean"]
        parts.append(f"{lo:.0f}-{hi:.0f} W")
    if m["throttle"]:
        parts.append("throttle " + ",".join(m["throttle"]))
    if m.get("host_load_1m"):
        lo, hi = m["host_load_1m"]
        busy = f", busy over {m['host_busy']} row(s)" if m["host_busy"] else ""
        parts.append(f"host load {lo:.2f}-{hi:.2f}{busy}")
    return "; ".join(parts)


def applicable(found: list[Ceiling], dtype: str | None) -> dict[str, Ceiling]:
    """metric -> the ceiling bounding a row of `dtype`: the one of its dtype where found, else the one of none."""
    out: dict[str, Ceiling] = {}
    for c in found:
        if c.dtype is None and c.metric not in out or c.dtype is not None and c.dtype == dtype:
            out[c.metric] = c
    return out


def fractions(metrics: dict | None, found: list[Ceiling], dtype: str | None = None) -> dict[str, float] | None:
    """A compute row's fraction of each ceiling that bounds its dtype (None when the row has no metrics or no
    ceiling exists). A fraction above 1 is returned as it is: the row beat the calibration set."""
    if not metrics or not found:
        return None
    return _shares(metrics, applicable(found, dtype))


def _shares(metrics: dict, by: dict[str, Ceiling]) -> dict[str, float] | None:
    out = {metric: metrics[metric] / c.value for metric, c in by.items() if metrics.get(metric) is not None}
    return out or None


def annotate(results: list[dict], found: list[Ceiling], db: str | None = None) -> None:
    """Adds `ceiling` to each ok row (a query result document) that has a metric with a ceiling: fractions, each
    ceiling's value and citation, how each was measured, and, when a fraction exceeds 1, `above_ceiling: true`
    with `why` (see the module docstring), whose commands name the ledger `db`. A row with no ceiling is as it was."""
    if not found:
        return
    for doc in results:
        by = applicable(found, (doc.get("spec") or {}).get("dtype"))
        share = _shares(doc["metrics"], by) if doc.get("status") == "ok" and doc.get("metrics") else None
        if share is None:
            continue
        ceiling = {"fraction": share, "values": {m: by[m].value for m in share},
                   "citations": {m: by[m].citation for m in share},
                   "method": {m: (by[m].method or {}).get("summary", "") for m in share}}
        above = {m: _why(doc, by[m], db) for m, v in share.items() if v > 1.0}
        if above:
            ceiling["above_ceiling"] = True
            ceiling["why"] = above
        doc["ceiling"] = ceiling


def _why(doc: dict, c: Ceiling, db: str | None) -> str:
    """Why a row may beat the ceiling `c`, from what the row and the ceiling say: a set measured in part, a dtype
    the set does not hold, a working set smaller than any of the set's (a cache serves it), else a state other
    than the calibration's; each with what to do."""
    method, prov = c.method or {}, doc.get("provenance") or {}
    # the command as it runs here, on ledger db under the row's method (without --backend it measures a CUDA GPU)
    again = f"`{measure_command('calibrate', prov.get('backend') or BASE_BACKEND['cuda'], db, prov.get('timing'))}"
    if method.get("measured", 0) < method.get("of", 0):
        return (f"the ceiling is the max over {method['measured']} of its {method['of']} shapes; {again}` measures "
                f"the rest")
    dtype = (doc.get("spec") or {}).get("dtype")
    held = sorted({x["spec"]["dtype"] for x in c.shapes if "dtype" in x["spec"]})
    if c.metric == "tflops" and dtype and held and dtype not in held:
        return (f"a {dtype} row, bounded by the ceiling of {'/'.join(held)} GEMMs: no calibration set is of "
                f"{dtype}, whose arithmetic may run faster")
    moved, least = _bytes(doc.get("metrics") or {}, c.metric), (method.get("bytes_per_call") or [None])[0]
    if moved is not None and least and moved < least:
        warm = "l2=warm" in (prov.get("timing") or "")
        return (f"moves {_size(moved)} a call, less than any row of the set ({_size(least)}): a cache can serve a "
                f"working set that small{', and this row is timed with warm caches' if warm else ''}; the ceiling "
                f"is memory's")
    return (f"faster than every row of the set as it was measured ({method.get('summary', c.citation)}): the set "
            f"was measured in another state (clocks, power, other work on the host), or does not hold a shape "
            f"this fast; {again} --force` measures it again")


def _bytes(metrics: dict, metric: str) -> float | None:
    """Bytes a call moves, from a row's bandwidth and time (None: not a bandwidth, or not both given)."""
    if metric != "memory_bandwidth_gbps" or not metrics.get(metric) or not metrics.get("time_ms"):
        return None
    return metrics[metric] * metrics["time_ms"] * 1e6


def _size(n: float) -> str:
    return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.3g} MiB"
