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
from ._nvml_access import NvmlError, _energy_counter

__all__ = ["EnergyResult", "TickPoint", "CounterPolls", "tick_points", "steady_points", "fit_power", "measure_energy",
           "settled_energy"]


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
    fit_from_s: float | None = None  # where the fit began, seconds into the window (settled_energy)


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


class CounterPolls:
    """A thread reading the energy counter every `poll_s` while the caller runs work: `polls` holds (host time just
    before the read, counter mJ). A failing counter is an NvmlError when the block ends. The interpreter's switch
    interval is lowered meanwhile: with the default 5 ms a host-bound caller would delay the poller by up to 5 ms,
    widening the interval each counter step is known to lie in."""

    def __init__(self, counter: Callable[[], int], poll_s: float = 0.002):
        self.counter, self.poll_s = counter, poll_s
        self.polls: list[tuple[float, int]] = []
        self._failure: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kprof-energy", daemon=True)

    def _poll(self) -> None:
        try:
            while True:
                self.polls.append((time.perf_counter(), self.counter()))
                if self._stop.wait(self.poll_s):
                    return
        except BaseException as e:  # noqa: BLE001 - reported when the block ends
            self._failure.append(e)

    def read(self) -> int:
        """The counter read on the calling thread (an NvmlError where it fails)."""
        try:
            return self.counter()
        except Exception as e:
            raise NvmlError(f"reading the energy counter failed: {e}") from e

    def __enter__(self) -> "CounterPolls":
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, 0.0005))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        if self._failure and exc[0] is None:
            raise NvmlError(f"reading the energy counter failed: {self._failure[0]}") from self._failure[0]


_TICK_S = 0.1  # NVML's energy counter steps about this often (98 ms on an H200)


class _Power(NamedTuple):
    power_w: float
    rel: float
    method: str
    points: list[TickPoint]  # the steady steps the fit used
    tick_s: float | None


def _power(polls: CounterPolls, t0: float, t1: float, c0: int, c1: int, method: str = "fit") -> _Power:
    """Mean power over [t0, t1] from the counter's steps polled inside it (less a leading ramp), or from the two
    readings c0, c1 at its ends (method "two_read", or fewer than two steps)."""
    if c1 < c0:
        raise NvmlError(f"the energy counter went back over {t1 - t0:.2f} s, from {c0} to {c1} mJ: NVML's counter was "
                        f"reset (a driver reload, a GPU reset) while the calls ran; measure again")
    if c1 == c0:
        raise NvmlError(f"the energy counter did not advance over {t1 - t0:.2f} s; it steps about every 0.1 s, "
                        f"so check that the device is the one the calls run on")
    points = steady_points(tick_points(polls.polls, t0, t1, max_width=max(0.02, 10 * polls.poll_s)))
    gaps = [b.t - a.t for a, b in zip(points, points[1:])]
    tick_s = statistics.median(gaps) if gaps else None
    if method == "fit" and len(points) >= 2:
        power, rel = fit_power(points)
        return _Power(power, rel, "nvml-energy-fit" if len(points) >= 3 else "nvml-energy-ticks", points, tick_s)
    window = t1 - t0
    stepped = sum(1 for (ta, ca), (tb, cb) in zip(polls.polls, polls.polls[1:]) if cb != ca and ta < t1 and tb > t0)
    if method == "fit" and stepped < 2 and window >= 5 * _TICK_S:
        # One step in a window of five: the two readings hold up to a whole step of energy too little or too much
        raise NvmlError(f"the energy counter stepped {stepped} time(s) in {window:.2f} s, where NVML's steps about "
                        f"every {_TICK_S} s: too few to measure energy (a counter that stalls, or steps more slowly on "
                        f"this GPU); a longer window holds more steps")
    # Each reading lags the true energy by 0..one step: the difference of two uniforms, sigma = step/sqrt(6).
    return _Power((c1 - c0) / window / 1000, (tick_s or _TICK_S) / math.sqrt(6) / window, "nvml-energy-2read", [],
                  tick_s)


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
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    with CounterPolls(counter or _energy_counter(index), poll_s) as polls:
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
        c0, t0, calls = polls.read(), time.perf_counter(), 0
        while True:
            for _ in range(per_chunk):
                fn()
            sync()
            calls += per_chunk
            if time.perf_counter() - t0 >= seconds:
                break
        t1, c1 = time.perf_counter(), polls.read()
    window = t1 - t0
    p = _power(polls, t0, t1, c0, c1, method)
    return EnergyResult(j_per_call=p.power_w * window / calls, calls=calls, window_s=window, power_w=p.power_w,
                        rel_uncertainty=p.rel, method=p.method, ticks=len(p.points), tick_s=p.tick_s,
                        two_read_j_per_call=(c1 - c0) / window / 1000 * window / calls)  # 2read's arithmetic: equal to it


