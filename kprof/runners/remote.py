"""The executors of `run --remote NAME`: an existing engine (Ray, or Slurm through submitit) measuring chunks and
returning segments. The remotes are read from `remote.yaml` by kprof.runners.remote_config; the run itself (what to
measure, the merges, remote-run.json) is kprof.remote.

    remote = load_remote("h200", "remote.yaml", ["launch.slurm.time=30"])  # kprof.runners.remote_config
    executor = executor_for(remote, "cuda", "runs/r1")

A remote is one entry of the untracked `remote.yaml` (`remote.example.yaml` lists every field). An executor runs
chunks (kprof.runners.chunk: specs in, a segment out) and nothing else:

    executor.workers() -> int                       how many chunks to split the work into
    executor.submit(chunks, first) -> iter of (i, data)  chunk i's returned data (first + its position), as it
                                                    completes (failures: .failures, {i: the reason})
    executor.describe() -> dict                     engine, address or cluster, job ids, hosts, GPUs
    executor.close() -> list[int]                   stops the chunks still queued or running (an interrupt); their
                                                    numbers

RayExecutor runs each chunk as a Ray task on a GPU (or a CPU slot for CPU backends), as many at once as the cluster
has free; SlurmExecutor submits one submitit job per
chunk, as one job array. Scheduling, retries and placement are the engine's: kprof only splits and merges.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Iterator

from .. import _scratch
from ..errors import UsageError
from .chunk import Chunk, chunk_entry, chunk_segment
from .remote_config import EXAMPLE, Remote, engine, where

__all__ = ["executor_for", "RayExecutor", "SlurmExecutor", "run_chunk", "job_reason"]

# ---- the worker side --------------------------------------------------------------------------------------------

def run_chunk(data: bytes) -> tuple[bytes, dict]:
    """What a remote worker runs: the chunk (Chunk.encode bytes) measured on this process's device, as a segment's
    bytes, and where it ran. A CPU chunk is refused on another CPU model than its key (the rows would lie)."""
    chunk = Chunk.decode(data)
    if chunk_entry(chunk).device == "cpu":
        from ..measure.env import cpu_model

        here = cpu_model()
        if here != chunk.gpu_key:
            raise UsageError(f"this worker's CPU is {here!r}, the chunk's rows are keyed {chunk.gpu_key!r}; pass "
                             f"--gpu-name {here!r} to measure on this remote")
    tmp, remove = _scratch.make("kprof-chunk-")  # one a killed chunk left (SIGKILL, a time limit) the next removes
    try:
        with open(chunk_segment(chunk, tmp), "rb") as f:
            segment = f.read()
    finally:  # a collective's ranks end with their chunk: an engine keeps its worker process for the next task, where
        from . import _ranks  # they held memory (CUDA contexts on GPUs the engine then hands out as free) for no one

        remove()
        _ranks.shutdown()
    return segment, {"host": socket.gethostname(), "pid": os.getpid(),
                     "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _ray_chunk(data: bytes) -> tuple[bytes, dict]:
    """One Ray task: measures one chunk on the GPU (or CPU slot) Ray gave it."""
    import ray

    segment, info = run_chunk(data)
    context = ray.get_runtime_context()
    info.update(gpus=[str(g) for g in ray.get_gpu_ids()], task=context.get_task_id(), node=context.get_node_id())
    return segment, info


# ---- executors --------------------------------------------------------------------------------------------------

def _gpus(remote: Remote, field: str, device: str, need: int) -> int:
    """The GPUs a chunk asks for: the field's value, else what the specs need (`need`: the most one spec of the run
    needs, a collective's world_size; 0 for CPU backends). A CUDA value below `need` is refused: every chunk asking
    for fewer GPUs than its spec measures on would fail it with `need N idle GPU(s), found M`."""
    settings = remote.ray if field.startswith("launch.ray") else remote.slurm
    value = getattr(settings, field.rsplit(".", 1)[1])
    if device != "cuda":
        return value if value is not None else 0
    if value is None:
        return need
    if value < need:
        raise UsageError(f"{where(remote.path, remote.name, field)} is {value} and a spec of this run needs {need} "
                         f"GPU(s); set it to {need} or leave it out (a chunk then asks for the GPUs "
                         f"its specs need)")
    return value


class RayExecutor:
    """Chunks as Ray tasks, each on a GPU (gpus_per_worker each) or a CPU slot (CPU backends)."""

    def __init__(self, remote: Remote, device: str, need: int = 1):
        ray = engine("ray", "ray[client]>=2.10", f"remote {remote.name!r} is kind ray, and ray is not installed here")
        self.remote, self.settings, self._ray = remote, remote.ray, ray
        self.gpus = _gpus(remote, "launch.ray.gpus_per_worker", device, need)
        self.owned = not ray.is_initialized()  # a connection made here is closed here; one made before is reused
        if self.owned:
            address = self.settings.address
            # ray.init replaces the SIGTERM handler with its own sys.exit(15): a run stopped so ended with exit 15 and
            # no word of what it left. The caller's handler (kprof's: exit 143, saying so) is put back.
            main = threading.current_thread() is threading.main_thread()
            on_term = signal.getsignal(signal.SIGTERM) if main else None
            try:
                if address == "local":
                    ray.init(num_cpus=self.settings.num_cpus, include_dashboard=False)
                else:
                    ray.init(address=address)
            except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
                raise UsageError(f"remote {remote.name!r}: cannot connect to Ray at {address!r} ({exc}); start the "
                                 f"cluster, or fix launch.ray.address in {remote.path}") from None
            finally:
                if on_term is not None:
                    signal.signal(signal.SIGTERM, on_term)
        self.failures: dict[int, str] = {}
        self.infos: dict[int, dict] = {}
        self.pending: dict = {}  # ObjectRef -> chunk number, of the tasks not finished

    def workers(self) -> int:
        """`workers`, else one chunk per task the cluster's nodes can run at once. A task asks for its GPUs on one
        node: where no node has that many, it would wait for good (with `workers` set too), so that is refused."""
        if self.gpus:
            gpus = [node["Resources"].get("GPU", 0) for node in self._ray.nodes() if node.get("Alive")]
            slots = sum(int(g // self.gpus) for g in gpus)
            if slots < 1:
                raise UsageError(f"remote {self.remote.name!r}: no node of the Ray cluster has {self.gpus} GPU(s) for "
                                 f"a task (its nodes have {', '.join(f'{g:g}' for g in gpus) or 'none'}), so none "
                                 f"would start; add GPUs or lower launch.ray.gpus_per_worker")
        else:
            slots = int(self._ray.cluster_resources().get("CPU", 0))
        return self.remote.workers if self.remote.workers is not None else slots

    def submit(self, chunks: list[Chunk], first: int = 0) -> Iterator[tuple[int, bytes]]:
        """Each chunk as one Ray task (chunk i is numbered first + i): Ray runs as many at once as the cluster has
        free GPUs (CPU slots) and starts the next as one finishes, so every chunk runs whatever `workers` is. A
        task is not retried: a chunk that kills its worker fails, as a local worker's spec does."""
        ray = self._ray
        from ray.exceptions import RayError

        task = ray.remote(_ray_chunk).options(num_cpus=1, num_gpus=self.gpus, max_retries=0,
                                              runtime_env=self.settings.runtime_env or None)
        self.pending = {task.remote(c.encode()): first + i for i, c in enumerate(chunks)}
        while self.pending:
            done, _ = ray.wait(list(self.pending), num_returns=1)
            i = self.pending.pop(done[0])
            try:
                segment, self.infos[i] = ray.get(done[0])
            except RayError as exc:  # the chunk's worker failed: the others go on
                self.failures[i] = str(getattr(exc, "cause", None) or exc).strip().splitlines()[-1]
                continue
            yield i, segment

    def describe(self) -> dict:
        ray = self._ray
        doc = {"engine": "ray", "ray_version": ray.__version__, "address": self.settings.address,
               "gpus_per_worker": self.gpus, "runtime_env": self.settings.runtime_env}
        if ray.is_initialized():
            doc["job_ids"] = [ray.get_runtime_context().get_job_id()]
        return doc | _placement(self.infos)

    def close(self) -> list[int]:
        stopped = sorted(self.pending.values())
        for ref in self.pending:  # the run stopped early (an interrupt): its chunks still queued or running go
            self._ray.cancel(ref, force=True)
        self.pending = {}
        if self.owned:
            self._ray.shutdown()
        return stopped


