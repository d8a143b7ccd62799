"""The CUDA device's recipe for one row: the thermal and power protocol, the energy run, the timing (CUPTI or CUDA
events, cold L2, eager or graph), the weight copies a row rotates over, the loaded state's heat. Made by
`kprof.runners.worker.prepare_device`; torch, CUPTI and NVML are imported when a device is made."""

from __future__ import annotations

import functools
import time
from typing import Callable

import msgspec

from ..ledger.events import Method
from ..measure._l2 import activations_rewrite
from ..measure._state import CAPPED_MAX_SAMPLE_S, CAPPED_SAMPLE_S
from ..measure.stats import StopRule, placement_notes, summarize
from ._case import algorithm_notes
from ..settings import env_ordered, env_seconds
from .registry import Entry, or_on_cpu

__all__ = ["CudaDevice", "energy_window_s", "capped_sample_s", "twice_if_unstable", "ENERGY_S",
           "CAPPED_SAMPLE_S", "CAPPED_MAX_SAMPLE_S", "MAX_COPIES", "COPY_BYTES", "ACTIVATION_COPY_BYTES",
           "cuda_zero", "need_cupti"]

# Seconds of back-to-back calls behind each row's energy_j, the settle included: two to three steps of NVML's
# ~98 ms counter, fitted past the first calls' ramp to the kernel's steady power.
ENERGY_S = 0.25
# A power-capped kernel's energy is fitted over this long from the end of its settle: the cap's controller swings
# the power over and under the limit for about a second (run 75) before a longer window's mean.
CAPPED_ENERGY_FIT_S = 1.0
# Rows rotate over this many allocations of their weights at most, within this many bytes of copies.
MAX_COPIES = 16
COPY_BYTES = 2 << 30
# Activations this small (decode's) get a copy per placement, each at its own offset: see CudaDevice._placements.
ACTIVATION_COPY_BYTES = 4 << 20
# The timing's settle right after an energy window, which has brought the GPU to this kernel's steady clock.
SETTLED_MIN_S = 0.04
# A power-capped kernel's settle in the samples' own pattern (sweep, call) after the energy window. 0.5 s instead
# changed nothing measurable (capped_settle_check.py, H200, 2026-12-03: prefill GEMMs' spread over four passes p95
# 2.22 against 2.20 %): what moves such a row is the cap's swings within and between seconds, not a ramp after the
# energy window.
SETTLED_CAPPED_S = 0.04


def _span_bytes(t) -> int:
    """Bytes from a tensor's first element to its last (a strided view's span, not its element count)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _offset(k: int) -> int:
    """Placement k's activation offset: 512-byte steps (the caching allocator's alignment) spread over 2 MiB by a
    multiplicative hash, so the placements sample a block's positions rather than one stride."""
    return (k * 0x9E3779B1) % 4096 * 512


def _placed_copy(torch, t, offset: int):
    """A copy of `t` (same shape and strides) starting `offset` bytes into a fresh block of its own; `t` itself
    where it is a broadcast (a stride of 0), whose copy could not be written in place."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return t
    nbytes = _span_bytes(t)
    block = torch.empty(offset + max(nbytes, 1), dtype=torch.uint8, device=t.device)
    flat = block[offset:offset + nbytes].view(t.dtype)
    out = flat.as_strided(t.shape, t.stride()) if nbytes else flat[:0].view(t.shape)
    out.copy_(t)
    return out


def energy_window_s() -> float:
    """Seconds of back-to-back calls behind each row's energy_j (KPROF_ENERGY_S; 0 turns energy off)."""
    return env_seconds("KPROF_ENERGY_S", ENERGY_S, zero_ok=True, least=0.2,
                       why="NVML's energy counter steps about every 0.1 s and the fit needs two steps")


def capped_sample_s() -> tuple[float, float]:
    """The least and the most seconds of timed work a power-capped kernel's row averages over
    (KPROF_CAPPED_SAMPLE_S, KPROF_CAPPED_MAX_SAMPLE_S; see kprof.measure._state): between them it stops once its
    mean is known to 0.7 % (`kprof.measure._state.CAPPED_TARGET`). A larger maximum is less noise for rows of
    GEMMs whose clock the cap swings most, at up to that cost per such spec; the default maximum below a set minimum
    is the minimum, and both set with the minimum above is refused."""
    least = env_seconds("KPROF_CAPPED_SAMPLE_S", CAPPED_SAMPLE_S)
    most = env_seconds("KPROF_CAPPED_MAX_SAMPLE_S", CAPPED_MAX_SAMPLE_S)
    env_ordered("KPROF_CAPPED_SAMPLE_S", least, "KPROF_CAPPED_MAX_SAMPLE_S", most)  # both set, least above most
    return least, max(least, most)


