"""Which kernels belong to which timed invocation, and what one invocation cost.

Pure functions over plain tuples, so every rule here is tested on the CPU:

- a kernel is ``(name, start_ns, end_ns, correlation_id)``, copied out of a CUPTI CONCURRENT_KERNEL record;
- a correlation is ``(correlation_id, external_id)``, copied out of an EXTERNAL_CORRELATION record: the runtime
  or driver API call ``correlation_id`` was made while ``external_id`` was pushed on CUPTI's stack.

The L2 flush is launched outside every pushed id and outside every timestamp window, so neither attribution
ever hands it to an invocation.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Sequence

from ..errors import KprofError

__all__ = ["TimerError", "UnstableKernels", "Kernel", "by_correlation", "by_window", "launch_order",
           "check_same_kernels", "kernel_time_ms", "one_invocation"]

Kernel = tuple  # (name: str, start_ns: int, end_ns: int, correlation_id: int)

_NAME_CHARS = 100  # kernel names are long mangled templates; messages show this much of each


class TimerError(KprofError):
    """The GPU timer cannot give an honest sample: the kernel set changed between invocations, CUPTI dropped
    records, or no kernel was seen. Raised loudly; a timing is never guessed."""


class UnstableKernels(TimerError):
    """The kernels seen differed between a callable's invocations: a library changed its launch sequence while it
    settled, or CUPTI handed over no record of one invocation. A second attempt may see a stable set."""


def by_correlation(kernels: Iterable[Kernel], correlations: Iterable[tuple[int, int]],
                   ids: Sequence[int]) -> list[list[Kernel]]:
    """One group per external id in `ids` (same order): the kernels whose launching API call ran while that
    id was pushed, in launch order. Kernels launched under no id (the L2 flush) or under another id are left
    out."""
    external = dict(correlations)
    slot = {ext: i for i, ext in enumerate(ids)}
    groups: list[list[Kernel]] = [[] for _ in ids]
    for k in kernels:
        i = slot.get(external.get(k[3], -1))
        if i is not None:
            groups[i].append(k)
    return [launch_order(g) for g in groups]


def by_window(kernels: Iterable[Kernel], windows: Sequence[tuple[int, int]]) -> list[list[Kernel]]:
    """One group per (t0, t1) window (same order): the kernels that start and end inside it, in launch order.

    Valid only when the host synchronized before t0 and after the call, and nothing else runs on the GPU:
    then everything inside the window was launched by the call."""
    ks = launch_order(kernels)
    return [[k for k in ks if t0 <= k[1] and k[2] <= t1] for t0, t1 in windows]


def launch_order(kernels: Iterable[Kernel]) -> list[Kernel]:
    return sorted(kernels, key=lambda k: (k[1], k[2]))


def _show(counts: Counter) -> str:
    def short(name: str) -> str:
        return name if len(name) <= _NAME_CHARS else name[:_NAME_CHARS] + "…"
    return "{" + ", ".join(f"{short(n)} ×{c}" for n, c in sorted(counts.items())) + "}"


def check_same_kernels(reference: Sequence[str], names: Sequence[str], where: str) -> None:
    """Raise TimerError unless `names` is the same multiset of kernel names as `reference` (the first warm-up
    invocation's). A changing launch sequence means the samples would not measure one thing."""
    ref, got = Counter(reference), Counter(names)
    if ref == got:
        return
    raise UnstableKernels(
        f"unstable kernel set: {where} launched {_show(got)}, but the first warm-up invocation launched "
        f"{_show(ref)} (missing {_show(ref - got)}, extra {_show(got - ref)}); time a callable whose launch "
        f"sequence does not change between calls (move autotuning, allocation and lazy setup out of it)")


def kernel_time_ms(group: Sequence[Kernel], pattern: re.Pattern | None = None) -> float:
    """Sum of (end - start) of the group's kernels, in ms; with `pattern`, only kernels whose name it matches
    (re.search). Gaps between kernels are not counted: this is kernel time, not a span."""
    chosen = [k for k in group if pattern is None or pattern.search(k[0])]
    if not chosen:
        seen = _show(Counter(k[0] for k in group))
        if pattern is None:
            raise TimerError("no kernel seen for an invocation; check that the callable launches GPU work")
        raise TimerError(f"kernel_filter {pattern.pattern!r} matches none of the invocation's kernels {seen}; "
                         f"fix the regex or drop kernel_filter to sum the whole launch sequence")
    for name, start, end, _ in chosen:
        if start <= 0 or end < start:
            raise TimerError(f"CUPTI returned an invalid kernel timestamp for {name[:_NAME_CHARS]} "
                             f"(start={start}, end={end}); rerun, and use timer='events' if it persists")
    return sum(end - start for _, start, end, _ in chosen) / 1e6


def one_invocation(names: Sequence[str], copies: int) -> tuple[str, ...]:
    """The kernel names of one invocation out of a graph replay that ran `copies` rotations back to back:
    the first len/copies names when the replay divides evenly, else the whole replay."""
    n = len(names)
    if copies > 1 and n % copies == 0:
        return tuple(names[: n // copies])
    return tuple(names)
