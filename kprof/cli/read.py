"""`kprof count-missing` and `kprof query`: read-only, never profile; a valid request exits 0."""

from __future__ import annotations

import functools

from .. import api
from ..method import effective_entry
from ..runners.registry import lookup
from ..specs import read_specs
from ._options import L2, Backend, CudaGraph, Db, GpuName, Json, Power, Spec, Specs, Table, Timer
from ._render import TABLE_ROWS, console, emit_json, results_table, stdout_to_stderr


def count_missing(table: Table, *, backend: Backend, spec: Spec = None, specs: Specs = None,
                  gpu_name: GpuName = None, db: Db = None, timer: Timer = None, l2: L2 = None,
                  cuda_graph: CudaGraph = None, power: Power = None, json: Json = False) -> int:
    """Count the specs without an ok row (missing, stale or failed). Never profiles."""
    given, method = read_specs(spec, specs), dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
    with stdout_to_stderr(json):  # a KPROF_RUNNERS module's print when imported: stdout is the document's alone
        res = api.count_missing(table, backend, given, gpu_name=gpu_name, db=db, **method)
        command = functools.partial(_run_command, res.table, res.backend, res.db, spec, specs, gpu_name, method)
        _unknown_gpu_key(res, stale=lambda: api.query(table, backend, given, gpu_name=gpu_name, db=db, **method),
                         now=lambda: effective_entry(lookup(table, backend), **method).contract, command=command)
        _newer_rows(res, res.missing, method, command)
    if json:
        emit_json(res.to_json())
    else:
        console().print(f"{res.missing_count} of {res.count} {table}/{backend} spec(s) missing for "
                        f"{res.gpu_name!r} in {res.db}", markup=False)
        if res.missing_count:
            console().print(f"measure them: {command()}", markup=False)
    return 0


def _run_command(table: str, backend: str, db: str, spec, specs, gpu_name, method: dict,
                 verb: str = "run") -> str:
    """The `kprof run` that fills what count-missing found missing: this command's specs, ledger and method (a run
    measures only the specs without an ok row; `verb` "query": the query that reads their rows). A method the
    environment chose (KPROF_TIMER=events, a CPU row's OMP_NUM_THREADS) is written out too, as the ledger is, and the
    KPROF_RUNNERS a table of one's own needs: run where those variables are unset, it reads the same keys."""
    import shlex

    from ..method import thread_variable
    from ..runners.catalog import parse_timing, timing_power, timing_threads
    from ..settings import environ
    from ._render import typed_as

    entry, env = lookup(table, backend), environ()
    timing = effective_entry(entry, **method).contract.timing
    argv = [*typed_as, verb, table, "--backend", backend, "--db", db]
    if entry.device == "cuda":  # a setting not given as a flag: the value its variable chose, where not the default
        timer, l2, graph = parse_timing(timing)
        resolved = dict(timer=timer, l2=l2, cuda_graph=graph, power=timing_power(timing))
        default = dict(timer="cupti", l2="cold", cuda_graph=False, power="sustained")
        method = {name: resolved[name] if value is None and resolved[name] != default[name] else value
                  for name, value in method.items()}
    threads = thread_variable()
    assign = []  # NAME=value words, the value alone quoted: a quoted word is a command to a shell, not an assignment
    if not entry.runner.startswith("kprof.") and env.get("KPROF_RUNNERS", "").strip():  # a table of one's own
        assign += [f"KPROF_RUNNERS={shlex.quote(env['KPROF_RUNNERS'].strip())}"]
    if threads and timing_threads(timing) is not None:  # a torch-cpu row's thread count, as the variable gave it
        assign += [f"{threads}={timing_threads(timing)}"]
    argv += ["--gpu-name", gpu_name] if gpu_name is not None else []
    for name, value in method.items():
        if value is not None:
            argv += [f"--{'no-' * (value is False)}cuda-graph"] if name == "cuda_graph" else [f"--{name}", value]
    return " ".join(assign + [shlex.join(argv + [a for s in spec or () for a in ("--spec", s)] +
                                         (["--specs", specs] if specs else []))])


def query(table: Table, *, backend: Backend, spec: Spec = None, specs: Specs = None, gpu_name: GpuName = None,
          db: Db = None, timer: Timer = None, l2: L2 = None, cuda_graph: CudaGraph = None, power: Power = None,
          json: Json = False) -> int:
    """Read the rows of the given specs. Never profiles; missing rows are reported, not an error."""
    with stdout_to_stderr(json):  # a KPROF_RUNNERS module's print when imported: stdout is the document's alone
        given, method = read_specs(spec, specs), dict(timer=timer, l2=l2, cuda_graph=cuda_graph, power=power)
        # a table prints its first TABLE_ROWS rows: only those are built as the contract's JSON (100,000 rows took 2 s)
        res = api.query(table, backend, given, gpu_name=gpu_name, db=db, full=None if json else TABLE_ROWS, **method)
        _unknown_gpu_key(res)
        _newer_rows(res, [r["spec"] for r in res.results if r["status"] != "ok"], method,
                    functools.partial(_run_command, res.table, res.backend, res.db, spec, specs, gpu_name, method))
    if json:
        emit_json(res.to_json())
    else:
        results_table(res)
    if json and res.ceiling_note:  # --json's rows carry `ceiling` only under the calibration's timing: say why none did
        console(stderr=True).print(res.ceiling_note, markup=False)
    return 0


