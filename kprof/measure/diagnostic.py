"""The `measure` diagnostic: one sustained CUPTI window of a kernel's launches beside NVML telemetry, its summary,
and the read-only artifacts it leaves (runtimes.csv, telemetry.csv, summary.json, two plots).

Everything here is pure: the window is recorded on the GPU by `kprof.measure._diagnostic_window` (torch, CUPTI,
NVML), which hands over plain records; this module turns them into statistics and files, so CI tests every rule
on recorded data. Nothing here reads or writes the ledger: the comparison with a ledger row arrives as a dict.

    launches = segment(kernels, prefix_names, call_names, t0_ns)   # CUPTI kernel tuples -> one Launch per call
    summary = summarize_window(window, header)                     # statistics, drift, throttle, energy, coverage

The artifacts and their citations are kprof.measure.diagnostic_files (`write_outputs`, `find_artifact`).

A citation `kmeasure.<16 hex>` is the start of the blake3 digest of an artifact's bytes: summary.json lists the
citation of every other artifact (and its full digest), and summary.json's own citation is that of its bytes.
"""

from __future__ import annotations

import math
import re
import statistics
from array import array
from bisect import bisect_left
from operator import itemgetter
from typing import NamedTuple, Sequence

from ..errors import KprofError, SettingError, UsageError
from ._attribution import TimerError
from ._nvml_telemetry import TelemetrySample
from ._reasons import decode_reasons
from .stats import quantile

__all__ = ["FORMAT", "ARTIFACTS", "TOKEN_PREFIX", "DiagnosticError", "Launches", "Window", "segment",
           "check_window_args", "check_output_dir", "launch_stats", "drift", "telemetry_summary", "throttle_time",
           "energy_summary", "compare_row", "summarize_window", "MAX_DURATION_S", "MAX_TELEMETRY_HZ"]

FORMAT = 1  # summary.json's "format"; a newer one is refused by find_artifact
TOKEN_PREFIX = "kmeasure."
TOKEN_HEX = 16  # hex digits of a citation, as kprof.* citations
MAX_DURATION_S = 3600.0
MAX_TELEMETRY_HZ = 1000.0  # one NVML round of six queries takes ~0.3-1 ms: faster asks the driver more than it answers
# name -> what it holds, in the order they are written (summary.json last: it lists the others' citations)
ARTIFACTS = {
    "runtimes.csv": "per-launch kernel time: launch, start_ns, end_ns, duration_ns, idle_before_ns (CUPTI, ns from "
                    "the window's zero; idle: GPU idle since the previous launch, the sweep excluded)",
    "telemetry.csv": "NVML telemetry: t_s, sm_mhz, mem_mhz, power_w, temp_c, util_pct, reasons, reason_labels, "
                     "energy_mj, read_ms",
    "durations.png": "plot: each launch's kernel time over the window, and the GPU's idle share between launches",
    "telemetry.png": "plot: power, SM and memory clocks, temperature and throttle reasons over the window",
    "summary.json": "summary: per-launch statistics, drift, throttle time by reason, power, energy per launch, "
                    "sampling coverage, the ledger row compared",
}
PLOTS = ("durations.png", "telemetry.png")
STAGING = ".measure-"  # the outputs are written in a staging folder inside --output-dir whose name starts so
EDGE = 0.1  # drift compares the first and the last 10 % of the window
DRIFT_BINS = 50


class DiagnosticError(KprofError):
    """The diagnostic could not measure (the kernel failed to build, check or run) or write its output: nothing
    was written."""


# --- records --------------------------------------------------------------------------------------------------

class Launches(NamedTuple):
    """One entry per launch of the timed callable, times in ns from the window's zero (CUPTI clock)."""

    start: array  # first kernel of the call starts
    end: array  # last kernel of the call ends
    duration: array  # kernel time: sum of (end - start) of the call's kernels (those kernel_filter matches)
    idle_before: array  # GPU idle time since the previous launch's last kernel, its own sweep excluded; 0 first


