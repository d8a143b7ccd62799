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


def _events_zero_ms(torch, flush, clock_mhz: float | None, n: int = 50) -> tuple[float, str]:
    """What an event pair adds to the kernel it brackets, in the samples' own pattern (a flush first, the
    GPU held back while the host enqueues), subtracted from every events sample.

    The pair brackets a sleep kernel of c and of 2c SM clock cycles in turn (torch.cuda._sleep spins for a count
    of cycles), n of each: the readings are zero + c/f and zero + 2c/f at the clock f the sleeps ran at, so
    zero = 2 r(c) - r(2c) whatever that clock is (its spread about twice one reading's: n is 50, not 25). It is the
    pair's cost plus a kernel's launch and completion latency, which every kernel pays alike (~2-3 µs on an H200:
    +10 % to +20 % on a 20 µs kernel). c is sized to
    ~10 µs at `clock_mhz` (the settled clock; 2 GHz where none is known). One sleep of known length at the settled
    clock (profiler revision 5) read the zero ~2 µs low in power-capped rows: settled under the cap at ~1530 MHz,
    the GPU ran the light sleeps at ~1980 MHz, so every events sample of such a row read ~2 µs slow (+1.5 % on a
    134 µs GEMM). Returns (ms, method)."""
    cycles = round(_ZERO_SLEEP_US * (clock_mhz or _SLEEP_CYCLES_PER_S / 1e6))  # µs x MHz = cycles
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2 * n)]
    torch.cuda._sleep(int(min(2 * n * 60e-6, 0.05) * _SLEEP_CYCLES_PER_S))  # held back while the host enqueues
    for i, (start, end) in enumerate(pairs):
        if flush is not None:
            flush()
        start.record()
        torch.cuda._sleep(cycles * (1 + i % 2))
        end.record()
    torch.cuda.synchronize()
    one, two = (statistics.median(start.elapsed_time(end) for start, end in pairs[k::2]) for k in (0, 1))
    return max(2 * one - two, 0.0), f"sleep kernels of {cycles} and {2 * cycles} cycles (2 r(c) - r(2c))"


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
