"""What the NVML telemetry of a `measure` window says (kprof.measure.diagnostic): sampling coverage, clocks, power
and temperature at the window's edges, time under each clock-event reason, and energy per launch. Pure, as the
rest of the diagnostic's summary: recorded samples in, plain dicts out."""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from ._nvml_telemetry import TelemetrySample
from ._reasons import decode_reasons

__all__ = ["EDGE", "telemetry_summary", "reason_labels", "throttle_time", "energy_summary"]

EDGE = 0.1  # drift and the clocks' first / last compare the first and the last 10 % of the window


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


_SHORT_S = 0.2  # a window not much longer than one of the counter's ~0.1 s steps may see none of them


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
    if e1 <= e0:  # no energy at all is not what the GPU drew
        if e1 < e0:
            why = (f"the energy counter went back over the {seconds:.2f} s window, from {e0} to {e1} mJ: NVML's "
                   f"counter was reset (a driver reload, a GPU reset) while the window ran; measure again")
        elif seconds < _SHORT_S:  # a healthy counter may not step at all in a window this short
            why = (f"the energy counter did not step over the {seconds:.2f} s window ({e0} mJ): it steps about "
                   f"every 0.1 s, too seldom for a window this short; a window of 1 s or more (--duration-s) "
                   f"holds ten steps")
        else:
            why = (f"the energy counter did not advance over the {seconds:.2f} s window ({e0} to {e1} mJ); it "
                   f"steps about every 0.1 s, so NVML's counter is not working on this GPU")
        return {"joules": None, "j_per_launch": None, "power_w": None, "rel_uncertainty_max": None, "error": why}
    joules = (e1 - e0) / 1e3
    tick = _tick_s(samples) or 0.1
    return {"joules": joules, "j_per_launch": joules / launches if launches else None,
            "power_w": joules / seconds if seconds > 0 else None, "window_s": seconds, "counter_step_s": tick,
            "rel_uncertainty_max": tick / seconds if seconds > 0 else None,
            "method": "nvml total-energy counter read at the window's two ends; includes each launch's sweep and "
                      "activation rewrite (cold L2) and the GPU's idle time between launches"}
