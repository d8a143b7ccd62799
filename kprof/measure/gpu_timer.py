"""The GPU timers: kernel time from CUPTI activity records (default) or CUDA-event time per launch, with a cold
L2 before every timed launch and adaptive stopping by `StopRule`. torch and cupti are imported when called.

- ``timer="cupti"``: a sample is the sum of (end - start) of every kernel one logical invocation launched (or
  of those `kernel_filter` matches): the full launch sequence of a compound callable, without launch gaps.
  Kernels are attributed through a CUSTOM external correlation id pushed around each invocation, so
  invocations go out in batches (flush, fn, flush, fn, ..., one synchronize, one CUPTI flush). During warm-up
  the same invocations are also bracketed by synchronized CUPTI timestamps; if correlation does not find
  exactly the kernels of each window, every timed invocation is bracketed that way instead (slower wall,
  same kind of sample). notes["attribution"] says which, notes["launch"] whether launches were batched.
- ``timer="events"``: a torch.cuda.Event pair around each launch, L2 flush before the start event, one
  synchronize per batch: triton.testing.do_bench's method. Includes launch gaps inside the callable (small
  kernels read ~3-4 µs slow).
- ``graph=True``: the callable captured as one CUDA graph, a sample per replay, swept before each replay as
  an eager call is (or, given rotations, one graph calling every input copy once, a sample being a replay's
  time over the copies).
- ``placements``: the callable on several allocations of its inputs; invocations rotate over them in turn,
  eager or graph (one graph each), and ``GpuTiming.placement_order`` says which each invocation used.
- ``state``: the thermal and power protocol (`kprof.measure._state`): before the first sample the callable runs
  back to back, as the samples will, until the SM clock holds steady; each timed batch is read while it runs,
  and a batch off the settled clock (or thermally slowed) is discarded. Without it, calls of 1 ms or more
  run back to back for _SETTLE_S first and every batch is kept.
- Cold L2 (`kprof.measure._l2`) is a read sweep of twice the L2 before each timed launch: it leaves clean lines,
  so the timed kernel never pays for writing back a flush's dirty lines.
"""

from __future__ import annotations

import re
import time
from typing import Callable, NamedTuple

from ..errors import UsageError
from . import _cupti, _l2
from ._state import StateProtocol
from ._attribution import (TimerError, UnstableKernels, by_correlation, by_window, check_same_kernels, kernel_time_ms,
                           one_invocation)
from ._events_timer import _run_events
from ._sampling import GRAPH_WARMUP_ROUNDS, _WARMUP_MAX, _WARMUP_S, _heated, _sample, _settle, side_warmup
from .stats import StopRule

__all__ = ["GpuTiming", "TimerError", "time_gpu", "cupti_available", "rotation_copies"]



class GpuTiming(NamedTuple):
    samples_ms: list[float]  # one per timed invocation: kernel time (cupti) or event time (events)
    stop_reason: str  # converged | resolution | budget | max_samples (StopRule.check; a capped row: capped_stop)
    warmup: int  # invocations run before timing
    wall_s: float  # wall time spent in time_gpu, warm-up included
    gpu_s: float  # timed GPU seconds: sum of samples x invocations per sample; gpu_s / wall_s = timer efficiency
    kernels: tuple[str, ...]  # kernel names of one invocation, in launch order (cupti); () for events
    dropped: int  # CUPTI records dropped (always 0: a drop raises TimerError)
    notes: dict[str, str]  # timer, attribution, launch, l2, l2_flush_bytes, batch, graph_copies, ...
    placement_order: tuple[int, ...] = ()  # with placements: the placement of every invocation, in call order


def cupti_available() -> str | None:
    """None when cupti-python imports and CUPTI answers; else the reason, for the row's error field."""
    try:
        _cupti.load().get_timestamp()
    except Exception as e:  # noqa: BLE001 - any failure is a reason, reported as text
        return f"{type(e).__name__}: {e}"
    return None


def rotation_copies(input_bytes: int, device=None) -> int:
    """How many input copies graph mode needs on `device`: the fewest whose total bytes exceed 2x its L2."""
    import torch

    with torch.cuda.device(device):
        return _l2.copies_for(input_bytes, _l2.l2_bytes(torch.cuda.current_device()))


