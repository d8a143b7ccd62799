"""Output: one JSON document on stdout with --json; readable tables otherwise; messages on stderr."""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import os
import re
import shlex
import sys
from collections import Counter

from ..errors import OutputClosed, OutputError


def emit_json(doc) -> None:
    import msgspec  # here: `main` imports this module before it handles Ctrl-C and SIGTERM

    data = memoryview(msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")  # keys in the contract's order
    out = sys.stdout
    try:
        out.flush()
        if not hasattr(out, "buffer"):  # a text stream alone (redirect_stdout(io.StringIO()), a notebook's)
            out.write(bytes(data).decode())
            return
        while data:  # a write cut short by a reader that left returns its count; the next one raises
            data = data[out.buffer.write(data):]
        out.buffer.flush()
    except OSError as exc:
        _stdout_failed(out, exc)


def _stdout_failed(stream, exc: OSError):
    """A verb's output could not be written: where kprof is the process, stdout is pointed at os.devnull (so the
    interpreter's last flush at exit does not fail again, with a traceback; a process that called main() keeps its
    stdout: it went on writing nothing, for good) and the failure is raised as OutputError, one line (exit 2), or,
    where the reader went away (a closed pipe), OutputClosed (nothing said, exit 141)."""
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no descriptor: a test's captured stream
        if whole_process[0]:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)
    if exc.errno == errno.EPIPE:
        raise OutputClosed("") from None
    raise OutputError(f"could not write the output to stdout ({exc.strerror or exc}); what the verb stored stays "
                      f"(a run's rows are in the ledger: `kprof query` reads them); send stdout elsewhere") from None


class _Guarded:
    """sys.stdout or sys.stderr while a verb runs (see `guarded`), passing everything through but failed writes."""

    def __init__(self, stream, answer: bool):
        self._stream, self._answer, self._lost = stream, answer, False

    def write(self, text):
        if self._lost:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            return self._failed(exc, len(text))

    def flush(self):
        if not self._lost:
            try:
                self._stream.flush()
            except OSError as exc:
                self._failed(exc, 0)

    def _failed(self, exc: OSError, count: int) -> int:
        if self._answer:
            _stdout_failed(self._stream, exc)
        self._lost = True  # stderr: its later lines are dropped too
        return count

    def __getattr__(self, name):
        return getattr(self._stream, name)


whole_process = [True]  # whether the verb's call is the process (main's `program`), which a failed stdout ends