class Window(NamedTuple):
    """What `_diagnostic_window.record_window` recorded."""

    launches: Launches
    span_s: float  # first kernel start to last kernel end (all kernels, sweeps included)
    busy_ns: int  # kernel time of every kernel in the window (sweeps and activation rewrites included)
    samples: list[TelemetrySample]  # t from the window's zero, with energy_mj and read_ms; [] when telemetry was off
    telemetry_hz: float  # 0: off
    telemetry_errors: dict[str, str]
    energy: tuple[float, int, float, int] | None  # (t_s, mJ) at the window's two ends, or None without the counter
    kernels: tuple[str, ...]  # one invocation's kernels, in launch order
    prefix: tuple[str, ...]  # the kernels before each launch (sweep, activations), in launch order
    notes: dict[str, str]


# --- arguments --------------------------------------------------------------------------------------------------

def check_window_args(duration_s, telemetry_hz, *, allow_off: bool = False) -> tuple[float, float]:
    """(duration_s, telemetry_hz) as floats, or a SettingError worded for Python callers (`duration_s=0`) and for the
    verb (`--duration-s 0`). `allow_off`: telemetry_hz 0 turns the sampler off (the Python API's, for checking the
    sampler's own overhead; the CLI refuses it)."""
    def refuse(name: str, value, why: str, example: str):
        shown = f"{value:g}" if type(value) is float else repr(value)  # 0, not the 0.0 the flag's converter made
        return SettingError(f"{name}={shown} {why}; pass e.g. {name}={example}",
                            f"--{name.replace('_', '-')} {shown} {why}; pass e.g. --{name.replace('_', '-')} {example}")

    def number(value, name, example) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(name, value, "is not a number", example)
        return float(value)

    d = number(duration_s, "duration_s", "10")
    if not (math.isfinite(d) and 0 < d <= MAX_DURATION_S):
        raise refuse("duration_s", d, f"is not a window length in (0, {MAX_DURATION_S:g}] seconds", "10")
    hz = number(telemetry_hz, "telemetry_hz", "20")
    if allow_off and hz == 0:
        return d, 0.0
    if not (math.isfinite(hz) and 0 < hz <= MAX_TELEMETRY_HZ):
        raise refuse("telemetry_hz", hz, f"is not a sampling rate in (0, {MAX_TELEMETRY_HZ:g}] Hz", "20")
    return d, hz


def check_output_dir(path: str) -> None:
    """Refuses a directory the artifacts could not be written to, before any work; creates nothing. A directory
    that already holds a measure output is refused: outputs are immutable, like run snapshots. What a write killed
    before its end left (a staging folder, and the files it had renamed) is removed first: it is no output."""
    from .._outdir import check_output_dir as check, drop_unfinished

    drop_unfinished(path, STAGING, ARTIFACTS)
    check(path, ARTIFACTS, "a measure output")


# --- kernels -> launches -------------------------------------------------------------------------------------

def _short(names: Sequence[str]) -> str:
    return "[" + ", ".join(n if len(n) <= 80 else n[:80] + "…" for n in names) + "]"