def twice_if_unstable(measure: Callable[[], object]) -> tuple[object, str | None]:
    """(measure(), None), or, when the first attempt saw the kernels differ between invocations (`UnstableKernels`),
    a second attempt's result and the first attempt's error. Library kernels can change their launch sequence while
    they settle (cuBLAS split-K is seen to drop its reduce kernel once), and CUPTI once handed over no record of
    one warm-up invocation while it did of the others, in three rows in a row of one pass on an H200 (run 41:
    a later invocation in one, read as an unstable set, the first invocation in two). A
    second attempt that is stable for all its calls is a valid measurement, and the row says a first one was
    refused. A second failure fails the row."""
    from ..measure._attribution import UnstableKernels

    try:
        return measure(), None
    except UnstableKernels as exc:
        return measure(), str(exc)[:500]


def cuda_zero(entry: Entry, gpu_key: str):
    """torch, where CUDA device 0 is there and is a GPU of the key's model (a CUDA row's device and a collective's
    first rank alike); else a UsageError saying how to measure."""
    import torch

    from ..errors import SettingError, UsageError

    if not torch.cuda.is_available():
        raise UsageError(f"backend {entry.backend} measures on a CUDA GPU and torch {torch.__version__} sees "
                         f"none; run on a GPU machine{or_on_cpu(entry)}")
    actual = torch.cuda.get_device_name(0)
    if actual != gpu_key:
        # a pool worker's device is one KPROF_PROFILE_GPUS may have named: the key then came from another GPU
        raise SettingError(*(f"GPU key {gpu_key!r} differs from CUDA device 0 ({actual!r}); measure on a GPU of "
                             f"that model (KPROF_PROFILE_GPUS and CUDA_VISIBLE_DEVICES name the GPUs), or omit "
                             f"{name}" for name in ("gpu_name=", "--gpu-name")))
    return torch


def need_cupti() -> None:
    """A UsageError where the cupti timer cannot run here, naming the fix."""
    from ..errors import UsageError
    from ..measure.gpu_timer import cupti_available

    why = cupti_available()
    if why:
        raise UsageError(f"CUPTI is not usable here ({why}); install cupti-python with nvidia-cuda-cupti, "
                         f"or set KPROF_TIMER=events to time with CUDA events (rows kept under their "
                         f"own timing key)")


