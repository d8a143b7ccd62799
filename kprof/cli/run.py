"""`kprof run`: JIT fill (profile only what is missing), --force (re-measure all), --fresh (measure all,
write nothing). Exit 1 when rows remain missing or errored."""

from __future__ import annotations

import contextlib
import datetime as _dt
import shlex
import sys
import time
from typing import Annotated

from cyclopts import Group, Parameter

from .. import api
from ..errors import UsageError
from ..specs import read_specs
from ._options import L2, Backend, CudaGraph, Db, GpuName, Json, OutputDir, Power, Spec, Specs, Table, Timer
from ._render import busy_host_note, console, emit_json, is_tty, results_table, stdout_to_stderr, waiting_note


def _one_mode(arguments) -> None:
    """--force and --fresh together are refused, saying what each does (cyclopts' own validator said "Invalid values
    for group Mode. Mutually exclusive arguments")."""
    if len([a for a in arguments if a.has_tokens and a.value is True]) > 1:  # `--fresh=false` asks for no mode
        raise UsageError("--force and --fresh cannot be combined: --force re-measures every spec and stores the new "
                         "rows, --fresh measures every spec and writes nothing; pass one of them")


modes = Group("Mode", validator=_one_mode)


PROGRESS_EVERY_S = 60.0  # off a terminal (a log file), one progress line a minute at most


def _progress():
    """A rich progress display on a terminal: the run's total, and one line per worker with its spec. Off one (a log
    of a long fill), or on one that cannot redraw it (TERM=dumb: an editor's shell, where the bar showed nothing for
    the whole run), a line on stderr at most every PROGRESS_EVERY_S: done of total, the rate and the time left."""
    err = console(stderr=True)
    if not is_tty(sys.stderr) or not err.is_interactive:  # (FORCE_COLOR, set for a CI log, makes rich's a terminal)
        return None, _progress_lines(), None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=err, transient=True)
    total = bar.add_task("measuring", total=None)
    lines: dict[str, int] = {}

    def update(done, count, spec, failed=0, opening=None):  # the opening call gives the total before a spec ends
        bar.update(total, completed=done, total=count, description=f"measuring{_failed(failed, ' (', ')')}")

    def watch(worker, spec):
        if worker not in lines:
            lines[worker] = bar.add_task("", total=None)
        bar.update(lines[worker], description=f"  {worker}: {spec if spec is not None else 'idle'}")

    return bar, update, watch


def _progress_lines():
    started = last = time.monotonic()

    def update(done, count, spec, failed=0, opening=None):
        nonlocal last
        now = time.monotonic()
        if opening is not None:  # a log shows the run began, not nothing for its first minute
            console(stderr=True).print(_opening_line(count, opening), markup=False)
            return
        if done >= count or now - last < PROGRESS_EVERY_S:
            return
        last, rate = now, done / max(now - started, 1e-9)
        console(stderr=True).print(f"progress: {done} of {count} spec(s) done in {_clock(now - started)} "
                                   f"({rate * 60:.1f}/min); about {_clock((count - done) / rate)} left"
                                   f"{_failed(failed, '; ')}", markup=False)

    return update


def _opening_line(count: int, opening: dict) -> str:
    present = f" ({opening['present']} already have an ok row)" if opening["present"] else ""
    where = ", ".join(opening["devices"]) + (" (in this process)" if opening["in_process"] else "")
    return f"measuring {count} spec(s){present} on {where}"


def _failed(failed: int, before: str, after: str = "") -> str:
    """The failed rows so far, where any, for a progress line or the bar (an oom on most specs shows as it comes)."""
    return f"{before}{failed} failed{after}" if failed else ""


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def _busy_host_note(table: str, backend: str, measured: int, load_before: float, mode: str,
                    busy_rows: int = 0) -> str | None:
    """A CPU row times the host, and other work on it slows every sample alike (their spread does not show it: a
    2-core host under load read GEMMs 10x slow with a small spread). Where the load average passed the cores while
    rows were timed, or rows say another process took their cores (`busy_rows`: the scheduler's involuntary switches,
    which a minute's load average misses), say so: the rows' notes carry it (host_busy), but a user reads the table.
    Only where rows say so: a row of more torch threads than cores put them in the load itself (`host_notes`)."""
    import os

    from ..runners.registry import lookup

    if not measured or not busy_rows or lookup(table, backend).device != "cpu":
        return None
    load, cores = max(load_before, os.getloadavg()[0]), os.cpu_count() or 1
    if load > cores:
        what = (f"the host's load average ({load:.1f}) passed its {cores} cores while these {measured} CPU row(s) "
                f"were timed")
    else:
        what = f"other processes took this one's cores while {busy_rows} of these {measured} CPU row(s) were timed"
    return busy_host_note(what, mode)