@contextlib.contextmanager
def guarded():
    """While a verb runs: a failed write of stdout (the verb's answer: a full disk, a reader that went away) raises
    OutputError, reported as one line instead of a traceback; a failed write of stderr (notes, progress, error lines)
    is dropped, as a lost log line must not fail a verb or stop a run. Standard descriptors closed by the caller
    (`>&-`) are first opened on os.devnull, so no file the verb opens (the ledger) takes their number and receives
    what is written to them."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: fd
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))
    saved = sys.stdout, sys.stderr
    # a stream not UTF-8 (a C locale's terminal) shows what it cannot encode as escapes while the verb runs, not a
    # crash; its own handler is put back after (it stayed, and the caller's own print of `é` no longer raised)
    escaped = [(s, s.errors) for s in dict.fromkeys(saved) if hasattr(s, "reconfigure") and
               (getattr(s, "encoding", None) or "utf-8").lower().replace("-", "") != "utf8"]
    for stream, _errors in escaped:
        stream.reconfigure(errors="backslashreplace")
    # None (an embedded interpreter's, or pythonw's, where the verb wrote to None: AttributeError): nothing is shown
    sys.stdout, sys.stderr = (_Guarded(io.StringIO() if stream is None else stream, answer)
                              for stream, answer in ((sys.stdout, True), (sys.stderr, False)))
    # COLUMNS=0 (or any value not a width) made rich print nothing, every answer and error line lost, and the help a
    # traceback: such a value is set aside while the verb runs, and a terminal's own size is used.
    # So is a COLUMNS outside 20 to 10,000: at 1 or 2 a verb's help wrapped forever (cyclopts), and at 10**11 rich laid
    # each help line out that wide (a MemoryError).
    bounds = {"COLUMNS": (20, 10_000), "LINES": (1, float("inf"))}
    sizes = {name: os.environ.pop(name) for name, (low, high) in bounds.items()
             if not os.environ.get(name, str(low)).strip().isdecimal()
             or not low <= int(os.environ.get(name, low)) <= high}
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        os.environ.update(sizes)
        for stream, errors in escaped:
            with contextlib.suppress(OSError, ValueError):  # a flush that fails (the reader left), a closed stream
                stream.reconfigure(errors=errors)


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


def is_tty(stream) -> bool:
    """Whether stream is a terminal: a caller's stream that only writes (a service's logger, no isatty) is not."""
    return bool(getattr(stream, "isatty", lambda: False)())


def console(stderr: bool = False):
    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal (pipes, logs, tests), rich would wrap tables at 80 columns: give them room instead, unless
    # COLUMNS says how wide (`COLUMNS=80 kprof query ... > log`, as the help is laid out; `guarded` keeps a valid one).
    columns = os.environ.get("COLUMNS", "").strip()
    width = None if is_tty(stream) else int(columns) if columns else 200
    # No markup: what is printed (paths, specs, exception text) is shown as it is; `rows[bold]/x.kseg` or
    # `pip install ray[client]` would otherwise lose their brackets. Styling goes through rich.text.Text.
    return _console_class()(file=stream, highlight=False, soft_wrap=True, width=width, markup=False)


@functools.cache
def _console_class():
    """rich's Console, printing every str (a line, a table's cell or title) with its control characters escaped:
    the values printed come from segments and ledgers written elsewhere, and rich passes an escape sequence in a
    metric name, note or message (ESC, `\\x1b]0;...`) to the terminal as it is, which obeys it (clears the screen,
    retitles the window, recolours what follows). Newlines kprof writes itself still break lines."""
    from rich.console import Console

    class Escaping(Console):
        def render_str(self, text: str, **kwargs):
            return super().render_str(_shown(as_typed(text), self.encoding), **kwargs)

    return Escaping


typed_as: list[str] = ["kprof"]  # the words of the command now running before its verb (set by kprof.cli.main)
db_given: list[str] = []  # the --db it was given, where one was (set by kprof.cli._main)


# a backtick, then any NAME=value assignments a suggested command begins with (`OMP_NUM_THREADS=1 kprof run ...`)
_SUGGESTED = re.compile(r"(`(?:[A-Z][A-Z0-9_]*=(?:'[^']*'|\S+) )*)kprof ")


def as_typed(text: str) -> str:
    """text with each command it names in backticks, `kprof <verb> ...` (after the variables it sets, if any), as the
    command was typed: the launcher's `python -m launcher kernel-profile <verb> ...` (its messages said `kprof`, which
    that user may not have); a `kprof audit` it names audits the --db given (alone, it audits $KPROF_DB or
    ./profile.db, another file, which may read clean)."""
    if db_given:
        text = text.replace("`kprof audit`", f"`kprof audit --db {shlex.quote(db_given[0])}`")
    if typed_as == ["kprof"] or "kprof " not in text:
        return text
    return _SUGGESTED.sub(lambda m: f"{m.group(1)}{shlex.join(typed_as)} ", text)


def _shown(text: str, encoding: str, one_line: bool = False) -> str:
    """text as printed on a stream of `encoding`: control characters escaped, and, on a stream that is not UTF-8 (a C
    locale, PYTHONIOENCODING=ascii), what it cannot encode too, before rich lays it out (the stream escaped `é` after,
    as `\\xe9`, and every column to its right moved); a quoted word of a command so, as $'...' (see _c_quoted).
    `one_line`: its newlines escaped too (an error's line)."""
    utf = encoding.lower().replace("-", "").startswith("utf")
    text = "\n".join(_one_line(line if utf and line.isprintable() else _QUOTED.sub(
        lambda m: _c_quoted(m[1], encoding), line)) for line in ([text] if one_line else text.split("\n")))
    return text if utf else text.encode(encoding, "backslashreplace").decode(encoding)


# a quoted word, as shlex.quote writes a path or value of a command (after a space, `=`, a backtick; not `device's`)
_QUOTED = re.compile(r"(?<![\w'$])'([^']*)'(?!\w)")


def _c_quoted(word: str, encoding: str) -> str:
    """A quoted word holding what the stream cannot encode or a control character (a tab, a newline), as the shell's
    $'...' of its UTF-8 bytes: pasted, it names the same file (`--db 'd\\xe9.db'` or `'d\\tx.db'`, escaped as Python
    does, named another, which `kprof run` then created)."""
    if word.isprintable() and word.encode(encoding, "replace").decode(encoding) == word:
        return f"'{word}'"
    return "$'" + "".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02x}"
                       for b in word.encode("utf-8", "surrogateescape")) + "'"


