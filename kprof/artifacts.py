"""`run --output-dir DIR`: request.json, results.json, curve.json, job.meta.json (and curve.png), each
written once and made read-only (see `_write`). A directory the snapshot could not be written to (one that already
holds a snapshot, a file, a path through a file, one that cannot be created or written) is refused before any work."""

from __future__ import annotations

import os

import msgspec

from . import _outdir
from ._signals import held
from .errors import SnapshotError, UsageError

__all__ = ["SNAPSHOT", "check_output_dir", "snapshot", "write_snapshot", "curve", "plot_series", "plot_skipped"]

SNAPSHOT = ("request.json", "results.json", "curve.json", "job.meta.json")
_json = msgspec.json.Encoder(order="deterministic")



def check_output_dir(path: str) -> None:
    """Refuses a directory the snapshot could not be written to. Creates nothing: a run refused after this (a bad
    spec, an unknown backend) leaves nothing behind; `write_snapshot` creates the directory. What a write killed
    before its end left (`_outdir.drop_unfinished`) is removed first: it is no snapshot, and must not refuse the
    command."""
    _outdir.drop_unfinished(path, _STAGING, (*SNAPSHOT, "curve.png"))
    _outdir.check_output_dir(path, (*SNAPSHOT, "curve.png"), "a snapshot")


_STAGING = ".snapshot-"  # a staging folder's name, in the output directory, starts so
LEGEND_MAX = 10  # curve.png's lines with a legend: matplotlib's colours repeat past 10, and 30 labels overflow it


def curve(result: dict, args_order: list[str]) -> dict:
    """Varying axes in KernelArgs declaration order; constants in fixedArgs; the first two varying axes
    are x and y, the rest are facets."""
    specs = [r["spec"] for r in result["results"]]
    varying = [a for a in args_order if len({msgspec.json.encode(s[a]) for s in specs}) > 1]
    fixed = {a: specs[0][a] for a in args_order if a not in varying} if specs else {}
    metrics = _metric_names(result)
    points = []
    for r in result["results"]:
        point = {m: (r["metrics"] or {}).get(m) for m in metrics}  # every point the same fields: null where none
        # the axes last: a comm row's metric message_size_bytes (a float) must not stand for the spec's int
        point.update({"status": r["status"], "citation": r["citation"]}, **{a: r["spec"][a] for a in varying})
        points.append(point)
    return {"table": result["table"], "backend": result["backend"], "gpu_name": result["gpu_name"],
            "axes": varying, "x": varying[0] if varying else None, "y": varying[1] if len(varying) > 1 else None,
            "facets": varying[2:], "fixedArgs": fixed, "metrics": metrics, "points": points}


def _metric_names(result: dict) -> list[str]:
    names: list[str] = []
    for r in result["results"]:
        for k in r["metrics"] or {}:
            if k not in names:
                names.append(k)
    return names


def write_snapshot(path: str, request: dict, result: dict, meta: dict, args_order: list[str]) -> list[str]:
    """Writes the snapshot into `path` (checked by `check_output_dir` before the run). Called once the run's rows
    are stored: a write that fails even so (the directory changed since, a full disk) says so, and how to get the
    snapshot without measuring again."""
    try:
        check_output_dir(path)
        os.makedirs(path, exist_ok=True)
        return _write(path, request, result, meta, args_order)
    except UsageError as exc:  # checked before the run, refused now: another run wrote its snapshot there since
        raise SnapshotError(f"cannot write the snapshot: {exc}; {_stored(request)}") from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise SnapshotError(f"cannot write the snapshot in --output-dir {path}: {exc.strerror or exc}{where}; "
                            f"{_stored(request)}") from None


def _stored(request: dict) -> str:
    """How to get the snapshot of a run whose rows are stored without measuring again; a --fresh run stored nothing,
    so the same command measures every spec again."""
    if request.get("mode") == "fresh":
        return ("the --fresh run finished and stored nothing: for the snapshot, run the command again with a new "
                "--output-dir (it measures every spec again)")
    return ("the run finished and its rows are in the ledger: for the snapshot, run the command again with a new "
            "--output-dir and without --force (stored rows are read, not measured again)")


def _write(path: str, request: dict, result: dict, meta: dict, args_order: list[str]) -> list[str]:
    """Every file is made in a staging folder inside `path`, held by a flock while it is written, then renamed into
    place: a run interrupted while it writes (the plot takes a second) leaves no part of a snapshot, which would
    refuse the same command again. A kill among the renames leaves the folder, with the files not yet renamed, and
    the next check of `path` removes it and what it had renamed (`_outdir.drop_unfinished`). (Staging beside `path` and
    renaming the folder onto it would be one step, but fails after the rows are stored where the parent is
    read-only or `path` is a mount point.)"""
    docs = {"request.json": request, "results.json": result, "curve.json": curve(result, args_order),
            "job.meta.json": meta}
    with _outdir.staged(path, _STAGING) as staging:
        try:
            for name, doc in docs.items():
                data = msgspec.json.format(_json.encode(doc), indent=2) + b"\n"
                _outdir.write_once(os.path.join(staging, name), data)
            written = [*docs, *(["curve.png"] if _plot(docs["curve.json"], os.path.join(staging, "curve.png")) else [])]
            check_output_dir(path)  # another run may have placed its snapshot since: a rename would replace its files
            with held():  # a Ctrl-C among the renames left part of a snapshot, which refused the command run again
                for name in written:
                    os.rename(os.path.join(staging, name), os.path.join(path, name))
            return written
        except OSError as exc:
            if exc.filename and os.path.dirname(exc.filename) == staging:  # named where it was to go
                exc.filename = os.path.join(path, os.path.basename(exc.filename))
            raise


