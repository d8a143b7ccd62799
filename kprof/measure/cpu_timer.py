"""The CPU timer: wall-clock time of the callable with `time.perf_counter_ns`, adaptive stopping.

Calls shorter than ~50 µs are timed in groups of r back-to-back calls (r chosen once from the warm-up's fastest call),
so the timer's own resolution and overhead stay under 1% of each sample.

A sample far beyond the others, over which the process did not run (see `_paused`), is no time of the callable: the
process was stopped (Ctrl-Z, SIGSTOP) or lost its cores for that long. It is set aside and timed again, its wall time
not counted against the budget. A pause between two samples is not counted against the budget either.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from .stats import StopRule, quantile

__all__ = ["time_cpu", "Timing"]

_GROUP_NS = 50_000
# A sample is set aside (`_paused`) where it passes both _PAUSE_RATIO times the median and, over all its calls, the
# median plus _PAUSE_MS: a stopped process reads as long as it was stopped (one 2,040 ms sample among 0.34 ms ones;
# half a second of SIGSTOP, 559 ms among a 1024^3 GEMM's 51 ms ones), while other work preempting the process mostly
# costs a sample a few scheduler slices (on a 2-core host at load 3.4, samples of a 0.19 ms GEMM up to 53 ms, of a
# 5.8 ms one up to 45 ms, of a 94 ms one up to 168 ms, 1.8x; beside two busy loops too, one of 162 ms among 3.8 ms
# ones was set aside, as its cores were taken that long: host_busy flags such a row). A slow call of the callable's own
# (a garbage collection, an allocation's page faults, a kernel of two speeds) is its time, and the process runs through
# it: a sample is set aside only where the process's CPU time over it passed the median sample's by less than half its
# wall time's excess (a garbage collection of 196 ms among 2.4 ms calls: its CPU time grew by as much). At most
# _MAX_SET_ASIDE a row: more are kept, as a host that takes the process's cores that often is the row's host.
_PAUSE_RATIO, _PAUSE_MS, _MAX_SET_ASIDE = 4.0, 100.0, 3


class Timing(NamedTuple):
    samples_ms: list[float]
    stop_reason: str
    warmup: int
    inner: int  # calls per sample
    wall_s: float
    set_aside: tuple[float, ...] = ()  # samples (ms) set aside as pauses (`_paused`) and timed again
    paused_s: float = 0.0  # pauses between samples (over _PAUSE_MS each), not counted against the budget


def _paused(samples: list[float], ran: list[float], inner: int) -> list[int]:
    """The indices of the samples (times per call of `inner` calls each, `ran` the process's CPU time per call over
    each) that read a pause of the process, not the callable: over _PAUSE_RATIO times their median, their `inner` calls
    _PAUSE_MS beyond as many at the median, and most of that excess off the CPU (a slow call of the callable's own runs
    on it: its CPU time grows with its wall time; a stopped process's does not)."""
    med, cpu = quantile(sorted(samples), 0.5), quantile(sorted(ran), 0.5)
    return [i for i, (x, c) in enumerate(zip(samples, ran))
            if x > _PAUSE_RATIO * med and (x - med) * inner > _PAUSE_MS and c - cpu < (x - med) / 2]


def time_cpu(fn: Callable[[], object], rule: StopRule | None = None, warmup_s: float = 0.01) -> Timing:
    rule = rule or StopRule()
    clock = time.perf_counter_ns
    started = clock()
    # Warm-up: at least 2 calls and warmup_s, to settle caches, allocator and lazy initialization. A sample's calls
    # are sized by the fastest warm-up call: the warm-up's mean holds the first calls' lazy initialization (an 8-byte
    # copy of 1.8 µs read over 10 µs, and was timed in groups of 4 calls, 7 µs) and any pause of the process (groups
    # of 1 call).
    warm, fastest, last = 0, float("inf"), started
    while warm < 2 or last - started < warmup_s * 1e9:
        fn()
        now = clock()
        fastest, last, warm = min(fastest, now - last), now, warm + 1
    inner = max(1, int(_GROUP_NS / max(fastest, 1))) if fastest < _GROUP_NS else 1
    samples: list[float] = []
    ran: list[float] = []  # the process's CPU time (all its threads) per call since the sample before ended
    set_aside: list[float] = []
    t0 = end = clock()
    cpu = time.process_time_ns()  # read outside the timed calls: a system call (2 µs on a VM)
    between = 0  # ns of pauses between samples
    while True:
        a = clock()
        if a - end > _PAUSE_MS * 1e6:  # no step between two samples takes that long: the process was paused there
            t0, between = t0 + a - end, between + a - end
        for _ in range(inner):
            fn()
        end = clock()
        was, cpu = cpu, time.process_time_ns()
        samples.append((end - a) / inner / 1e6)
        ran.append((cpu - was) / inner / 1e6)
        reason = rule.check(samples, (end - t0) / 1e9)
        # Before the row stops (a pause spends the budget at once), the samples that read a pause are set aside, and
        # their wall time with them (t0 moves on by it): the samples go on as if the process had not stopped.
        paused = _paused(samples, ran, inner) if reason and len(set_aside) < _MAX_SET_ASIDE else []
        if paused:
            paused = paused[:_MAX_SET_ASIDE - len(set_aside)]
            set_aside += [samples[i] for i in paused]
            t0 += int(sum(samples[i] for i in paused) * inner * 1e6)
            samples[:] = [x for i, x in enumerate(samples) if i not in paused]
            ran[:] = [x for i, x in enumerate(ran) if i not in paused]
        elif reason:
            return Timing(samples, reason, warm, inner, (clock() - started) / 1e9, tuple(set_aside), between / 1e9)
