"""`run --remote NAME`: the chunks of a run measured on an existing engine (Ray, or Slurm through submitit), each
returned as a segment and merged into the local ledger as it arrives.

    res = run_remote("single_gemm", "torch", specs, remote="h200", output_dir="runs/r1", gpu_name="NVIDIA H200")

The remotes and their executors are kprof.runners.remote. The output directory holds `segments/` (each returned
segment, named by its content), `remote-run.json` (where and how it ran, what each segment merged) and, on a
conflict, `merge-report.json`: a conflicting segment merges nothing and the run exits 3. `fresh` mode merges
nothing at all.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any, Callable

import msgspec

from .api import QueryResult, _empty_root, _fresh_result, _keys, _prepare, _query
from .errors import MergeConflict, UsageError
from .ledger import Ledger
from .ledger._codec import encode, event_decoder, event_id
from .ledger.events import Measured, Origin
from .runners import remote as _remotes
from .merge import segment
from .runners.chunk import Chunk
from .runners.registry import lookup
from .runners.fill import to_measure
from .runners.remote_config import CONFIG, load_remote

__all__ = ["RemoteResult", "run_remote"]


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
    from .merge import segment

    return [event_decoder.decode(data) for data in segment.read(path)]


def _store(directory: str, data: bytes) -> str:
    """The segment's bytes at the name kprof.merge.segment gives its content in DIR."""
    named = segment.named(directory, data[-32:])
    if not os.path.exists(named):
        tmp = f"{named}.part"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, named)
    return named


def _check_output_dir(output_dir: str | None) -> str:
    from .artifacts import check_output_dir

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
    from . import __version__

    started = time.perf_counter()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if mode not in ("jit", "force", "fresh"):
        raise UsageError(f"mode {mode!r} is not one of jit, force, fresh")
    target = load_remote(remote, config, list(remote_set))
    output_dir = _check_output_dir(output_dir)
    method = dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
    if lookup(table, backend).device == "cuda" and gpu_name is None:  # this machine's GPU, if any, is not remote's
        raise UsageError(f"backend {backend} measures on a CUDA GPU: pass --gpu-name with the GPU of remote "
                         f"{remote!r} (e.g. --gpu-name 'NVIDIA H200'); its rows are keyed by it")
    entry, canonical, gpu_key, db = _prepare(table, backend, raw_specs, gpu_name, db, method)

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
    todo = to_measure(spec_keys, before_rows, mode)  # one measurement per key, as in api.run
    parents = {r.key: r.event_id for r in before_rows if r is not None and r.event_id is not None}

    executor = _remotes.executor_for(target, entry.device, output_dir) if todo else None
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
        res = _fresh_result(entry, canonical, gpu_key, db, [fresh.get(k) for k in spec_keys], spec_keys, before_root)
        for doc, k in zip(res.results, spec_keys):
            if k in errored:
                doc["error"] = errored[k]
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
    from .merge.merge import merge_into

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
