"""Records the measure diagnostic's window on the GPU: every launch of one kernel for `duration_s`, traced by CUPTI,
beside NVML telemetry sampled on a background thread. torch, cupti and pynvml are imported when called.

The recipe: build the sweep (cold L2), learn one launch's kernel sequence, time the host loop, then run the window
and hand `kprof.measure.diagnostic` the plain records.

- Cold L2 (default), exactly as rows are timed: before each launch a read sweep of twice the L2 and the rewrite of
  the case's activations (`Case.warm`, or `Case.refresh`), outside the launch's kernels. `clear_l2=False`: launches
  back to back, warm.
- Graph mode: the callable is captured once and each launch is a replay. With a cold L2 a replay holds one
  invocation, swept before it as an eager call is (a row's graph mode); with a warm L2 a replay holds enough
  invocations for >= 100 µs of kernel time, so host dispatch never leaves the GPU idle.
- Attribution by stream order: only kernel and memcpy records are traced in the window (the runtime and driver API
  records that external correlation needs would multiply the records and the host's work per launch). The
  warm-up learns the sequence of one launch (sweep, rewrite, call) in synchronized CUPTI timestamp windows; on one
  stream with nothing else on the GPU, the window's kernels in start order are that sequence repeated, and
  `diagnostic.segment` checks every repetition by name.
- The host keeps at most IN_FLIGHT batches of ~10 ms queued (a CUDA event per batch), so the window ends when
  its time is up, not when a deep launch queue drains.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time

from ..errors import SettingError
from ._nvml_telemetry import Telemetry
from ._l2 import activations_rewrite
from ._sampling import side_warmup
from .diagnostic import Window, segment

__all__ = ["record_window"]

LEARN_ROUNDS = 3
UNROLL_TARGET_NS = 100_000  # a warm graph replay holds at least this much kernel time ...
MAX_UNROLL = 256  # ... in at most this many invocations ...
UNROLL_BYTES = 512 << 20  # ... whose counted bytes (an upper bound on their outputs) stay under this
BATCH_S = 0.01  # host wall time of one batch of launches between CUDA events
IN_FLIGHT = 3  # batches queued ahead of the GPU at most
TIME_HOST_S = 0.02  # the host loop is timed over at least this long before the window
# CUPTI's kernel records of a window are held in memory until it ends (about 200 bytes each as Python records): a
# window that would record more is refused before it starts, naming the longest --duration-s this kernel allows.
MAX_RECORDS = 10_000_000


def _energy_reader(index: int, errors: dict[str, str]):
    """NVML's total-energy counter (mJ), read at the window's ends and with each sample; None (why in errors)
    where the GPU has none. A read NVML refuses partway (an Unknown Error) is None, why in errors: the window
    already recorded is kept."""
    from ._nvml_access import NvmlError, _energy_counter

    try:
        counter = _energy_counter(index)
    except NvmlError as e:
        errors["energy"] = str(e)
        return None

    def read() -> int | None:
        try:
            return counter()
        except Exception as e:  # noqa: BLE001 - recorded, as every other reading NVML refuses
            errors.setdefault("energy", f"reading the energy counter failed: {type(e).__name__}: {e}")
            return None

    return read


def _kernels_only(session) -> None:
    """Stop tracing the runtime and driver API and external correlation: the window attributes by stream order."""
    kinds = session.cupti.ActivityKind
    for kind in (kinds.RUNTIME, kinds.DRIVER, kinds.EXTERNAL_CORRELATION):
        session.cupti.activity_disable(kind)


def _learn(torch, session, prefix, call) -> tuple[tuple[str, ...], tuple[str, ...], float]:
    """(prefix kernels, call kernels, kernel ns of one call) from LEARN_ROUNDS synchronized timestamp windows; the
    same sequence every round, else TimerError."""
    from ._attribution import TimerError, by_window

    windows = []
    for _ in range(LEARN_ROUNDS):
        torch.cuda.synchronize()
        a = session.timestamp()
        if prefix is not None:
            prefix()
        torch.cuda.synchronize()
        b = session.timestamp()
        call()
        torch.cuda.synchronize()
        windows += [(a, b), (b, session.timestamp())]
    kernels, _ = session.collect()
    groups = by_window(kernels, windows)
    if not all(groups[1::2]):  # a record may arrive a flush late
        kernels += session.collect()[0]
        groups = by_window(kernels, windows)
    pre = {tuple(k[0] for k in g) for g in groups[0::2]}
    calls = {tuple(k[0] for k in g) for g in groups[1::2]}
    if len(pre) != 1 or len(calls) != 1:
        raise TimerError(f"the launch sequence changed between warm-up launches (calls: {sorted(calls)}; before them: "
                         f"{sorted(pre)}); measure a callable whose kernels do not change between calls")
    (names,) = calls
    if not names:
        raise TimerError("CUPTI saw no kernel of the callable in the warm-up: it launched no GPU work on this device, "
                         "or another profiler holds CUPTI in this process")
    ns = sorted(sum(k[2] - k[1] for k in g) for g in groups[1::2])
    return next(iter(pre)), names, float(ns[len(ns) // 2])


def _unroll(call_ns: float, call_bytes: float) -> int:
    by_time = -(-UNROLL_TARGET_NS // max(1, int(call_ns)))
    by_bytes = int(UNROLL_BYTES // call_bytes) if call_bytes > 0 else MAX_UNROLL
    return max(1, min(MAX_UNROLL, by_time, by_bytes))


def _capture(torch, fn, unroll: int):
    """A graph of `unroll` invocations of fn (warmed on a side stream first, as torch.cuda.graphs asks); its replay."""
    side_warmup(torch, [fn])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(unroll):
            fn()
    torch.cuda.synchronize()
    return graph.replay  # the bound method keeps the graph alive


def record_window(case, *, duration_s: float, telemetry_hz: float, clear_l2: bool = True, graph: bool = False,
                  index: int = 0) -> Window:
    """One window of `duration_s` of `case.fn` launches on CUDA device `index` (see the module's recipe). `case` is
    a runner's Case (fn, inputs, warm, refresh, bytes, kernel_filter are read). telemetry_hz 0: no sampler."""
    import re

    import torch

    from . import _cupti, _l2
    from ._attribution import TimerError

    errors: dict[str, str] = {}
    notes = {"timer": "cupti", "attribution": "stream order, sequence learned in synchronized windows",
             "l2": "read-sweep" if clear_l2 else "warm", "launch": "graph" if graph else "eager",
             "weights": "one allocation of the inputs (a CUDA row's time is the mean over up to 16 placements of "
                        "its weights and decode-sized activations: its notes' input_copies, activation_copies)"}
    pattern = re.compile(case.kernel_filter) if case.kernel_filter else None
    if pattern is not None:
        notes["kernel_filter"] = case.kernel_filter
    prefix = None
    if clear_l2:
        sweep, nbytes = _l2.flusher(index)
        notes["l2_flush_bytes"] = str(nbytes)
        rewrite = activations_rewrite(torch, case)  # as a row does after each sweep
        prefix = sweep
        if rewrite is not None:
            notes["l2_warm_inputs"] = "activations rewritten after the sweep (dirty in L2, as produced)"

            def prefix():  # noqa: F811 - the sweep, then the activations written back into L2
                sweep()
                rewrite()
    energy = _energy_reader(index, errors)
    with _cupti.Session() as session:
        _kernels_only(session)
        case.fn()  # lazy setup (handles, modules, autotuning) before anything is learned
        torch.cuda.synchronize()
        call, unroll = case.fn, 1
        if graph:
            if not clear_l2:
                unroll = _unroll(_learn(torch, session, None, case.fn)[2], float(case.bytes or 0))
            call = _capture(torch, case.fn, unroll)
        pre, names, _ns = _learn(torch, session, prefix, call)
        one = names[: len(names) // unroll]
        if one * unroll != names:
            raise TimerError(f"a replay of {unroll} invocations launched {len(names)} kernels, not {unroll} repeats of "
                             f"one invocation's sequence; measure without --cuda-graph")
        notes.update(invocations_per_replay=str(unroll))
        batch, per_s = _batch(torch, prefix, call)
        _check_records(duration_s, per_s, len(pre) + len(names))
        notes["batch"] = str(batch)
        torch.cuda.synchronize()
        session.collect()  # the warm-up's and the host timing's records are not the window's
        sampler = Telemetry(index, telemetry_hz, energy=energy) if telemetry_hz > 0 else None
        with sampler or contextlib.nullcontext():
            e0 = (time.perf_counter(), energy()) if energy is not None else None
            host0, ts0 = time.perf_counter(), session.timestamp()
            iterations = _run(torch, prefix, call, batch, host0, duration_s)
            torch.cuda.synchronize()
            host1 = time.perf_counter()
            e1 = (time.perf_counter(), energy()) if energy is not None else None
        samples = []
        if sampler is not None:  # its times from the window's zero (host0), not from its own start
            errors.update(sampler.errors)
            samples = [s._replace(t=s.t + (sampler.t0 - host0)) for s in sampler.samples]
        kernels, _ = session.collect()
        if sum(1 for k in kernels if k[1] >= ts0) < iterations * (len(pre) + len(names)):
            kernels += session.collect()[0]  # a record may arrive a flush late
    notes.update(iterations=str(iterations), host_loop_s=f"{host1 - host0:.4f}")
    launches, busy, last_end = segment(kernels, pre if unroll == 1 else (), one, ts0, pattern)
    if len(launches.duration) != iterations * unroll:
        raise TimerError(f"CUPTI recorded {len(launches.duration)} launches of the {iterations * unroll} enqueued; "
                         f"rerun, and report it if it persists")
    return Window(launches=launches, span_s=last_end / 1e9, busy_ns=busy,
                  samples=samples, telemetry_hz=telemetry_hz,
                  telemetry_errors=errors,
                  energy=(e0[0] - host0, e0[1], e1[0] - host0, e1[1]) if e0 and e1 and None not in (e0[1], e1[1])
                  else None,
                  kernels=one, prefix=pre if unroll == 1 else (), notes=notes)


def _check_records(duration_s: float, per_s: float, kernels: int) -> None:
    """Refuses a window whose kernel records (one launch every per_s, `kernels` records each) would pass MAX_RECORDS."""
    expected = duration_s / per_s * kernels
    if expected > MAX_RECORDS:
        longest = max(1, math.floor(MAX_RECORDS / kernels * per_s))
        raise SettingError(*(
            f"{flag}{duration_s:g} of this kernel would record about {expected:,.0f} CUPTI kernel records (a launch "
            f"every {per_s * 1e6:.1f} µs, {kernels} kernel{'s' if kernels != 1 else ''} each), over the "
            f"{MAX_RECORDS:,} a window holds in memory; use {flag}{longest} or less" for flag in ("duration_s=",
                                                                                             "--duration-s ")))


def _batch(torch, prefix, call) -> tuple[int, float]:
    """(launches per batch: about BATCH_S of the host loop, seconds a launch), timed back to back over TIME_HOST_S."""
    t = time.perf_counter()
    k = 0
    while k < 5 or time.perf_counter() - t < TIME_HOST_S:
        if prefix is not None:
            prefix()
        call()
        k += 1
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / k
    return max(1, min(100_000, round(BATCH_S / per))), per


def _run(torch, prefix, call, batch: int, host0: float, duration_s: float) -> int:
    """The window's host loop: batches of launches, each followed by a CUDA event, at most IN_FLIGHT queued, until
    duration_s of wall time has passed. Returns the iterations (launches, or replays) enqueued."""
    queued: collections.deque = collections.deque()
    iterations = 0
    clock = time.perf_counter
    while True:
        if prefix is None:
            for _ in range(batch):
                call()
        else:
            for _ in range(batch):
                prefix()
                call()
        iterations += batch
        event = torch.cuda.Event()
        event.record()
        queued.append(event)
        if len(queued) >= IN_FLIGHT:
            queued.popleft().synchronize()
        if clock() - host0 >= duration_s:
            return iterations