_ESCAPED_BYTE = re.compile(r"(\\\\)|\\udc([89a-f][0-9a-f])")


def _one_line(message: str) -> str:
    """The message with every character that is not printable text (a newline, tab or terminal escape in a path or
    value it names, an undecodable byte's surrogate) as its escape, `\\n`: an error is one line, and shows the value
    as typed (an undecodable byte as `\\xff`, not Python's `\\udcff`, whether raw or as repr() writes it)."""
    if "\\udc" in message:  # a repr's escaped backslash (`\\\\udcff`: a backslash, then text) is left as it is
        message = _ESCAPED_BYTE.sub(lambda m: m[1] or f"\\x{m[2]}", message)
    if message.isprintable():
        return message
    return "".join(c if c.isprintable() else f"\\x{ord(c) - 0xdc00:02x}" if "\udc80" <= c <= "\udcff" else
                   ascii(c)[1:-1] for c in message)


# The characters of an error line: a value of megabytes it names (a spec's string or field name, a path) is cut in
# the middle, so the line still says what is wrong and how to fix it (it was printed whole, twice: 6 MB of stderr).
ERROR_CHARS = 2_000


def error(message: str) -> None:
    from rich.text import Text

    out = console(stderr=True)
    line = _shown(as_typed(message), out.encoding, one_line=True)
    if len(line) > ERROR_CHARS:
        cut = len(line) - ERROR_CHARS + 100
        line = f"{line[:ERROR_CHARS - 600]} ... ({cut:,} characters left out) ... {line[-500:]}"
    out.print(Text.assemble(("error:", "bold red"), " ", line))


def busy_host_note(what: str, mode: str, remote: bool = False) -> str:
    """The note under a run's table where other work took the host's cores while `what` (its CPU rows) were timed:
    how the rows say so and how to measure them again. A --fresh run stored no row (no notes to read) and is measured
    again as it was given, not with --force; a remote run measures on its remote's hosts, into a new --output-dir."""
    if mode == "fresh":
        stored, again = "", "the same command" + (" with a new --output-dir" if remote else "")
    else:
        stored = " (their notes say host_busy)"
        # this command's own words, not `kprof run --force` (which names no table)
        again = "the same command with --force and a new --output-dir" if remote else \
            "the same command with --force (and a new --output-dir, where it had one)"
    return f"note: {what}: other work slowed them{stored}; measure again on a quieter host with {again}"


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


# The metric columns a table shows at most: a row has a handful (one merged from elsewhere may have any number).
METRIC_COLUMNS = 12
# The metric columns a narrow terminal drops first (the last first); time_ms, the row's measurement, is kept.
_OPTIONAL = ("energy_j", "memory_bandwidth_gbps", "busbw_gbps", "algbw_gbps", "tflops")