_JUDGED_S = 0.18  # the least stretch of counter steps a fit holds: about two steps of NVML's counter


def _last_over(polls: list[tuple[float, int]], since: float, limit_w: float,
               min_gap: float = 0.09) -> float | None:
    """The host time of the last counter step after `since` that ends an interval (of at least `min_gap` s, about
    one step of NVML's counter) drawn above `limit_w` beyond its timing's uncertainty: the power over the interval
    lengthened by its two steps' poll widths, its lowest reading, is over the limit. None if no interval is."""
    points = tick_points(polls[:], since, math.inf)
    last, over = None, None
    for p in points:
        if last is None:
            last = p
        elif p.t - last.t >= min_gap:
            if (p.mj - last.mj) / (p.t - last.t + (p.width + last.width) / 2) / 1000 > limit_w:
                over = p.t
            last = p
    return over


def settled_energy(run, *, span_s: float, settle: Callable[[Callable[[float], None]], object] | None = None,
                   fit_after_settle: Callable[[object], bool] = lambda settled: False, fit_s: float = 0.2,
                   index: int = 0, counter: Callable[[], int] | None = None, calls_per_step: int = 1,
                   chunk_s: float = 0.02, poll_s: float = 0.002, ramp_s: float = 0.03,
                   power_limit_w: float | None = None, over_limit: float = 0.03,
                   max_s: float = 2.0, min_steps: int = 3,
                   settled_fit_s: float | None = None) -> tuple[EnergyResult, object]:
    """Energy per call over one back-to-back run that first settles the GPU, then goes on until it spans `span_s`:
    the settle's steady part is part of the energy window, not a separate run before it.

    `run` keeps steps running (see kprof.measure._sampling.BackToBack): `run(chunk_s)` enqueues about chunk_s of
    steps, `run.drain()` waits for them all, and `run.marks` holds (host time, steps completed) as chunks finish.
    `settle(run)` (the state protocol's settle over those chunks) returns once the clock holds steady; None runs
    no settle. The mean power is the fit over the counter's steps polled during the run from `ramp_s` on (the
    power of the first calls is still rising), less any longer leading ramp (`steady_points`); the time per step
    is taken from the marks from the fit's first step on, so both cover the same steady calls.
    Where `fit_after_settle(settle's result)` says so, the fit starts when the settle ends instead, and the run
    goes on for `fit_s` more: a power-capped kernel draws over the limit for a few hundred milliseconds before the
    cap's controller holds it there (a 2048x4096x4096 GEMM on an H200: 756 W over its first 0.3 s, 691 W over 5 s).
    With `power_limit_w`, a draw over the board's limit is not a steady state either, whether or not the settle
    called the kernel capped: while the counter shows the power of its latest step interval more than
    `over_limit` above the limit, the fit moves past it and the run goes on, as long as the fit can still span
    `fit_s` within `max_s` in all (a kernel still over the limit then is fitted over what it ran). Past a draw over
    the limit the fit spans `settled_fit_s` (or what `max_s` leaves past a late one), as a capped kernel's: an
    H100's 2048x4096x4096 GEMM, not called capped by its settle at 1725 MHz, drew over the limit, and a 0.2 s fit
    past that caught the controller's dip: 562 W against 697 W over 5 s (-8.4 %, protocol_check run 96). The same
    8192^3 GEMM drew 746 W over a fit that began 0.3 s in, and 691 W over a 5 s window: 5 % more energy a call.
    The cap's controller does not hold the limit at once either: past the draw over it, the power falls to 510-650 W
    before it returns (2048x4096x4096 and 8192^3, run 75), so a fit that starts after the settle spans
    `settled_fit_s` (default `fit_s`) to average what a longer window reads.
    The fit spans at least `min_steps` counter steps, its window lengthened to hold them (within `max_s`): two
    steps are one interval, its ends timed to a poll each (about 5 ms of 98), too loose a power for 5 %.
    Energy per call = power x time per step / calls_per_step. Returns (EnergyResult, settle's result)."""
    if not span_s > 0:
        raise UsageError(f"the energy span must be positive, got {span_s} s")
    with CounterPolls(counter or _energy_counter(index), poll_s) as polls:
        c0, t0, n0 = polls.read(), time.perf_counter(), run.enqueued
        settled = settle(run) if settle is not None else None
        capped_fit_s = fit_s if settled_fit_s is None else settled_fit_s  # a capped kernel's fit, or one past the limit
        if settle is not None and fit_after_settle(settled):
            fit_from, fit_s = time.perf_counter(), capped_fit_s
        else:
            fit_from = t0 + ramp_s
        least_fit_s = fit_s
        limit = None if power_limit_w is None else power_limit_w * (1 + over_limit)
        width = max(0.02, 10 * poll_s)

        def short() -> bool:  # the fit is not yet as long as asked, or holds too few steps to fit and judge
            now = time.perf_counter()
            if now - t0 < span_s or now - fit_from < fit_s:
                return True
            steps = tick_points(polls.polls[:], fit_from, math.inf, width)
            return now - t0 < max_s and (len(steps) < min_steps or steps[-1].t - steps[0].t < _JUDGED_S)

        while True:
            while short():
                run(chunk_s)
            over = None if limit is None else _last_over(polls.polls, fit_from, limit)
            # A draw over the limit is the cap's controller at work, whatever the settle said: past it the power
            # swings under the limit and back for about a second, so the fit spans capped_fit_s as a capped one does,
            # or what max_s leaves past a late draw (at least fit_s: else the fit keeps what it spans)
            if over is None or over + least_fit_s - t0 > max_s:  # (a second, later draw too: judged by the least)
                break
            fit_from, fit_s = over, max(least_fit_s, min(capped_fit_s, t0 + max_s - over))
        run.drain()
        t1, c1 = time.perf_counter(), polls.read()
    # the counter as polled at the fit's start: the plain two readings (a fit short of two steps) span the fit only
    c_from = next((c for t, c in reversed(polls.polls) if t <= fit_from), c0)
    p = _power(polls, fit_from, t1, c_from, c1)
    calls = (run.enqueued - n0) * calls_per_step
    start = p.points[0].t if p.points else fit_from
    steady = [(t, n) for t, n in run.marks if start <= t <= t1]
    if len(steady) < 2 or steady[-1][1] <= steady[0][1]:
        steady = [(t0, n0), (t1, run.enqueued)]
    per_step = (steady[-1][0] - steady[0][0]) / (steady[-1][1] - steady[0][1])
    return EnergyResult(j_per_call=p.power_w * per_step / calls_per_step, calls=calls, window_s=t1 - t0,
                        power_w=p.power_w, rel_uncertainty=p.rel, method=p.method, ticks=len(p.points),
                        tick_s=p.tick_s, two_read_j_per_call=(c1 - c0) / 1000 / calls,
                        fit_from_s=round(start - t0, 4)), settled
