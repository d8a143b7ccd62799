"""Remotes: where `run --remote NAME` sends its chunks. `remote.yaml` read and validated, and the executors of an
existing engine (Ray, or Slurm through submitit) that measure chunks and return segments; the run itself (what to
measure, the merges, remote-run.json) is kprof.remote.

    remote = load_remote("h200", "remote.yaml", ["launch.slurm.time=30"])  # validated; UsageError names the fix
    executor = executor_for(remote, "cuda", "runs/r1")

A remote is one entry of the untracked `remote.yaml` (`remote.example.yaml` lists every field). An executor runs
chunks (kprof.runners.chunk: specs in, a segment out) and nothing else:

    executor.workers() -> int                       how many chunks to split the work into
    executor.submit(chunks) -> iter of (i, bytes)   each chunk's segment, as it completes (failures: .failures)
    executor.describe() -> dict                     engine, address or cluster, job ids, hosts, GPUs

RayExecutor keeps one actor per GPU (or per CPU slot for CPU backends); SlurmExecutor submits one submitit job per
chunk, as one job array. Scheduling, retries and placement are the engine's: kprof only splits and merges.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Iterator

import msgspec

from ..errors import UsageError
from .chunk import Chunk, chunk_entry, chunk_segment

__all__ = ["Remote", "RaySettings", "SlurmSettings", "load_remote", "executor_for", "RayExecutor", "SlurmExecutor",
           "run_chunk", "FIELDS", "CONFIG"]

CONFIG = "remote.yaml"
CONFIG_VERSION = 1
_EXAMPLE = "remote.example.yaml lists every field"


# ---- remote.yaml ------------------------------------------------------------------------------------------------

class RaySettings(msgspec.Struct, frozen=True):
    address: str  # "local" (start a cluster here), "auto" (the running one), or "ray://host:10001"
    num_cpus: int | None = None  # only with "local"
    gpus_per_worker: int | None = None  # None: 1 for CUDA backends, 0 for CPU ones
    runtime_env: dict = {}


class SlurmSettings(msgspec.Struct, frozen=True):
    time: int  # minutes per job
    partition: str | None = None  # required with cluster "slurm"
    gpus_per_node: int | None = None  # GPUs each job asks for; None: 1 for CUDA backends, 0 for CPU ones
    account: str | None = None
    folder: str | None = None  # submitit's logs and pickles; default OUTPUT_DIR/submitit
    cluster: str = "slurm"  # slurm | local (submitit's LocalExecutor) | debug (in this process)


class Remote(msgspec.Struct, frozen=True):
    name: str
    path: str
    kind: str  # ray | slurm
    workers: int | None = None  # chunks; None: every GPU/CPU slot of the Ray cluster, 1 Slurm job
    ray: RaySettings | None = None
    slurm: SlurmSettings | None = None
    overrides: list[str] = []


class _Field(msgspec.Struct, frozen=True):
    type: str  # str | int | mapping
    doc: str
    choices: tuple = ()
    minimum: int | None = None


# Every settable field, by its dotted name: the name in remote.yaml (nested) and in --remote-set KEY=VALUE.
FIELDS: dict[str, _Field] = {
    "kind": _Field("str", "the engine", choices=("ray", "slurm")),
    "workers": _Field("int", "how many chunks (Ray actors or Slurm jobs)", minimum=1),
    "launch.ray.address": _Field("str", 'the cluster: "local", "auto" or "ray://HOST:10001"'),
    "launch.ray.num_cpus": _Field("int", 'CPUs of a cluster started here (address "local" only)', minimum=1),
    "launch.ray.gpus_per_worker": _Field("int", "GPUs per actor (0 for CPU backends)", minimum=0),
    "launch.ray.runtime_env": _Field("mapping", "Ray runtime_env of the actors, e.g. {env_vars: {A: b}}"),
    "launch.slurm.partition": _Field("str", "the Slurm partition"),
    "launch.slurm.gpus_per_node": _Field("int", "GPUs each job asks for (0 for CPU backends)", minimum=0),
    "launch.slurm.time": _Field("int", "each job's time limit in minutes", minimum=1),
    "launch.slurm.account": _Field("str", "the Slurm account"),
    "launch.slurm.folder": _Field("str", "submitit's folder for logs and pickles"),
    "launch.slurm.cluster": _Field("str", "submitit's executor", choices=("slurm", "local", "debug")),
}
_SECTIONS = {"launch", "launch.ray", "launch.slurm"}


def _where(path: str, name: str, field: str) -> str:
    return f"{path}: remote {name!r}: field {field}"


def _flatten(path: str, name: str, doc: dict, prefix: str = "") -> dict[str, Any]:
    """The remote's mapping as {dotted field: value}; an unknown field is refused, naming the known ones there."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        dotted = f"{prefix}{key}"
        if dotted in _SECTIONS:
            if not isinstance(value, dict):
                raise UsageError(f"{_where(path, name, dotted)} is {value!r}, not a mapping; nest its fields under "
                                 f"it ({_EXAMPLE})")
            out.update(_flatten(path, name, value, dotted + "."))
        elif dotted in FIELDS:
            out[dotted] = value
        else:
            here = sorted({f[len(prefix):].split(".")[0] for f in [*FIELDS, *_SECTIONS] if f.startswith(prefix)})
            raise UsageError(f"{_where(path, name, dotted)} is not a remote field; the fields there are "
                             f"{', '.join(here)} ({_EXAMPLE})")
    return out