def _fit(columns: list[str], cells: list[list[str]], width: int) -> tuple[list[int], dict[int, int] | None]:
    """(the indices of the columns to show within `width`, a terminal's; {index: width} of each). Each is as wide
    as its widest cell, so no number or citation is cut or split, and as half its header, which folds onto two lines
    at most: optional metric columns are dropped, least useful first, until they fit (a header of 21 characters over
    cells of 5 folded onto five lines, `energy_j` over `-` onto eight), and headers longer than their cells fold where
    no room is left (the shortest shortfalls are made whole first). Where even the rest cannot fit so, headers fold
    further; widths None where the cells cannot: every cell folds then (a number split over two lines, never cut)."""
    need = [max((len(row[i]) for row in cells), default=1) for i in range(len(columns))]
    two_lines = [max(n, -(-len(name) // 2)) for n, name in zip(need, columns)]

    def room(shown, widths):  # each column's padding and border take 3 characters, the table's last border 1
        return width - sum(widths[i] + 3 for i in shown) - 1

    shown = list(range(len(columns)))
    for name in _OPTIONAL:
        if room(shown, two_lines) >= 0:
            break
        shown = [i for i in shown if columns[i] != name]
    least = two_lines if room(shown, two_lines) >= 0 else need
    spare = room(shown, least)
    if spare < 0:
        return shown, None
    widths = {i: least[i] for i in shown}
    for i in sorted(shown, key=lambda i: len(columns[i]) - widths[i]):
        grow = min(max(0, len(columns[i]) - widths[i]), spare)
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
    metric_cols: dict[str, None] = {}  # first seen first; a dict: a merged row of 100,000 metrics took hours as a list
    for r in shown:  # (not a comm row's message_size_bytes: its spec's column)
        metric_cols.update((k, None) for k in r["metrics"] or {} if k not in spec_cols)
    metric_cols, unshown = list(metric_cols)[:METRIC_COLUMNS], len(metric_cols) - METRIC_COLUMNS
    names = [*spec_cols, "status", *metric_cols, "citation"]
    cells = [[*(repr(v) if isinstance(v := r["spec"][c], float) else _fmt(v) for c in spec_cols), r["status"],
              *(_fmt((r["metrics"] or {}).get(c)) for c in metric_cols), r["citation"] or "-"] for r in shown]
    # measured as printed: a value a stream that is not UTF-8 escapes is wider than its characters
    names, cells = [_shown(n, out.encoding) for n in names], [[_shown(c, out.encoding) for c in row] for row in cells]
    keep, widths = _fit(names, cells, out.width)
    dropped = [n for i, n in enumerate(names) if i not in keep]
    citation = max((len(row[-1]) for row in cells), default=None)
    table = Table(*(Column(names[i], overflow="fold", width=widths[i] if widths else None,
                           min_width=citation if names[i] == "citation" else None) for i in keep),
                  title=f"{res.table} / {res.backend} on {res.gpu_name} ({res.mode})")
    for row in cells:
        table.add_row(*(row[i] for i in keep))
    width = out.width  # where even the kept columns cannot fit, each keeps a character (rich left some none: cut)
    out.width = width if widths else max(width, 1 + sum(3 + (citation if names[i] == "citation" else 1) for i in keep))
    out.print(table)
    out.width = width
    if dropped:
        out.print(f"(not shown at {out.width} columns: {', '.join(dropped)}; widen the terminal, or use --json)",
                  markup=False)
    if unshown > 0:
        out.print(f"({unshown} more metric(s) of these rows not shown; use --json for all)", markup=False)
    if hidden:
        out.print(_more(hidden), markup=False)
    others = Counter(r["status"] for r in res.results if r["status"] != "ok")
    split = f" ({', '.join(f'{n} {s}' for s, n in others.items())})" if set(others) - {"missing"} else ""
    out.print(f"{res.count - res.missing_count} of {res.count} ok, {res.missing_count} missing{split}; db {res.db}; "
              f"view root {res.view_root[:16]}", markup=False)
    errors = [r for r in res.results if r.get("error")]
    for r in errors[:limit]:  # a stored failure (failed) or this run's (error), its spec as --spec takes it
        out.print(f"{r['status']} spec {json.dumps(r['spec'])} ({r['error']['kind']}): {r['error']['message']}",
                  markup=False)
    if len(errors) > limit:
        more = len(errors) - limit
        out.print(f"... and {more} more error{'s' if more != 1 else ''}; use --json for all", markup=False)


def waiting_note(bar, db: str | None):
    """One line on stderr when the run (local or --remote) first finds specs another run on the ledger is measuring:
    it waits for them, silent otherwise for as long as that run takes."""
    said = []

    def waiting(held: int) -> None:
        if not said:
            said.append(held)
            from ..ledger import ledger_path

            (bar.console if bar is not None else console(stderr=True)).print(
                f"waiting: another run on {ledger_path(db)} is measuring {held} of these spec(s); each is read once "
                f"that run stores it (measured here if it ends without)", markup=False)

    return waiting
