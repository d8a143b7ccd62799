"""Energy per call from NVML's total-energy counter. Public through `kprof.measure.nvml`.

The counter (mJ) advances in steps about 98 ms apart, so one call's energy cannot be read off it.
`measure_energy` runs the callable back to back for a window of several steps, times each step from a
polling thread, and fits the counter against host time: the slope is the mean power, and
power x (window / calls) is the energy of one call.
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from typing import Callable, NamedTuple, Sequence

import msgspec

from ..errors import UsageError

__all__ = ["EnergyResult", "TickPoint", "tick_points", "steady_points", "fit_power", "measure_energy"]


class EnergyResult(msgspec.Struct, frozen=True):
    """Energy of one call, from NVML's energy counter over a back-to-back window.

    `rel_uncertainty` is a one-sigma relative uncertainty of `j_per_call` (and `power_w`) from reading the
    counter (its steps' timing, the fit's residuals); the board sensor's own calibration is not in it. `method`:
    "nvml-energy-fit" (least-squares slope over the counter's steps, the default), "nvml-energy-ticks"
    (two ticks only: a window too short for a fit), "nvml-energy-2read" (counter read at the window's two
    ends; quantized by one step at each end). `two_read_j_per_call` is that plain reading, kept as a check.
    """

    j_per_call: float
    calls: int
    window_s: float
    power_w: float
    rel_uncertainty: float
    method: str
    ticks: int = 0  # counter steps ("ticks") timed inside the window
    tick_s: float | None = None  # median time between ticks
    two_read_j_per_call: float | None = None


class TickPoint(NamedTuple):
    t: float  # host time of the step: the middle of the two polls around it
    mj: int  # counter value just after the step
    width: float  # seconds between those two polls: the step lies somewhere inside


def tick_points(polls: Sequence[tuple[float, int]], t0: float, t1: float, max_width: float = 0.02) -> list[TickPoint]:
    """The counter's steps inside [t0, t1] from (host time, counter mJ) polls. A step whose polls are more
    than `max_width` apart (the poller was starved) is timed too loosely to use and is dropped."""
    out = []
    for (ta, ca), (tb, cb) in zip(polls, polls[1:]):
        mid = (ta + tb) / 2
        if cb != ca and t0 <= mid <= t1 and tb - ta <= max_width:
            out.append(TickPoint(mid, cb, tb - ta))
    return out


def steady_points(points: Sequence[TickPoint], tolerance: float = 0.02) -> list[TickPoint]:
    """`points` without a leading ramp: while the power of the first interval (between two steps) differs
    from the median interval power by more than `tolerance` or by four robust sigmas of the interval powers
    (their spread comes from the timing of the steps), that first point is dropped; at most a third are."""
    if len(points) < 4:
        return list(points)
    powers = [(b.mj - a.mj) / (b.t - a.t) for a, b in zip(points, points[1:])]
    med = statistics.median(powers)
    mad = statistics.median(abs(p - med) for p in powers)
    tol = max(tolerance, 4 * 1.4826 * mad / med)
    start = 0
    while start < len(points) // 3 and abs(powers[start] / med - 1) > tol:
        start += 1
    return list(points[start:])


def fit_power(points: Sequence[TickPoint]) -> tuple[float, float]:
    """(mean power in W, its one-sigma relative uncertainty) from the least-squares slope of counter (mJ)
    against time over two or more steps. The uncertainty is the slope's standard error from the residuals,
    floored by what the timing of the steps alone allows (each lies uniformly inside its poll interval)."""
    n = len(points)
    if n < 2:
        raise ValueError(f"a power fit needs at least 2 counter steps, got {n}")
    tm = math.fsum(p.t for p in points) / n
    ym = math.fsum(p.mj for p in points) / n
    sxx = math.fsum((p.t - tm) ** 2 for p in points)
    if sxx <= 0:
        raise ValueError("the counter steps are not spread in time")
    slope = math.fsum((p.t - tm) * (p.mj - ym) for p in points) / sxx  # mJ/s = mW
    if slope <= 0:
        raise ValueError(f"the energy counter did not advance ({slope:.3g} mW)")
    sigma_t = math.sqrt(math.fsum(p.width ** 2 for p in points) / n / 12)  # uniform inside the poll interval
    timing = slope * sigma_t / math.sqrt(sxx)
    if n > 2:
        resid = math.fsum((p.mj - ym - slope * (p.t - tm)) ** 2 for p in points)
        stderr = math.sqrt(resid / (n - 2) / sxx)
    else:
        stderr = 0.0
    return slope / 1000, max(stderr, timing) / slope


def measure_energy(fn: Callable[[], object], *, seconds: float = 1.0, sync: Callable[[], object] | None = None,
                   index: int = 0, warmup_s: float = 0.25, method: str = "fit", poll_s: float = 0.002,
                   chunk_s: float = 0.05, counter: Callable[[], int] | None = None) -> EnergyResult:
    """Energy per call of `fn` on CUDA device `index`, run back to back.

    `fn` enqueues one call; `sync` waits for the device (torch.cuda.synchronize when None, the only case
    that imports torch). `fn` is run for `warmup_s` to reach the steady (e.g. power-capped) state, then for
    a window of at least `seconds`, in chunks of about `chunk_s` with a `sync` after each so that host time
    tracks the device. A thread polls the counter every `poll_s`. `method` "fit": the least-squares slope
    of the counter over the steps timed inside the window (less a leading ramp, see `steady_points`) is
    the mean power, and power x window / calls is the energy of one call. "two_read": the two readings at
    the window's ends instead. `counter` replaces NVML's counter (a callable returning mJ) for tests.

    Steady state is the caller's to provide: an `fn` whose power drifts over the window gets its mean.
    Allow at least 3 counter steps (seconds >= 0.3); ~1 s keeps the fit's uncertainty well under 1%.
    """
    if method not in ("fit", "two_read"):
        raise UsageError(f"unknown energy method {method!r}; use 'fit' or 'two_read'")
    if not seconds > 0:
        raise UsageError(f"the energy window must be positive, got {seconds} s")
    from ._nvml_access import NvmlError, _energy_counter

    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    if counter is None:
        counter = _energy_counter(index)

    def read() -> int:  # on the main thread: a failing counter is an NvmlError, a failing fn is itself
        try:
            return counter()
        except Exception as e:
            raise NvmlError(f"reading the energy counter failed: {e}") from e

    polls: list[tuple[float, int]] = []
    failure: list[BaseException] = []
    stop = threading.Event()

    def poll() -> None:
        try:
            while True:
                polls.append((time.perf_counter(), counter()))  # time taken just before the read
                if stop.wait(poll_s):
                    return
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)

    # The poller needs the GIL to timestamp a read; with the default 5 ms switch interval a host-bound fn
    # would delay it by up to 5 ms, widening the interval each step is known to lie in.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, 0.0005))
    thread = threading.Thread(target=poll, name="kprof-energy", daemon=True)
    thread.start()
    try:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        per_chunk = max(1, int(chunk_s / max(time.perf_counter() - t, 1e-7)))
        done, t = 0, time.perf_counter()
        while time.perf_counter() - t < warmup_s:
            for _ in range(per_chunk):
                fn()
            sync()
            done += per_chunk
        if done:  # the first call may have paid one-time setup: size chunks from the warm calls
            per_chunk = max(1, int(chunk_s * done / (time.perf_counter() - t)))
        c0, t0, calls = read(), time.perf_counter(), 0
        while True:
            for _ in range(per_chunk):
                fn()
            sync()
            calls += per_chunk
            if time.perf_counter() - t0 >= seconds:
                break
        t1, c1 = time.perf_counter(), read()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    if failure:
        raise NvmlError(f"reading the energy counter failed: {failure[0]}") from failure[0]

    window = t1 - t0
    if c1 <= c0:
        raise NvmlError(f"the energy counter did not advance over {window:.2f} s; it steps about every 0.1 s, "
                        f"so check that the device is the one {fn!r} runs on")
    points = steady_points(tick_points(polls, t0, t1, max_width=max(0.02, 10 * poll_s)))
    gaps = [b.t - a.t for a, b in zip(points, points[1:])]
    tick_s = statistics.median(gaps) if gaps else None
    two_read_w = (c1 - c0) / window / 1000
    if method == "fit" and len(points) >= 2:
        power, rel = fit_power(points)
        name = "nvml-energy-fit" if len(points) >= 3 else "nvml-energy-ticks"
    else:
        # Each reading lags the true energy by 0..one step: the difference of two uniforms, sigma = step/sqrt(6).
        power, rel = two_read_w, (tick_s or 0.1) / math.sqrt(6) / window
        name = "nvml-energy-2read"
    return EnergyResult(j_per_call=power * window / calls, calls=calls, window_s=window, power_w=power,
                        rel_uncertainty=rel, method=name, ticks=len(points), tick_s=tick_s,
                        two_read_j_per_call=two_read_w * window / calls)
