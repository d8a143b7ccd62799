"""The telemetry sampler: clocks, power, temperature, utilization and clock-event reasons of one GPU (and, when
asked, its total-energy counter), on a background thread, while the measured work runs. Public through
`kprof.measure.nvml`; the measure diagnostic's window samples with it too."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, NamedTuple, Sequence

from ..errors import UsageError
from ._nvml_access import Reading
from ._reasons import REASON_BITS, decode_reasons

__all__ = ["REASON_BITS", "decode_reasons", "TelemetrySample", "Telemetry", "reasons_seen", "summarize"]

class TelemetrySample(NamedTuple):
    """One reading; a field NVML could not give is None."""

    t: float  # seconds since the capture started (the measure diagnostic: from its window's zero)
    sm_mhz: float | None
    mem_mhz: float | None
    power_w: float | None
    temp_c: float | None
    util_pct: float | None
    reasons: int | None  # clock-event reasons bitmask
    energy_mj: int | None = None  # NVML's total-energy counter, when the sampler was given `energy`
    read_ms: float | None = None  # how long the reading (and the energy counter's) took


class Telemetry:
    """Samples SM/memory clock, power, temperature, utilization and clock-event reasons of one GPU on a
    background thread at `hz` while the `with` block runs.

        with Telemetry(0, hz=20) as tel:
            work()
        tel.summary(), tel.throttle, tel.samples

    `read` replaces the NVML reading (tests, other backends): a callable returning
    (sm_mhz, mem_mhz, power_w, temp_c, util_pct, reasons). `energy`, when given, is read with each sample (NVML's
    total-energy counter in mJ: the measure diagnostic's window). A field NVML cannot give is None, and why is in
    `errors`; the work is never interrupted by the sampler.
    """

    def __init__(self, index: int = 0, hz: float = 20.0, *, read: Callable[[], Reading] | None = None,
                 energy: Callable[[], int | None] | None = None):
        if not hz > 0:
            raise UsageError(f"telemetry rate must be positive, got {hz} Hz; pass e.g. --telemetry-hz 20")
        self.index, self.hz = index, hz
        self.samples: list[TelemetrySample] = []
        self.errors: dict[str, str] = {}
        self.t0 = 0.0  # time.perf_counter() at the start of the capture
        self.started_at = 0.0  # unix seconds at the start of the capture
        self._read, self._energy = read, energy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Telemetry:
        if self._read is None:
            from ._nvml_access import _nvml_reading

            self._read = _nvml_reading(self.index, self.errors)
        self.samples = []
        self._stop.clear()
        self.started_at, self.t0 = time.time(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="kprof-telemetry", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        period = 1.0 / self.hz
        due = time.perf_counter()
        while True:
            t = time.perf_counter()
            try:
                reading = self._read()
                energy = self._energy() if self._energy is not None else None
            except Exception as e:  # noqa: BLE001 - a sampler failure must not break the measured work
                self.errors["sampler"] = f"{type(e).__name__}: {e}"
                return
            self.samples.append(TelemetrySample(t - self.t0, *reading, energy, (time.perf_counter() - t) * 1e3))
            due += period
            if due < time.perf_counter():  # fell behind (slow NVML call): skip ahead, never burst
                due = time.perf_counter()
            if self._stop.wait(due - time.perf_counter()):
                return

    @property
    def throttle(self) -> list[str]:
        return reasons_seen(self.samples)

    def summary(self) -> dict:
        out = summarize(self.samples)
        out["hz"] = self.hz
        out["errors"] = dict(self.errors)
        return out


def reasons_seen(samples: Sequence[TelemetrySample]) -> list[str]:
    """Sorted reason labels seen while the work ran. The first and last samples straddle the start and end
    of the work (the GPU is often idle there), so they count only when there are fewer than three samples."""
    inner = samples[1:-1] if len(samples) >= 3 else samples
    mask = 0
    for s in inner:
        mask |= s.reasons or 0
    return decode_reasons(mask)


def summarize(samples: Sequence[TelemetrySample]) -> dict:
    """min/median/max SM clock, median memory clock, mean and max power, max temperature, mean utilization,
    the reasons seen (`throttle`) and the fraction of samples showing each. A field with no data is None."""

    def col(name: str) -> list[float]:
        return [getattr(s, name) for s in samples if getattr(s, name) is not None]

    sm, mem, power, temp, util = col("sm_mhz"), col("mem_mhz"), col("power_w"), col("temp_c"), col("util_pct")
    counts: dict[str, int] = {}
    for s in samples:
        for label in decode_reasons(s.reasons or 0):
            counts[label] = counts.get(label, 0) + 1
    return {
        "samples": len(samples),
        "duration_s": samples[-1].t - samples[0].t if samples else 0.0,
        "sm_mhz_min": min(sm) if sm else None,
        "sm_mhz_median": statistics.median(sm) if sm else None,
        "sm_mhz_max": max(sm) if sm else None,
        "mem_mhz_median": statistics.median(mem) if mem else None,
        "power_w_mean": statistics.fmean(power) if power else None,
        "power_w_max": max(power) if power else None,
        "temp_c_max": max(temp) if temp else None,
        "util_pct_mean": statistics.fmean(util) if util else None,
        "throttle": reasons_seen(samples),
        "reason_fractions": {k: counts[k] / len(samples) for k in sorted(counts)},
    }
