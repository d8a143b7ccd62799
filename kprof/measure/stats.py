"""Sample statistics and the adaptive stopping rule shared by every timer."""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from .records import SampleStats

__all__ = ["summarize", "median_halfwidth", "mean_halfwidth", "block_means", "StopRule", "quantile", "copy_medians",
           "placement_notes"]

# The seconds of timing a spec gets at most by default (KPROF_TIME_BUDGET_S).
BUDGET_S = 1.0
# Student's t, two-sided 95 %, for 1-30 degrees of freedom (beyond: the normal's 1.96).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of sorted values, interpolated linearly between the two nearest."""
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_halfwidth(xs_sorted: list[float]) -> float:
    """Half-width of a distribution-free ~95% confidence interval of the median, relative to it.

    The interval runs between the order statistics n/2 ± 0.98·√n (binomial normal approximation), so it
    needs no assumption about the shape of the timing distribution (which is skewed, with outliers).
    """
    n = len(xs_sorted)
    if n < 5:
        return math.inf
    half = 0.98 * math.sqrt(n)
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half))
    med = quantile(xs_sorted, 0.5)
    return (xs_sorted[hi] - xs_sorted[lo]) / 2 / med if med > 0 else math.inf


def mean_halfwidth(xs: Sequence[float]) -> float:
    """Half-width of the ~95% confidence interval of the mean of `xs` (Student's t), relative to the mean; inf
    for fewer than two values. Meant for block means (`block_means`), which are near normal and near independent
    where the samples themselves are neither."""
    n = len(xs)
    if n < 2:
        return math.inf
    mean = statistics.fmean(xs)
    if mean <= 0:
        return math.inf
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96  # n - 1 degrees of freedom
    return t * statistics.stdev(xs) / math.sqrt(n) / mean


def block_means(batches: list[tuple[float, float, int]], block_s: float, start: float) -> list[float]:
    """Per-call means over consecutive blocks of at least `block_s` of wall time, from batches given in order as
    (end time, sum of their samples, number of samples), the first block starting at `start`. The batch-means
    method: samples under a power cap are correlated over tens of milliseconds (the cap's controller moves the
    clock), so their own spread understates the mean's error; means over blocks longer than that are not. A last,
    shorter block is left out; so are batches without samples."""
    out: list[float] = []
    total, n, begin = 0.0, 0, start
    for end, sum_ms, count in batches:
        total, n = total + sum_ms, n + count
        if end - begin >= block_s:
            if n:
                out.append(total / n)
            total, n, begin = 0.0, 0, end
    return out


def summarize(samples_ms: list[float], keep: int = 512) -> SampleStats:
    """Summary of the samples (ms). Raw samples are kept up to `keep`, evenly thinned beyond it. Raises ValueError
    where there are none or one is no duration (NaN, infinite or negative: a broken timer), as no statistic of them
    holds: sorted around a NaN, the median is any sample, and a negative mean reads as no spread (cv 0)."""
    bad = next((x for x in samples_ms if not 0 <= x < math.inf), None)  # a NaN fails both comparisons
    if not samples_ms or bad is not None:
        what = "no samples" if not samples_ms else f"a sample of {bad!r} ms among {len(samples_ms)}"
        raise ValueError(f"the timer gave {what}: a row's statistics need durations, finite and >= 0")
    xs = sorted(samples_ms)
    n = len(xs)
    mean = statistics.fmean(xs)
    stdev = statistics.stdev(xs) if n > 1 else 0.0
    med = quantile(xs, 0.5)
    kept = samples_ms if n <= keep else [samples_ms[round(i * (n - 1) / (keep - 1))] for i in range(keep)]
    return SampleStats(n=n, median=med, p10=quantile(xs, 0.1), p90=quantile(xs, 0.9), mean=mean, stdev=stdev,
                 cv=stdev / mean if mean > 0 else 0.0, min=xs[0], max=xs[-1], samples=list(kept))