def segment(kernels: list, prefix: Sequence[str], call: Sequence[str], t0_ns: int,
            pattern: re.Pattern | None = None) -> tuple[Launches, int, int]:
    """(launches, busy_ns, last_end_ns) from the window's CUPTI kernel tuples (name, start, end, correlation).

    The window runs on one stream with nothing else on the GPU, so its kernels, in start order, are the sequence
    `prefix + call` (the sweep and activation rewrite, then one invocation) repeated once per launch. Every
    repetition must name the same kernels in the same order: one that does not (a library that changed its launch
    sequence mid-window) is a TimerError naming the launch, never a guess. `pattern` picks the kernels a launch's
    duration sums (kernel_filter); the sequence check covers every kernel. Works column by column (position j of
    every launch at once): a 10 s window of a 3 µs kernel holds millions of launches."""
    expected = list(prefix) + list(call)
    size, skip = len(expected), len(prefix)
    if not call:
        raise TimerError("the timed callable launched no kernel in the warm-up; it must launch GPU work")
    ks = [k for k in kernels if k[1] >= t0_ns]
    ks.sort(key=itemgetter(1, 2))
    if len(ks) % size:
        raise TimerError(f"the window holds {len(ks)} kernels, not a whole number of launches of {size} "
                         f"({_short(expected)}); the callable's launch sequence changed during the window, or other "
                         f"work ran on this GPU")
    chosen = [j for j, name in enumerate(call, skip) if pattern is None or pattern.search(name)]
    if not chosen:
        raise TimerError(f"kernel_filter {pattern.pattern!r} matches none of the call's kernels {_short(call)}")
    columns = [ks[j::size] for j in range(size)]
    bad = [next((i for i, k in enumerate(col) if k[0] != name), None) for col, name in zip(columns, expected)]
    bad = [i for i in bad if i is not None]
    if bad:
        i = min(bad)
        names = [k[0] for k in ks[i * size:(i + 1) * size]]
        raise TimerError(f"launch {i} of the window ran {_short(names)}, not the warm-up's {_short(expected)}; "
                         f"the callable's launch sequence changed during the window")
    if not ks:
        return Launches(array("q"), array("q"), array("q"), array("q")), 0, 0
    durations = [e - s for _n, s, e, _c in columns[chosen[0]]]
    for j in chosen[1:]:
        durations = [d + e - s for d, (_n, s, e, _c) in zip(durations, columns[j])]
    prefix_ns = [0] * len(columns[0])
    for j in range(skip):
        prefix_ns = [p + e - s for p, (_n, s, e, _c) in zip(prefix_ns, columns[j])]
    call_starts = [k[1] for k in columns[skip]]
    lasts = [k[2] for k in columns[-1]]
    starts = array("q", [s - t0_ns for s in call_starts])
    ends = array("q", [e - t0_ns for e in lasts])
    # idle before a launch: from the previous launch's last kernel to this one's first call kernel, less this
    # launch's sweep and rewrite (on one stream nothing else ran in between)
    idle = array("q", [0] + [max(0, a - b - p) for a, b, p in zip(call_starts[1:], lasts, prefix_ns[1:])])
    busy = sum(k[2] - k[1] for k in ks)
    return Launches(starts, ends, array("q", durations), idle), busy, lasts[-1] - t0_ns


# --- statistics -------------------------------------------------------------------------------------------------

