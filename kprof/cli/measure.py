"""`kprof measure`: the diagnostic. One kernel spec, one sustained CUPTI window of `--duration-s` with NVML
telemetry beside it, written to `--output-dir` as runtimes.csv, telemetry.csv, summary.json and two plots, each
read-only with a `kmeasure.<hex>` citation that `kprof show` resolves.

It is no cache verb: it never writes the ledger and stores no row. The only ledger access is a read-only lookup of
the spec's own row, to compare the window with it, when a ledger file exists at --db ($KPROF_DB, else
./profile.db); without one the summary says nothing was compared.

`diagnose(...)` is the verb's work, callable from Python with the same arguments:

    from kprof.cli.measure import diagnose
    doc = diagnose("single_gemm", "torch", {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"}, duration_s=10)
    doc["summary"]["launch_us"]["median"], doc["files"]["durations.png"]["citation"]
"""

from __future__ import annotations

import datetime as _dt
import os
import shlex
from typing import Annotated, Any

from cyclopts import Parameter

from ..errors import KprofError, UsageError
from ._options import Json, Table, _db_given, number
from ._render import console, emit_json, stdout_to_stderr

__all__ = ["measure", "diagnose"]

# measure's own --backend and --gpu-name: the shared ones name torch-cpu, which measure refuses, and a GPU key as a
# filter, where measure's must be the GPU it runs on
MeasureBackend = Annotated[str, Parameter(name="--backend", help=(
    "The backend, a CUDA one timed by CUPTI, e.g. torch (see `kprof list`); a CPU backend or a collective is "
    "refused."))]
MeasureGpuName = Annotated[str | None, Parameter(name="--gpu-name", help=(
    "GPU key of the ledger row compared; it must be the name of the GPU measured on (CUDA device 0). Default: that "
    "name."))]
MeasureDb = Annotated[str | None, Parameter(name="--db", validator=_db_given, help=(
    "Ledger whose row of this spec the window is compared with, read-only (never written). Default: $KPROF_DB, "
    "else ./profile.db; no file there: nothing is compared."))]
MeasureSpec = Annotated[list[str] | None, Parameter(name="--spec", consume_multiple=False, metavar="JSON",
                                                    required=True, help=(
    "The one spec to measure, as a JSON object of the table's KernelArgs."))]
MeasureDir = Annotated[str | None, Parameter(name="--output-dir", help=(
    "Write runtimes.csv, telemetry.csv, summary.json, durations.png and telemetry.png there, once, read-only. "
    "Default: ./measure_TABLE_BACKEND."))]


def measure(table: Table, *, backend: MeasureBackend, spec: MeasureSpec = None, output_dir: MeasureDir = None,
            duration_s: Annotated[float, Parameter(name="--duration-s", converter=number("10"), help=(
                "Seconds of the window: every launch in it is recorded (at most 10 million CUPTI records; a "
                "longer window of a fast kernel is refused, naming the length that fits)."))] = 10.0,
            telemetry_hz: Annotated[float, Parameter(name="--telemetry-hz", converter=number("20"), help=(
                "NVML readings per second (clocks, power, temperature, utilization, throttle reasons, energy), "
                "on a background thread."))] = 20.0,
            no_clear_l2: Annotated[bool, Parameter(name="--no-clear-l2", negative="", help=(
                "Launch back to back with a warm L2 (a continuous window, for sustained power and clock drift). "
                "Default: a cold L2 before each launch, exactly as rows are timed."))] = False,
            cuda_graph: Annotated[bool, Parameter(name="--cuda-graph", negative="", help=(
                "Replay the kernel from a CUDA graph. With --no-clear-l2 a replay holds >= 100 us of launches, so "
                "slow host dispatch does not leave the GPU idle; with a cold L2 each replay is swept first, as a "
                "graph row is."))] = False,
            gpu_name: MeasureGpuName = None, db: MeasureDb = None, json: Json = False) -> int:
    """Measure one spec over a sustained window with NVML telemetry beside it (never writes the ledger)."""
    from ..specs import parse_spec_texts

    if not spec:
        raise UsageError("no spec given; pass exactly one --spec JSON (measure takes one spec, not a batch)")
    if len(spec) > 1:
        raise UsageError(f"measure takes exactly one spec and {len(spec)} --spec were given; measure them one at a "
                         f"time, or use `kprof run` for a batch")
    (raw,) = parse_spec_texts(spec, files=False)
    from . import invocation

    with stdout_to_stderr(json):  # what a runner prints while measuring: stdout is the document's alone
        doc = diagnose(table, backend, raw, output_dir=output_dir, duration_s=duration_s, telemetry_hz=telemetry_hz,
                       clear_l2=not no_clear_l2, cuda_graph=cuda_graph, gpu_name=gpu_name, db=db,
                       command=shlex.join(invocation), allow_telemetry_off=False)
    if json:
        emit_json(doc)
    else:
        _render(doc)
    return 0