def _checked(where: str, field: _Field, value: Any, raw: bool) -> Any:
    """The value of one field, checked (and parsed when `raw`: a --remote-set string)."""
    example = f"e.g. {field.choices[0]}" if field.choices else f"({field.doc})"
    if field.type == "mapping":
        if raw:
            import yaml

            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                value = None
        if not isinstance(value, dict):
            raise UsageError(f"{where} is {value!r}, not a mapping; give one, e.g. {{env_vars: {{KPROF_TIMER: "
                             f"cupti}}}} {example}")
        return value
    if field.type == "int":
        if raw:
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{where} is {value!r}, not a whole number; give one {example}")
        if field.minimum is not None and value < field.minimum:
            raise UsageError(f"{where} is {value}; give a number >= {field.minimum} {example}")
        return value
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where} is {value!r}, not a non-empty string; give one {example}")
    if field.choices and value not in field.choices:
        raise UsageError(f"{where} is {value!r}, not one of {', '.join(field.choices)}; {example}")
    return value


def _override(path: str, name: str, item: str) -> tuple[str, str]:
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise UsageError(f"--remote-set {item!r} is not KEY=VALUE; e.g. --remote-set launch.slurm.time=30")
    if key not in FIELDS:
        raise UsageError(f"--remote-set {key}: not a field of a remote; the fields are {', '.join(FIELDS)} "
                         f"({_EXAMPLE})")
    return key, value


def _read(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise UsageError(f"{path} not found: --remote reads its named remotes from it; copy remote.example.yaml "
                         f"to {path} and fill in your remote") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}; check its permissions") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path} is not valid YAML{at} ({getattr(exc, 'problem', None) or exc}); fix the "
                         f"file ({_EXAMPLE})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path} is not a mapping with a `remotes:` section; {_EXAMPLE}")
    unknown = sorted(set(doc) - {"version", "remotes"})
    if unknown:
        raise UsageError(f"{path}: top-level field {unknown[0]} is not known; the top level holds version and "
                         f"remotes ({_EXAMPLE})")
    version = doc.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise UsageError(f"{path}: version {version!r}; this kprof reads version {CONFIG_VERSION}: set version: "
                         f"{CONFIG_VERSION}, or upgrade kprof")
    remotes = doc.get("remotes")
    if not isinstance(remotes, dict) or not remotes:
        raise UsageError(f"{path}: `remotes:` is missing or empty; add a mapping of named remotes ({_EXAMPLE})")
    return remotes