class SlurmExecutor:
    """Chunks as submitit jobs, one per chunk in one job array: Slurm, or submitit's LocalExecutor or DebugExecutor."""

    POLL_S = 1.0  # submitit's Slurm watcher rate-limits its sacct calls itself

    def __init__(self, remote: Remote, device: str, output_dir: str, need: int = 1):
        submitit = engine("submitit", "submitit>=1.5.4",
                          f"remote {remote.name!r} is kind slurm, and submitit is not installed here")
        self.remote, self.settings, self._submitit = remote, remote.slurm, submitit
        s = self.settings
        self.gpus = _gpus(remote, "launch.slurm.gpus_per_node", device, need)
        self.folder = s.folder or os.path.join(output_dir, "submitit")
        try:
            self.executor = submitit.AutoExecutor(folder=self.folder, cluster=s.cluster)
        except RuntimeError as exc:  # no Slurm here: submitit finds no `srun`
            raise UsageError(f"remote {remote.name!r}: cannot submit to Slurm from this machine ({exc}); run where "
                             f"Slurm is, or set launch.slurm.cluster: local (in {remote.path}, or --remote-set "
                             f"launch.slurm.cluster=local) to test on this machine") from None
        except OSError as exc:  # the folder is a file, or cannot be made (it was a traceback, exit 1)
            field = "launch.slurm.folder"
            given = ("--output-dir's submitit folder" if s.folder is None
                     else where(remote.path, remote.name, field, remote.overrides))
            raise UsageError(f"{given} {self.folder!r} cannot be made ({exc.strerror}: {exc.filename}); give a "
                             f"directory that is there or can be made") from None
        params = dict(timeout_min=s.time, gpus_per_node=self.gpus, nodes=1, tasks_per_node=1, name="kprof")
        if s.cluster == "slurm":
            params.update(slurm_partition=s.partition, **({"slurm_account": s.account} if s.account else {}))
        self.executor.update_parameters(**params)
        self.failures: dict[int, str] = {}
        self.infos: dict[int, dict] = {}
        self.job_ids: list[str] = []
        self.pending: dict[int, object] = {}  # chunk number -> its job, of the jobs not finished

    def workers(self) -> int:
        return self.remote.workers or 1

    def submit(self, chunks: list[Chunk], first: int = 0) -> Iterator[tuple[int, bytes]]:
        jobs = self.executor.map_array(run_chunk, [c.encode() for c in chunks])
        self.job_ids += [str(j.job_id) for j in jobs]
        index = {id(j): first + i for i, j in enumerate(jobs)}
        self.pending.update((first + i, j) for i, j in enumerate(jobs))
        for job in self._submitit.helpers.as_completed(jobs, poll_frequency=self.POLL_S):
            i = index[id(job)]
            self.pending.pop(i, None)
            try:
                segment, self.infos[i] = job.result()
            except Exception as exc:  # noqa: BLE001 - a failed or cancelled job: the others go on
                self.failures[i] = f"job {job.job_id}: {job_reason(exc)}"
                continue
            self.infos[i]["job_id"] = str(job.job_id)
            yield i, segment

    def describe(self) -> dict:
        s = self.settings
        doc = {"engine": "submitit", "submitit_version": self._submitit.__version__, "cluster": s.cluster,
               "partition": s.partition, "account": s.account, "time_min": s.time, "gpus_per_node": self.gpus,
               "folder": self.folder, "job_ids": self.job_ids}
        return doc | _placement(self.infos)

    def close(self) -> list[int]:
        """Cancels the jobs not finished (the run stopped early: an interrupt), as Ray's tasks are: left running, they
        measured specs that no run merges, and that the next run measures again."""
        stopped = sorted(self.pending)
        for job in self.pending.values():
            job.cancel(check=False)
        self.pending = {}
        return stopped


