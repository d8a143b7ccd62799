"""Measures specs and turns each outcome into an event: `measured`, or `failed` with its error kind.

A failure of one spec never stops the others. Input building, correctness checks and synchronization
stay outside the timed closure; the check runs before any timing, so a wrong kernel is never timed.
"""

from __future__ import annotations

import math
import numbers
import os
import resource
import sys
import time
import traceback
from typing import Callable, Iterable, Iterator

import msgspec

from .._children import cpus
from ..errors import KprofError, UsageError
from ..ledger.build import failed, measured
from ..ledger.events import Environment, Event, Method, Origin, Provenance, Stats
from ..ledger.keys import KeyMaker
from ..specs import ShapeCodec
from ..measure._attribution import TimerError
from ..measure._nvml_access import NvmlError
from ..measure.env import host_notes
from ..measure.stats import StopRule, summarize
from ._case import Unsupported, WrongResult, algorithm_notes
from .registry import Entry

__all__ = ["measure_specs", "Outcome", "classify"]


class Outcome(msgspec.Struct, frozen=True):
    index: int  # position in the caller's spec list
    event: Event
    seconds: float  # wall time spent on this spec (build, check, timing)
    timed_seconds: float  # of which inside the timed loop


# How an allocation failure reads: CUDA's caching allocator, and torch's CPU allocator (a RuntimeError) where memory
# is limited (a ulimit, a container, strict overcommit): "can't allocate memory", "not enough memory" before 2.x.
_OOM_TEXT = ("out of memory", "can't allocate memory", "not enough memory")


def classify(exc: BaseException) -> str:
    """The error kind of a failed measurement."""
    name = type(exc).__name__
    text = str(exc).lower()
    if isinstance(exc, WrongResult):
        return "wrong_result"
    if isinstance(exc, DeviceLost):  # never tried: whatever the earlier spec's error said, this one did not fail so
        return "crash"
    # a timer's or NVML's refusal (NVML's "Not Supported": no energy counter) is the measurement's, not the kernel's
    library = not isinstance(exc, (TimerError, NvmlError))
    if isinstance(exc, (Unsupported, NotImplementedError)) or library and ("not implemented for" in text
                                                                           or "not supported" in text):
        return "unsupported"
    if name in ("OutOfMemoryError", "MemoryError") or any(m in text for m in _OOM_TEXT):
        return "oom"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "crash"


def _metrics(case, time_ms: float, energy_j: float | None) -> dict:
    seconds = time_ms / 1e3
    return {"time_ms": time_ms, "tflops": case.flops / seconds / 1e12 if case.flops else None,
            "memory_bandwidth_gbps": case.bytes / seconds / 1e9 if case.bytes else None, "energy_j": energy_j}


def _check_case(entry: Entry, case) -> None:
    """Raises ValueError unless the case's counted work (flops, bytes) is a finite number >= 0 (a plugin's negative,
    NaN or infinite count made an ok row of a negative, NaN (null in --json: "does not apply") or infinite rate), and
    its notes name none that the row's time is read from (`_time_ms`: a note "estimator": "mean" made a CPU row's
    time the mean of its samples)."""
    for name in ("flops", "bytes"):
        value = getattr(case, name)
        if not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
            raise ValueError(f"runner {entry.runner} build() counted {name}={value!r}: the work of one call is a "
                             f"finite number >= 0 (0: not counted, its rate null)")
    taken = sorted({"estimator", "copy_mean_ms"} & set(case.notes))
    if taken:
        raise ValueError(f"runner {entry.runner} build() gave the note {taken[0]!r}, which kprof reads the row's time "
                         f"by: give the runner's note another name")


def _record(kind: type, value):
    """`value` (measure's SampleStats or DeviceEnvironment, or the ledger record already) as the ledger record
    `kind`: the same fields, converted here so that measure never imports the ledger."""
    return value if type(value) is kind else kind(**msgspec.structs.asdict(value))


def prepare_device(entry: Entry, gpu_key: str, environment: Callable[[], Environment] | None = None):
    """The device the entry measures on, checked and fingerprinted: raises UsageError (no GPU, another GPU
    than the key names, no CUPTI for the cupti timer, an environment other than the entry's) before anything is
    opened or written."""
    from .._signals import held
    from .environments import require

    with held():  # torch's import (here, or in require) runs C++ that a Ctrl-C raised inside aborts: held till it ends
        require(entry)  # the packages and CUDA of entry.subprocess_env (kprof.runners.environments)
        import torch  # noqa: F401
    if entry.metric_family == "comm":  # collectives: timed on a group of rank processes (kprof.runners._comm_device)
        from ._comm_device import CommDevice

        return CommDevice(entry, gpu_key, environment)
    if entry.device == "cpu":
        from .catalog import timing_threads

        return _CpuDevice(environment, timing_threads(entry.contract.timing))
    from .cuda_device import CudaDevice

    try:
        return CudaDevice(entry, gpu_key, environment)
    except KprofError:
        raise
    except Exception as e:  # its first CUDA work failed (memory another process holds, a GPU busy in exclusive mode)
        raise UsageError(f"CUDA device 0 could not be prepared ({type(e).__name__}: {str(e)[:500]}); nothing was "
                         f"measured: check with nvidia-smi that no other process holds the GPU") from e


