"""`run --remote NAME`: the chunks of a run measured on an existing engine (Ray, or Slurm through submitit), each
returned as a segment and merged into the local ledger as it arrives.

    res = run_remote("single_gemm", "torch", specs, remote="h200", output_dir="runs/r1", gpu_name="NVIDIA H200")

The remotes and their executors are kprof.runners.remote. The run claims the keys it sends (kprof.runners.claims),
so a concurrent run, local or remote, skips them, and waits for the keys another run holds. The output directory
holds `segments/` (each returned segment that checks out, as chunk-N.kseg), `refused/` (what a worker returned that
is not a segment of its chunk's keys: chunk-N.bin, never merged), `remote-run.json` (where and how it ran, what each
chunk returned and merged) and, on a conflict, `merge-report.json`: a conflicting segment merges nothing and the
run exits 3. `fresh` mode merges nothing at all. What is checked before anything is written or submitted beyond the
remote's own fields (kprof.runners.remote_config) is kprof._remote_checks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from typing import Any, Callable

import msgspec

from ._outdir import as_text, replace_whole
from ._signals import held
from ._remote_checks import check_remote_output_dir, check_runtime_env, check_task_env, refuse_spec_timeout
from .api import QueryResult, _empty_root, _fresh_result, _keys, _prepare, _query
from .errors import MergeConflict, UsageError
from .ledger import Ledger
from .ledger._codec import encode, event_decoder, event_id
from .ledger.events import Failed, Measured, Origin
from .runners import remote as _remotes
from .merge import segment
from .runners.chunk import Chunk
from .runners.claims import Claims, rounds
from .runners.devices import need_of
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


def _received(output_dir: str, j: int, data: Any, keys: set) -> tuple[str, list]:
    """Chunk j's returned data, checked before anything of it is used: bytes making a whole segment whose events are
    all of the chunk's keys. Stored as segments/chunk-J.kseg (the path and its events); anything else raises
    UsageError saying why, and its bytes (if any) are kept as refused/chunk-J.bin, out of segments/."""
    if not isinstance(data, (bytes, bytearray)):
        raise UsageError(f"the worker returned {type(data).__name__}, not a segment's bytes")
    name = f"chunk-{j:04d}"
    staged = os.path.join(output_dir, "segments", f"{name}.kseg.part")  # not a .kseg: `kprof merge DIR` skips it
    with open(staged, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        try:
            events = [event_decoder.decode(e) for e in segment.read(staged)]
        except (msgspec.DecodeError, RecursionError) as exc:  # one nested past the decoder's depth: RecursionError
            raise UsageError(f"an event of the segment does not decode ({exc})") from None
        foreign = [ev for ev in events if type(ev) not in (Measured, Failed) or ev.key not in keys]
        if foreign:
            raise UsageError(f"the segment holds {len(foreign)} event(s) of keys the chunk did not ask for (or not a "
                             f"measurement); none of it is merged")
    except UsageError as exc:
        kept = os.path.join(output_dir, "refused", f"{name}.bin")
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        os.replace(staged, kept)
        message = str(exc).replace(staged, kept)
        raise UsageError(message if kept in message else f"{message}; its bytes are kept as {kept}") from None
    path = os.path.join(output_dir, "segments", f"{name}.kseg")
    os.replace(staged, path)
    return path, events


def _write_json(path: str, doc: dict) -> None:
    """The document as JSON (msgspec's: NaN and infinities as null, never the bare NaN the standard module writes,
    which no strict parser reads), written whole or not at all."""
    replace_whole(path, msgspec.json.format(msgspec.json.encode(doc, enc_hook=str), indent=1) + b"\n")


def run_remote(table: str, backend: str, raw_specs: list, *, remote: str, remote_set: list[str] | tuple = (),
               output_dir: str | None, mode: str = "jit", gpu_name: str | None = None, timer: str | None = None,
               l2: str | None = None, cuda_graph: bool | None = None, power: str | None = None, command: str = "",
               config: str = CONFIG, db: str | None = None,
               progress: Callable[[int, int, dict], None] | None = None,
               waiting: Callable[[int], None] | None = None) -> RemoteResult:
    """Measures the specs on the remote `remote` of `config` (with `remote_set` overrides) and merges each returned
    segment into the ledger at `db` ($KPROF_DB, else ./profile.db) as it arrives; mode jit (the missing specs),
    force (all) or fresh (all, nothing merged). Everything is validated before anything is written or submitted.
    `progress(done, total, chunk record)` after each chunk; `waiting(n)` each round that finds n of the keys held by
    another run (this one waits for them, as a local run does). The result's exit_code: 3 on a merge conflict (that
    segment merged nothing; merge-report.json in output_dir), else 1 when rows remain missing, else 0."""
    from . import __version__

    started = time.perf_counter()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if mode not in ("jit", "force", "fresh"):
        raise UsageError(f"mode {mode!r} is not one of jit, force, fresh")
    target = load_remote(remote, config, list(remote_set))
    refuse_spec_timeout(target)
    from .runners.fill import check_settings

    check_settings(here=False)  # the workers inherit them: a bad one would fail every chunk after the jobs start
    check_task_env(target)
    check_runtime_env(target)
    output_dir = check_remote_output_dir(output_dir)
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

    if todo and mode != "fresh":
        Claims(db, "check").check()  # a claims directory it cannot use: refused before a ledger or a job is made
    need = max((need_of(entry, canonical[i]) for i in todo), default=1)  # a Slurm job (Ray task) asks for that many
    executor = _remotes.executor_for(target, entry.device, output_dir, need) if todo else None
    try:
        n = max(1, min(executor.workers(), len(todo))) if executor is not None else 0  # may refuse: nothing written
        if executor is not None and mode != "fresh":
            # Opened for writing (created where missing, so that the events name the ledger they are for) before
            # the output directory is made: one it cannot open is refused with nothing written, not after the jobs
            with Ledger.open(db) as ledger:
                ledger_id = ledger.ledger_id
    except BaseException:
        if executor is not None:
            executor.close()
        raise
    os.makedirs(os.path.join(output_dir, "segments"))
    record: dict[str, Any] = {
        "remote": target.name, "config": as_text(os.path.abspath(target.path)), "kind": target.kind,
        "overrides": list(remote_set),
        "launch": msgspec.to_builtins(target.ray if target.kind == "ray" else target.slurm),
        "kprof_version": __version__, "table": table, "backend": backend, "gpu_name": gpu_key, "mode": mode,
        "db": db, "command": command, "started_at": started_at, "specs": len(canonical), "measured": 0,
        "chunks": [], "segments": [], "merged": {"added": 0, "existing": 0}, "conflicts": 0, "merge_report": None,
        "waited_for": 0}
    record_path = os.path.join(output_dir, "remote-run.json")
    run = _Run(output_dir, db, mode, record, progress)
    try:
        if executor is not None:
            origin = Origin(ledger_id=ledger_id, run_id=uuid.uuid4().hex, host=socket.gethostname(), command=command)
            with contextlib.ExitStack() as stack:
                # Claimed as the local pool claims (kprof.runners.claims): a concurrent run skips what this one sends
                claims = None if mode == "fresh" else stack.enter_context(Claims(db, origin.run_id))

                def rows_now() -> list:
                    with Ledger.open(db, readonly=True) as ledger:
                        return ledger.view(table, backend, gpu_key, entry.contract, entry.args).query(canonical)[1]

                waited: set[bytes] = set()
                for batch, rows, held in rounds(claims, todo, spec_keys, rows_now, mode, before_rows):
                    waited.update(held)  # keys another run was measuring: read from the ledger once it stored them
                    record["waited_for"] = len(waited)
                    if held and waiting is not None:
                        waiting(len(held))
                    if batch:
                        parts = [batch[j::n] for j in range(min(n, len(batch)))]  # round robin: sizes spread out
                        chunks = [Chunk.of(entry, gpu_key, [canonical[i] for i in part],
                                           [rows[i].event_id if rows[i] is not None else None for i in part], origin)
                                  for part in parts]
                        run.send(executor, chunks, [{spec_keys[i] for i in part} for part in parts], claims)
        else:
            record["engine"] = {"engine": target.kind, "note": "nothing to measure: nothing was submitted"}
    finally:
        if executor is not None:
            run.failed(executor)
            record["engine"] = executor.describe()
            stopped = set(executor.close())  # an interrupt: what was still queued or running is stopped
            for doc in record["chunks"]:  # none merges; one whose result the run was taking when stopped, too
                if doc["status"] == "submitted":
                    doc.update(status="cancelled", error="the run was interrupted; the engine's job was cancelled"
                               if doc["index"] in stopped else "the run stopped as its result came back; "
                                                               "nothing of it was merged")
        record["seconds"] = round(time.perf_counter() - started, 3)
        _write_json(record_path, record)
    fresh, errored = run.fresh, run.errored

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
    out.measured = record["measured"]
    busy = {k for k, ev in fresh.items() if type(ev) is Measured and "host_busy" in ev.method.notes}
    out.host_busy = len({k for doc, k in zip(res.results, spec_keys)  # rows shown that say so, each key once
                         if k in busy and doc["event"] == event_id(encode(fresh[k])).hex()})
    out.record, out.record_path, out.merge_report = record, record_path, record["merge_report"]
    out.failures = [f"chunk {c['index']} ({c['specs']} specs): {c['status']}: {c['error']}"
                    for c in record["chunks"] if c.get("error")]
    return out


class _Run:
    """What the chunks of one remote run come back to: each returned segment checked, stored and merged as it
    arrives, its keys' claims then ended; remote-run.json's chunks, segments and merge counts."""

    def __init__(self, output_dir: str, db: str, mode: str, record: dict, progress):
        self.output_dir, self.db, self.mode, self.record, self.progress = output_dir, db, mode, record, progress
        self.report: dict | None = None
        self.fresh: dict[bytes, Any] = {}
        self.errored: dict[bytes, dict] = {}
        self.keys: list[set] = []  # per chunk: its keys
        self.claims = None
        self.done = 0

    def send(self, executor, chunks: list[Chunk], keys: list[set], claims) -> None:
        record, first = self.record, len(self.record["chunks"])
        record["chunks"] += [{"index": first + j, "specs": len(c.specs), "status": "submitted"}
                             for j, c in enumerate(chunks)]
        record["measured"] += sum(len(c.specs) for c in chunks)
        self.keys += keys
        self.claims = claims
        for j, data in executor.submit(chunks, first):
            with held():  # a chunk's merge and its record land together
                self._returned(j, data)
        self.failed(executor)

    def _returned(self, j: int, data) -> None:
        """Chunk j's data: checked, stored, merged (or refused), recorded, its claims ended."""
        record, chunk_doc = self.record, self.record["chunks"][j]
        try:
            path, events = _received(self.output_dir, j, data, self.keys[j])
        except UsageError as exc:  # bad data: nothing of it is used
            chunk_doc.update(status="refused", error=str(exc))
            self._end(j, chunk_doc)
            return
        chunk_doc.update(segment=path, status="returned", events=len(events))
        short = len(self.keys[j] - {ev.key for ev in events})
        if short:  # a worker that stopped early (or another kprof's): the rest is merged, these stay missing
            chunk_doc["error"] = (f"the worker returned no event for {short} of the chunk's {chunk_doc['specs']} "
                                  f"specs; they are left missing: run again to measure them")
        record["segments"].append(path)
        for ev in events:
            if type(ev) is not Measured:
                self.errored[ev.key] = {"kind": ev.error_kind, "message": ev.message}
            self.fresh[ev.key] = ev
        if self.mode == "fresh":
            chunk_doc["status"] = "fresh"
        else:
            self.report = _merge(self.db, path, self.output_dir, chunk_doc, record, self.report)
        self._end(j, chunk_doc)

    def failed(self, executor) -> None:
        """The chunks the engine failed (its .failures), recorded, their claims ended."""
        for j, message in executor.failures.items():
            if self.record["chunks"][j]["status"] == "submitted":
                self.record["chunks"][j].update(status="failed", error=message)
                self._end(j, self.record["chunks"][j])

    def _end(self, j: int, chunk_doc: dict) -> None:
        if self.claims is not None:
            self.claims.drop(self.keys[j])
        self.done += 1
        if self.progress:
            self.progress(self.done, len(self.record["chunks"]), chunk_doc)


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
