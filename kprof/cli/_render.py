"""Output: one JSON document on stdout with --json; readable tables otherwise; messages on stderr."""

from __future__ import annotations

import sys

import msgspec

_json = msgspec.json.Encoder()  # keys in the order the contract lists them


def emit_json(doc) -> None:
    sys.stdout.buffer.write(msgspec.json.format(_json.encode(doc), indent=2) + b"\n")
    sys.stdout.flush()


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal (pipes, logs, tests), rich would wrap tables at 80 columns: give them room instead.
    width = None if stream.isatty() else 200
    return Console(file=stream, highlight=False, soft_wrap=True, width=width)


def error(message: str) -> None:
    console(stderr=True).print(f"[bold red]error:[/] {message}", markup=True)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def results_table(res) -> None:
    """A readable table of a query/run result: spec columns beside status and metrics."""
    from rich.table import Table

    out = console()
    spec_cols = list(res.results[0]["spec"]) if res.results else []
    metric_cols = []
    for r in res.results:
        for k in r["metrics"] or {}:
            if k not in metric_cols:
                metric_cols.append(k)
    table = Table(*spec_cols, "status", *metric_cols, "citation",
                  title=f"{res.table} / {res.backend} on {res.gpu_name} ({res.mode})")
    for r in res.results:
        m = r["metrics"] or {}
        table.add_row(*(_fmt(r["spec"][c]) for c in spec_cols), r["status"], *(_fmt(m.get(c)) for c in metric_cols),
                      r["citation"] or "-")
    out.print(table)
    out.print(f"{res.count - res.missing_count} of {res.count} ok, {res.missing_count} missing; db {res.db}; "
              f"view root {res.view_root[:16]}", markup=False)
    for r in res.results:
        if r.get("error"):
            out.print(f"error for {r['spec']}: {r['error']['kind']}: {r['error']['message']}", markup=False)
