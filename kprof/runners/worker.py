"""Measures specs and turns each outcome into an event: `measured`, or `failed` with its error kind.

A failure of one spec never stops the others. Input building, correctness checks and synchronization
stay outside the timed closure; the check runs before any timing, so a wrong kernel is never timed.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable, Iterable, Iterator

import msgspec

from ..ledger.build import failed, measured
from ..ledger.events import Environment, Event, Method, Origin, Provenance
from ..ledger.keys import KeyMaker, ShapeCodec
from ..measure.stats import StopRule, summarize
from ._case import Unsupported, WrongResult
from .registry import Entry

__all__ = ["measure_specs", "Outcome", "classify"]


class Outcome(msgspec.Struct, frozen=True):
    index: int  # position in the caller's spec list
    event: Event
    seconds: float  # wall time spent on this spec (build, check, timing)
    timed_seconds: float  # of which inside the timed loop


def classify(exc: BaseException) -> str:
    """The error kind of a failed measurement."""
    name = type(exc).__name__
    text = str(exc).lower()
    if isinstance(exc, WrongResult):
        return "wrong_result"
    if isinstance(exc, (Unsupported, NotImplementedError)) or "not implemented for" in text \
            or "not supported" in text:
        return "unsupported"
    if name in ("OutOfMemoryError", "MemoryError") or "out of memory" in text:
        return "oom"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "crash"


def _metrics(case, time_ms: float, energy_j: float | None) -> dict:
    seconds = time_ms / 1e3
    return {"time_ms": time_ms, "tflops": case.flops / seconds / 1e12 if case.flops else None,
            "memory_bandwidth_gbps": case.bytes / seconds / 1e9 if case.bytes else None, "energy_j": energy_j}


def measure_specs(entry: Entry, specs: Iterable, gpu_key: str, *, origin: Origin = Origin(),
                  environment: Callable[[], Environment] | None = None, rule: StopRule | None = None,
                  parents: dict[bytes, bytes] | None = None) -> Iterator[Outcome]:
    """Measures each spec (a dict or the table's KernelArgs) on the entry's device, yielding as it goes."""
    if entry.device != "cpu":
        raise NotImplementedError(f"backend {entry.backend} measures on {entry.device}; this worker is CPU-only")
    from ..measure.cpu_timer import time_cpu
    from ..measure.env import cpu_environment

    keys = KeyMaker(entry.table, entry.backend, gpu_key, entry.contract, ShapeCodec(entry.args))
    runner = entry.load_runner()()
    env = (environment or cpu_environment)()
    rule = rule or StopRule.from_env()
    parents = parents or {}
    for index, raw in enumerate(specs):
        started = time.perf_counter()
        prov: Provenance = keys.provenance(raw, index)
        spec = msgspec.convert(prov.shape, entry.args)
        parent = parents.get(keys.key(raw, index))
        timed = 0.0
        try:
            case = runner.build(spec, entry.device)
            case.check()
            timing = time_cpu(case.fn, rule)
            timed = timing.wall_s
            stats = summarize(timing.samples_ms)
            method = Method(timer="cpu", l2="warm", graph=False, warmup=timing.warmup, budget_s=rule.budget_s,
                            stop_reason=timing.stop_reason,
                            notes={"calls_per_sample": str(timing.inner), "target_rel_ci": str(rule.target),
                                   **({"algorithm_used": case.algorithm} if case.algorithm else {}), **case.notes})
            event = measured(prov, _metrics(case, stats.median, None), stats, method, environment=env,
                             origin=origin, parent=parent)
        except Exception as exc:  # any failure of one spec is recorded, and the others go on
            kind = classify(exc)
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            event = failed(prov, kind, detail[:2000], environment=env, origin=origin, parent=parent)
        yield Outcome(index, event, time.perf_counter() - started, timed)