def diagnose(table: str, backend: str, spec: Any, *, output_dir: str | None = None, duration_s: float = 10.0,
             telemetry_hz: float = 20.0, clear_l2: bool = True, cuda_graph: bool = False,
             gpu_name: str | None = None, db: str | None = None, command: str = "",
             allow_telemetry_off: bool = True) -> dict:
    """The diagnostic of one spec (a dict of the table's KernelArgs): {table, backend, gpu_name, spec, output_dir,
    files: {name: {path, citation}}, summary_citation, summary}. Every input is checked before the GPU is touched
    and nothing is written on a refusal (UsageError). telemetry_hz=0 turns the sampler off (the Python API's, to
    check the sampler's own overhead; the CLI refuses it)."""
    from ..measure.diagnostic import check_output_dir, check_window_args

    duration_s, telemetry_hz = check_window_args(duration_s, telemetry_hz, allow_off=allow_telemetry_off)
    _check_arguments(clear_l2=clear_l2, cuda_graph=cuda_graph, output_dir=output_dir, gpu_name=gpu_name)
    entry, canonical = _entry_and_spec(table, backend, spec)
    out = output_dir if output_dir is not None else f"measure_{table}_{backend}"
    check_output_dir(out)
    from ..ledger import ledger_path

    db_path = ledger_path(db)
    gpu_key = _gpu_key(entry, gpu_name)
    from ..runners.diagnose import record
    from ..runners.environments import require

    require(entry, only_timer="cupti")  # measure records with CUPTI alone: KPROF_TIMER=events is no way round
    started = _dt.datetime.now(_dt.timezone.utc)
    window, device = record(entry, canonical, gpu_key, duration_s, telemetry_hz, clear_l2, cuda_graph)
    header = {"kind": "kprof measure", "table": table, "backend": backend, "spec": canonical, "gpu_name": gpu_key,
              "mode": {"l2": "cold" if clear_l2 else "warm", "graph": cuda_graph,
                       "invocations_per_replay": int(window.notes.get("invocations_per_replay", "1")),
                       "duration_s": duration_s, "telemetry_hz": telemetry_hz},
              "device": device, "started_at": started.isoformat(timespec="seconds"), "command": command,
              "ledger_access": "read-only lookup of this spec's row; never written"}
    from ..measure.diagnostic import summarize_window
    from ..measure.diagnostic_files import write_outputs

    summary = summarize_window(window, header, _ledger_row(entry, canonical, gpu_key, db_path, clear_l2, cuda_graph))
    summary = write_outputs(out, window, summary)
    files = {name: {"path": os.path.join(out, name), "citation": a["citation"]}
             for name, a in summary["artifacts"].items()}
    files["summary.json"] = {"path": os.path.join(out, "summary.json"), "citation": summary["summary_citation"]}
    return {"table": table, "backend": backend, "gpu_name": gpu_key, "spec": canonical, "output_dir": out,
            "files": files, "summary_citation": summary["summary_citation"], "summary": summary}


def _check_arguments(**given) -> None:
    """A Python caller's mode flags are bools and its paths and GPU key str (the verb's flags are already): a
    truthy `clear_l2="no"` read as a cold L2, and a `gpu_name=5` raised AttributeError."""
    for name in ("clear_l2", "cuda_graph"):
        if type(given[name]) is not bool:
            raise UsageError(f"{name}={given[name]!r} is not a bool; pass {name}=True or {name}=False")
    for name in ("output_dir", "gpu_name"):
        value = given[name]
        if value is not None and (not isinstance(value, str) or "\0" in value):
            raise UsageError(f"{name}={value!r} is not {'a path' if name == 'output_dir' else 'a GPU key'}; pass it "
                             f"as a str without NUL bytes, or omit it")


