"""The sampling loop both GPU timers share: batch sizing, settling the GPU into its state (and the loaded
state's heat), and the loop that collects samples until the stopping rule says so, holding each batch to the
state protocol. Used by kprof.measure.gpu_timer (CUPTI) and kprof.measure._events_timer (CUDA events)."""

from __future__ import annotations

import math
import time
from typing import Callable

from ._state import StateProtocol
from .stats import StopRule, block_means

_WARMUP_S = 0.01  # warm-up wall time (at least 2 invocations)
_WARMUP_MAX = 200  # warm-up invocations at most: each keeps its kernel records until attribution
_BATCH_S = 0.02  # GPU work per batch between two host synchronizations
_MAX_BATCH = 100
_SETTLE_S = 0.05  # back-to-back running before the first sample, for calls long enough to heat the GPU
_SETTLE_MIN_CALL_S = 1e-3  # warm-up wall per call (launch + sync included) from which a call settles
_HEAT_RATIO = 4.0  # loaded state: heavy work per sample, in multiples of the call's own time
_HEAT_MAX_UNITS = 32


def _batch(per_call_s: float, n: int, elapsed_s: float, rule: StopRule | None) -> int:
    """Calls in the next batch: ~_BATCH_S of work, a multiple of 5 (StopRule checks convergence at multiples of
    5), and with a `rule`, no more than its budget left and never past its max_samples (None: a power-capped
    kernel, which stops by its own rule, see _sample)."""
    per_call_s = max(per_call_s, 1e-7)
    k = _BATCH_S / per_call_s
    left = rule.budget_s - elapsed_s if rule is not None else 0.0
    if left > 0:
        k = min(k, left / per_call_s)
    k = min(_MAX_BATCH, max(5, 5 * math.ceil(round(k) / 5)))
    return max(1, min(k, rule.max_samples - n)) if rule is not None else k


def _settle(torch, call, flush, per_call_s: float, notes: dict, state: StateProtocol | None = None) -> None:
    """Run back to back, as the samples will, before the first sample. A long kernel draws the GPU towards
    its power cap within milliseconds; without this its first samples would catch the boost clock the
    warm-up's synchronized calls leave, and the median would mix two regimes. With `state`, until the SM
    clock holds steady (any call length); without, for _SETTLE_S, calls of 1 ms or more only."""
    if state is not None:
        _settle_to_state(torch, call, flush, per_call_s, state)
        return
    if per_call_s < _SETTLE_MIN_CALL_S:
        return
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < _SETTLE_S:
        for _ in range(max(1, int(0.01 / per_call_s))):
            if flush is not None:
                flush()
            call()
            n += 1
        torch.cuda.synchronize()
    notes["settle"] = f"{n} calls in {time.perf_counter() - t:.3f} s"


class BackToBack:
    """Chunks of `step` kept running on the GPU back to back, two chunks in flight at most: `self(chunk_s)` enqueues
    about chunk_s of steps, then waits for the chunk before it, so the GPU is never idle and the host never runs far
    ahead. `marks` holds (host time, steps completed) each time a chunk is seen finished. `event()` makes a
    recordable event (torch.cuda.Event), `sync()` waits for the device (torch.cuda.synchronize)."""

    def __init__(self, step: Callable[[], object], per_step_s: float, event: Callable[[], object],
                 sync: Callable[[], object]):
        self.step, self.per_step_s, self._event, self._sync = step, max(per_step_s, 1e-7), event, sync
        self.marks: list[tuple[float, int]] = []
        self._pending: list[tuple[object, int]] = []
        self.enqueued = 0  # steps enqueued so far

    def __call__(self, chunk_s: float) -> None:
        n = max(1, int(chunk_s / self.per_step_s))
        for _ in range(n):
            self.step()
        self.enqueued += n
        done = self._event()
        done.record()
        self._pending.append((done, self.enqueued))
        if len(self._pending) > 1:
            event, steps = self._pending.pop(0)
            event.synchronize()
            self.marks.append((time.perf_counter(), steps))

    def drain(self) -> None:
        """Waits for every step enqueued."""
        self._sync()
        self._pending.clear()
        self.marks.append((time.perf_counter(), self.enqueued))

    @classmethod
    def on_cuda(cls, torch, step: Callable[[], object], per_step_s: float) -> "BackToBack":
        return cls(step, per_step_s, torch.cuda.Event, torch.cuda.synchronize)