def time_gpu(fn: Callable[[], object], rule: StopRule | None = None, *, timer: str = "cupti",
             cold_l2: bool = True, graph: bool = False, kernel_filter: str | None = None,
             rotations: list[Callable[[], object]] | None = None, device=None,
             state: StateProtocol | None = None,
             warm: Callable[[], object] | list[Callable[[], object]] | None = None,
             heat: Callable[[], object] | None = None,
             placements: list[Callable[[], object]] | None = None) -> GpuTiming:
    """Time `fn` on the GPU until `rule` stops (default `StopRule()`).

    fn: the production callable, inputs built beforehand; it is called once before warm-up so lazy setup
        (cuBLAS handles, module loading, autotuning) happens outside every sample, then warmed up for
        >= 2 invocations and ~10 ms (200 at most); every later invocation must launch the same multiset of
        kernels as the first warm-up one (cupti), else TimerError.
    cold_l2: read a buffer of 2x the device's L2 before every timed launch, outside the timed region.
    kernel_filter: regex (re.search) on kernel names; only matching kernels are summed (cupti only).
    graph: the callable is captured once as a CUDA graph and each invocation is one replay. With cold_l2 the
        sweep (and `warm`) runs before every replay, outside the graph, exactly as before an eager call, so
        the two modes time the same L2 state and differ only in how the callable's kernels are launched.
    rotations: instead, one graph calls every rotation (a closure over its own copy of the inputs) once and
        a sample is a replay's time over the copies; L2 stays cold only if the copies' bytes exceed 2x the L2
        (`rotation_copies`). No sweep then; fn is not called.
    device: the CUDA device (index, "cuda:N" or torch.device); the current one when None.
    warm: with cold_l2, called after each flush, outside the timed region: puts back in L2 the inputs a
        model's previous kernel would have just written (the activations), so only the rest (weights, KV
        caches) is cold, as inside a model. With placements, a list of one callable per placement: the sweep
        before each call is followed by the warm of the placement that call uses.
    placements: instead of fn, the callable on each of several allocations of its inputs (its weights, and its
        activations where they are small): invocations rotate over them in order, eagerly or, with graph, as one
        graph per placement (the sweep before each replay as before), so eager and graph rows time the same mix
        of allocations. The result's placement_order lists the placement of every invocation (warm-up and
        settle included, the timed ones last).
    heat: the loaded power state: one unit of heavy work (a large GEMM) enqueued before every sweep, as many
        units (32 at most) as take about 4x a warm-up call's wall time, so the GPU runs at its power limit as it
        does inside a prefill, whatever the timed kernel itself draws. Outside the timed region, like the sweep.
    state: the thermal and power protocol whose probe reads this device (settle, then hold every batch to the
        settled clock); its summary joins the notes. None: the fixed settle of long calls only.
    """
    started = time.perf_counter()
    rule = rule or StopRule()
    pattern = _check_args(fn, timer, graph, kernel_filter, rotations, placements)
    import torch

    if not torch.cuda.is_available():
        raise TimerError("time_gpu needs a CUDA device and torch sees none; use the CPU timer (time_cpu) here")
    with torch.cuda.device(device):
        index = torch.cuda.current_device()
        notes = {"timer": timer, "device": f"cuda:{index}"}
        if kernel_filter:
            notes["kernel_filter"] = kernel_filter
        flush = None
        copies = None
        order: list[int] = []
        if placements:
            placements = list(placements)
            notes["placements"] = str(len(placements))
        elif graph:
            copies = list(rotations) if rotations else [fn]
            notes["graph_copies"] = str(len(copies))
        if rotations:
            notes.update(l2="rotation", l2_flush_bytes="0")
        elif cold_l2:
            flush, nbytes = _l2.flusher(index)
            notes.update(l2="read-sweep", l2_flush_bytes=str(nbytes))
            if warm is not None:
                sweep = flush
                if isinstance(warm, (list, tuple)):  # one per placement: the next call's activations
                    if not placements or len(warm) != len(placements):
                        raise UsageError(f"warm as a list needs one callable per placement ({len(warm)} given "
                                         f"for {len(placements or [])} placements)")
                    warms = list(warm)

                    def warm():  # noqa: F811 - the placement the next call uses (see _rotating)
                        warms[len(order) % len(warms)]()

                def flush():  # noqa: F811 - the sweep, then the activations read back in
                    sweep()
                    warm()

                notes["l2_warm_inputs"] = "activations rewritten after the sweep (dirty in L2, as produced)"
        else:
            notes.update(l2="warm", l2_flush_bytes="0")

        if timer == "events":
            call, per_call, primed = _prime(torch, fn, copies, placements, graph, order)
            samples, reason, warm = _run_events(torch, call, flush, per_call, rule, notes, state, heat)
            names: tuple[str, ...] = ()
            dropped = 0
        else:
            why = cupti_available()
            if why:
                raise TimerError(f"timer='cupti' cannot use CUPTI ({why}); install cupti-python with its "
                                 f"nvidia-cuda-cupti (pip install --no-deps), or pass timer='events'")
            # The session opens before any graph is captured: CUPTI attaching after capture can leave a
            # graph's kernels untraced.
            with _cupti.Session() as session:
                call, per_call, primed = _prime(torch, fn, copies, placements, graph, order)
                samples, reason, warm, ref = _run_cupti(torch, session, call, flush, per_call, rule, pattern,
                                                        notes, state, heat)
                dropped = session.dropped
            names = one_invocation(ref, per_call)
            notes["kernels_per_invocation"] = str(len(names))
        if state is not None:
            notes.update(state.summary())
    return GpuTiming(samples, reason, primed + warm * per_call, time.perf_counter() - started,
                     sum(samples) * per_call / 1e3, names, dropped, notes, tuple(order))


