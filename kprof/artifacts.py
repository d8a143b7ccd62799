"""`run --output-dir DIR`: request.json, results.json, curve.json, job.meta.json (and curve.png), each
written once and made read-only. A directory that already holds a snapshot is refused before any work."""

from __future__ import annotations

import os
import stat

import msgspec

from .errors import UsageError

__all__ = ["SNAPSHOT", "check_output_dir", "write_snapshot", "curve"]

SNAPSHOT = ("request.json", "results.json", "curve.json", "job.meta.json")
_json = msgspec.json.Encoder(order="deterministic")


def check_output_dir(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--output-dir {path} is a file; pass a directory (it is created if absent)")
    held = [name for name in SNAPSHOT if os.path.exists(os.path.join(path, name))]
    if held:
        raise UsageError(f"--output-dir {path} already holds a snapshot ({', '.join(held)}); snapshots are "
                         f"immutable: pass a new directory")


def _write_once(path: str, data: bytes) -> None:
    with open(path, "xb") as f:  # "x": never overwrite
        f.write(data)
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


def curve(result: dict, args_order: list[str]) -> dict:
    """Varying axes in KernelArgs declaration order; constants in fixedArgs; the first two varying axes
    are x and y, the rest are facets."""
    specs = [r["spec"] for r in result["results"]]
    varying = [a for a in args_order if len({msgspec.json.encode(s[a]) for s in specs}) > 1]
    fixed = {a: specs[0][a] for a in args_order if a not in varying} if specs else {}
    points = []
    for r in result["results"]:
        point = {a: r["spec"][a] for a in varying}
        point.update({"status": r["status"], "citation": r["citation"]})
        point.update(r["metrics"] or {})
        points.append(point)
    return {"table": result["table"], "backend": result["backend"], "gpu_name": result["gpu_name"],
            "axes": varying, "x": varying[0] if varying else None, "y": varying[1] if len(varying) > 1 else None,
            "facets": varying[2:], "fixedArgs": fixed, "metrics": _metric_names(result), "points": points}


def _metric_names(result: dict) -> list[str]:
    names: list[str] = []
    for r in result["results"]:
        for k in r["metrics"] or {}:
            if k not in names:
                names.append(k)
    return names


def write_snapshot(path: str, request: dict, result: dict, meta: dict, args_order: list[str]) -> list[str]:
    os.makedirs(path, exist_ok=True)
    check_output_dir(path)
    docs = {"request.json": request, "results.json": result, "curve.json": curve(result, args_order),
            "job.meta.json": meta}
    written = []
    for name, doc in docs.items():
        _write_once(os.path.join(path, name), msgspec.json.format(_json.encode(doc), indent=2) + b"\n")
        written.append(name)
    png = _plot(docs["curve.json"], os.path.join(path, "curve.png"))
    if png:
        written.append("curve.png")
    return written


def _plot(c: dict, path: str) -> bool:
    """curve.png: time_ms against x, one line per y value (facets folded into the label)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [p for p in c["points"] if p.get("time_ms") is not None]
    if not ok or c["x"] is None:
        return False
    series: dict[str, list] = {}
    for p in ok:
        label = ", ".join(f"{a}={p[a]}" for a in ([c["y"]] if c["y"] else []) + c["facets"]) or "all"
        series.setdefault(label, []).append((p[c["x"]], p["time_ms"]))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    numeric = all(isinstance(p[c["x"]], (int, float)) and not isinstance(p[c["x"]], bool) for p in ok)
    for label, pts in sorted(series.items()):
        pts.sort(key=lambda t: t[0] if numeric else str(t[0]))
        ax.plot([str(x) if not numeric else x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    if numeric and max(p[c["x"]] for p in ok) > 16 * max(1, min(p[c["x"]] for p in ok)):
        ax.set_xscale("log", base=2)
    ax.set_xlabel(c["x"])
    ax.set_ylabel("time_ms (median)")
    fixed = ", ".join(f"{k}={v}" for k, v in c["fixedArgs"].items())
    ax.set_title(f"{c['table']} / {c['backend']} on {c['gpu_name']}\n{fixed}", fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    return True