def settle_back_to_back(torch, step: Callable[[], object], per_call_s: float, state: StateProtocol):
    """state.settle over chunks of `step` (one call, with whatever goes before it) run back to back (`BackToBack`):
    the GPU is read while a chunk runs. Returns state.settle's result, the device synchronized."""
    run = BackToBack.on_cuda(torch, step, per_call_s)
    settled = state.settle(run)
    run.drain()
    return settled


def _settle_to_state(torch, call, flush, per_call_s: float, state: StateProtocol) -> None:
    """state.settle over (flush, call) pairs, as the samples will run."""

    def step() -> None:
        if flush is not None:
            flush()
        call()

    settle_back_to_back(torch, step, per_call_s, state)


def _heated(torch, flush, heat, per_call_s: float, notes: dict):
    """`flush` preceded by enough units of `heat` to take about _HEAT_RATIO times the call (at least one, at
    most _HEAT_MAX_UNITS), or `flush` itself without heat."""
    if heat is None:
        return flush
    heat()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        heat()
    torch.cuda.synchronize()
    unit_s = (time.perf_counter() - t) / 5
    units = max(1, min(_HEAT_MAX_UNITS, math.ceil(_HEAT_RATIO * per_call_s / unit_s)))
    notes.update(power="loaded", heat_units=str(units), heat_unit_us=f"{unit_s * 1e6:.1f}")

    def heated() -> None:
        for _ in range(units):
            heat()
        if flush is not None:
            flush()

    return heated


def _sample(batch: Callable[[int, int, Callable[[], None]], list[float]], per_call_s: float, rule: StopRule,
            started: float, notes: dict, state: StateProtocol | None = None) -> tuple[list[float], str]:
    """The sampling loop both timers share: batches sized by `_batch` from the last batch's wall time per
    call, `batch(k, samples so far, during)` returning k samples, until `rule` stops. `during()` is called
    while the batch runs on the GPU; with `state`, it reads the GPU there, and a batch that ran out of the
    settled state (`state.hold`) has its samples discarded. A power-capped kernel (`state.capped`) stops by
    `state.capped_stop` instead, on the means of its blocks of `state.capped_block_s`: the rule's median
    interval, budget and sample cap do not apply to a mean of correlated samples."""
    samples: list[float] = []
    biggest, batches = 0, 0
    t0 = time.perf_counter()
    notes["warmup_s"] = f"{t0 - started:.4f}"  # warm-up and settling, before the first sample
    reading = []
    capped = state is not None and state.capped
    timeline: list[tuple[float, float, int]] = []  # capped: (end, sum, count) of each batch, for block_means

    def during() -> None:
        if state is not None:
            reading.append(state.probe())

    while True:
        k = _batch(per_call_s, len(samples), time.perf_counter() - t0, None if capped else rule)
        b0 = time.perf_counter()
        reading.clear()
        got = batch(k, len(samples), during)
        kept = not reading or state.hold(reading[-1])
        if kept:
            samples += got
        now = time.perf_counter()
        per_call_s = (now - b0) / k
        biggest, batches = max(biggest, k), batches + 1
        if capped:
            timeline.append((now, math.fsum(got) if kept else 0.0, len(got) if kept else 0))
            # at least 3 samples, as the rule's budget asks (every batch so far may have been discarded)
            reason = state.capped_stop(now - t0, block_means(timeline, state.capped_block_s, t0)) \
                if len(samples) >= 3 else None
        else:
            reason = rule.check(samples, now - t0)
        if reason:
            notes.update(batch=str(biggest), batches=str(batches), sample_s=f"{time.perf_counter() - t0:.4f}")
            return samples, reason


GRAPH_WARMUP_ROUNDS = 3  # eager rounds on a side stream before capture, as torch.cuda.graphs asks


def side_warmup(torch, calls) -> None:
    """GRAPH_WARMUP_ROUNDS of every call on a side stream, joined back: what torch.cuda.graphs asks before a
    capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP_ROUNDS):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(side)