def copy_medians(samples_ms: list[float], copies_used: list[int], copies: int, min_each: int = 3) -> list[float] | None:
    """The median of each input copy's samples, where sample i was timed on copy copies_used[i]; None when a copy
    has fewer than `min_each` samples (or the two lists differ in length)."""
    if len(samples_ms) != len(copies_used) or copies < 1:
        return None
    groups: list[list[float]] = [[] for _ in range(copies)]
    for copy, sample in zip(copies_used, samples_ms):
        groups[copy].append(sample)
    if min(len(g) for g in groups) < min_each:
        return None
    return [statistics.median(g) for g in groups]


def placement_notes(samples_ms: list[float], used: list[int], copies: int, discarded: int) -> dict[str, str]:
    """The estimator notes of a row timed over `copies` input copies (`used`: the copy of every call of the timed
    closure, in call order, the timed calls last): each copy's median and their mean ("copy_mean"), where every
    timed call can be matched to its copy (no batch was discarded) and each copy has samples enough; else the
    median of all samples, and why."""
    if discarded:
        return {"copy_estimator": f"median of all samples ({discarded} batch(es) discarded: calls and samples no "
                                  f"longer line up)"}
    medians = copy_medians(samples_ms, used[-len(samples_ms):] if samples_ms else [], copies)
    if medians is None:
        return {"copy_estimator": "median of all samples (a copy has fewer than 3 samples)"}
    if min(medians) <= 0:  # the events timer clamps a reading at 0: a copy it did not resolve has no time to average
        return {"copy_estimator": "median of all samples (a copy's median is 0 ms: the timer did not resolve it)"}
    mean = statistics.fmean(medians)
    return {"estimator": "copy_mean", "copy_mean_ms": repr(mean),
            "copy_medians_ms": ",".join(f"{m:.6g}" for m in medians),
            "placement_spread": f"{max(medians) / min(medians) - 1:.4f}"}


def _resolution(xs_sorted: list[float]) -> float:
    """The smallest step between distinct sample values: the timer's tick as the samples show it."""
    gaps = [b - a for a, b in zip(xs_sorted, xs_sorted[1:]) if b > a]
    return min(gaps) if gaps else 0.0


class StopRule:
    """Stop when at least `min_samples` and `min_time_s` are reached, the samples hold either `min_work_s`
    of timed work or `min_work_n` samples, and the median's relative CI half-width is under `target` (or the
    interval spans one tick of the samples' clock: "resolution"); or when `budget_s` or `max_samples` is reached.

    The work floor keeps a long kernel from converging on its first few samples: its clock still moves
    (power capping acts over tens of milliseconds), and a median of 10 samples taken in 15 ms would name
    one moment of that, not the kernel's steady time."""

    def __init__(self, *, target: float = 0.005, min_samples: int = 10, max_samples: int = 2000,
                 min_time_s: float = 0.02, budget_s: float = BUDGET_S, min_work_s: float = 0.05, min_work_n: int = 100):
        self.target, self.min_samples, self.max_samples = target, min_samples, max_samples
        self.min_time_s, self.budget_s = min_time_s, budget_s
        self.min_work_s, self.min_work_n = min_work_s, min_work_n

    @classmethod
    def from_env(cls) -> "StopRule":
        """The default rule, with KPROF_TIME_BUDGET_S (seconds per spec) and KPROF_TARGET_CI (relative
        half-width of the median's CI) overriding the budget and the target when set."""
        from ..settings import env_number, env_seconds

        kw = {"budget_s": env_seconds("KPROF_TIME_BUDGET_S", BUDGET_S)}
        target = env_number("KPROF_TARGET_CI", "a relative half-width between 0 and 1", lambda v: 0 < v < 1, "0.005")
        if target is not None:
            kw["target"] = target
        return cls(**kw)

    def check(self, samples: list[float], elapsed_s: float) -> str | None:
        n = len(samples)
        if n >= self.max_samples:
            return "max_samples"
        if elapsed_s >= self.budget_s and n >= 3:
            return "budget"
        if n >= self.min_samples and elapsed_s >= self.min_time_s and n % 5 == 0:
            if n < self.min_work_n and math.fsum(samples) < self.min_work_s * 1e3:
                return None
            xs = sorted(samples)
            half = median_halfwidth(xs)
            if half <= self.target:
                return "converged"
            if 2 * half * quantile(xs, 0.5) <= _resolution(xs) * (1 + 1e-9):
                return "resolution"  # the CI spans one tick of the clock: more samples cannot narrow it
        return None