def launch_stats(values: Sequence[float]) -> dict:
    """n, median, mean, p1/p10/p90/p99, min, max, stdev and cv of the values (µs); None fields with none."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return {"n": 0, "median": None, "mean": None, "p1": None, "p10": None, "p90": None, "p99": None, "min": None,
                "max": None, "stdev": None, "cv": None}
    mean = math.fsum(xs) / n
    stdev = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "median": quantile(xs, 0.5), "mean": mean, "p1": quantile(xs, 0.01), "p10": quantile(xs, 0.1),
            "p90": quantile(xs, 0.9), "p99": quantile(xs, 0.99), "min": xs[0], "max": xs[-1], "stdev": stdev,
            "cv": stdev / mean if mean > 0 else 0.0}


def _ols(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def drift(times_s: Sequence[float], values: Sequence[float], bins: int = DRIFT_BINS) -> dict:
    """How the values (per-launch µs, `times_s` ascending) move over the window: the median of the first and of the
    last 10 % of the window's time (of its launches, with fewer than 20), their change in %, and the least-squares
    slope of per-bin medians (`bins` equal slices of time) against time, in µs/s and in % of the median per s."""
    n = len(values)
    out = {"first_median": None, "last_median": None, "pct": None, "slope_per_s": None, "slope_pct_per_s": None,
           "bins": 0}
    if n == 0:
        return out
    t_first, t_last = times_s[0], times_s[-1]
    span = t_last - t_first
    if n < 20 or span <= 0:
        k = max(1, round(n * EDGE))
        first, last = values[:k], values[-k:]
    else:
        first = values[:max(1, bisect_left(times_s, t_first + EDGE * span))]
        last = values[min(n - 1, bisect_left(times_s, t_last - EDGE * span)):]
    out["first_median"], out["last_median"] = statistics.median(first), statistics.median(last)
    if out["first_median"] > 0:
        out["pct"] = 100.0 * (out["last_median"] / out["first_median"] - 1)
    if span > 0 and n >= 2:
        cuts = [bisect_left(times_s, t_first + i * span / bins) for i in range(bins)] + [n]
        xs, ys = [], []
        for i in range(bins):
            if cuts[i + 1] > cuts[i]:
                xs.append(t_first + (i + 0.5) * span / bins)
                ys.append(statistics.median(values[cuts[i]:cuts[i + 1]]))
        slope = _ols(xs, ys)
        med = statistics.median(values)
        out["bins"] = len(xs)
        if slope is not None:
            out["slope_per_s"] = slope
            out["slope_pct_per_s"] = 100.0 * slope / med if med > 0 else None
    return out


def _inside(samples: Sequence[TelemetrySample], span_s: float) -> list[TelemetrySample]:
    return [s for s in samples if 0.0 <= s.t <= span_s]


def _col(samples: Sequence[TelemetrySample], name: str) -> list[float]:
    return [getattr(s, name) for s in samples if getattr(s, name) is not None]


def _edges(samples: Sequence[TelemetrySample], name: str, span_s: float) -> tuple[float | None, float | None]:
    """Median of the field over the first and the last 10 % of the window (the first / last reading when a slice
    holds none)."""
    have = [s for s in samples if getattr(s, name) is not None]
    if not have:
        return None, None
    first = [getattr(s, name) for s in have if s.t < EDGE * span_s] or [getattr(have[0], name)]
    last = [getattr(s, name) for s in have if s.t >= (1 - EDGE) * span_s] or [getattr(have[-1], name)]
    return statistics.median(first), statistics.median(last)


def telemetry_summary(samples: Sequence[TelemetrySample], span_s: float, hz: float) -> dict:
    """Sampling coverage (readings inside the window, the rate achieved, gaps longer than two periods and the
    share of the window they leave unsampled, NVML read time) and the clocks, power, temperature and utilization."""
    if hz <= 0:
        return {"off": True}
    inside = _inside(samples, span_s)
    ts = [s.t for s in inside]
    period = 1.0 / hz
    gaps = [b - a for a, b in zip(ts, ts[1:]) if b - a > 2 * period]
    # unsampled: time beyond one period in each gap, and at the window's ends
    unsampled = sum(g - period for g in gaps)
    if ts:
        unsampled += max(0.0, ts[0] - period) + max(0.0, span_s - ts[-1] - period)
    else:
        unsampled = span_s
    reads = [s.read_ms for s in inside if s.read_ms is not None]
    sm_first, sm_last = _edges(inside, "sm_mhz", span_s)
    mem_first, mem_last = _edges(inside, "mem_mhz", span_s)
    temp_first, temp_last = _edges(inside, "temp_c", span_s)

    def stats(name):
        xs = _col(inside, name)
        return (min(xs), statistics.median(xs), max(xs), math.fsum(xs) / len(xs)) if xs else (None,) * 4

    sm, mem, power, temp, util = (stats(k) for k in ("sm_mhz", "mem_mhz", "power_w", "temp_c", "util_pct"))
    return {
        "target_hz": hz,
        "samples": len(inside),
        "achieved_hz": (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else None,
        "gaps": {"threshold_s": 2 * period, "count": len(gaps), "max_s": max(gaps) if gaps else 0.0},
        "coverage_pct": 100.0 * max(0.0, 1 - unsampled / span_s) if span_s > 0 else 0.0,
        "read_ms": {"median": statistics.median(reads), "max": max(reads)} if reads else None,
        "sm_mhz": {"first": sm_first, "last": sm_last, "min": sm[0], "median": sm[1], "max": sm[2]},
        "mem_mhz": {"first": mem_first, "last": mem_last, "min": mem[0], "median": mem[1], "max": mem[2]},
        "power_w": {"mean": power[3], "max": power[2]},
        "temp_c": {"first": temp_first, "last": temp_last, "max": temp[2]},
        "util_pct_mean": util[3],
    }


def reason_labels(mask: int | None) -> list[str]:
    if mask is None:
        return ["unread"]
    return decode_reasons(mask) or ["none"]


def throttle_time(samples: Sequence[TelemetrySample], span_s: float) -> dict:
    """Seconds and % of the window under each clock-event reason, each reading held until the next one (the first
    reading also covers the window's start): {label: {"s", "pct"}}; "none" is no reason set, "unread" a reading
    NVML refused. A stretch under two reasons counts for both."""
    ordered = sorted(samples, key=lambda s: s.t)
    if not ordered or span_s <= 0:
        return {}
    totals: dict[str, float] = {}
    for i, s in enumerate(ordered):
        a = 0.0 if i == 0 else max(0.0, s.t)
        b = ordered[i + 1].t if i + 1 < len(ordered) else span_s
        a, b = max(a, 0.0), min(b, span_s)
        if b <= a:
            continue
        for label in reason_labels(s.reasons):
            totals[label] = totals.get(label, 0.0) + (b - a)
    return {k: {"s": v, "pct": 100.0 * v / span_s} for k, v in sorted(totals.items())}


def _tick_s(samples: Sequence[TelemetrySample]) -> float | None:
    """The energy counter's step, as the readings show it: the median time between readings at which it moved
    (an upper bound when the sampler is slower than the counter)."""
    moved = [b.t for a, b in zip(samples, samples[1:]) if a.energy_mj is not None and b.energy_mj is not None
             and b.energy_mj != a.energy_mj]
    steps = [b - a for a, b in zip(moved, moved[1:])]
    return statistics.median(steps) if steps else None


def energy_summary(energy: tuple[float, int, float, int] | None, launches: int, samples: Sequence[TelemetrySample],
                   error: str | None = None) -> dict:
    """Energy per launch from NVML's total-energy counter read at the window's two ends: the GPU's energy over
    the window over its launches. Each reading is up to one counter step (~0.1 s of power) old, so the relative
    error is at most step / window."""
    if energy is None:
        return {"joules": None, "j_per_launch": None, "power_w": None, "rel_uncertainty_max": None,
                "error": error or "no energy counter reading"}
    t0, e0, t1, e1 = energy
    seconds = t1 - t0
    joules = (e1 - e0) / 1e3
    tick = _tick_s(samples) or 0.1
    return {"joules": joules, "j_per_launch": joules / launches if launches else None,
            "power_w": joules / seconds if seconds > 0 else None, "window_s": seconds, "counter_step_s": tick,
            "rel_uncertainty_max": tick / seconds if seconds > 0 else None,
            "method": "nvml total-energy counter read at the window's two ends; includes each launch's sweep and "
                      "activation rewrite (cold L2) and the GPU's idle time between launches"}


def summarize_window(window: Window, header: dict, ledger: dict | None = None) -> dict:
    """summary.json's document (without the artifacts' citations, which `write_outputs` adds): `header` holds who
    and what (table, backend, spec, gpu, mode, device environment, versions), `ledger` the row compared."""
    la = window.launches
    n = len(la.duration)
    durations = [d / 1e3 for d in la.duration]
    starts = [s / 1e9 for s in la.start]
    idle = [g / 1e3 for g in la.idle_before[1:]] if n > 1 else []
    timed_ns = sum(la.duration)
    span = window.span_s
    gpu = {
        "busy_pct": 100.0 * window.busy_ns / (span * 1e9) if span > 0 else None,
        "timed_pct": 100.0 * timed_ns / (span * 1e9) if span > 0 else None,
        "idle_between_launches_us": None,
    }
    if idle:
        gaps = launch_stats(idle)
        gpu["idle_between_launches_us"] = {k: gaps[k] for k in ("median", "p90", "max")}
    stats = launch_stats(durations)
    doc = dict(header)
    doc.update({
        "format": FORMAT,
        "window": {"span_s": span, "launches": n, "launches_per_s": n / span if span > 0 else None,
                   "kernels_per_launch": len(window.kernels), "kernels": list(window.kernels),
                   "prefix_kernels": list(window.prefix)},
        "launch_us": stats,
        "drift": drift(starts, durations),
        "gpu": gpu,
        "telemetry": telemetry_summary(window.samples, span, window.telemetry_hz),
        "throttle": throttle_time(window.samples, span) if window.telemetry_hz > 0 else {},
        "energy": energy_summary(window.energy, n, window.samples, window.telemetry_errors.get("energy")),
        "telemetry_errors": dict(window.telemetry_errors),
        "ledger": compare_row(ledger, stats) if ledger is not None else {"compared": False,
                                                                         "why": "no ledger row was looked up"},
        "notes": dict(window.notes),
    })
    return doc


def compare_row(ledger: dict, stats: dict) -> dict:
    """The ledger row (`{"compared": True, "time_ms", ...}` as the caller read it) beside the window: the window's
    median over the row's time, and whether the row's time lies inside the window's p10-p90."""
    out = dict(ledger)
    if not out.get("compared") or out.get("time_ms") is None or stats.get("median") is None:
        return out
    row_us = out["time_ms"] * 1e3
    out.update(window_median_us=stats["median"], window_mean_us=stats["mean"],
               window_over_row=stats["median"] / row_us if row_us > 0 else None,
               row_inside_window_p10_p90=bool(stats["p10"] <= row_us <= stats["p90"]))
    return out