def job_reason(exc: BaseException) -> str:
    """Why a submitit job failed, from the error submitit raises for it: the last line of the job's traceback (the
    exception it raised: a UsageError's message, a time limit's UncompletedJobError), or the line saying it left
    no result ("has not produced any output (state: ...)"), not the log lines and paths submitit appends."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "has not produced any output" in ln:
            return ln
    rules = [n for n, ln in enumerate(lines) if set(ln) == {"-"}]
    if len(rules) >= 2 and rules[1] > rules[0] + 1:  # "failed during processing with trace:", the trace between rules
        return lines[rules[1] - 1]
    return lines[0] if lines else type(exc).__name__


def _placement(infos: dict[int, dict]) -> dict:
    return {"hosts": sorted({info["host"] for info in infos.values()}),
            "gpus": [{"chunk": i, **info} for i, info in sorted(infos.items())]}


def executor_for(remote: Remote, device: str, output_dir: str, need: int = 1):
    """The executor of the remote's kind, connected (a Ray cluster joined or started; submitit configured). `need`:
    the most GPUs one spec of the run needs (a collective's world_size), what each chunk asks for by default."""
    if remote.kind == "ray":
        if remote.ray is None:
            raise UsageError(f"{where(remote.path, remote.name, 'launch.ray')} is missing; add it ({EXAMPLE})")
        return RayExecutor(remote, device, need)
    if remote.slurm is None:
        raise UsageError(f"{where(remote.path, remote.name, 'launch.slurm')} is missing; add it ({EXAMPLE})")
    return SlurmExecutor(remote, device, output_dir, need)