def _rotating(placements: list[Callable[[], object]], graph: bool, order: list[int]) -> Callable[[], object]:
    """One invocation per call, rotating over `placements` in turn and appending each one's index to `order`.
    Graph mode: each placement captured as its own CUDA graph (the captures share one memory pool: they are
    replayed one at a time), after eager rounds on a side stream; the call replays the next one."""
    import torch

    calls = placements
    if graph:
        side_warmup(torch, placements)
        graphs, pool = [], None
        for c in placements:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                c()
            pool = g.pool()
            graphs.append(g)
        torch.cuda.synchronize()
        calls = [g.replay for g in graphs]  # the bound replays keep their graphs alive
    n = len(calls)

    def call():
        i = len(order) % n
        order.append(i)
        return calls[i]()

    return call


def _check_args(fn, timer, graph, kernel_filter, rotations, placements) -> re.Pattern | None:
    if timer not in ("cupti", "events"):
        raise UsageError(f"timer must be 'cupti' or 'events', not {timer!r}")
    if kernel_filter is not None and timer != "cupti":
        raise UsageError("kernel_filter selects kernels by name, which only timer='cupti' sees; "
                         "drop it or use timer='cupti'")
    if rotations is not None and not graph:
        raise UsageError("rotations are graph mode's input copies; pass graph=True, or drop rotations "
                         "(eager launches get an L2 flush instead)")
    if rotations is not None and not (rotations and all(callable(r) for r in rotations)):
        raise UsageError("rotations must be a non-empty list of callables, one per input copy")
    if placements is not None and (rotations is not None or not (placements and all(callable(p) for p in placements))):
        raise UsageError("placements must be a non-empty list of callables, one per allocation of the inputs, "
                         "and cannot be combined with rotations")
    if not callable(fn) and not (graph and rotations) and not placements:
        raise UsageError(f"fn must be a callable taking no arguments, not {type(fn).__name__}")
    try:
        return re.compile(kernel_filter) if kernel_filter else None
    except re.error as e:
        raise UsageError(f"kernel_filter {kernel_filter!r} is not a valid regex: {e}") from e


def _prime(torch, fn, copies, placements=None, graph=False, order=None):
    """Run the callable before any warm-up sample, so lazy setup stays out of the kernel sets compared.
    Graph mode: eager rounds on a side stream, then one capture calling every copy once. Placements: the
    rotating call over them (`_rotating`; its graphs captured here, inside the CUPTI session).
    Returns (call, invocations per call, invocations run)."""
    if placements:
        fn = _rotating(placements, graph, order)
    if copies is None:
        fn()
        torch.cuda.synchronize()
        return fn, 1, 1 + (GRAPH_WARMUP_ROUNDS * len(placements) if placements and graph else 0)  # _rotating's rounds
    side_warmup(torch, copies)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in copies:
            c()
    torch.cuda.synchronize()
    return g.replay, len(copies), GRAPH_WARMUP_ROUNDS * len(copies)  # g.replay keeps the graph alive


def _scoped(session, external_id: int, call) -> None:
    session.push(external_id)
    try:
        call()
    finally:
        session.pop(external_id)


def _uniform(groups) -> bool:
    """Whether every group holds the same multiset of kernel names (and none is empty)."""
    first = sorted(_names(groups[0])) if groups else []
    return bool(first) and all(sorted(_names(g)) == first for g in groups)


def _names(group) -> list[str]:
    return [k[0] for k in group]


def _attributed(session, attribute, complete):
    """attribute(kernels, correlations) over the records CUPTI has handed over; when `complete` says the
    result lacks kernels, over those of one more flush too (a record may come a flush late)."""
    kernels, correlations = session.collect()
    result = attribute(kernels, correlations)
    if not complete(result):
        more_k, more_c = session.collect()
        result = attribute(kernels + more_k, correlations + more_c)
    return result


def _windowed(torch, session, call, flush) -> tuple[int, int]:
    """One call between two synchronized CUPTI timestamps (the flush before it, outside the window)."""
    if flush is not None:
        flush()
    torch.cuda.synchronize()
    a = session.timestamp()
    call()
    torch.cuda.synchronize()
    return a, session.timestamp()


