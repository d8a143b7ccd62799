"""Output: one JSON document on stdout with --json; readable tables otherwise; messages on stderr."""

from __future__ import annotations

import sys
from collections import Counter

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
    # No markup: what is printed (paths, specs, exception text) is shown as it is; `rows[bold]/x.kseg` or
    # `pip install ray[client]` would otherwise lose their brackets. Styling goes through rich.text.Text.
    return Console(file=stream, highlight=False, soft_wrap=True, width=width, markup=False)


def error(message: str) -> None:
    from rich.text import Text

    console(stderr=True).print(Text.assemble(("error:", "bold red"), " ", message))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# A result longer than this prints its first TABLE_ROWS rows and a line counting the rest: rich lays a table out
# at ~1.4 ms a row (a 100,000-spec query took 165 s as a table, 2.8 s as --json), and nobody reads past a screen.
TABLE_ROWS = 50


def _more(hidden: list[dict]) -> str:
    """`... and N more rows (counts by status)`, the statuses in the contract's order."""
    from ..ledger.view import STATUSES  # here: `kprof list` renders too, and reads no ledger

    counts = Counter(r["status"] for r in hidden)
    order = [s for s in STATUSES if s in counts] + sorted(set(counts) - set(STATUSES))
    by_status = ", ".join(f"{counts[s]} {s}" for s in order)
    return f"... and {len(hidden)} more row{'s' if len(hidden) != 1 else ''} ({by_status}); use --json for all"


def results_table(res, limit: int = TABLE_ROWS) -> None:
    """A readable table of a query/run result: spec columns beside status and metrics. Past `limit` rows, the
    first `limit` and a line counting the others by status (--json prints every row); the same for error lines."""
    from rich.table import Table

    out = console()
    shown, hidden = res.results[:limit], res.results[limit:]
    spec_cols = list(shown[0]["spec"]) if shown else []
    metric_cols = []
    for r in shown:
        for k in r["metrics"] or {}:
            if k not in metric_cols:
                metric_cols.append(k)
    table = Table(*spec_cols, "status", *metric_cols, "citation",
                  title=f"{res.table} / {res.backend} on {res.gpu_name} ({res.mode})")
    for r in shown:
        m = r["metrics"] or {}
        table.add_row(*(_fmt(r["spec"][c]) for c in spec_cols), r["status"], *(_fmt(m.get(c)) for c in metric_cols),
                      r["citation"] or "-")
    out.print(table)
    if hidden:
        out.print(_more(hidden), markup=False)
    others = Counter(r["status"] for r in res.results if r["status"] != "ok")
    split = f" ({', '.join(f'{n} {s}' for s, n in others.items())})" if set(others) - {"missing"} else ""
    out.print(f"{res.count - res.missing_count} of {res.count} ok, {res.missing_count} missing{split}; db {res.db}; "
              f"view root {res.view_root[:16]}", markup=False)
    errors = [r for r in res.results if r.get("error")]
    for r in errors[:limit]:
        out.print(f"error for {r['spec']}: {r['error']['kind']}: {r['error']['message']}", markup=False)
    if len(errors) > limit:
        more = len(errors) - limit
        out.print(f"... and {more} more error{'s' if more != 1 else ''}; use --json for all", markup=False)
