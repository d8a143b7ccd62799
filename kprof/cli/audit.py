"""`kprof audit`: verify every event, the log, the views and the file structure."""

from __future__ import annotations

import time
from typing import Annotated, get_args

from cyclopts import Parameter

from ..errors import UsageError
from ..ledger import ledger_path
from ..ledger._verify import AUDIT
from ..ledger.audit import JOBS
from ..ledger.audit import audit as run_audit
from ._options import L2, CudaGraph, Db, Json, Power, Timer, number, whole
from ._render import console, emit_json, stdout_to_stderr


def _remeasure_only(alias):
    """A shared timing-method option whose help says it serves --remeasure (the audit reads every method)."""
    shared = get_args(alias)[-1]
    return Annotated[alias, Parameter(help=f"With --remeasure: {shared.help}")]


def audit(*, db: Db = None, json: Json = False,
          jobs: Annotated[int | None, Parameter(name="--jobs", converter=whole, help=(
              "Shard processes the audit runs, each replaying a share of the keys (1 to 256; default: one per CPU "
              f"this process may use, up to 8, here {JOBS}); no more run than those CPUs or the ledger's keys."))
          ] = None,
          remeasure: Annotated[int | None, Parameter(name="--remeasure", converter=whole, help=(
              "Instead: re-measure N random current rows of this machine's device and report their drift "
              "(exit 1 when any drifts past --tolerance or fails to measure). Writes nothing. KPROF_SPEC_TIMEOUT_S "
              "bounds each, in a worker, as it bounds a run's spec."))] = None,
          tolerance: Annotated[float | None, Parameter(name="--tolerance", converter=number("0.05"), help=(
              "Relative drift allowed by --remeasure (default 0.05)."))] = None,
          seed: Annotated[int | None, Parameter(name="--seed", converter=whole, help=(
              "With --remeasure: the seed of the random draw of rows; the report gives the one used, so the same "
              "rows can be drawn again (default: a new one each time)."))] = None,
          timer: _remeasure_only(Timer) = None, l2: _remeasure_only(L2) = None,
          cuda_graph: _remeasure_only(CudaGraph) = None, power: _remeasure_only(Power) = None) -> int:
    """Recompute every event id and key, check the log, rebuild the views and compare; exit 3 on any finding.
    The timing-method flags pick which CUDA rows --remeasure re-measures, and how."""
    method = {"timer": timer, "l2": l2, "cuda_graph": cuda_graph, "power": power}
    if remeasure is not None:  # a flag of the other mode is refused, not ignored
        if jobs is not None:
            raise UsageError(f"--jobs {jobs} applies to the audit, which --remeasure replaces; drop --jobs")
        return _remeasure(ledger_path(db), remeasure, 0.05 if tolerance is None else tolerance, json, method, seed)
    _no_method_without_remeasure({**method, "tolerance": tolerance, "seed": seed})
    from . import _sigbus

    path, started = ledger_path(db), time.perf_counter()
    _sigbus.say(lambda: _faulted(path, json, time.perf_counter() - started))  # a damaged page read here: a finding
    try:
        report = run_audit(path, JOBS if jobs is None else jobs)
    finally:
        _sigbus.say()
    if jobs is not None and 0 < report.shards < jobs:  # what was asked for, not silently something else (0: no shard)
        console(stderr=True).print(f"note: --jobs {jobs}: the audit ran {report.shards} shard process(es), as many as "
                                   f"are of use (one per CPU this process may use, at most one per row key)",
                                   markup=False)
    report = report._replace(findings=[_in_audit(line) for line in report.findings])
    if json:
        emit_json({k: v for k, v in report._asdict().items() if k != "shards"})
    else:
        from rich.text import Text

        out = console()
        state = ("clean", "green") if report.ok else (f"{sum(report.counts.values())} finding(s)", "red")
        out.print(Text.assemble(f"audit of {report.path}: ", state, f" — {report.events} events, last seq "
                                f"{report.last_seq}, {report.seconds:.2f} s"))
        for line in report.findings:
            out.print(f"  {line}", markup=False)
    return 0 if report.ok else 3


def _faulted(path: str, json: bool, seconds: float) -> tuple[bytes, bytes]:
    """What the audit says where reading the file faults in this process (SIGBUS: a damaged page LMDB read past the
    file's end), as a report of one finding; the shards' faults are findings already (see kprof.ledger.audit)."""
    import json as _json

    finding = "structure: the file's pages are damaged: reading them faulted (SIGBUS); restore the file from a copy"
    doc = {"path": path, "ok": False, "events": 0, "last_seq": 0, "findings": [finding], "counts": {"structure": 1},
           "seconds": seconds}
    out = _json.dumps(doc, indent=2) + "\n" if json else \
        f"audit of {path}: 1 finding(s) — 0 events, last seq 0, {seconds:.2f} s\n  {finding}\n"
    return f"kprof: the ledger file {path} is damaged (SIGBUS while the audit read it)\n".encode(), out.encode()