def _plot(c: dict, path: str) -> bool:
    """curve.png of `plot_series(c)`; False without matplotlib or without a point to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    x, metric, series = plot_series(c)
    ok = [p for pts in series.values() for p in pts]
    if not ok:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v, _ in ok)
    for label, pts in series.items():
        pts.sort(key=lambda t: t[0] if numeric else str(t[0]))
        ax.plot([str(v) if not numeric else v for v, _ in pts], [y for _, y in pts], marker="o", label=label)
    if numeric and max(v for v, _ in ok) > 16 * max(1, min(v for v, _ in ok)):
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    fixed = ", ".join(f"{k}={v}" for k, v in c["fixedArgs"].items())
    title = f"{c['table']} / {c['backend']} on {c['gpu_name']}\n{fixed}"
    if len(series) > LEGEND_MAX:  # more lines than colours, and a legend taller than the plot: none, a count instead
        by = ", ".join(a for a in c["axes"] if a != x)
        title += f"\n{len(series)} lines, one per {by} (curve.json holds each point)"
    ax.set_title(title, fontsize=9)
    if 1 < len(series) <= LEGEND_MAX:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    _outdir.make_read_only(path)
    return True


def plot_skipped(path: str, written: list[str]) -> str | None:
    """The note for the snapshot in `path` (its files `written`) that has a curve to draw and no curve.png because
    matplotlib is not installed (it was left out without a word); None when curve.png was drawn or shows nothing."""
    if "curve.png" in written:
        return None
    try:
        import matplotlib  # noqa: F401
        return None
    except ImportError as exc:
        why = str(exc)
    with open(os.path.join(path, "curve.json"), "rb") as f:
        if not plot_series(msgspec.json.decode(f.read()))[2]:
            return None
    return (f"note: no curve.png in {path}: matplotlib is not installed ({why}); pip install matplotlib (kprof's "
            f"[plot] extra) to draw it")


def plot_series(c: dict) -> tuple[str | None, str, dict[str, list]]:
    """(x axis, metric, {label: [(x, value)]} in label order, numbers as numbers) of a curve.json document: time_ms
    against x, one series per y value (facets folded into the label); for collectives (rows with busbw_gbps),
    busbw_gbps against message_size_bytes, one series per world size (other varying axes folded into the label), as
    nccl-tests' curves are read. No series where no spec field varies (a lone point is no curve)."""
    comm = "busbw_gbps" in c["metrics"]
    x, metric = ("message_size_bytes", "busbw_gbps") if comm else (c["x"], "time_ms")
    ok = [p for p in c["points"] if p.get(metric) is not None]
    if not ok or not c["axes"]:
        return x, metric, {}
    if comm:
        rest = sorted((a for a in c["axes"] if a != x), key=lambda a: a != "world_size")  # world size first
        ok = [{**p, x: int(p[x])} for p in ok]  # one size for every point: the metric's copy (a float)
    else:
        rest = ([c["y"]] if c["y"] else []) + c["facets"]
    series: dict[str, list] = {}
    for p in ok:
        label = ", ".join(f"{a}={p[a]}" for a in rest) or "all"
        series.setdefault(label, []).append((p[x], p[metric]))
    return x, metric, dict(sorted(series.items(), key=_label_order))


def _label_order(item) -> tuple:
    """Series in label order, numbers compared as numbers (world_size=8 after world_size=2)."""
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", item[0]))


def snapshot(path: str, res, specs: list, *, started_at, seconds: float, command: str = "",
             method: dict | None = None, doc: dict | None = None) -> list[str]:
    """Write the snapshot of a finished `kprof.api.run` (its QueryResult `res`, asked for `specs` as given, under the
    timing method `method`: the run's timer/l2/cuda_graph/power arguments): request.json (with the method as resolved,
    `timing`), results.json, curve.json, job.meta.json (and curve.png with matplotlib), read-only, once.
    `started_at` is the run's start (an aware datetime), `seconds` its wall time; `doc` is `res.to_json()` where the
    caller built it already (a 100k-spec run's document is hundreds of MB). Returns the files written."""
    import platform

    from . import __version__
    from .measure.env import torch_version
    from .method import effective_entry
    from .runners.registry import lookup

    entry = effective_entry(lookup(res.table, res.backend), **(method or {}))
    versions = {"kprof": __version__, "python": platform.python_version()}
    if (torch := torch_version()) is not None:
        versions["torch"] = torch
    request = {"table": res.table, "backend": res.backend, "mode": res.mode, "gpu_name": res.gpu_name,
               "timing": entry.contract.timing, "db": res.db, "specs": specs}
    meta = {"command": command, "versions": versions, "host": platform.node(), "device": res.gpu_name,
            "mode": res.mode, "count": res.count, "missing_count": res.missing_count, "measured": res.measured,
            "exit_code": res.exit_code, "started_at": started_at.isoformat(timespec="seconds"),
            "duration_s": round(seconds, 3), "timed_s": round(res.timed_seconds, 3),
            "view_root_before": res.view_root_before, "view_root_after": res.view_root,
            "cwd": _outdir.as_text(os.getcwd()), "devices": res.pool}
    doc = res.to_json() if doc is None else doc
    return write_snapshot(path, request, doc, meta, list(entry.args.__struct_fields__))