def _entry_and_spec(table: str, backend: str, spec: Any):
    """The registry entry (a CUDA compute entry: CUPTI-timed, one GPU) and the one spec, canonical."""
    from ..runners.registry import lookup
    from ..specs import validate

    entry = lookup(table, backend)
    if entry.metric_family == "comm" or entry.gpus > 1:
        raise UsageError(f"{table}/{backend} is a communication table; measure times one "
                         f"kernel on one GPU with CUPTI: pass a compute table (see `kprof list`)")
    if entry.device != "cuda":
        raise UsageError(f"{table}/{backend} is timed by wall clock on the CPU, not by CUPTI; measure records CUDA "
                         f"kernels: pass a CUDA backend such as --backend torch (see `kprof list`)")
    if isinstance(spec, list):
        if not spec:
            raise UsageError(f"the spec is an empty list; pass one JSON object of {table}'s KernelArgs "
                             f"{{{', '.join(entry.args.__struct_fields__)}}}")
        if len(spec) != 1:
            raise UsageError(f"measure takes exactly one spec and was given a batch of {len(spec)}; measure them one "
                             f"at a time, or use `kprof run` for a batch")
        spec = spec[0]
    if not isinstance(spec, dict) and not hasattr(spec, "__struct_fields__"):
        from ..spec_input import json_kind

        raise UsageError(f"the spec must be a JSON object of {table}'s KernelArgs, not {json_kind(spec)}; pass one "
                         f"object of {{{', '.join(entry.args.__struct_fields__)}}}")
    if hasattr(spec, "__struct_fields__"):
        import msgspec

        spec = msgspec.structs.asdict(spec)
    return entry, validate(entry.args, [spec], entry.table)[0]


def _gpu_key(entry, gpu_name: str | None) -> str:
    """The local GPU's name, which --gpu-name (the key of the ledger row compared) must equal when given."""
    from ..measure.device_name import local_gpu_name, visible_gpus

    local = local_gpu_name()
    if local is None:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if hidden is not None and visible_gpus(env={}):  # the driver lists GPUs: the variable hides them
            raise UsageError(f"measure runs {entry.table}/{entry.backend} on a CUDA GPU and CUDA_VISIBLE_DEVICES="
                             f"{hidden!r} leaves none of this machine's visible; set it to the GPU to measure, or "
                             f"unset it")
        raise UsageError(f"measure runs {entry.table}/{entry.backend} on a CUDA GPU and none is visible here (no "
                         f"NVIDIA driver or device); run it on a GPU machine")
    if gpu_name is not None:
        if not gpu_name.strip():
            raise UsageError("--gpu-name is empty; pass the GPU key, e.g. --gpu-name 'NVIDIA H200', or omit it")
        if gpu_name != local:
            raise UsageError(f"--gpu-name {gpu_name!r} differs from the GPU this would measure on ({local!r}); omit "
                             f"--gpu-name, or run on a machine with that GPU")
    return local


def _ledger_row(entry, canonical: dict, gpu_key: str, db_path: str, clear_l2: bool, graph: bool) -> dict:
    """The spec's ok row in the ledger at db_path, read-only: the row timed the window's way (CUPTI, this L2 state,
    graph or eager, sustained power) if there is one, else the default method's row. {"compared": False, "why"}
    when there is no ledger file or no such row; a ledger that cannot be read is reported, never raised."""
    if not os.path.isfile(db_path):
        return {"compared": False, "db": db_path, "why": f"no ledger at {db_path}"}
    from .. import api

    l2 = "cold" if clear_l2 else "warm"
    methods = [(l2, graph)] + ([("cold", False)] if (l2, graph) != ("cold", False) else [])
    for l2_, graph_ in methods:
        try:
            res = api.query(entry.table, entry.backend, [canonical], gpu_name=gpu_key, db=db_path, timer="cupti",
                            l2=l2_, cuda_graph=graph_, power="sustained")
        except KprofError as e:
            return {"compared": False, "db": db_path, "error": str(e)}
        row = res.results[0]
        if row["status"] == "ok":
            stats = row.get("stats") or {}
            return {"compared": True, "db": db_path, "citation": row["citation"],
                    "method": f"cupti;l2={l2_};{'graph' if graph_ else 'eager'}",
                    "same_method": (l2_, graph_) == (l2, graph), "time_ms": (row["metrics"] or {}).get("time_ms"),
                    "row_stats_ms": {k: stats.get(k) for k in ("n", "median", "p10", "p90", "mean")},
                    "measured_at": row.get("measured_at")}
    tried = "; ".join(f"l2={a}, {'graph' if b else 'eager'}" for a, b in methods)
    return {"compared": False, "db": db_path,
            "why": f"{db_path} has no ok row of this spec on {gpu_key!r} timed with CUPTI ({tried})"}


