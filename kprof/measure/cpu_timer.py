"""The CPU timer: wall-clock time of the callable with `time.perf_counter_ns`, adaptive stopping.

Calls shorter than ~50 µs are timed in groups of r back-to-back calls (r chosen once from the warm-up),
so the timer's own resolution and overhead stay under 1% of each sample.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from .stats import StopRule

__all__ = ["time_cpu", "Timing"]

_GROUP_NS = 50_000


class Timing(NamedTuple):
    samples_ms: list[float]
    stop_reason: str
    warmup: int
    inner: int  # calls per sample
    wall_s: float


def time_cpu(fn: Callable[[], object], rule: StopRule | None = None, warmup_s: float = 0.01) -> Timing:
    rule = rule or StopRule()
    clock = time.perf_counter_ns
    started = clock()
    # Warm-up: at least 2 calls and warmup_s, to settle caches, allocator and lazy initialization.
    warm = 0
    while warm < 2 or clock() - started < warmup_s * 1e9:
        fn()
        warm += 1
    per_call = (clock() - started) / warm
    inner = max(1, int(_GROUP_NS / per_call)) if per_call < _GROUP_NS else 1
    samples: list[float] = []
    t0 = clock()
    while True:
        a = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - a) / inner / 1e6)
        reason = rule.check(samples, (clock() - t0) / 1e9)
        if reason:
            return Timing(samples, reason, warm, inner, (clock() - started) / 1e9)
