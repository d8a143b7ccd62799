"""`run --remote NAME`: the chunks of a run measured on an existing engine (Ray, or Slurm through submitit), each
returned as a segment and merged into the local ledger as it arrives.

    remote = load_remote("h200", "remote.yaml", ["launch.slurm.time=30"])  # validated; UsageError names the fix
    res = run_remote("single_gemm", "torch", specs, remote="h200", output_dir="runs/r1", gpu_name="NVIDIA H200")

A remote is one entry of the untracked `remote.yaml` (`remote.example.yaml` lists every field). An executor runs
chunks (kprof.runners.chunk: specs in, a segment out) and nothing else:

    executor.workers() -> int                       how many chunks to split the work into
    executor.submit(chunks) -> iter of (i, bytes)   each chunk's segment, as it completes (failures: .failures)
    executor.describe() -> dict                     engine, address or cluster, job ids, hosts, GPUs

RayExecutor keeps one actor per GPU (or per CPU slot for CPU backends); SlurmExecutor submits one submitit job per
chunk, as one job array. Scheduling, retries and placement are the engine's: kprof only splits and merges.

The output directory holds `segments/` (each returned segment, named by its content), `remote-run.json` (where
and how it ran, what each segment merged) and, on a conflict, `merge-report.json`: a conflicting segment merges
nothing and the run exits 3. `fresh` mode merges nothing at all.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any, Callable, Iterator

import msgspec

from ..api import QueryResult, _empty_root, _keys, _prepare, _query, _result
from ..errors import MergeConflict, UsageError
from ..ledger import Ledger
from ..ledger._codec import encode, event_decoder, event_id
from ..ledger.events import Measured, Origin, summary_of
from ..ledger.view import Row
from .chunk import Chunk, chunk_entry, chunk_segment

__all__ = ["Remote", "RaySettings", "SlurmSettings", "RemoteResult", "load_remote", "run_remote", "executor_for",
           "RayExecutor", "SlurmExecutor", "run_chunk", "FIELDS", "CONFIG"]

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


# ---- the run ----------------------------------------------------------------------------------------------------

class RemoteResult(QueryResult):
    """A run's QueryResult, and what the remote did: `record` is remote-run.json; exit_code 3 on a conflict."""

    record: dict = {}
    record_path: str = ""
    merge_report: str | None = None
    failures: list[str] = []

    def to_json(self) -> dict:
        doc = super().to_json()
        for extra in ("record", "record_path", "merge_report", "failures"):
            doc.pop(extra)
        return doc


def _segment_events(path: str) -> list:
    from ..merge import segment

    return [event_decoder.decode(data) for data in segment.read(path)]


def _store(directory: str, data: bytes) -> str:
    """The segment's bytes at DIR/<first 32 hex digits of its digest>.kseg (as kprof.merge.segment names it)."""
    named = os.path.join(directory, data[-32:].hex()[:32] + ".kseg")
    if not os.path.exists(named):
        tmp = f"{named}.part"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, named)
    return named


def _check_output_dir(output_dir: str | None) -> str:
    from ..artifacts import check_output_dir

    if output_dir is None:
        raise UsageError("--remote needs --output-dir DIR: the segments, remote-run.json and any merge-report.json "
                         "go there; pass a new directory")
    check_output_dir(output_dir)
    for name in ("remote-run.json", "segments", "merge-report.json"):
        if os.path.lexists(os.path.join(output_dir, name)):
            raise UsageError(f"--output-dir {output_dir} already holds {name} of another remote run; pass a new "
                             f"directory")
    return output_dir