def _warm_cupti(torch, session, call, flush):
    """Warm up with each invocation both under an external id and inside a synchronized timestamp window;
    choose the attribution, and return (groups, attribution, why, wall per invocation)."""
    windows, ids = [], []
    t = time.perf_counter()
    while len(ids) < 2 or (time.perf_counter() - t < _WARMUP_S and len(ids) < _WARMUP_MAX):
        ids.append(len(ids) + 1)
        windows.append(_windowed(torch, session, lambda: _scoped(session, ids[-1], call), flush))
    per_call_s = (time.perf_counter() - t) / len(ids)
    win, cor, n_kernels, n_correlations = _attributed(
        session, lambda kernels, correlations: (by_window(kernels, windows), by_correlation(kernels, correlations, ids),
                                                len(kernels), len(correlations)),
        lambda r: _uniform(r[0]) and _uniform(r[1]))
    if not any(win) and not any(cor):
        raise TimerError(f"CUPTI saw no kernel in {len(ids)} warm-up invocations ({n_kernels} kernel records "
                         f"in all): the callable launched no GPU work on this device, or another profiler "
                         f"(torch.profiler, nsys) holds CUPTI in this process; use timer='events' to check")
    # Correlation is exact where every window's kernels are among its invocation's: a window that lacks one of them
    # had its record's timestamps fall past the synchronized window (CUPTI's GPU clock, converted to the host's, can
    # be a few µs off, and a call's kernel ends a few µs before its synchronize returns). A window holding a kernel
    # that correlation lacks means work launched outside the pushed id: then the windows are the attribution.
    pairs = [(set(c), set(w)) for c, w in zip(cor, win)]
    if _uniform(cor) and all(w <= c for c, w in pairs):
        late = sum(w != c for c, w in pairs)
        why = (f"{late} of {len(ids)} warm-up windows lacked a kernel that external correlation attributed (its "
               f"timestamps past the window)") if late else ""
        return cor, "external_correlation", why, per_call_s
    found = sum(len(c) for c in cor)
    why = (f"external correlation attributed {found} kernels, the synchronized windows {sum(len(w) for w in win)}"
           f" ({n_correlations} correlation records)")
    return win, "timestamp_window", why, per_call_s


def _run_cupti(torch, session, call, flush, per_call, rule, pattern, notes, state=None, heat=None):
    started = time.perf_counter()
    groups, attribution, why, per_call_s = _warm_cupti(torch, session, call, flush)
    flush = _heated(torch, flush, heat, per_call_s, notes)
    _settle(torch, call, flush, per_call_s, notes, state)
    session.collect()  # the settling calls ran under no external id: their records are dropped here
    ref = _names(groups[0])
    if not ref:
        seen = sum(1 for g in groups[1:] if g)
        raise UnstableKernels(f"CUPTI saw no kernel in the first warm-up invocation, and kernels in {seen} of the "
                         f"{len(groups) - 1} after it ({attribution}); the callable must launch the same GPU work "
                         f"every call")
    for i, g in enumerate(groups[1:], 2):
        check_same_kernels(ref, _names(g), f"warm-up invocation {i}")
    ref_sorted = sorted(ref)

    def complete(groups) -> bool:
        return all(sorted(_names(g)) == ref_sorted for g in groups)

    correlated = attribution == "external_correlation"
    notes.update(attribution=attribution, launch="batched" if correlated else "synchronized")
    if why:
        notes["attribution_why"] = why
    warm = len(groups)
    next_id = warm + 1

    def batch(k: int, done: int, during: Callable[[], None]) -> list[float]:
        nonlocal next_id
        if correlated:
            ids = range(next_id, next_id + k)
            next_id += k
            for i in ids:
                if flush is not None:
                    flush()  # outside the pushed id: its kernel belongs to no invocation
                _scoped(session, i, call)
            during()  # the batch is running: read the GPU's state now
            torch.cuda.synchronize()
            groups = _attributed(session, lambda kernels, correlations: by_correlation(kernels, correlations, ids),
                                 complete)
        else:
            windows = [_windowed(torch, session, call, flush) for _ in range(k // 2)]
            during()  # between synchronized calls: the clock of the calls just run
            windows += [_windowed(torch, session, call, flush) for _ in range(k - k // 2)]
            groups = _attributed(session, lambda kernels, _correlations: by_window(kernels, windows), complete)
        out = []
        for g in groups:
            check_same_kernels(ref, _names(g), f"timed invocation {done + len(out) + 1}")
            out.append(kernel_time_ms(g, pattern) / per_call)
        return out

    samples, reason = _sample(batch, per_call_s, rule, started, notes, state)
    return samples, reason, warm, ref