def _in_audit(finding: str) -> str:
    """A finding without the ledger's advice to "run `kprof audit` for the full report" (an error that opening the
    file raises says so to every other verb): here it is that report."""
    return finding.replace(f"{AUDIT}, and ", "").replace(f"; {AUDIT}", "")


def _no_method_without_remeasure(method: dict) -> None:
    """The audit itself checks every row whatever its method, so a method flag (or --tolerance, --seed) alone would be
    silently ignored: refuse it instead."""
    given = [f"--{'no-' if value is False else ''}{name.replace('_', '-')}" for name, value in method.items()
             if value is not None]  # the method flags, --tolerance and --seed
    if given:
        why = "" if given[0] in ("--tolerance", "--seed") else " (the audit checks the rows of every timing method)"
        raise UsageError(f"{given[0]} applies to `kprof audit --remeasure N` only{why}; add --remeasure N, or drop "
                         f"{given[0]}")


def _remeasure(db: str, n: int, tolerance: float, json: bool, method: dict, seed: int | None) -> int:
    from ..remeasure import remeasure

    with stdout_to_stderr(json):  # what a runner prints while measuring: stdout is the document's alone
        report = remeasure(db, n, tolerance, **method, seed=seed)
    if report.unregistered:  # rows of a plugin's table, drawn only where its module is loaded
        console(stderr=True).print(f"note: rows of {', '.join(report.unregistered)} were not drawn: no runner "
                                   f"registered here measures them; set KPROF_RUNNERS to the module that registers "
                                   f"them", markup=False)
    if not report.candidates:
        _nothing_to_remeasure(report)
    if json:
        emit_json(report.to_json())
    else:
        out = console()
        out.print(f"re-measured {len(report.rows)} of {report.candidates} current row(s) of "
                  f"{', '.join(report.gpu_keys) or 'no local device'}: {report.drifted} drifted past "
                  f"{report.tolerance:.1%}{f', {report.failed} failed to measure' if report.failed else ''} "
                  f"({report.seconds:.1f} s; --seed {report.seed})", markup=False)
        for r in report.rows:
            drift = f"{r.drift:+.2%}" if r.drift is not None else r.error
            mark = "ok" if r.ok else "DRIFT" if r.error is None else "FAIL"
            now = "no time" if r.new_ms is None else f"{r.new_ms:.4g} ms"
            stored = "no time" if r.stored_ms is None else f"{r.stored_ms:.4g} ms"
            busy = "" if not r.suspect else " (host busy)" if r.drift > 0 else " (stored on a busy host)"
            out.print(f"  {mark:5} {r.table}/{r.backend} {r.spec} {stored} -> {now} ({drift}) "
                      f"{r.citation}{busy}", markup=False)
    slower = sum(r.suspect and r.drift > 0 for r in report.rows)
    if slower:  # other work slows every sample alike, which no spread shows: the drift may be the host's
        console(stderr=True).print(f"note: other work took the host's cores while {slower} row(s) that drifted "
                                   f"slower were re-measured (host_busy in --json): the drift may be the host's, not "
                                   f"the row's; re-measure them on a quieter host", markup=False)
    if report.busy > slower:  # the stored row was slowed: it, not this host, is off
        from json import dumps

        from .read import _run_command  # the run of those specs, on this ledger under this method

        specs: dict[tuple, list] = {}
        for r in report.rows:
            if r.suspect and r.drift <= 0:
                specs.setdefault((r.table, r.backend), []).append(dumps(r.spec))
        again = "; ".join(f"`{_run_command(t, b, report.db, s, None, None, method)}"
                          f" --force`" for (t, b), s in specs.items())
        console(stderr=True).print(f"note: {report.busy - slower} row(s) that drifted faster were stored while other "
                                   f"work took their host's cores (stored_host_busy in --json): the stored row may be "
                                   f"the slow one; measure it again on a quiet host with {again}", markup=False)
    return 1 if report.drifted or report.failed else 0


def _nothing_to_remeasure(report) -> None:
    """A note on stderr where no row could be drawn: a ledger of other machines' rows re-measured nothing, and its
    "0 drifted" read as a check passed. The exit stays 0 (no row drifted or failed), as `query`'s does."""
    from .. import api

    others = sorted({s.gpu_name for s in api.scopes(report.db)} - set(report.gpu_keys))
    held = f"; it holds rows of {', '.join(repr(k) for k in others)}: re-measure them on that machine" if others else ""
    from ..measure.env import cpu_model
    from ..method import cpu_threads

    threads = f" (torch-cpu: on {cpu_threads()} torch thread(s), see OMP_NUM_THREADS)" \
        if cpu_model() in report.gpu_keys else ""
    if report.older:  # the rows' timing is this process's: only the runner's revision moved on since they were measured
        threads = (f"; {report.older} of this machine's row(s) there are of an older profiler revision (stale): `kprof "
                   f"run` measures them at this kprof's, then audit them")
    console(stderr=True).print(f"note: nothing re-measured: {report.db} holds no current ok row of this machine's "
                               f"{' or '.join(repr(k) for k in report.gpu_keys) or 'devices'} under the timing "
                               f"method asked for{threads}{held}", markup=False)