def _write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def run_remote(table: str, backend: str, raw_specs: list, *, remote: str, remote_set: list[str] | tuple = (),
               output_dir: str | None, mode: str = "jit", gpu_name: str | None = None, timer: str | None = None,
               l2: str | None = None, cuda_graph: bool | None = None, power: str | None = None, command: str = "",
               config: str = CONFIG, db: str | None = None,
               progress: Callable[[int, int, dict], None] | None = None) -> RemoteResult:
    """Measures the specs on the remote `remote` of `config` (with `remote_set` overrides) and merges each returned
    segment into the ledger at `db` ($KPROF_DB, else ./profile.db) as it arrives; mode jit (the missing specs),
    force (all) or fresh (all, nothing merged). Everything is validated before anything is written or submitted.
    `progress(done, total, chunk record)` after each chunk. The result's exit_code: 3 on a merge conflict (that
    segment merged nothing; merge-report.json in output_dir), else 1 when rows remain missing, else 0."""
    from .. import __version__

    started = time.perf_counter()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if mode not in ("jit", "force", "fresh"):
        raise UsageError(f"mode {mode!r} is not one of jit, force, fresh")
    target = load_remote(remote, config, list(remote_set))
    output_dir = _check_output_dir(output_dir)
    method = dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
    entry, canonical, gpu_key, db = _prepare(table, backend, raw_specs, gpu_name, db, method)
    if entry.device == "cuda" and gpu_name is None:
        raise UsageError(f"backend {backend} measures on a CUDA GPU: pass --gpu-name with the GPU of remote "
                         f"{remote!r} (e.g. --gpu-name 'NVIDIA H200'); its rows are keyed by it")

    # The rows before, from the local ledger (read only: it is opened for writing per merge, briefly).
    exists = os.path.exists(db)
    if exists:
        with Ledger.open(db, readonly=True) as ledger:
            ledger_id = ledger.ledger_id
            before_root, before_rows = ledger.view(table, backend, gpu_key, entry.contract,
                                                   entry.args).query(canonical)
    else:
        ledger_id, before_root, before_rows = "", _empty_root(entry, gpu_key), [None] * len(canonical)
    spec_keys = [_keys(entry, gpu_key).key(s) for s in canonical]
    todo, seen = [], set()
    for i, k in enumerate(spec_keys):  # one measurement per key, as in api.run
        if k in seen or (mode == "jit" and before_rows[i] is not None and before_rows[i].status == "ok"):
            continue
        seen.add(k)
        todo.append(i)
    parents = {r.key: r.event_id for r in before_rows if r is not None and r.event_id is not None}

    executor = executor_for(target, entry.device, output_dir) if todo else None
    try:
        n = max(1, min(executor.workers(), len(todo))) if executor is not None else 0  # may refuse: nothing written
    except BaseException:
        executor.close()
        raise
    seg_dir = os.path.join(output_dir, "segments")
    os.makedirs(seg_dir)
    record: dict[str, Any] = {
        "remote": target.name, "config": os.path.abspath(target.path), "kind": target.kind,
        "overrides": list(remote_set),
        "launch": msgspec.to_builtins(target.ray if target.kind == "ray" else target.slurm),
        "kprof_version": __version__, "table": table, "backend": backend, "gpu_name": gpu_key, "mode": mode,
        "db": db, "command": command, "started_at": started_at, "specs": len(canonical), "measured": len(todo),
        "chunks": [], "segments": [], "merged": {"added": 0, "existing": 0}, "conflicts": 0, "merge_report": None}
    record_path = os.path.join(output_dir, "remote-run.json")
    report: dict | None = None
    fresh: dict[bytes, Any] = {}
    errored: dict[bytes, dict] = {}
    try:
        if executor is not None:
            if not exists and mode != "fresh":
                with Ledger.open(db) as ledger:  # created now, so that the events name the ledger they are for
                    ledger_id = ledger.ledger_id
            origin = Origin(ledger_id=ledger_id, run_id=uuid.uuid4().hex, host=socket.gethostname(), command=command)
            parts = [todo[j::n] for j in range(n)]  # round robin: sorted specs spread their sizes over the workers
            chunks = [Chunk.of(entry, gpu_key, [canonical[i] for i in part],
                               [parents.get(spec_keys[i]) for i in part], origin) for part in parts]
            record["chunks"] = [{"index": j, "specs": len(p), "status": "submitted"} for j, p in enumerate(parts)]
            done = 0
            for j, data in executor.submit(chunks):
                chunk_doc = record["chunks"][j]
                path = _store(seg_dir, data)
                chunk_doc.update(segment=path, status="returned")
                record["segments"].append(path)
                try:
                    events = _segment_events(path)
                except UsageError as exc:  # a damaged segment: nothing of it is used
                    chunk_doc.update(status="damaged", error=str(exc))
                    continue
                chunk_doc["events"] = len(events)
                for ev in events:
                    if type(ev) is not Measured and getattr(ev, "error_kind", None) is not None:
                        errored[ev.key] = {"kind": ev.error_kind, "message": ev.message}
                    fresh[ev.key] = ev
                if mode == "fresh":
                    chunk_doc["status"] = "fresh"
                else:
                    report = _merge(db, path, output_dir, chunk_doc, record, report)
                done += 1
                if progress:
                    progress(done, len(chunks), chunk_doc)
        else:
            record["engine"] = {"engine": target.kind, "note": "nothing to measure: nothing was submitted"}
    finally:
        if executor is not None:
            for j, message in executor.failures.items():
                record["chunks"][j].update(status="failed", error=message)
            record["engine"] = executor.describe()
            executor.close()
        record["seconds"] = round(time.perf_counter() - started, 3)
        _write_json(record_path, record)

    if mode == "fresh":
        res = _fresh(entry, canonical, gpu_key, db, [fresh.get(k) for k in spec_keys], spec_keys, before_root)
    else:
        with Ledger.open(db, readonly=True) as ledger:
            res = _query(entry, canonical, gpu_key, db, ledger, mode)
        for doc, k in zip(res.results, spec_keys):
            if k in errored and doc["event"] == event_id(encode(fresh[k])).hex():
                doc["status"] = "error"
                doc["error"] = errored[k]
        res.missing_count = sum(r["status"] != "ok" for r in res.results)
    out = RemoteResult(**{f: getattr(res, f) for f in QueryResult.__struct_fields__})
    out.view_root_before = before_root.hex()
    out.exit_code = 3 if record["conflicts"] else 1 if out.missing_count else 0
    out.seconds = time.perf_counter() - started
    out.measured = len(todo)
    out.record, out.record_path, out.merge_report = record, record_path, record["merge_report"]
    out.failures = [f"chunk {c['index']} ({c['specs']} specs): {c['status']}: {c['error']}"
                    for c in record["chunks"] if c.get("error")]
    return out