def load_remote(name: str, path: str = CONFIG, overrides: list[str] | tuple = ()) -> Remote:
    """The remote `name` of the YAML file at `path`, with `overrides` (`--remote-set KEY=VALUE`, KEY one of FIELDS)
    applied for this call. Every field is checked: a bad one is a UsageError naming the file, remote, field and
    fix. Only the section of the remote's kind (launch.ray or launch.slurm) must be complete."""
    if not name or not name.strip():
        raise UsageError("--remote is empty; pass the name of a remote of remote.yaml")
    remotes = _read(path)
    if name not in remotes:
        raise UsageError(f"{path} has no remote {name!r}; it has {', '.join(map(repr, remotes))}: pass one of "
                         f"those to --remote, or add {name!r} to {path}")
    doc = remotes[name]
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: remote {name!r} is {doc!r}, not a mapping of its fields ({_EXAMPLE})")
    values = {k: _checked(_where(path, name, k), FIELDS[k], v, raw=False)
              for k, v in _flatten(path, name, doc).items()}
    for item in overrides:
        key, value = _override(path, name, item)
        values[key] = _checked(f"--remote-set {key}", FIELDS[key], value, raw=True)
    kind = values.get("kind")
    if kind is None:
        raise UsageError(f"{_where(path, name, 'kind')} is missing; set kind: ray or kind: slurm")

    def section(engine: str, required: str, fix: str) -> dict | None:
        """The fields of launch.<engine>; the section of the remote's kind must have `required`. A section of the
        other kind is kept only when complete (so that --remote-set kind=... can switch to it)."""
        prefix = f"launch.{engine}."
        fields = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        if required not in fields:
            if kind == engine:
                raise UsageError(f"{_where(path, name, prefix + required)} is missing; {fix}")
            return None
        return fields

    ray = section("ray", "address", 'set it to "local", "auto" or "ray://HOST:10001"')
    slurm = section("slurm", "time", "set each job's time limit in minutes, e.g. time: 60")
    if kind == "slurm" and slurm.get("cluster", "slurm") == "slurm" and "partition" not in slurm:
        raise UsageError(f"{_where(path, name, 'launch.slurm.partition')} is missing; set the Slurm partition "
                         f"(or launch.slurm.cluster: local to run the jobs on this machine)")
    if kind == "ray" and "num_cpus" in ray and ray["address"] != "local":
        raise UsageError(f"{_where(path, name, 'launch.ray.num_cpus')} applies only to address \"local\" (a cluster "
                         f"started here); {ray['address']!r} names a running cluster: remove num_cpus")
    return Remote(name, path, kind, values.get("workers"), RaySettings(**ray) if ray else None,
                  SlurmSettings(**slurm) if slurm else None, list(overrides))


# ---- the worker side --------------------------------------------------------------------------------------------

