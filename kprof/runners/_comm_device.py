"""The worker's device for comm entries (`prepare_device` makes it): each collective spec measured on a group of
rank processes (kprof.runners._ranks). A collective needs every rank to run the same iterations, so comm specs
are not timed call by call by the adaptive timer. `CommDevice.measure` is the recipe:

    group = group_for(backend, world_size)      # started once, kept across specs of the same size
    ask(spec)                                   # each rank builds its buffers and checks the closed form
    warm-up batches; then timed batches until the StopRule stops

A timed batch is k iterations on every rank, each `reset input -> (cold: L2 read sweep) -> synchronize -> CPU
barrier -> time the op`; each rank sends its k times and the coordinator keeps, per iteration, the maximum over
ranks (a collective is done when its slowest rank is). The row's time is the median of those maxima. A rank
times its op by CUPTI kernel time (nccl, timer cupti: the GPU work between two CUPTI timestamps around the
synchronized op), CUDA events (timer events) or perf_counter around the blocking call (gloo).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import msgspec

from ..errors import UsageError
from ..measure.env import host_notes
from ..measure.stats import StopRule, summarize
from ..measure.nvml import gpu_topology
from . import _ranks
from ._case import Unsupported
from ._ranks import RankGroup

__all__ = ["CommDevice"]

WARMUP_N = 5  # iterations of the first warm-up batch (NCCL's first ops also set up its channels)
WARMUP_S = {"cpu": 0.01, "cuda": 0.05}  # at least this long of warm-up iterations
BATCH_S = 0.02  # a timed batch lasts about this long
MAX_BATCH = 200


class CommDevice:
    """What `prepare_device` returns for a comm entry: measures each CommCase on a rank group (see the module)."""

    def __init__(self, entry, gpu_key: str, environment=None):
        from .catalog import parse_timing, timing_power

        self.entry, self.gpu_key = entry, gpu_key
        self.backend = "nccl" if entry.device == "cuda" else "gloo"
        self.name = entry.device
        timer, l2, graph = parse_timing(entry.contract.timing)
        if entry.device == "cuda":
            if graph or timing_power(entry.contract.timing) != "sustained":
                raise UsageError(f"{entry.table}/{entry.backend} times each collective eagerly, one op per barrier, "
                                 f"in the sustained power state: a CUDA graph (KPROF_CUDA_GRAPH, --cuda-graph) or "
                                 f"--power loaded does not apply; omit it")
            self._check_cuda(timer)
            from ..measure.nvml import gpu_environment

            self.env = (environment or gpu_environment)()
        else:
            from ..measure.env import cpu_environment

            self.env = (environment or cpu_environment)()
        self.timer = {"cpu-wall": "cpu"}.get(timer, timer)
        self.cold = entry.device == "cuda" and l2 == "cold"
        self._topology: dict[str, tuple[str, str]] = {}

    def _check_cuda(self, timer: str) -> None:
        from .cuda_device import cuda_zero, need_cupti

        cuda_zero(self.entry, self.gpu_key)  # as a CUDA row's device checks it: the same refusals, worded alike
        if timer == "cupti":
            need_cupti()

    def measure(self, case, rule: StopRule):
        from .comm import COLLECTIVES  # not at the top: comm imports this module

        spec, n = case.spec, case.spec.world_size
        if self.backend == "nccl":
            import torch

            if torch.cuda.device_count() < n:
                raise Unsupported(f"world_size {n} needs {n} GPUs and this worker sees {torch.cuda.device_count()} "
                                  f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); run it on the "
                                  f"pool (KPROF_POOL=auto), which gives such a spec a group of {n} GPUs")
        t = time.perf_counter()
        group = _ranks.group_for(self.backend, n)
        others = [f"cuda:{r} is a {i['name']}" for r, i in enumerate(group.info) if i.get("name", self.gpu_key)
                  != self.gpu_key]
        if others:
            raise Unsupported(f"the rows go under GPU key {self.gpu_key!r} and {', '.join(others)}: a group of "
                              f"one GPU model only (set KPROF_PROFILE_GPUS to such GPUs)")
        start_s = time.perf_counter() - t  # ~0 when the group of this size was running already
        t_check, load = time.perf_counter(), os.getloadavg()[0]
        die = _ranks.exit_rank_for_tests()
        group.ask(("spec", case.table, msgspec.to_builtins(spec), self.timer, self.cold, die),
                  f"{case.table} {spec.message_size_bytes} bytes {spec.dtype}: build and check")
        check_s = time.perf_counter() - t_check

        def free() -> None:
            if group.alive() and group.conns:
                group.ask(("done",), "free the buffers")

        try:
            stats, method, timed = self._time(group, case, rule)
        except Exception:
            free()
            raise
        # Not on an interrupt: Ctrl-C (SIGINT to the process group) or a SIGTERM to it ends the ranks too, and asking
        # them raised a rank's death in the interrupt's place: a crash row, and the run went on with fresh ranks.
        free()
        info = group.info
        notes = {"ranks": str(n), "rank_time": "per iteration, the maximum over ranks",
                 "barrier": "a CPU barrier (gloo) before each op; inputs rewritten before it",
                 "bus_factor": COLLECTIVES[case.table].bus,
                 "message_size": "nccl-tests' size (all_gather/reduce_scatter: the whole gathered/scattered buffer)",
                 "algorithm_used": info[0]["calls"][case.table], "rank_check_s": f"{check_s:.4f}",
                 "group_start_s": f"{start_s:.3f}", **method.notes}
        env = self.env
        errors = {**env.errors, "energy": "not measured for collectives (ranks on several devices); energy_j is null"}
        if self.backend == "nccl":
            notes["nccl_version"] = info[0].get("nccl", "")
            notes["gpus"] = "; ".join(f"cuda:{r} {i['name']} {i['uuid']}" for r, i in enumerate(info))
            topology, why = self._topology_of(n)
            notes["topology"] = topology
            if why:
                errors["topology"] = why
            env = msgspec.structs.replace(env, gpu_uuid=",".join(i["uuid"] for i in info))
        else:  # a CPU row, as worker._CpuDevice's: the host's load beside it (other work slows every sample alike)
            notes["ranks_on"] = f"{n} CPU processes, 1 torch thread each"
            notes.update(host_notes(load))  # the load only: the ranks, not this process, take the cores
            env = msgspec.structs.replace(env, clocks={**env.clocks, "threads": 1.0})  # each rank's, not this process's
        method = msgspec.structs.replace(method, notes=notes)
        return stats, method, None, msgspec.structs.replace(env, errors=errors), timed

    def _time(self, group: RankGroup, case, rule: StopRule):
        from ..ledger.events import Method

        def batch(k: int) -> tuple[list[float], list[float]]:
            times = group.ask(("batch", k), f"a batch of {k} {case.table} iterations")
            return [max(col) for col in zip(*times)], [min(col) for col in zip(*times)]

        hi, _ = batch(WARMUP_N)
        warm = WARMUP_N
        per_op = max(statistics.median(hi), 1e-4) / 1e3  # s; the maximum's median, floored at 0.1 µs
        more = min(MAX_BATCH, math.ceil((WARMUP_S[self.name] - sum(hi) / 1e3) / per_op))
        if more > 0:
            batch(more)
            warm += more
        k = min(MAX_BATCH, max(5, 5 * math.ceil(BATCH_S / per_op / 5)))
        samples, lows = [], []
        started = time.perf_counter()
        while True:
            hi, lo = batch(k)
            samples += hi
            lows += lo
            reason = rule.check(samples, time.perf_counter() - started)
            if reason:
                break
        stats = summarize(samples)
        method = Method(timer=self.timer, l2="cold" if self.cold else "warm", graph=False, warmup=warm,
                        budget_s=rule.budget_s, stop_reason=reason,
                        notes={"target_rel_ci": str(rule.target), "batch": str(k),
                               "rank_min_median_ms": f"{statistics.median(lows):.6g}",
                               "timer_wall_s": f"{time.perf_counter() - started:.4f}"})
        return stats, method, sum(samples) / 1e3

    def _topology_of(self, n: int) -> tuple[str, str]:
        """How the group's GPUs are linked, from NVML (best effort): (text, why it is incomplete)."""
        key = os.environ.get("CUDA_VISIBLE_DEVICES", "") + f"/{n}"
        if key not in self._topology:
            self._topology[key] = gpu_topology(n)
        return self._topology[key]

    def recover(self) -> None:
        pass