def _unknown_gpu_key(res, stale=None, now=None, command=None) -> None:
    """One note on stderr where every spec is missing because the ledger has no row at all of the table/backend
    under this GPU key while it holds others (a mistyped --gpu-name reads as missing rows), or other backends' rows of
    the table and none of this one (a mistyped --backend), or (count-missing, which
    counts stale rows as missing: `stale` runs the query that tells them) where some have rows of another timing or
    revision (a CPU row of another thread count), naming what differs from the contract `now` gives and the
    commands (`command(verb)`: this one's specs, ledger and method) that show them and measure them again. The answer
    itself, its JSON and its exit 0 stay as the contract says; `kprof export` refuses such a key instead."""
    if not res.count or res.missing_count < res.count:
        return
    scopes = api.scopes(res.db)
    held = [s for s in scopes if (s.table, s.backend) == (res.table, res.backend)]
    others = sorted({s.backend for s in scopes if s.table == res.table} - {res.backend})
    if not held and others:  # a mistyped --backend reads as missing rows too
        console(stderr=True).print(f"note: {res.db} has no {res.table}/{res.backend} rows for any GPU key; its "
                                   f"{res.table} rows are of backend{'s' * (len(others) > 1)} {', '.join(others)}",
                                   markup=False)
    elif held and all(s.gpu_name != res.gpu_name for s in held):
        keys = ", ".join(f"{s.gpu_name!r} ({s.rows} row{'s' if s.rows != 1 else ''})" for s in held)
        console(stderr=True).print(f"note: {res.db} has no {res.table}/{res.backend} rows for GPU key "
                                   f"{res.gpu_name!r}; it holds: {keys}", markup=False)
    elif stale is not None and held:
        rows = [r for r in stale().results if r["status"] == "stale"]
        if rows:
            old, current = rows[0]["provenance"], now()
            if old["timing"] != current.timing:  # a CPU row of another thread count, a CUDA row of another method
                threads = " (a CPU row's timing names its torch thread count: OMP_NUM_THREADS, MKL_NUM_THREADS)" * (
                    "threads=" in old["timing"])
                what = f"one timed {old['timing']!r}, where this command reads {current.timing!r}){threads}"
            elif old["profiler_revision"] != current.profiler_revision:  # a runner's revision bumped since
                what = (f"one of profiler revision {old['profiler_revision']}, where the runner is now at "
                        f"{current.profiler_revision}: `{command('run')}` measures it again)")
            else:
                what = f"one of another algorithm, layout or numerics: `{command('run')}` measures it again)"
            have = "has a row" if len(rows) == 1 else "have rows"
            console(stderr=True).print(f"note: {len(rows)} of the {res.count} spec(s) {have} of another timing or "
                                       f"profiler revision (stale; {what}; `{command('query')}` shows them",
                                       markup=False)


_LOOKED_AT = 64  # specs looked at, spread over the request: ~45 µs each (a stale row is looked for in the index)


def _newer_rows(res, specs: list[dict], method: dict, run) -> None:
    """One note on stderr where specs without an ok row have rows of a newer profiler revision than this kprof's
    runner measures: a newer kprof's rows, which this one reads as missing (or, beside an older row, stale). They are
    found as a view of a revision past any reads them: stale, each with its revision. _LOOKED_AT such specs, spread
    over them, are looked at (1,000 added 16 % to count-missing's 10,000; a newer kprof's fill shows in any sample).
    `run()`: this command's `kprof run`, which measures them again at this kprof's revision."""
    import lmdb
    import msgspec

    from .. import __version__
    from ..errors import KprofError
    from ..ledger import Ledger

    if not specs:
        return
    entry = effective_entry(lookup(res.table, res.backend), **method)
    ours = entry.contract.profiler_revision
    past = msgspec.structs.replace(entry.contract, profiler_revision=1 << 62)
    sample = specs[::-(-len(specs) // _LOOKED_AT)]  # every n-th: _LOOKED_AT at most
    try:  # a second read, after the answer: where it fails (the file removed or replaced since), the answer stands
        with Ledger.open(res.db, readonly=True) as ledger:
            rows = ledger.view(res.table, res.backend, res.gpu_name, past, entry.args).get_many(sample)
    except (KprofError, lmdb.Error, OSError):
        return
    newer = [r.provenance.profiler_revision for r in rows if r.status == "stale" and
             r.provenance.profiler_revision > ours]
    if newer:
        revisions = ", ".join(map(str, sorted(set(newer))))
        have = "has a row" if len(newer) == 1 else "have rows"
        of = f"{len(sample)} spec(s) sampled from the {len(specs):,} without an ok row" if len(sample) < len(specs) \
            else f"{res.count} spec(s)"
        console(stderr=True).print(f"note: {len(newer)} of {of} {have} of profiler revision "
                                   f"{revisions} in {res.db}, newer than this kprof's ({__version__}: "
                                   f"{res.table}/{res.backend} at revision {ours}), which reads such rows as missing, "
                                   f"or stale beside an older one; upgrade kprof to read them (`{run()}` here measures "
                                   f"those specs again, at revision {ours})", markup=False)