def _merge(db: str, path: str, output_dir: str, chunk_doc: dict, record: dict, report: dict | None) -> dict | None:
    """Merges one segment into the ledger (opened for this merge only). A conflict merges nothing of it and adds its
    conflicts to merge-report.json (one report for the whole run). Returns the report so far."""
    from ..merge.merge import merge_into

    try:
        with Ledger.open(db) as ledger:
            added, existing = merge_into(ledger, [path], output_dir)
    except MergeConflict as exc:
        where = os.path.join(output_dir, "merge-report.json")
        if report is None:
            report = exc.report
        else:  # merge_into wrote this segment's report over the run's: write the union back
            report = {**report, "conflicts": report["conflicts"] + exc.report["conflicts"],
                      "keys": report["keys"] + exc.report["keys"]}
            _write_json(where, report)
        chunk_doc.update(status="conflict", conflicts=exc.report["conflicts"], error=str(exc))
        record["conflicts"] += exc.report["conflicts"]
        record["merge_report"] = where
        return report
    chunk_doc.update(status="merged", added=added, existing=existing)
    record["merged"]["added"] += added
    record["merged"]["existing"] += existing
    return report


def _fresh(entry, canonical, gpu_key, db, events, spec_keys, before_root) -> QueryResult:
    """Rows straight from the returned events (nothing was merged, so none is citable); a spec whose chunk
    failed is missing."""
    rows = [Row(spec, "missing", k) if ev is None else
            Row(spec, "ok" if type(ev) is Measured else "error", ev.key, event_id(encode(ev)), summary_of(ev),
                ev.provenance) for spec, ev, k in zip(canonical, events, spec_keys)]
    result = _result(entry, gpu_key, db, "fresh", before_root, rows, canonical)
    for doc, ev in zip(result.results, events):
        doc["citation"] = None
        if ev is not None and type(ev) is not Measured:
            doc["status"] = "error"
            doc["error"] = {"kind": ev.error_kind, "message": ev.message}
    return result