def measure_specs(entry: Entry, specs: Iterable, gpu_key: str, *, origin: Origin = Origin(),
                  environment: Callable[[], Environment] | None = None, rule: StopRule | None = None,
                  parents: dict[bytes, bytes] | None = None, device=None) -> Iterator[Outcome]:
    """Measures each spec (a dict or the table's KernelArgs) on the entry's device, yielding as it goes.

    `entry.contract.timing` names the method: "cpu-wall;..." on the CPU; "cupti;..." or "events;..." on a
    CUDA device (see `kprof.api.effective_entry`), with the L2 state and graph/eager after it."""
    keys = KeyMaker(entry.table, entry.backend, gpu_key, entry.contract, ShapeCodec(entry.args, name=entry.table))
    runner = entry.make_runner()
    rule = rule or StopRule.from_env()
    parents = parents or {}
    device = device or prepare_device(entry, gpu_key, environment)
    for index, raw in enumerate(specs):
        started = time.perf_counter()
        prov: Provenance = keys.provenance(raw, index)
        spec = msgspec.convert(prov.shape, entry.args)
        parent = parents.get(keys.key(raw, index))
        timed, failing = 0.0, False
        env = device.env
        try:
            if getattr(device, "lost", None):
                raise DeviceLost(f"not measured: an earlier spec's failure left this process's device unusable "
                                 f"({device.lost}); run again to measure it in a fresh process")
            if device.name == "cpu":
                _fits_in_memory(runner, spec)
            t_build = time.perf_counter()
            case = runner.build(spec, device.name)
            if not callable(getattr(case, "check", None)):  # a plugin's build that returned nothing, or no Case
                raise TypeError(f"runner {entry.runner} build() returned {type(case).__name__}, not a "
                                f"kprof.runners._case.Case")
            if entry.metric_family != "comm":
                _check_case(entry, case)
            t_check = time.perf_counter()
            case.check()
            t_measure = time.perf_counter()
            stats, method, energy, env, timed = device.measure(case, rule)
            method = msgspec.structs.replace(method, notes={**method.notes, "build_s": f"{t_check - t_build:.4f}",
                                                            "check_s": f"{t_measure - t_check:.4f}"})
            time_ms = _time_ms(stats, method.notes)
            if not time_ms > 0:  # (the events timer clamps a negative reading at 0): no rate can be read from it
                raise ValueError(f"the timer read the row's time as {time_ms!r} ms: the call is shorter than this timer "
                                 f"resolves; time it with `--timer cupti` on a GPU")
            metrics = case.metrics(time_ms, energy) if entry.metric_family == "comm" else _metrics(case, time_ms, energy)
            event = measured(prov, metrics, _record(Stats, stats), method,
                             environment=_record(Environment, env), origin=origin, parent=parent)
        except (Exception, SystemExit) as exc:  # any failure of one spec is recorded, and the others go on
            if _stopped_by_engine(exc) or isinstance(exc, SystemExit) and exc.code in (129, 130, 143):
                raise  # (SIGTERM, SIGHUP or a Ctrl-C cyclopts ended stops the run: kprof.cli; a runner's sys.exit not)
            kind = classify(exc)
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            event = failed(prov, kind, detail[:2000], environment=_record(Environment, env), origin=origin,
                           parent=parent)
            failing = not isinstance(exc, DeviceLost)
        case = None
        if failing:  # after the case and the error's traceback (whose frames hold its inputs) are let go
            _recover(device)
        yield Outcome(index, event, time.perf_counter() - started, timed)


class DeviceLost(KprofError):
    """A spec not measured because an earlier one left the device unusable (`_recover`)."""


def _recover(device) -> None:
    """device.recover() after a failed spec. Where that fails too (a CUDA error such as an illegal memory access is
    sticky: every later CUDA call of the process raises it again), the device is marked lost with why: the specs
    after it fail at once, naming it, rather than each one crashing on the same error, and a pool's worker ends so
    that a fresh process takes the device over. The failed spec's own event is kept either way."""
    try:
        device.recover()
    except Exception as exc:  # noqa: BLE001 - recorded on the device, and in every later spec's event
        device.lost = f"{type(exc).__name__}: {exc}"[:500]


def _stopped_by_engine(exc: BaseException) -> bool:
    """Whether `exc` is a job engine stopping this process, not the spec failing: submitit's time-limit (or
    preemption) signal handler raises UncompletedJobError inside whatever the job runs. The chunk fails with it;
    no row says the kernel crashed. (submitit is looked up, never imported: only its jobs raise it.)"""
    utils = sys.modules.get("submitit.core.utils")
    return utils is not None and isinstance(exc, utils.UncompletedJobError)