def run_chunk(data: bytes) -> tuple[bytes, dict]:
    """What a remote worker runs: the chunk (Chunk.encode bytes) measured on this process's device, as a segment's
    bytes, and where it ran. A CPU chunk is refused on another CPU model than its key (the rows would lie)."""
    import tempfile

    chunk = Chunk.decode(data)
    if chunk_entry(chunk).device == "cpu":
        from ..measure.env import cpu_model

        here = cpu_model()
        if here != chunk.gpu_key:
            raise UsageError(f"this worker's CPU is {here!r}, the chunk's rows are keyed {chunk.gpu_key!r}; pass "
                             f"--gpu-name {here!r} to measure on this remote")
    with tempfile.TemporaryDirectory(prefix="kprof-chunk-") as tmp:
        with open(chunk_segment(chunk, tmp), "rb") as f:
            segment = f.read()
    return segment, {"host": socket.gethostname(), "pid": os.getpid(),
                     "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


class _RayWorker:
    """One Ray actor: measures the chunks it is given, one at a time, on its GPU (or CPU slot)."""

    def measure(self, data: bytes) -> tuple[bytes, dict]:
        import ray

        segment, info = run_chunk(data)
        context = ray.get_runtime_context()
        info.update(gpus=[str(g) for g in ray.get_gpu_ids()], actor=context.get_actor_id(),
                    node=context.get_node_id())
        return segment, info


# ---- executors --------------------------------------------------------------------------------------------------

def _gpus(settings_value: int | None, device: str) -> int:
    return settings_value if settings_value is not None else (1 if device == "cuda" else 0)


class RayExecutor:
    """Chunks on Ray actors, one per GPU (gpus_per_worker each) or per CPU slot (CPU backends)."""

    def __init__(self, remote: Remote, device: str):
        import ray

        self.remote, self.settings, self._ray = remote, remote.ray, ray
        self.gpus = _gpus(self.settings.gpus_per_worker, device)
        if device == "cuda" and self.gpus == 0:
            raise UsageError(f"{_where(remote.path, remote.name, 'launch.ray.gpus_per_worker')} is 0 and the backend "
                             f"measures on a CUDA GPU; set it to 1")
        self.owned = not ray.is_initialized()  # a connection made here is closed here; one made before is reused
        if self.owned:
            address = self.settings.address
            try:
                if address == "local":
                    ray.init(num_cpus=self.settings.num_cpus, include_dashboard=False)
                else:
                    ray.init(address=address)
            except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
                raise UsageError(f"remote {remote.name!r}: cannot connect to Ray at {address!r} ({exc}); start the "
                                 f"cluster, or fix launch.ray.address in {remote.path}") from None
        self.failures: dict[int, str] = {}
        self.infos: dict[int, dict] = {}
        self.actors: list = []

    def workers(self) -> int:
        if self.remote.workers is not None:
            return self.remote.workers
        resources = self._ray.cluster_resources()
        slots = int(resources.get("GPU", 0) // self.gpus) if self.gpus else int(resources.get("CPU", 0))
        if slots < 1:
            raise UsageError(f"remote {self.remote.name!r}: the Ray cluster has {resources.get('GPU', 0)} GPU(s) for "
                             f"actors of {self.gpus}; add GPUs or lower launch.ray.gpus_per_worker")
        return slots

    def submit(self, chunks: list[Chunk]) -> Iterator[tuple[int, bytes]]:
        ray = self._ray
        from ray.exceptions import RayError

        actor = ray.remote(_RayWorker).options(num_cpus=1, num_gpus=self.gpus,
                                               runtime_env=self.settings.runtime_env or None)
        self.actors = [actor.remote() for _ in range(min(len(chunks), self.workers()))]
        pending = {self.actors[i % len(self.actors)].measure.remote(c.encode()): i for i, c in enumerate(chunks)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
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

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self.actors = []
        if self.owned:
            self._ray.shutdown()


class SlurmExecutor:
    """Chunks as submitit jobs, one per chunk in one job array: Slurm, or submitit's LocalExecutor or DebugExecutor."""

    POLL_S = 1.0  # submitit's Slurm watcher rate-limits its sacct calls itself

    def __init__(self, remote: Remote, device: str, output_dir: str):
        import submitit

        self.remote, self.settings, self._submitit = remote, remote.slurm, submitit
        s = self.settings
        self.gpus = _gpus(s.gpus_per_node, device)
        if device == "cuda" and self.gpus == 0:
            raise UsageError(f"{_where(remote.path, remote.name, 'launch.slurm.gpus_per_node')} is 0 and the "
                             f"backend measures on a CUDA GPU; set it to 1")
        self.folder = s.folder or os.path.join(output_dir, "submitit")
        self.executor = submitit.AutoExecutor(folder=self.folder, cluster=s.cluster)
        params = dict(timeout_min=s.time, gpus_per_node=self.gpus, nodes=1, tasks_per_node=1, name="kprof")
        if s.cluster == "slurm":
            params.update(slurm_partition=s.partition, **({"slurm_account": s.account} if s.account else {}))
        self.executor.update_parameters(**params)
        self.failures: dict[int, str] = {}
        self.infos: dict[int, dict] = {}
        self.job_ids: list[str] = []

    def workers(self) -> int:
        return self.remote.workers or 1

    def submit(self, chunks: list[Chunk]) -> Iterator[tuple[int, bytes]]:
        jobs = self.executor.map_array(run_chunk, [c.encode() for c in chunks])
        self.job_ids = [str(j.job_id) for j in jobs]
        index = {id(j): i for i, j in enumerate(jobs)}
        for job in self._submitit.helpers.as_completed(jobs, poll_frequency=self.POLL_S):
            i = index[id(job)]
            try:
                segment, self.infos[i] = job.result()
            except Exception as exc:  # noqa: BLE001 - a failed or cancelled job: the others go on
                lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
                self.failures[i] = f"job {job.job_id}: {lines[-1] if lines else type(exc).__name__}"
                continue
            self.infos[i]["job_id"] = str(job.job_id)
            yield i, segment

    def describe(self) -> dict:
        s = self.settings
        doc = {"engine": "submitit", "submitit_version": self._submitit.__version__, "cluster": s.cluster,
               "partition": s.partition, "account": s.account, "time_min": s.time, "gpus_per_node": self.gpus,
               "folder": self.folder, "job_ids": self.job_ids}
        return doc | _placement(self.infos)

    def close(self) -> None:
        pass


def _placement(infos: dict[int, dict]) -> dict:
    return {"hosts": sorted({info["host"] for info in infos.values()}),
            "gpus": [{"chunk": i, **info} for i, info in sorted(infos.items())]}


def executor_for(remote: Remote, device: str, output_dir: str):
    """The executor of the remote's kind, connected (a Ray cluster joined or started; submitit configured)."""
    if remote.kind == "ray":
        if remote.ray is None:
            raise UsageError(f"{_where(remote.path, remote.name, 'launch.ray')} is missing; add it ({_EXAMPLE})")
        return RayExecutor(remote, device)
    if remote.slurm is None:
        raise UsageError(f"{_where(remote.path, remote.name, 'launch.slurm')} is missing; add it ({_EXAMPLE})")
    return SlurmExecutor(remote, device, output_dir)
