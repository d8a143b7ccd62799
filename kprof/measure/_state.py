"""The thermal and power state a GPU row is timed in, so that a row does not depend on what ran before it.

A kernel inside a model runs back to back with others, and its SM clock is the one that load sustains: near
boost for decode-sized kernels, held down by the power limit for large GEMMs. A row timed from an idle GPU
(boost clock, cool die) or right after heavy work (a hot die leaks more power, so the power-capped clock
is lower) names a moment, not the kernel. The protocol, for every CUDA row:

1. **Start**: a GPU hotter than `max_start_c` is left idle until it cools to it (at most `cool_s`), so no
   row starts from a die heated by its neighbours beyond the stated limit.
2. **Settle**: the callable runs back to back, as the samples will, in chunks of ~`chunk_s` of GPU work,
   with the SM clock and power read while each chunk runs, until the last `window` readings lie within
   `tol` of their median at no more than the power limit (after at least `min_s`, at most `max_s`). Their
   median is the settled clock. A kernel that reaches the power cap settles for `capped_settle_s` instead
   and is sampled for at least `capped_sample_s`: under the cap the clock swings by 10-20 % over tens of
   milliseconds, and a short median would catch one swing (rows of such GEMMs spread by 5-9 % that way).
   Such a row's time is the mean of its samples (`estimator`): per-call times under a swinging clock are not
   one-peaked, and their median jumps between the peaks from run to run (4.3 % between passes on an H200,
   with 0.5 s of samples), while the mean is the time the kernel spends on average, which a sum of rows needs.
   Past that minimum it is sampled until the mean's 95 % interval, from the means of blocks of `capped_block_s`
   (the batch-means method: the swings correlate samples over tens to hundreds of milliseconds), is within
   `capped_target` of it, for `capped_max_sample_s` at most (`capped_stop`): the mean of one second of an
   8192^3 GEMM's fifths moved by up to 5 % within the second, while a 2048x4096x4096 one's held within 0.2 %.
3. **Hold**: each timed batch gets a reading taken while it runs. A batch whose SM clock is off the settled
   clock by more than `tol` (not for a capped kernel, whose clock swings by nature), or that shows a thermal
   or hardware slowdown, was measured out of state: its samples are discarded and the stopping rule asks
   for more, as nvbench drops throttled samples. Past
   `max_discards` discarded batches in a row the state is re-anchored on the latest reading (the GPU found a new
   steady state; the row says so) rather than looping forever on a drifting GPU.

The row records the state in its method notes (`state`, settled and timed SM clock, power, temperature,
reasons, discards). Readings come from `probe()`: NVML on a GPU, anything returning a `StateReading` in
tests. Nothing here imports torch or NVML.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, NamedTuple, Sequence

from ._reasons import decode_reasons
from .stats import mean_halfwidth

__all__ = ["StateReading", "StateProtocol", "Settled", "state_label", "OUT_OF_STATE_REASONS", "CAPPED_SAMPLE_S",
           "CAPPED_MAX_SAMPLE_S"]

# Clock-event reasons that mean the clock was held below what the load itself sets: a batch showing one
# was timed in another state than its neighbours. (power_cap is the steady state of a heavy kernel.)
OUT_OF_STATE_REASONS = frozenset({"thermal", "hw_slowdown", "hw_power_brake"})
# The least timed work a power-capped kernel's row averages over (KPROF_CAPPED_SAMPLE_S): its clock swings with the
# cap's controller over tens to hundreds of milliseconds (the fifths of one second of 8192^3 read up to 5 % apart on
# an H200, those of 2048x4096x4096 within 0.2 %).
CAPPED_SAMPLE_S = 0.5
# ... and at most this long (KPROF_CAPPED_MAX_SAMPLE_S), until its mean is known to CAPPED_TARGET (95 % half-width,
# relative) from the means of blocks of CAPPED_BLOCK_S, at least CAPPED_MIN_BLOCKS of them.
CAPPED_MAX_SAMPLE_S = 3.0
# 0.7 %, not 1 %: replayed on 88 rows of 3 s from two machine starts (capped_stop_replay.py, runs 47 and 50 on an
# H200), rows stopped at 1 % were up to 1.75 % off their own 3 s mean, and spread over passes up to 4.5 % (3.0 % at
# 3 s); at 0.7 % they were within 1.4 % and spread as at 3 s. Cost: 1.3 s a row on average against 1.0 in run 47;
# a GEMM whose clock holds still stops at 0.5 s either way.
CAPPED_TARGET = 0.007
CAPPED_BLOCK_S = 0.1
CAPPED_MIN_BLOCKS = 5


class StateReading(NamedTuple):
    sm_mhz: float | None
    power_w: float | None
    temp_c: float | None
    reasons: int | None  # clock-event reasons bitmask


class Settled(NamedTuple):
    sm_mhz: float | None  # the settled clock: median of the last readings (None: no clock readings)
    seconds: float
    chunks: int
    steady: bool  # False: max_s ran out before the clock held still


def state_label(readings: Sequence[StateReading], regime: str = "sustained") -> str:
    """What limited the clock while these readings were taken: 'power-capped', 'thermal-limited' or
    'boost' (nothing but the load itself), after the regime: 'sustained' (the kernel back to back) or
    'loaded' (each call after heavy work that holds the GPU at its power limit). 'unknown' where NVML gave no
    clock-event reasons for any of them (the call Not Supported): what held the clock was not seen."""
    known = [r.reasons for r in readings if r.reasons is not None]
    if readings and not known:
        return f"{regime}, unknown (no clock-event reasons)"
    seen = set()
    for reasons in known:
        seen.update(decode_reasons(reasons))
    if seen & OUT_OF_STATE_REASONS:
        return f"{regime}, thermal-limited"
    if "power_cap" in seen:
        return f"{regime}, power-capped"
    return f"{regime}, boost"


class StateProtocol:
    """Start, settle and hold (see the module doc) around one row's timing, with readings from `probe`."""

    def __init__(self, probe: Callable[[], StateReading], *, max_start_c: float = 80.0, cool_s: float = 30.0,
                 tol: float = 0.02, window: int = 3, chunk_s: float = 0.02, min_s: float = 0.12,
                 max_s: float = 1.5, max_discards: int = 8, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter, regime: str = "sustained",
                 power_limit_w: float | None = None, capped_settle_s: float = 0.3,
                 capped_sample_s: float = CAPPED_SAMPLE_S, capped_share: float = 0.25,
                 capped_max_sample_s: float = CAPPED_MAX_SAMPLE_S, capped_target: float = CAPPED_TARGET,
                 capped_block_s: float = CAPPED_BLOCK_S):
        self.regime, self.power_limit_w = regime, power_limit_w
        self.capped_settle_s, self.capped_sample_s = capped_settle_s, capped_sample_s
        self.capped_max_sample_s = max(capped_max_sample_s, capped_sample_s)
        self.capped_target, self.capped_block_s = capped_target, capped_block_s
        self.capped_share = capped_share  # readings past the first capped one that must show the cap too
        self.capped = False
        self.min_sample_s = 0.0  # timed work the samples must span (set by settle: capped kernels)
        self.estimator = "median"  # the row's time from its samples: "mean" for a capped kernel (set by settle)
        self.probe, self.max_start_c, self.cool_s, self.tol = probe, max_start_c, cool_s, tol
        self.window, self.chunk_s, self.min_s, self.max_s = window, chunk_s, min_s, max_s
        self.max_discards, self._sleep, self._clock = max_discards, sleep, clock
        self.reference: float | None = None  # the settled clock batches are held to
        self.kept: list[StateReading] = []  # readings of the batches whose samples were kept
        self.discarded = 0  # since the last kept batch or re-anchoring
        self.discarded_total = 0
        self.reanchored = 0
        self.notes: dict[str, str] = {}

    def start(self) -> None:
        """Wait, idle, until the GPU is no hotter than max_start_c (at most cool_s)."""
        first = self.probe()
        temp, waited, t0 = first.temp_c, 0.0, self._clock()
        while temp is not None and temp > self.max_start_c and waited < self.cool_s:
            self._sleep(0.5)
            temp = self.probe().temp_c
            waited = self._clock() - t0
        self.notes["start_temp_c"] = _fmt(first.temp_c)
        if waited:
            self.notes["cooldown_s"] = f"{waited:.1f}"
            self.notes["cooldown_to_c"] = _fmt(temp)

    def settle(self, run_chunk: Callable[[float], None]) -> Settled:
        """Run `run_chunk(chunk_s)` (about chunk_s of GPU work, enqueued and left running) and read the GPU
        while it runs, until it holds steady; sets the reference clock.

        Steady: the last `window` clocks within `tol` of their median, and their power not above the limit
        (a GPU drawing more than its limit is about to be capped: the clock has not fallen yet). A kernel
        that reaches the power cap never holds one clock: the cap's controller moves it by 10-20 % over
        tens of milliseconds. Such a kernel settles for `capped_settle_s` and is then sampled for at least
        `capped_sample_s` (see `min_sample_s`), so its samples span the controller's swings rather than
        catching one of them, and its time is their mean (`estimator`). A kernel is capped only where at least
        `capped_share` of the readings from the first capped one on show the cap: on an H200 a 15 µs GEMM
        graph-replayed between sweeps drew 350 W at 1980 MHz and showed the cap reason once, which made its row
        the mean of 1 s of samples, 5 % over its median (protocol_check case c, run 21).
        Notes `power_cap_transient` where that happened."""
        t0 = self._clock()
        readings: list[StateReading] = []
        capped_at: int | None = None
        transient: str | None = None  # capped readings too few to call the kernel capped (then never again)
        chunks = 0
        steady = False
        while True:
            run_chunk(self.chunk_s)
            reading = self.probe()
            readings.append(reading)
            chunks += 1
            elapsed = self._clock() - t0
            if capped_at is None and transient is None and self._capped(reading):
                capped_at = len(readings) - 1
            if capped_at is not None and elapsed >= max(self.min_s, self.capped_settle_s):
                marks = [self._capped(r) for r in readings[capped_at:]]
                if sum(marks) >= self.capped_share * len(marks):
                    steady = True
                    break
                # A moment at the cap (one power spike, a cap reason set once), not a capped kernel: its clock
                # held boost around it. Settle it as an uncapped kernel, which the median times.
                transient, capped_at = f"{sum(marks)} of {len(marks)} readings", None
            if capped_at is None and elapsed >= self.min_s and self._steady(readings[-self.window:]):
                steady = True
                break
            if elapsed >= self.max_s:
                break
        clocks = [r.sm_mhz for r in readings[capped_at or 0:] if r.sm_mhz is not None]
        recent = clocks if capped_at is not None else clocks[-self.window:]
        ref = statistics.median(recent) if recent else None
        self.reference = ref
        self.capped = capped_at is not None
        self.min_sample_s = self.capped_sample_s if self.capped else 0.0
        self.estimator = "mean" if self.capped else "median"
        result = Settled(ref, self._clock() - t0, chunks, steady)
        unsettled = "no (max_s reached)" if clocks else "no (NVML gave no SM clock: max_s run)"
        self.notes.update(settle_s=f"{result.seconds:.3f}", settle_chunks=str(chunks),
                          settled_sm_mhz=_fmt(ref), settled="yes" if steady else unsettled,
                          power_capped="yes" if self.capped else "no")
        self.notes["estimator"] = self.estimator
        if self.capped:
            self.notes["capped_sample_s"] = f"{self.capped_sample_s:.2f}"
            self.notes["capped_max_sample_s"] = f"{self.capped_max_sample_s:.2f}"
        if transient:
            self.notes["power_cap_transient"] = transient
        return result

    def _capped(self, r: StateReading) -> bool:
        return "power_cap" in decode_reasons(r.reasons or 0) or (
            self.power_limit_w is not None and r.power_w is not None and r.power_w >= 0.97 * self.power_limit_w)

    def _steady(self, recent: Sequence[StateReading]) -> bool:
        clocks = [r.sm_mhz for r in recent if r.sm_mhz is not None]
        if len(clocks) < self.window:
            return False
        mid = statistics.median(clocks)
        if not (mid > 0 and all(abs(c / mid - 1) <= self.tol for c in clocks)):
            return False
        powers = [r.power_w for r in recent if r.power_w is not None]
        return self.power_limit_w is None or all(p <= 1.02 * self.power_limit_w for p in powers)

    def capped_stop(self, elapsed_s: float, blocks: Sequence[float]) -> str | None:
        """Whether a power-capped kernel's sampling stops after `elapsed_s` of it, with `blocks` the per-call
        means of its blocks of capped_block_s so far (`kprof.measure.stats.block_means`): "converged" once the
        minimum (`min_sample_s`) is spanned and the mean's 95 % half-width from the blocks is within
        capped_target; "budget" at capped_max_sample_s; else None. Notes the blocks and the half-width."""
        half = mean_halfwidth(blocks) if len(blocks) >= CAPPED_MIN_BLOCKS else math.inf
        if elapsed_s >= self.capped_max_sample_s:
            reason = "budget"
        elif elapsed_s >= self.min_sample_s and half <= self.capped_target:
            reason = "converged"
        else:
            return None
        self.notes.update(capped_blocks=str(len(blocks)),
                          capped_mean_halfwidth="n/a" if math.isinf(half) else f"{half:.4f}")
        return reason

    def hold(self, reading: StateReading) -> bool:
        """Whether a batch read as `reading` ran in the settled state (keep its samples). Counts discards and
        re-anchors past max_discards in a row. A power-capped kernel is held only against thermal and hardware
        slowdowns: its clock swings with the cap's controller, and that swing is its steady state."""
        reasons = set(decode_reasons(reading.reasons or 0))
        off_clock = (not self.capped and bool(self.reference) and reading.sm_mhz is not None  # 0 MHz: no clock read
                     and abs(reading.sm_mhz / self.reference - 1) > self.tol)
        if not off_clock and not reasons & OUT_OF_STATE_REASONS:
            self.kept.append(reading)
            self.discarded = 0  # a re-anchor needs max_discards off-state batches in a row, not spread over the row
            return True
        if self.discarded >= self.max_discards:
            # The GPU has moved to another steady state (a slow thermal drift, a neighbour's load): hold to it
            # from here on, and say so, rather than discard without end.
            self.reanchored += 1
            self.discarded = 0
            self.reference = reading.sm_mhz if reading.sm_mhz is not None else self.reference
            self.kept.append(reading)
            return True
        self.discarded += 1
        self.discarded_total += 1
        return False

    def summary(self) -> dict[str, str]:
        """The row's state notes: label, settled and timed clocks, power, temperature, reasons, discards."""
        kept = self.kept
        out = dict(self.notes)
        out["state"] = state_label(kept, self.regime) if kept else "unknown (no readings)"
        out["batches_discarded"] = str(self.discarded_total)
        if self.reanchored:
            out["state_reanchored"] = str(self.reanchored)
        for name, col in (("sm_mhz", "sm_mhz"), ("power_w", "power_w"), ("temp_c", "temp_c")):
            values = [getattr(r, col) for r in kept if getattr(r, col) is not None]
            if values:
                out[f"timed_{name}_median"] = _fmt(statistics.median(values))
                out[f"timed_{name}_min"] = _fmt(min(values))
                out[f"timed_{name}_max"] = _fmt(max(values))
        mask = 0
        for r in kept:
            mask |= r.reasons or 0
        read = any(r.reasons is not None for r in kept)
        out["timed_reasons"] = ",".join(decode_reasons(mask)) or ("none" if read else "n/a")
        return out


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