def _devices_line(pool: dict | None) -> str | None:
    """Where the run measured, as one line: the devices, and whether a variable forced them past the idle guard."""
    if not pool or not (pool.get("devices") or pool.get("skipped")):
        return None
    line = f"devices: {', '.join(pool['devices']) or 'none usable'}"
    if pool.get("in_process"):
        line += " (in this process)"
    if pool.get("forced_by"):
        line += f", forced by {pool['forced_by']} (the idle guard was bypassed)"
    for s in pool.get("skipped", []):
        line += f"; {s['gpu']} skipped: {s['why']}"
    for d in pool.get("dropped", []):
        line += f"; {d['device']} given up: {d['why']}"
    if pool.get("waited_for"):
        line += f"; {pool['waited_for']} spec(s) another run was measuring were waited for"
    return line


def run(table: Table, *, backend: Backend, spec: Spec = None, specs: Specs = None,
        force: Annotated[bool, Parameter(group=modes, negative="", help="Re-measure every spec.")] = False,
        fresh: Annotated[bool, Parameter(group=modes, negative="",
                                         help="Measure every spec and write nothing.")] = False,
        output_dir: OutputDir = None, gpu_name: GpuName = None, db: Db = None, timer: Timer = None, l2: L2 = None,
        cuda_graph: CudaGraph = None, power: Power = None, json: Json = False,
        remote: Annotated[str | None, Parameter(help=(
            "Run on this remote of ./remote.yaml (Ray or Slurm; remote.example.yaml lists the fields): needs "
            "--output-dir, refuses --db; the rows merge into $KPROF_DB or ./profile.db."))] = None,
        remote_set: Annotated[list[str] | None, Parameter(name="--remote-set", consume_multiple=False,
                                                          metavar="KEY=VALUE", help=(
            "Change one of the remote's settings for this call, e.g. launch.slurm.time=30; repeatable."))] = None
        ) -> int:
    """Profile the specs that are missing (or all with --force / --fresh), then report every row."""
    started_at = _dt.datetime.now(_dt.timezone.utc)
    raw = read_specs(spec, specs)
    mode = "force" if force else "fresh" if fresh else "jit"
    if remote is not None:
        from . import invocation
        from ._remote import run_remote_cli

        return run_remote_cli(table, backend, raw, remote=remote, remote_set=remote_set or [], output_dir=output_dir,
                              mode=mode, gpu_name=gpu_name, db=db, timer=timer, l2=l2, cuda_graph=cuda_graph,
                              power=power, json=json, command=shlex.join(invocation))
    if remote_set:
        raise UsageError(f"--remote-set {remote_set[0]!r} changes a remote's settings; give --remote NAME with it")
    if output_dir is not None:
        from ..artifacts import check_output_dir

        check_output_dir(output_dir)
    from . import invocation

    command = shlex.join(invocation)
    bar, update, watch = _progress()
    t0, load_before = time.perf_counter(), _load()
    options = dict(mode=mode, gpu_name=gpu_name, db=db, command=command, timer=timer, l2=l2, cuda_graph=cuda_graph,
                   power=power, conflict_dir=output_dir)
    with stdout_to_stderr(json), bar or contextlib.nullcontext():  # stdout is the document's alone
        res = api.run(table, backend, raw, progress=update, watch=watch, waiting=waiting_note(bar, db), **options)
    devices = _devices_line(res.pool)
    doc = res.to_json() if json or output_dir is not None else None  # built once: at 100k specs, hundreds of MB
    no_plot = None
    if output_dir is not None:
        from ..artifacts import plot_skipped, snapshot

        written = snapshot(output_dir, res, raw, started_at=started_at, seconds=time.perf_counter() - t0,
                           command=command, method=dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power),
                           doc=doc)
        no_plot = plot_skipped(output_dir, written)
    if json:
        emit_json(doc)
    else:
        results_table(res)
        console().print(f"measured {res.measured} spec(s) in {res.seconds:.1f} s ({res.timed_seconds:.1f} s timed)",
                        markup=False)
    if devices:  # where it ran: a log line, on stderr in either mode
        console(stderr=True).print(devices, markup=False)
    if no_plot:
        console(stderr=True).print(no_plot, markup=False)
    if json and res.ceiling_note:  # only --json gives rows their `ceiling`: say why none did
        console(stderr=True).print(res.ceiling_note, markup=False)
    busy = _busy_host_note(table, backend, res.timed_rows, load_before, mode, res.host_busy)
    if busy:
        console(stderr=True).print(busy, markup=False)
    return res.exit_code


def _load() -> float:
    import os

    return os.getloadavg()[0]