def _fits_in_memory(runner, spec) -> None:
    """Raises MemoryError (an `oom` row) where the least the case must hold (`runner.held_bytes`: its inputs and
    output in their dtypes), or the most its build holds at once (`runner.peak_bytes`: inputs drawn in fp32 beside
    their copies in the spec's dtype), exceeds this machine's memory. On the CPU an allocation past it does not
    fail: the kernel's OOM killer ends the process, with no row and no message. A GPU raises its own OOM error."""
    held = getattr(runner, "held_bytes", None)
    if held is None:
        return
    need, have = held(spec), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    what = getattr(runner, "held_what", "its inputs and output")  # a collective's ranks are processes too
    if need > have:
        raise MemoryError(f"out of memory before building: {what} alone take {need / 2**30:,.1f} GiB, "
                          f"and this machine has {have / 2**30:,.1f} GiB; use a smaller spec or a larger machine")
    peak = getattr(runner, "peak_bytes", held)(spec)
    if peak > have:
        raise MemoryError(f"out of memory before building: {what} take {need / 2**30:,.1f} GiB, and building them "
                          f"(drawn in fp32, then converted) {peak / 2**30:,.1f} GiB at once; this machine has "
                          f"{have / 2**30:,.1f} GiB; use a smaller spec or a larger machine")


class _CpuDevice:
    name = "cpu"

    def __init__(self, environment, threads: int | None = None):
        from ..measure.env import cpu_environment

        self.env = (environment or cpu_environment)()
        self.threads = threads  # the torch threads the key names (None: as torch has them)

    def measure(self, case, rule: StopRule):
        import torch

        from ..measure.cpu_timer import time_cpu

        before = os.getloadavg()[0]
        had = torch.get_num_threads()
        if self.threads is not None:  # the key's thread count, whatever this process (a caller's) had set
            torch.set_num_threads(self.threads)
        try:
            env = msgspec.structs.replace(self.env, clocks={**self.env.clocks,
                                                            "threads": float(torch.get_num_threads())})
            switched = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
            timing = time_cpu(case.fn, rule)
            switched = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - switched
        finally:
            torch.set_num_threads(had)
        stats = summarize(timing.samples_ms)
        # Other work on the host slows every sample alike, which no spread shows: the load beside the row says it. The
        # load average is a minute's mean and misses a neighbour that holds a core through a row's second (a 2-thread
        # GEMM read 5x slow at load 1.3 on 2 cores): the scheduler taking this process's cores says it too (involuntary
        # context switches: on the 2-core VM, quiet, 7-44 a row and at most 40 a second, a 1 s row of 9 samples among
        # them; beside one busy-looping process, 180-233 a row and 210-460 a second, the rows 1.2-3x slow). So 100 a
        # second, and 10 at least: one per two samples flagged a quiet host's slow rows.
        paused_s = sum(timing.set_aside) * timing.inner / 1e3 + timing.paused_s  # no time the switches could fall in
        per_s, samples = switched / max(timing.wall_s - paused_s, 1e-3), len(timing.samples_ms)
        taken = [f"{switched} involuntary context switches over {samples} samples"] * (switched >= 10 and per_s >= 100)
        # More torch threads than CPUs this process may run on take turns on them: the switches are their own (a 256^3
        # GEMM at load 3.4 on 2 CPUs: 1,060-1,128 a second on 8 threads, 143-149 on 2), no sign of other work, which no
        # quieter host would take away. The load average beyond its threads alone then says other work took the cores.
        threads, usable = int(env.clocks["threads"]), len(cpus())
        crowded = {"oversubscribed": f"{threads} torch threads on the {usable} CPU(s) this process may use: they took "
                                     f"turns on them (the involuntary switches are theirs)"} if threads > usable else {}
        taken = [] if crowded else taken
        method = Method(timer="cpu", l2="warm", graph=False, warmup=timing.warmup, budget_s=rule.budget_s,
                        stop_reason=timing.stop_reason,
                        notes={"calls_per_sample": str(timing.inner), "target_rel_ci": str(rule.target),
                               "involuntary_switches": str(switched), **host_notes(before, taken, threads), **crowded,
                               **_set_aside(timing),
                               **algorithm_notes(case), **case.notes})
        return stats, method, None, env, timing.wall_s

    def recover(self) -> None:
        pass


def _set_aside(timing) -> dict[str, str]:
    """The notes naming the samples the CPU timer set aside as pauses of the process (stopped, or its cores taken, for
    100 ms or more) and timed again (the row's statistics are of the others), and its pauses between samples."""
    notes = {}
    if timing.set_aside:
        what = ", ".join(f"{x:.6g}" for x in timing.set_aside)
        notes["set_aside_ms"] = f"{what}: the process was paused (stopped, or its cores taken) then; timed again"
    if timing.paused_s:
        notes["paused_s"] = (f"{timing.paused_s:.3f}: the process was paused (stopped, or its cores taken) between "
                             f"samples; not counted against the budget")
    return notes


def _time_ms(stats, notes: dict[str, str]) -> float:
    """The row's time from its samples, by the timing's estimator: the median; the mean (a power-capped kernel);
    or the mean over the input copies of each copy's median ("copy_mean", see CudaDevice._placements)."""
    estimator = notes.get("estimator")
    if estimator == "mean":
        return stats.mean
    if estimator == "copy_mean":
        return float(notes["copy_mean_ms"])
    return stats.median
