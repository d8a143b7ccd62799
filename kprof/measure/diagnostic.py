"""The `measure` diagnostic: one sustained CUPTI window of a kernel's launches beside NVML telemetry, its summary,
and the read-only artifacts it leaves (runtimes.csv, telemetry.csv, summary.json, two plots).

Everything here is pure: the window is recorded on the GPU by `kprof.measure._diagnostic_window` (torch, CUPTI,
NVML), which hands over plain records; this module turns them into statistics and files, so CI tests every rule
on recorded data. Nothing here reads or writes the ledger: the comparison with a ledger row arrives as a dict.

    launches = segment(kernels, prefix_names, call_names, t0_ns)   # CUPTI kernel tuples -> one Launch per call
    summary = summarize_window(window, header)                     # statistics, drift, throttle, energy, coverage

The telemetry's part of the summary (coverage, throttle time, energy) is kprof.measure._diagnostic_telemetry.

The artifacts and their citations are kprof.measure.diagnostic_files (`write_outputs`, `find_artifact`).

A citation `kmeasure.<16 hex>` is the start of the blake3 digest of an artifact's bytes: summary.json lists the
citation of every other artifact (and its full digest), and summary.json's own citation is that of its bytes.
"""

from __future__ import annotations

import math
import numbers
import re
import statistics
from array import array
from bisect import bisect_left
from operator import itemgetter
from typing import NamedTuple, Sequence

from ..errors import KprofError, SettingError
from ._attribution import TimerError
from ._diagnostic_telemetry import EDGE, energy_summary, telemetry_summary, throttle_time
from ._nvml_telemetry import TelemetrySample
from .stats import quantile

__all__ = ["FORMAT", "ARTIFACTS", "TOKEN_PREFIX", "DiagnosticError", "Launches", "Window", "segment",
           "check_window_args", "check_output_dir", "launch_stats", "drift", "compare_row", "summarize_window",
           "MAX_DURATION_S", "MAX_TELEMETRY_HZ"]

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
STAGING = ".measure-"  # the outputs are written in a staging folder inside --output-dir whose name starts so
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

    def number(value, name, example) -> float:  # numpy's numbers too (np.int64(5) is a number), not a bool
        if type(value).__name__ in ("bool", "bool_") or not isinstance(value, numbers.Real):
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
