"""Output: one JSON document on stdout with --json; readable tables otherwise; messages on stderr."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter

import msgspec

_json = msgspec.json.Encoder()  # keys in the order the contract lists them


def emit_json(doc) -> None:
    sys.stdout.buffer.write(msgspec.json.format(_json.encode(doc), indent=2) + b"\n")
    sys.stdout.flush()


@contextlib.contextmanager
def stdout_to_stderr(on: bool = True):
    """While a --json verb works, what anything else writes to stdout (a runner's print, a worker process's, Ray's
    forwarded worker logs, a C library's write to descriptor 1) goes to stderr: stdout holds the document alone.
    Descriptor 1 itself is pointed at stderr, so the processes started meanwhile inherit it."""
    if not on:
        yield
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2 (closed): Python's own stdout is still redirected
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


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


# The metric columns a narrow terminal drops first (the last first); time_ms, the row's measurement, is kept.
_OPTIONAL = ("energy_j", "memory_bandwidth_gbps", "busbw_gbps", "algbw_gbps", "tflops")


def _fit(columns: list[str], cells: list[list[str]], width: int) -> tuple[list[int], dict[int, int] | None]:
    """(the indices of the columns to show within `width`, a terminal's; {index: width} of each). Each is as wide
    as its widest cell, so no number or citation is cut or split: optional metric columns are dropped, least useful
    first, until they fit, and headers longer than their cells fold where no room is left (the shortest shortfalls
    are made whole first). Widths None where even the rest cannot fit: every cell folds then (a number split over
    two lines, still never cut)."""
    need = [max((len(row[i]) for row in cells), default=1) for i in range(len(columns))]

    def room(shown):  # each column's padding and border take 3 characters, the table's last border 1
        return width - sum(need[i] + 3 for i in shown) - 1

    shown = list(range(len(columns)))
    for name in _OPTIONAL:
        if room(shown) >= 0:
            break
        shown = [i for i in shown if columns[i] != name]
    spare = room(shown)
    if spare < 0:
        return shown, None
    widths = {i: need[i] for i in shown}
    for i in sorted(shown, key=lambda i: len(columns[i]) - need[i]):
        grow = min(max(0, len(columns[i]) - need[i]), spare)
        widths[i] += grow
        spare -= grow
    return shown, widths


def results_table(res, limit: int = TABLE_ROWS, out=None) -> None:
    """A readable table of a query/run result: spec columns beside status and metrics. Past `limit` rows, the
    first `limit` and a line counting the others by status (--json prints every row); the same for error lines.
    Numbers and citations are printed whole at any width: a terminal too narrow for every metric loses the optional
    ones (named on a line below), and headers fold instead."""
    from rich.table import Column, Table

    out = out or console()
    shown, hidden = res.results[:limit], res.results[limit:]
    spec_cols = list(shown[0]["spec"]) if shown else []
    metric_cols = []
    for r in shown:
        for k in r["metrics"] or {}:
            if k not in metric_cols and k not in spec_cols:  # a comm row's message_size_bytes: its spec's
                metric_cols.append(k)
    names = [*spec_cols, "status", *metric_cols, "citation"]
    cells = [[*(_fmt(r["spec"][c]) for c in spec_cols), r["status"],
              *(_fmt((r["metrics"] or {}).get(c)) for c in metric_cols), r["citation"] or "-"] for r in shown]
    keep, widths = _fit(names, cells, out.width)
    dropped = [n for i, n in enumerate(names) if i not in keep]
    citation = max((len(row[-1]) for row in cells), default=None)
    table = Table(*(Column(names[i], overflow="fold", width=widths[i] if widths else None,
                           min_width=citation if names[i] == "citation" else None) for i in keep),
                  title=f"{res.table} / {res.backend} on {res.gpu_name} ({res.mode})")
    for row in cells:
        table.add_row(*(row[i] for i in keep))
    out.print(table)
    if dropped:
        out.print(f"(not shown at {out.width} columns: {', '.join(dropped)}; widen the terminal, or use --json)",
                  markup=False)
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