def _fmt(v, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def _render(doc: dict) -> None:
    """Key figures of the window, then each artifact with its citation."""
    from rich.table import Table

    s = doc["summary"]
    stats, drift, tel, energy = s["launch_us"], s["drift"], s["telemetry"], s["energy"]
    out = console()
    mode = s["mode"]
    out.print(f"{doc['table']}/{doc['backend']} {doc['spec']} on {doc['gpu_name']}: L2 {mode['l2']}, "
              f"{'graph' if mode['graph'] else 'eager'}, {s['window']['span_s']:.2f} s, "
              f"{s['window']['launches']} launches", markup=False)
    t = Table("figure", "value")
    t.add_row("kernel time per launch (µs)", f"median {_fmt(stats['median'])}, p10 {_fmt(stats['p10'])}, "
                                             f"p90 {_fmt(stats['p90'])}, cv {_fmt(stats['cv'], '.3f')}")
    t.add_row("drift (last vs first 10 %)", f"{_fmt(drift['pct'], '+.2f')} %, slope "
                                            f"{_fmt(drift['slope_pct_per_s'], '+.3f')} %/s")
    gpu = s["gpu"]
    t.add_row("GPU busy", f"{_fmt(gpu['busy_pct'], '.1f')} % (timed kernels {_fmt(gpu['timed_pct'], '.1f')} %)")
    if not tel.get("off"):
        sm = tel["sm_mhz"]
        t.add_row("SM clock (MHz), first / last 10 %", f"{_fmt(sm['first'])} / {_fmt(sm['last'])}")
        t.add_row("power (W), mean of readings", _fmt(tel["power_w"]["mean"], ".1f"))
        t.add_row("throttled (% of window)", ", ".join(f"{k} {v['pct']:.1f}" for k, v in s["throttle"].items()) or "-")
        t.add_row("telemetry", f"{tel['samples']} readings, {_fmt(tel['achieved_hz'], '.1f')} Hz of "
                               f"{tel['target_hz']:g}, coverage {_fmt(tel['coverage_pct'], '.1f')} %, "
                               f"{tel['gaps']['count']} gaps")
    t.add_row("energy per launch (mJ)", _fmt(energy["j_per_launch"] * 1e3) if energy["j_per_launch"] is not None
              else f"- ({energy.get('error') or 'no energy counter reading'})")
    if s.get("telemetry_errors"):  # a reading NVML refused shows as "-" above: say why
        t.add_row("NVML could not read", "; ".join(f"{k}: {v}" for k, v in s["telemetry_errors"].items()))
    row = s["ledger"]
    if row.get("compared"):
        other = "" if row.get("same_method") else ", not this window's method: not comparable as equals"
        t.add_row("ledger row", f"{row['citation']}: {row['time_ms'] * 1e3:.4g} µs ({row['method']}{other}); window "
                                f"median / row = {_fmt(row.get('window_over_row'), '.4f')}")
    else:
        t.add_row("ledger row", row.get("why") or row.get("error") or "-")
    if "skipped" in s["plots"]:
        t.add_row("plots", f"skipped: {s['plots']['skipped']}")
    out.print(t)
    files = Table("file", "citation", title=f"written to {doc['output_dir']} (read-only)")
    for name, f in doc["files"].items():
        files.add_row(f["path"], f["citation"])
    out.print(files)
