"""Ranks of a collective: a coordinator (in the worker) and world_size rank processes it starts and times.

A collective needs every rank to run the same iterations, so comm specs are not timed call by call by the
adaptive timer. The worker's `CommDevice.measure` is the recipe:

    group = group_for(backend, world_size)      # started once, kept across specs of the same size
    ask(spec)                                   # each rank builds its buffers and checks the closed form
    warm-up batches; then timed batches until the StopRule stops

A timed batch is k iterations on every rank, each `reset input -> (cold: L2 read sweep) -> synchronize -> CPU
barrier -> time the op`; each rank sends its k times and the coordinator keeps, per iteration, the maximum over
ranks (a collective is done when its slowest rank is). The row's time is the median of those maxima. A rank
times its op by CUPTI kernel time (nccl, timer cupti: the GPU work between two CUPTI timestamps around the
synchronized op), CUDA events (timer events) or perf_counter around the blocking call (gloo).

Ranks are `python -m kprof.runners._rank` processes (a fresh interpreter each, never a fork: the worker may
hold CUDA and LMDB state, and a pool worker, being a daemon, may not have multiprocessing children), each talking
to the coordinator over its own socket pair, each rank r on cuda:r of the worker's CUDA_VISIBLE_DEVICES (nccl) or
on the CPU (gloo, one thread). torch.distributed is initialised from a FileStore in a fresh temporary directory;
nccl ranks add a gloo group for the CPU barrier. Ranks log to files in that directory; a failure quotes the end.

One group lives per process (`group_for`): a spec of another backend or world size shuts it down and starts
another; it is shut down when the process exits (a multiprocessing finalizer, so pool workers too). A rank exits
when the coordinator's socket closes or its parent dies. Nothing waits forever: a group that does not start
within KPROF_RANK_START_S (default 300 s), or a step (a check, a batch) that takes longer than KPROF_RANK_STEP_S
(default 300 s), fails the spec as `timeout`; a rank that dies fails it as `crash`, naming the rank, its exit
code, its log's path and end (the logs of a failed group are kept, in `kprof-rank-logs-*`; the rest is removed); in
both cases the group is killed and the next spec starts a fresh one.

Test hook: `EXIT_RANK_FOR_TESTS`, when set to a rank number, makes that rank exit (code 3) on receiving the next
spec, as a crashed rank would; it is cleared as it is sent (tests/runners/test_comm.py sets it in-process).
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing import connection, util

import msgspec

from .. import _scratch
from ..errors import KprofError, UsageError
from ..measure.stats import StopRule, summarize
from ._case import Unsupported, WrongResult
from ..measure.nvml import gpu_topology
from ..settings import env_seconds

__all__ = ["CommDevice", "RankGroup", "RankError", "group_for", "shutdown", "EXIT_RANK_FOR_TESTS"]

EXIT_RANK_FOR_TESTS: int | None = None
START_S = 300.0
STEP_S = 300.0
WARMUP_N = 5  # iterations of the first warm-up batch (NCCL's first ops also set up its channels)
WARMUP_S = {"cpu": 0.01, "cuda": 0.05}  # at least this long of warm-up iterations
BATCH_S = 0.02  # a timed batch lasts about this long
MAX_BATCH = 200
_TAIL = 1500  # characters of a rank's log quoted in a failure


def start_s() -> float:
    """Seconds the ranks may take to start (KPROF_RANK_START_S)."""
    return env_seconds("KPROF_RANK_START_S", START_S, least=10.0,
                       why="the ranks import torch and initialize torch.distributed first, so no rank would start")


def step_s() -> float:
    """Seconds a rank may take to answer one step (KPROF_RANK_STEP_S)."""
    return env_seconds("KPROF_RANK_STEP_S", STEP_S, least=1.0,
                       why="a step is a batch of collectives and a barrier across the ranks, so every step would "
                           "time out")


class RankError(KprofError):
    """A rank failed, died or did not start: the spec fails, and the group is replaced."""


# --- the coordinator ------------------------------------------------------------------------------------------

class RankGroup:
    """world_size rank processes of one backend, started and initialised (torch.distributed) on construction."""

    def __init__(self, backend: str, world_size: int):
        self.backend, self.n = backend, world_size
        # held while this process lives: where it is killed (the OOM killer), the next group's start removes it
        self.dir, self._release = _scratch.make("kprof-ranks-", f"{backend}{world_size}-")
        self.conns: list[connection.Connection] = []
        self.procs: list[subprocess.Popen] = []
        self.logs = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self.keep_logs = False  # a failure quoted a rank's log: it stays where the message says
        started = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(),
                                                                        os.environ.get("PYTHONPATH")]))}
        try:
            for r in range(world_size):
                mine, theirs = socket.socketpair()
                with open(self.logs[r], "wb") as log:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "kprof.runners._rank", str(theirs.fileno()), str(r), str(world_size),
                         backend, os.path.join(self.dir, "store"), str(step_s())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=env, close_fds=True))
                theirs.close()
                self.conns.append(connection.Connection(mine.detach()))
            self.info = self._gather(start_s(), "start (import torch, init "
                                     f"torch.distributed {backend})", "KPROF_RANK_START_S")
        except BaseException:
            self.close(kill=True)
            raise
        self.start_s = time.perf_counter() - started

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def ask(self, message, what: str) -> list:
        """Sends `message` to every rank and returns their answers in rank order. A rank that answers with an
        error, dies, or is silent past KPROF_RANK_STEP_S raises; the group is then unusable and is killed (but for
        a wrong result: every rank finished the check's collective, so the group goes on)."""
        for r, c in enumerate(self.conns):
            try:
                c.send(message)
            except OSError:
                pass  # a dead rank is reported by _gather, with its exit code and log
        try:
            return self._gather(step_s(), what, "KPROF_RANK_STEP_S")
        except (KeyboardInterrupt, SystemExit):  # answers left in flight would answer the next step: never ask again
            self.close(kill=True)
            raise

    def _gather(self, timeout: float, what: str, knob: str) -> list:
        answers: dict[int, object] = {}
        errors: list[tuple[int, str, str]] = []
        deadline = time.monotonic() + timeout
        waiting = {c: r for r, c in enumerate(self.conns)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(waiting.values())
                tail = self._tail(ranks[0])
                self.close(kill=True)
                raise TimeoutError(f"{self._name(ranks)} of {self.n} did not answer within {timeout:g} s ({what}; {knob} "
                                   f"sets the limit); the rank group was killed{tail}")
            for c in connection.wait(list(waiting), timeout=min(left, 1.0)):
                r = waiting.pop(c)
                try:
                    reply = c.recv()
                except (EOFError, OSError):
                    self._died(r, what)
                if reply[0] == "ok":
                    answers[r] = reply[1]
                elif reply[1] == "WrongResult":  # every rank finished the check's collective: wait for them all
                    errors.append((r, reply[1], reply[2]))
                else:  # the others may wait in a collective for this rank: do not wait for them
                    self._failed(r, reply[1], reply[2], what)
            for c, r in list(waiting.items()):  # a rank can die without closing its socket first (a kill)
                if self.procs[r].poll() is not None and not c.poll():
                    self._died(r, what)
        if errors:
            raise WrongResult(errors[0][2])
        return [answers[r] for r in range(self.n)]

    def _failed(self, r: int, kind: str, text: str, what: str):
        if kind == "Unsupported":
            self.close(kill=True)
            raise Unsupported(f"rank {r}: {text}")
        tail = self._tail(r)
        self.close(kill=True)
        raise RankError(f"rank {r} of {self.n} failed ({what}): {kind}: {text}; the rank group was shut down, and the "
                        f"next spec starts a fresh one{tail}")

    def _died(self, r: int, what: str):
        p = self.procs[r]
        try:
            code = p.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        tail = self._tail(r)
        self.close(kill=True)
        raise RankError(f"rank {r} of {self.n} (pid {p.pid}) exited with code {code} ({what}); the rank group was "
                        f"shut down, and the next spec starts a fresh one{tail}")

    def _name(self, ranks: list[int]) -> str:
        return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"

    def _tail(self, r: int) -> str:
        """The rank's log for a failure's message: its path and its end. The logs are kept (`close` leaves them),
        moved out of the swept scratch directories first, so that the path quoted stays true."""
        if not self.keep_logs:  # the ranks write on through their open logs
            self.keep_logs, self.dir = True, _scratch.keep(self.dir, "kprof-ranks-", "kprof-rank-logs-")
            self.logs = [os.path.join(self.dir, os.path.basename(log)) for log in self.logs]
        try:
            with open(self.logs[r], "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _TAIL))
                text = f.read().decode(errors="replace").strip()
        except OSError as exc:
            return f"; rank {r}'s log {self.logs[r]} cannot be read ({exc.strerror})"
        return f"; rank {r}'s log {self.logs[r]} " + (f"ends: {text}" if text else "is empty")

    def close(self, kill: bool = False) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (0 if kill else 10)
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
        self._release()  # removes the directory, unless _tail moved it out to keep the logs a failure named
        for name in set(os.listdir(self.dir)) - set(map(os.path.basename, self.logs)) if self.keep_logs else ():
            path = os.path.join(self.dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def _package_root() -> str:
    """The directory holding the kprof package, so a rank imports this same kprof."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_group: RankGroup | None = None
_finalizer = None


def group_for(backend: str, world_size: int) -> RankGroup:
    """This process's rank group of (backend, world_size): the running one, or a fresh one (the old one shut down)."""
    global _group, _finalizer
    if _group is not None and (_group.backend, _group.n) == (backend, world_size) and _group.alive():
        return _group
    shutdown()
    _group = RankGroup(backend, world_size)
    if _finalizer is None:  # runs at exit of this process, a multiprocessing child (a pool worker) included
        _finalizer = util.Finalize(None, shutdown, exitpriority=20)
    return _group


def shutdown() -> None:
    """Stops this process's rank group, if any."""
    global _group
    if _group is not None:
        group, _group = _group, None
        group.close(kill=not group.alive())


# --- the worker's device for comm entries -----------------------------------------------------------------------

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
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"backend {self.entry.backend} runs NCCL on CUDA GPUs and torch {torch.__version__} sees "
                             f"none; run on a GPU machine, or use backend gloo (the CPU twin)")
        actual = torch.cuda.get_device_name(0)
        if actual != self.gpu_key:
            raise UsageError(f"GPU key {self.gpu_key!r} differs from CUDA device 0 ({actual!r}); omit --gpu-name")
        if timer == "cupti":
            from ..measure.gpu_timer import cupti_available

            why = cupti_available()
            if why:
                raise UsageError(f"CUPTI is not usable here ({why}); install cupti-python with nvidia-cuda-cupti, or "
                                 f"set KPROF_TIMER=events to time with CUDA events (rows kept under their own key)")

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
        group = group_for(self.backend, n)
        others = [f"cuda:{r} is a {i['name']}" for r, i in enumerate(group.info) if i.get("name", self.gpu_key)
                  != self.gpu_key]
        if others:
            raise Unsupported(f"the rows go under GPU key {self.gpu_key!r} and {', '.join(others)}: a group of "
                              f"one GPU model only (set KPROF_PROFILE_GPUS to such GPUs)")
        start_s = time.perf_counter() - t  # ~0 when the group of this size was running already
        t_check, load = time.perf_counter(), os.getloadavg()[0]
        global EXIT_RANK_FOR_TESTS
        die, EXIT_RANK_FOR_TESTS = EXIT_RANK_FOR_TESTS, None  # the test hook is one-shot
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
            load, cores = max(load, os.getloadavg()[0]), os.cpu_count() or 1
            notes["host_load_1m"] = f"{load:.2f}"
            if load > cores:
                notes["host_busy"] = f"load {load:.2f} over {cores} cores: other work shared them"
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
