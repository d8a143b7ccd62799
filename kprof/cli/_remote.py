"""`kprof run ... --remote NAME [--remote-set KEY=VALUE ...]`: the run on a remote of remote.yaml (see
kprof.runners.remote). `kprof.cli.run` binds the flags and calls `run_remote_cli`; this renders as `run` does."""

from __future__ import annotations

import datetime as _dt
import shlex
import time

from ..errors import UsageError
from ._render import busy_host_note, console, emit_json, error, results_table, stdout_to_stderr, waiting_note

__all__ = ["run_remote_cli"]


def run_remote_cli(table: str, backend: str, raw_specs: list, *, remote: str, remote_set: list[str] | tuple = (),
                   output_dir: str | None, mode: str = "jit", gpu_name: str | None = None, db: str | None = None,
                   timer: str | None = None, l2: str | None = None, cuda_graph: bool | None = None,
                   power: str | None = None, json: bool = False, command: str = "") -> int:
    """Runs the specs on the remote `remote`, merges its segments into $KPROF_DB (else ./profile.db), writes the run's
    snapshot, remote-run.json and segments/ to `output_dir`, renders the rows; the exit code (0 ok, 1 rows missing,
    2 usage, 3 a merge conflict). --db is refused (the remote merges into the default ledger) and --output-dir is
    required: both before anything is written."""
    if db is not None:
        raise UsageError(f"--db {db} cannot be used with --remote: a remote run merges into the default ledger "
                         f"($KPROF_DB, else ./profile.db); set KPROF_DB={shlex.quote(db)} instead, or drop --remote")
    if output_dir is None:
        raise UsageError("--remote needs --output-dir DIR (the segments, remote-run.json and any merge-report.json "
                         "go there); pass a new directory")
    from ..artifacts import plot_skipped, snapshot
    from ..remote import run_remote

    started_at = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    progress = None
    if not json:
        def progress(done, total, chunk):  # named by its index, as remote-run.json and the failure lines name it
            console(stderr=True).print(f"chunk {chunk['index']}: {chunk['specs']} spec(s), {chunk['status']} "
                                       f"({done} of {total} chunk(s) done)", markup=False)

    with stdout_to_stderr(json):  # a worker's output, which Ray forwards to this process's stdout, too
        res = run_remote(table, backend, raw_specs, remote=remote, remote_set=list(remote_set), output_dir=output_dir,
                         mode=mode, gpu_name=gpu_name, timer=timer, l2=l2, cuda_graph=cuda_graph, power=power,
                         command=command, progress=progress, waiting=waiting_note(None, db))
    doc = res.to_json()  # built once, for the snapshot and --json alike: at 100k specs, hundreds of MB
    written = snapshot(output_dir, res, raw_specs, started_at=started_at, seconds=time.perf_counter() - t0,
                       command=command, method=dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power), doc=doc)
    for line in res.failures:
        error(line)
    if res.merge_report:
        error(f"{res.record['conflicts']} incoming event(s) conflict with the ledger's current rows; those segments "
              f"merged nothing; the conflicts are in {res.merge_report} (do not force it: compare the rows)")
    if json:
        emit_json(doc)
    else:
        results_table(res)
        console().print(_summary(res, remote), markup=False)
    if res.host_busy:  # as a local run says it (the table alone does not show it), of the hosts that measured
        console(stderr=True).print(busy_host_note(f"other processes took their host's cores while {res.host_busy} of "
                                                  f"these CPU row(s) were timed", mode, remote=True), markup=False)
    if note := plot_skipped(output_dir, written):
        console(stderr=True).print(note, markup=False)
    return res.exit_code


def _summary(res, remote: str) -> str:
    """The run's last line: what was sent where, what came back, what was merged."""
    record = res.record
    engine = record.get("engine", {})
    where = " ".join(str(w) for w in (engine.get("engine"), engine.get("address") or engine.get("cluster")) if w)
    merged = f"{record['merged']['added']} event(s) merged; record {res.record_path}"
    if record.get("waited_for"):  # as a local run says it: their rows are another run's
        merged = f"{record['waited_for']} spec(s) another run was measuring were waited for; {merged}"
    chunks = record["chunks"]
    if not chunks:
        what = "nothing left to measure" if record.get("waited_for") else "nothing to measure"
        return f"{what}: no spec sent to remote {remote} ({where}); {merged}"
    lost = [c for c in chunks if c["status"] not in ("merged", "fresh", "conflict")]  # failed or refused
    back = res.measured - sum(c["specs"] for c in lost)
    failed = f", {len(lost)} of {len(chunks)} chunk(s) failed (see above)" if lost else ""
    return (f"measured {back} of {res.measured} spec(s) on remote {remote} ({where}) in {res.seconds:.1f} s{failed}; "
            f"{merged}")