class CudaDevice:
    """CUDA device 0 of this process (a pool gives each worker its own CUDA_VISIBLE_DEVICES)."""

    name = "cuda"

    def __init__(self, entry: Entry, gpu_key: str, environment):
        from ..errors import UsageError
        from ..measure.nvml import gpu_environment

        torch = cuda_zero(entry, gpu_key)
        torch.cuda.set_device(0)
        self.torch = torch
        from .catalog import parse_timing, timing_power

        self.timer, l2, self.graph = parse_timing(entry.contract.timing)
        self.power = timing_power(entry.contract.timing)
        self._heater = None
        self.cold = l2 != "warm"
        if self.timer == "cupti":
            need_cupti()
        self.energy_s = energy_window_s()
        self.capped_sample_s = capped_sample_s()
        self.env = (environment or gpu_environment)()
        if "nvml" in self.env.errors:  # every row's telemetry and energy would fail on it, one spec at a time
            raise UsageError(f"NVML cannot read CUDA device 0 ({self.env.errors['nvml']}); a CUDA row's clocks, power, "
                             f"thermal state and energy come from NVML: run where the driver's NVML can open this GPU")
        self._wake()
        self.state_errors: dict[str, str] = {}
        self.start_notes: dict[str, str] = {}
        self._probe = None  # NVML's reader of the state protocol, made once per device

    def measure(self, case, rule: StopRule):
        from ..measure.gpu_timer import time_gpu
        from ..measure.nvml import Telemetry, with_telemetry

        self.state_errors.clear()  # the probe's refusals during this row only (the probe writes into this dict)
        self.start_notes = {}
        state = self._state()  # waits, idle, for a hot GPU to cool: before the sampler, whose readings are of the work
        with Telemetry(0) as telemetry:
            energy, notes = self._energy(case, state) if self.energy_s > 0 else (None, {})
            # Timing follows the energy window: the GPU is already in the steady state of this kernel, and
            # time_gpu settles it again in the samples' own pattern (flush, call) before holding each batch to it.
            placements, warms, copy_notes = self._placements(case) or (None, self._warm(case), {"input_copies": "1"})
            copies = len(placements) if placements else 1
            timing, retried = twice_if_unstable(lambda: time_gpu(
                None if placements else case.fn, rule, timer=self.timer, cold_l2=self.cold, graph=self.graph,
                kernel_filter=case.kernel_filter, state=self._state(start=False, settled=energy is not None),
                warm=warms, heat=self._heat(), placements=placements))
        placement = {}
        if copies > 1 and timing.notes.get("estimator", "median") == "median":
            placement = placement_notes(timing.samples_ms, list(timing.placement_order), copies,
                                        int(timing.notes.get("batches_discarded", "0")))
        env = with_telemetry(self.env, telemetry)
        if self.state_errors:
            env = msgspec.structs.replace(env, errors={**env.errors, **{f"state.{k}": v
                                                                       for k, v in self.state_errors.items()}})
        if self.energy_s <= 0:
            env = msgspec.structs.replace(env, errors={**env.errors, "energy": "KPROF_ENERGY_S=0: energy not measured"})
        stats = summarize(timing.samples_ms)
        kernels = ",".join(timing.kernels)
        method = Method(timer=self.timer, l2="cold" if self.cold else "warm", graph=self.graph,
                        warmup=timing.warmup, budget_s=rule.budget_s, stop_reason=timing.stop_reason,
                        notes={"target_rel_ci": str(rule.target), "timer_wall_s": f"{timing.wall_s:.4f}",
                               **({"first_attempt": retried} if retried else {}),
                               "gpu_s": f"{timing.gpu_s:.6f}", **self.start_notes, **timing.notes,
                               **({"kernels": kernels[:1000]} if kernels else {}), **copy_notes,
                               **placement, **notes, **algorithm_notes(case),
                               **case.notes})
        return stats, method, energy, env, timing.gpu_s

    def _state(self, start: bool = True, settled: bool = False):
        """A fresh thermal and power protocol for device 0 (None where NVML cannot read it: the row says so).
        `start`: first wait until the GPU is no hotter than the stated start temperature. `settled`: the GPU
        has just run this kernel back to back to a steady clock (the energy window), so the timing's own
        settle need only confirm it in the samples' pattern (a shorter minimum)."""
        from ..measure._state import StateProtocol
        from ..measure.nvml import state_probe

        if self._probe is None:
            try:
                self._probe = state_probe(0, self.state_errors)
            except Exception as e:  # noqa: BLE001 - no NVML: time without the protocol, and record why
                self.state_errors["state"] = f"{type(e).__name__}: {e}"
                return None
        probe = self._probe
        # Right after the energy window the GPU is in this kernel's state already, capped or not: the settle
        # only confirms it in the samples' pattern.
        after = {"min_s": SETTLED_MIN_S, "capped_settle_s": SETTLED_CAPPED_S} if settled else {}
        least, most = self.capped_sample_s
        state = StateProtocol(probe, regime=self.power, power_limit_w=self.env.power_limit_w,
                              capped_sample_s=least, capped_max_sample_s=most, **after)
        if start:
            state.start()
            self.start_notes = dict(state.notes)
        return state

    def _energy(self, case, state) -> tuple[float, dict[str, str]]:
        """Energy per call over one run of steady back-to-back calls (L2 warm, launched as a CUDA graph of calls):
        the protocol's settle brings the clock to its steady state, and the same run goes on until it spans
        energy_s; NVML's counter is fitted over every step of it past the ramp (`settled_energy`), so the settle
        is part of the window rather than a run before it."""
        from ..measure._burst import burst
        from ..measure._sampling import BackToBack
        from ..measure.nvml import NvmlError, settled_energy

        torch = self.torch
        t = time.perf_counter()
        for _ in range(3):
            case.fn()
        torch.cuda.synchronize()
        per_call = max((time.perf_counter() - t) / 3, 1e-6)
        calls_fn, per_replay, how = burst(case.fn, per_call, call_bytes=case.bytes)
        run = BackToBack.on_cuda(torch, calls_fn, per_call * per_replay)
        try:
            result, settled = settled_energy(run, span_s=self.energy_s, settle=state.settle if state else None,
                                             fit_after_settle=lambda _settled: state.capped, calls_per_step=per_replay,
                                             power_limit_w=self.env.power_limit_w, settled_fit_s=CAPPED_ENERGY_FIT_S)
        except NvmlError as e:  # the counter, not the kernel: say how to measure the row without it
            raise NvmlError(f"energy_j: {e}; KPROF_ENERGY_S=0 measures the row without energy_j") from e
        warm = {}
        if settled is not None:
            warm = {"energy_settle_s": f"{settled.seconds:.3f}",  # no SM clock from NVML: "n/a", as settled_sm_mhz
                    "energy_settled_sm_mhz": "n/a" if settled.sm_mhz is None else f"{settled.sm_mhz}"}
        return result.j_per_call, {
            "energy_window_s": f"{result.window_s:.3f}", "energy_calls": str(result.calls),
            "energy_launch": how, "energy_ticks": str(result.ticks),
            "energy_rel_uncertainty": f"{result.rel_uncertainty:.4f}", "energy_method": result.method,
            "energy_power_w": f"{result.power_w:.1f}", "energy_fit_from_s": f"{result.fit_from_s:.3f}",
            "energy_regime": "back-to-back calls, L2 warm, settled (the settle is part of the window)", **warm}

    def _wake(self, seconds: float = 0.1) -> None:
        """Run device memory sweeps and GEMMs for `seconds` before the first spec. The first row of a fresh
        process read 5 % slow on an idle H200 (a decode GEMM: 15.7 µs, then 14.9-15.0 µs in three more runs),
        whatever the spec; the settle holds the SM clock, not what else wakes with the first work."""
        from ..measure._l2 import flusher

        torch = self.torch
        sweep, _nbytes = flusher(0)
        a = torch.randn(2048, 2048, device="cuda").to(torch.bfloat16)
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            for _ in range(10):
                sweep()
                a @ a
            torch.cuda.synchronize()

    def _heat(self):
        """The loaded power state's unit of heavy work (see time_gpu's `heat`): a 4096^3 bf16 GEMM, the kind of
        kernel that holds a GPU at its power limit through a prefill; None in the sustained state."""
        if self.power != "loaded":
            return None
        if self._heater is None:
            torch = self.torch
            g = torch.Generator("cuda").manual_seed(0x4EA7)
            a, b = (torch.randn(4096, 4096, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
            out = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
            self._heater = lambda: torch.matmul(a, b, out=out)
        return self._heater

    def _placements(self, case):
        """(timed closures, their warms, notes) over the row's placements, or None where there is one. Placement i holds
        copy i % n_w of the case's cold inputs (its weights: up to MAX_COPIES allocations within COPY_BYTES) and,
        where the activations are small (ACTIVATION_COPY_BYTES), its own copy of them at its own offset in a
        fresh block (`_placed_copy`); time_gpu rotates over the placements, eager calls and graph replays alike
        (one graph each), and rewrites the next one's activations after each sweep (`warms`).

        Why: a memory-bound kernel's time depends on where its inputs lie in device memory. On an H200,
        Qwen2.5-7B's decode `down` GEMM (a 136 MB weight, m = 8) read 38.1 µs on most weight allocations and
        40.0 µs on 2-7 of 16 (tests/benchmarks/placement_check.py); Mixtral-8x7B's b=1 expert GEMMs moved 15 %
        with the address of their 16 KB activations (gate/up 185-223 µs, down 89-101 µs over nine offsets), and
        a model's layers alternated between two speeds as its allocator alternated their activations' blocks
        (tests/benchmarks/moe_decode_check.py). A model's layers each have their own placements and a sum of
        rows needs their mean, so the row is the mean over the placements of each one's median
        (`placement_notes`)."""
        if case.call is None or not case.inputs:
            return None
        cold = [i for i in range(len(case.inputs)) if i not in case.warm]
        acts = [i for i in case.warm if i < len(case.inputs)]
        wsize = sum(case.inputs[i].numel() * case.inputs[i].element_size() for i in cold)
        asize = sum(_span_bytes(case.inputs[i]) for i in acts)
        n_w = min(MAX_COPIES, 1 + int(COPY_BYTES // wsize)) if wsize else 1
        n_a = MAX_COPIES if acts and asize <= ACTIVATION_COPY_BYTES else 1
        n = max(n_w, n_a)
        if n == 1:
            return None
        weights = [case.inputs] + [tuple(t.clone() if i in cold else t for i, t in enumerate(case.inputs))
                                   for _ in range(n_w - 1)]
        sets = []
        for k in range(n):
            inputs = list(weights[k % n_w])
            if n_a > 1 and k > 0:
                for i in acts:
                    inputs[i] = _placed_copy(self.torch, case.inputs[i], _offset(k))
            sets.append(tuple(inputs))
        warms = [self._warm(case, inputs) for inputs in sets] if self.cold and acts else None
        return ([functools.partial(case.call, *inputs) for inputs in sets], warms,
                {"input_copies": str(n_w), "activation_copies": str(n_a)})

    def _warm(self, case, inputs: tuple | None = None):
        """Cold L2: after each sweep, the case's activations (of `inputs`, a placement's, else the case's) written
        again (`activations_rewrite`: dirty in L2, as inside a model, so the timed kernel pays their write-back
        when it evicts them, as there); before an eager call and a graph replay alike."""
        return activations_rewrite(self.torch, case, inputs) if self.cold else None

    def recover(self) -> None:
        """After a failure (an OOM above all), give the cached blocks back so the next spec starts clean. Raises where
        the failure left the CUDA context unusable (a sticky error, an illegal memory access: it raises again here)."""
        import gc

        gc.collect()
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
