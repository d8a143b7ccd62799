"""The CUDA-events timer: a torch.cuda.Event pair around each launch, the flush before the start event, one
synchronize per batch (triton.testing.do_bench's method), less what an event pair adds to a kernel."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from ._attribution import TimerError
from ._sampling import _WARMUP_MAX, _WARMUP_S, _heated, _sample, _settle

_SLEEP_CYCLES_PER_S = 2.0e9  # torch.cuda._sleep counts SM clock cycles; about the boost clock of current GPUs

_ZERO_SLEEP_US = 10.0  # length of the reference kernel that measures an event pair's overhead


def _events_zero_ms(torch, flush, clock_mhz: float | None, n: int = 25) -> tuple[float, str]:
    """What an event pair adds to the kernel it brackets, in the samples' own pattern (a flush first, the
    GPU held back while the host enqueues), subtracted from every events sample.

    With the SM clock known (the settled clock of the state protocol), the pair brackets a reference kernel
    of known length: torch.cuda._sleep spins for a count of SM clock cycles, so it lasts cycles / clock. The
    reading less that length is the pair's cost plus a kernel's launch and completion latency, which every
    kernel pays alike (~2-3 µs on an H200: +10 % to +20 % on a 20 µs kernel). Without a clock, an empty pair
    is the zero: its own cost only, so the launch latency stays in the samples. Returns (ms, method)."""
    cycles = round(_ZERO_SLEEP_US * clock_mhz) if clock_mhz else 0  # µs x MHz = cycles
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda._sleep(int(0.002 * _SLEEP_CYCLES_PER_S))
    for start, end in zip(starts, ends):
        if flush is not None:
            flush()
        start.record()
        if cycles:
            torch.cuda._sleep(cycles)
        end.record()
    torch.cuda.synchronize()
    reading = statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))
    if not cycles:
        return reading, "empty event pair"
    known_ms = cycles / (clock_mhz * 1e6) * 1e3
    return max(reading - known_ms, 0.0), f"{cycles}-cycle sleep kernel at {clock_mhz:.0f} MHz"


def _run_events(torch, call, flush, per_call, rule, notes, state=None, heat=None):
    started = time.perf_counter()
    warm = 0
    while warm < 2 or (time.perf_counter() - started < _WARMUP_S and warm < _WARMUP_MAX):
        if flush is not None:
            flush()
        call()
        torch.cuda.synchronize()
        warm += 1
    per_call_s = (time.perf_counter() - started) / warm
    flush = _heated(torch, flush, heat, per_call_s, notes)
    _settle(torch, call, flush, per_call_s, notes, state)
    notes.update(attribution="events", launch="batched")
    enqueue_s = 50e-6  # host time to enqueue one (flush, event, call, event): measured per batch after the first
    clock_mhz = state.reference if state is not None else None
    zero_ms, how = _events_zero_ms(torch, flush, clock_mhz)
    notes.update(events_zero_us=f"{zero_ms * 1e3:.3f}", events_zero_method=how)

    def batch(k: int, _done: int, during: Callable[[], None]) -> list[float]:
        nonlocal enqueue_s
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
        # Hold the GPU back while the host enqueues the batch: a start event the GPU reaches before the
        # host has launched the call would time the host's launch latency (a short kernel reads several
        # times slow). The sleep runs before the first start event, untimed.
        torch.cuda._sleep(int(min(enqueue_s * k * 1.5, 0.05) * _SLEEP_CYCLES_PER_S))
        e0 = time.perf_counter()
        for start, end in zip(starts, ends):
            if flush is not None:
                flush()  # before the start event: not timed
            start.record()
            call()
            end.record()
        enqueue_s = (time.perf_counter() - e0) / k
        during()
        torch.cuda.synchronize()
        return [max(start.elapsed_time(end) - zero_ms, 0.0) / per_call for start, end in zip(starts, ends)]

    samples, reason = _sample(batch, per_call_s, rule, started, notes, state)
    if statistics.median(samples) <= 0:  # a row of 0 ms would be no time at all (and no rate could divide by it)
        raise TimerError(f"CUDA events timed nothing: most of {len(samples)} samples were no longer than what an "
                         f"event pair adds to a kernel ({zero_ms * 1e3:.2f} µs, {how}); the callable launches no GPU "
                         f"work, or too little for events to resolve; time it with timer='cupti'")
    return samples, reason, warm
