"""The cyclopts app. Verbs are registered by import string, so `kprof list` or `kprof query` import only
what they use (no torch, cupti or pynvml on the read path). The app itself is built on first use (see _app)."""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
import threading

from .. import __version__
from .._limits import hit  # here, not where an error is handled: that import may be refused a descriptor (ulimit -n)
from ..errors import KprofError, SettingError, UsageError

__all__ = ["app", "main"]

# Verbs by import string, with their help here too, so `kprof --help` lists every verb without importing it.
VERBS = [
    ("list", "kprof.cli.list_:list_",
     "List every table/backend pair with its args, kernel kind, metric family, env and read functions."),
    ("scopes", "kprof.cli.scopes:scopes",
     "List every table/backend/GPU key the ledger holds, with its current rows (one per key: a spec measured under "
     "two profiler revisions or timing methods has two): the GPU keys to read rows under."),
    ("count-missing", "kprof.cli.read:count_missing", "Count the specs without an ok row. Read-only: never profiles."),
    ("query", "kprof.cli.read:query",
     "Read the rows of the given specs. Read-only: never profiles; missing rows exit 0."),
    ("run", "kprof.cli.run:run",
     "Profile the missing specs (or all with --force; --fresh writes nothing), then report every row."),
    ("audit", "kprof.cli.audit:audit",
     "Verify every event id and key, the log, the views and the file structure (exit 3 on damage)."),
    ("calibrate", "kprof.cli.calibrate:calibrate",
     "Measure the device's ceilings (the best of large GEMMs, of large copies) into the ledger; `query --json` "
     "gives each ok row's fraction of them."),
    ("measure", "kprof.cli.measure:measure",
     "Diagnose one spec: a sustained CUPTI window of every launch beside NVML telemetry, with plots. Never writes "
     "the ledger."),
    ("show", "kprof.cli.show:show", "Show one row's provenance, metrics and full history by citation, key or event id."),
    ("export", "kprof.cli.merge:export", "Write the ledger's events (of a table, backend or GPU key) to a segment file."),
    ("merge", "kprof.cli.merge:merge",
     "Merge segment files into the ledger: every event checked, conflicts refused (exit 3), all or nothing."),
]


@functools.cache
def _app(name: str = "kprof"):
    """`app`, built where it is first asked for: the `kprof` script imports this module before `main` handles Ctrl-C
    and SIGTERM, and cyclopts takes a while to load. `name` is the command its help's usage lines give (the
    launcher's `python -m launcher kernel-profile`, as typed)."""
    from cyclopts import App, Parameter

    # negative_iterable="": no list flag gets cyclopts' `--empty-NAME` twin (`--empty-spec --specs FILE` was accepted
    # and every verb's help listed them): an empty list is never a request kprof takes.
    app = App(name=name, help="Profile GPU kernels into a content-addressed ledger and serve the rows.",
              version=__version__, exit_on_error=False, print_error=False, result_action="return_value",
              default_parameter=Parameter(negative_iterable=""))
    for name, target, help_ in VERBS:
        app.command(target, name=name, help=help_)
    return app


def __getattr__(name: str):
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


invocation: list[str] = []  # the command now running (`kprof` and its arguments), for the records it writes


def _cyclopts_error(exc: Exception) -> bool:
    """Whether exc is cyclopts' own error for a command line it cannot parse: one usage line (exit 2)."""
    errors = sys.modules.get("cyclopts.exceptions")
    return errors is not None and isinstance(exc, errors.CycloptsError)


def _ledger_failure(exc: Exception) -> bool:
    """Whether exc is an LMDB error (a damaged file the verified reads did not wrap): reported as exit 3."""
    lmdb = sys.modules.get("lmdb")
    return lmdb is not None and isinstance(exc, lmdb.Error)


def _write_refused(exc: Exception) -> bool:
    """Whether exc is LMDB failing to write (a full disk, a file size limit, an I/O error at commit): the
    transaction is aborted and every earlier commit stays, so the file is not damaged."""
    lmdb = sys.modules.get("lmdb")
    return lmdb is not None and (isinstance(exc, lmdb.DiskError) or
                                 (isinstance(exc, lmdb.Error) and "mdb_txn_commit" in str(exc)))


def _terminated(signum, _frame):
    """SIGTERM or SIGHUP as an exception, so what a verb was writing is cleaned up as on Ctrl-C (temporary files
    removed, an open write transaction aborted) before the process ends with 128 + the signal."""
    raise SystemExit(128 + signum)


_FALSE = ("false", "f", "no", "n", "0")  # what cyclopts reads as False in `--flag=VALUE`
_WRITERS = ("run", "calibrate", "merge")  # the verbs that store rows: a limit's line says what they left


def _interrupted_note(verb: str, argv: list[str], exc: BaseException) -> str:
    """What an interrupt left, by verb: every commit is whole, so only the verbs that write have more to say (a
    merge of several batches says which it committed, as a note on the interrupt)."""
    # cyclopts ends a Ctrl-C as SystemExit(130), raised while handling it
    notes = [n for raised in (exc, exc.__context__) for n in getattr(raised, "__notes__", None) or ()]

    def given(flag: str) -> bool:  # `--fresh=false` is no --fresh
        return any(a == flag or a.startswith(flag + "=") and a.partition("=")[2].strip().lower() not in _FALSE
                   for a in argv)

    remote = verb == "run" and given("--remote")
    if notes and (remote or verb not in ("run", "calibrate")):  # a merge's batches (merge, a remote run's chunks)
        return notes[-1]
    out = _db_given(argv, "--output-dir")  # a remote run's record is in the one given; a local run's snapshot where
    placed = remote or out and os.path.isfile(os.path.join(out, "request.json"))  # whole before the interrupt
    same = "the same command with a new --output-dir" if placed else "the same command again"  # (it refuses that one)
    if verb == "run" and given("--fresh"):  # it stores nothing, and measures every spec whenever it runs
        cancelled = ", and the engine's unfinished jobs were cancelled" if remote else ""
        return f"a --fresh run writes nothing: the ledger is as it was{cancelled}; {same} measures every spec"
    # --force measures every spec (every ceiling) again whenever it runs; without it, only what is missing
    what = "every ceiling" if verb == "calibrate" else "every spec"
    again = (f"measures {what} anew (--force; without it, only what is missing)" if given("--force")
             else "measures only what is missing")
    if remote:
        return ("every chunk merged before it stays in the ledger, and the engine's unfinished jobs were cancelled; "
                f"{same} {again.replace('measures', 'sends', 1)}")
    if verb in ("run", "calibrate"):  # a local run's note counts the rows it stored (a calibration's, one table's)
        stored = f" ({notes[-1]})" if notes and verb == "run" else ""
        return f"every row stored before it stays in the ledger{stored}, and nothing half-written does; {same} {again}"
    if verb == "merge":
        return "a merge is all or nothing: the ledger holds none of its events; run it again"
    return "nothing was left half-written"


def _missing(exc: Exception, argv: list[str]) -> str | None:
    """A required argument left out, worded by what it is (cyclopts named a positional TABLE as `--table`, which
    reads as a flag to add): `TABLE is missing: the table, e.g. single_gemm ...`; None for any other error."""
    from cyclopts.exceptions import MissingArgumentError

    argument = getattr(exc, "argument", None)
    if not isinstance(exc, MissingArgumentError) or argument is None:
        return None
    names = [n for n in argument.parameter.name or () if n.startswith("-")]
    helps = (argument.parameter.help or "").rstrip(".")
    first = helps.split(" ")[0]  # "The table" reads "the table", and an acronym ("GPU key") stays as it is
    lower = helps[:1] if len(first) > 1 and first.isupper() else helps[:1].lower()
    what = f": {lower}{helps[1:]}" if helps else ""
    given = next((n for n in names if n in argv or any(a.startswith(n + "=") for a in argv)), None)
    after = argv[argv.index(given) + 1:][:1] if given in argv else []  # what followed: `--db -x.db`, read as a flag
    if after and after[0].startswith("-") and not re.fullmatch(r"--?[A-Za-z][A-Za-z-]*", after[0]):  # no flag's name
        return (f"{given} needs a value{what}; {after[0]!r} after it reads as an option: to pass it as the value, "
                f"write {shlex.quote(f'{given}={after[0]}')}")
    if given:
        return f"{given} needs a value{what}"
    if argument.field_info.kind is argument.field_info.POSITIONAL_OR_KEYWORD:
        return f"{argument.field_info.name.upper()} is missing{what}"
    return f"{'/'.join(sorted(names, key=len)) or argument.field_info.name} is missing{what}"


def _stream(verb: str | None, argv: list[str]) -> str | None:
    """`-` given to export or merge, for stdout or stdin (cyclopts read it as an option: "-o needs a value", "Unknown
    option: -"): segments are files, said with the fix; None for anything else."""
    after = [argv[i - 1] if i else "" for i, a in enumerate(argv) if a == "-"]  # the token before each `-`
    if not (verb == "export" and {"-o", "--output"} & set(after) or
            verb == "merge" and any(a not in ("--db", "--output-dir") for a in after)):
        return None
    given, stream = ("-o -", "stdout") if verb == "export" else ("a segment -", "stdin")
    return (f"{given}: a segment is a file, not {stream} (a merge reads each segment twice, checked and then merged); "
            f"give a file path (or a directory), and copy the file between machines")


def _one_pair(exc: Exception, verb: str | None, argv: list[str]) -> str | None:
    """A second table (a token left over) or a second --backend, worded as the rule it breaks: one table/backend pair
    per command (cyclopts said "Unused Tokens: ['rms_norm']" and "Parameter --backend specified multiple times"); None
    for any other error."""
    from cyclopts.exceptions import RepeatArgumentError, UnusedCliTokensError

    if isinstance(exc, UnusedCliTokensError) and exc.unused_tokens:
        tokens = exc.unused_tokens
        extra = f"unexpected argument{'s' if len(tokens) > 1 else ''} " + ", ".join(map(repr, tokens))
        at = len(argv) - 1 - argv[::-1].index(tokens[0]) if tokens[0] in argv else 0  # its last place: not the value
        prev2, prev = ["", "", *argv][at:at + 2]  # the two arguments before it
        # `--spec A B`, `--db=x.db y.db`: the extra value follows a flag's value
        flag = (prev.partition("=")[0] if prev.startswith("--") and "=" in prev
                else prev2 if prev2.startswith("--") and not prev.startswith("-") else None)
        if flag == "--spec" or tokens[0].lstrip()[:1] in ("{", "["):
            return (f"{extra}: --spec takes one JSON object; give each spec its own --spec, or put them in a --specs "
                    f"file")
        if flag == "--specs":
            return f"{extra}: --specs takes one file; put every spec in it (a JSON list, or JSONL)"
        if flag is not None and flag != "--backend":
            return f"{extra}: {flag} takes one value"
        if verb in ("count-missing", "query", "run", "measure"):
            return f"{extra}: a command takes one table and one --backend; run one command per table/backend pair"
        return f"{extra}: `{' '.join(('kprof', *([verb] if verb else [])))}` takes no such argument"
    token = getattr(exc, "token", None)
    if isinstance(exc, RepeatArgumentError) and token is not None and token.keyword == "--backend":
        return "--backend is given more than once: a command takes one backend; run one command per table/backend pair"
    return None


def _dashed(exc: Exception) -> str | None:
    """A file named with a leading '-' given as an argument (`kprof merge -rows.kseg`), which cyclopts read as an
    unknown option ("-r is not a recognized option"), said with the way to pass it; None for any other error."""
    from cyclopts.exceptions import UnknownOptionError

    token = getattr(getattr(exc, "token", None), "value", None)
    if not isinstance(exc, UnknownOptionError) or not token or not os.path.lexists(token):
        return None
    return f"{token!r} reads as an option, and names a file here: to pass the file, write ./{token}"


def _utf8(argv: list[str]) -> None:
    """Refuses an argument, or a $KPROF_DB, holding bytes that are not UTF-8 (Python reads them as lone surrogates: a
    file name in another encoding, a C locale's text): specs are UTF-8 JSON, LMDB opens a ledger by its UTF-8 path, and
    the keys and every record written are UTF-8, where such a value was a traceback (after the rows were stored, for a
    snapshot's record of the command)."""
    env = os.environ.get("KPROF_DB", "")
    for name, value in [*(("argument", arg) for arg in argv), ("KPROF_DB", env)]:
        try:
            value.encode("utf-8")
            continue
        except UnicodeEncodeError:
            pass
        try:
            raw = os.fsencode(value)  # the bytes as given
        except UnicodeEncodeError:  # a surrogate no byte is read as (passed from Python, not from a shell)
            raw = value.encode("utf-8", "surrogatepass")
        try:
            raw.decode("utf-8")
            at = None
        except UnicodeDecodeError as exc:
            at = exc.start
        text = raw.decode("utf-8", "backslashreplace")
        shown = f"argument '{text}'" if name == "argument" else f"KPROF_DB='{text}'"
        locale = sys.getfilesystemencoding()
        if at is None and locale.lower().replace("-", "") != "utf8":  # UTF-8 as given, read in the locale's encoding
            raise UsageError(f"{shown} is UTF-8, but Python reads arguments and variables here as {locale} (a C or "
                             f"POSIX locale with UTF-8 mode off); set PYTHONUTF8=1, or a UTF-8 locale "
                             f"(LC_ALL=C.UTF-8), and run it again")
        at = at or 0  # a str from Python whose escaped bytes are UTF-8 (no byte of a command line reads so)
        raise UsageError(f"{shown} is not UTF-8 text (byte {at} is 0x{raw[at]:02x}); kprof reads and records its "
                         f"arguments and ledger path as UTF-8: pass the value in UTF-8 (rename a file whose name is in "
                         f"another encoding)")


def _here(verb: str, argv: list[str]) -> None:
    """Refuses a current directory removed since the shell entered it (a batch job's scratch directory cleaned up):
    relative paths name nothing there, and spawned processes (audit's shards, workers) and torch's libraries failed
    to start in it, as a traceback or a C library's fatal error. A reader of a ledger named by its whole path (query,
    count-missing, scopes, show; its --specs file so too), --help and --version answer as anywhere."""
    try:
        os.getcwd()
    except FileNotFoundError:
        read = [_db_given(argv) or os.environ.get("KPROF_DB", "").strip(), *{_db_given(argv, "--specs")} - {None}]
        if not verb or verb in ("query", "count-missing", "scopes", "show") and all(map(os.path.isabs, read)):
            return
        shown = f" ({os.environ['PWD']})" if os.environ.get("PWD") else ""
        raise UsageError(f"the current directory{shown} was removed; cd to a directory that exists and run the "
                         f"command again") from None


def main(argv: list[str] | None = None, prog: tuple[str, ...] = ("kprof",), program: bool | None = None) -> int:
    """Runs one verb and returns its exit code: 0 ok, 1 run left rows missing, 2 usage, 3 integrity (130, 143, 129:
    an interrupt; 141: the reader of stdout left). `prog` is the command's words before the verb, as the records name it
    (the launcher's `python -m launcher kernel-profile`). `program`: the call is the process (the `kprof` script,
    `python -m kprof`, the launcher; by default where argv is None), which then ends by the signal of a 129, 130, 141
    or 143 (see _end_by_signal)."""
    program = argv is None if program is None else program
    if program:
        import atexit

        atexit.register(_end_by_signal)  # before anything a verb registers: it runs last
    # each a str, bytes or a path (a test's `tmp_path / "p.db"`), as subprocess takes them; a str alone, one argument
    argv = sys.argv[1:] if argv is None else [os.fsdecode(a) for a in ([argv] if isinstance(argv, str) else argv)]
    from ._render import db_given, guarded, typed_as, whole_process

    with _one_verb:  # a verb holds the process's sys.stdout and sys.stderr, and the command recorded, till it ends
        invocation[:] = [*prog, *argv]
        typed_as[:], db_given[:] = prog, []  # the command as typed, which messages name (see _render.as_typed); --db
        whole_process[:] = [program]
        with guarded():  # a failed write of stdout: one line (exit 2), of stderr: dropped; no traceback either way
            code = _main(argv, " ".join(prog))
    if program:
        _ending[:] = [code]
    return code


# One verb at a time in a process: main() called from several threads at once left sys.stdout and sys.stderr kprof's
# wrappers for good (each verb put back the streams it found, another's), and recorded another's command in its rows
_one_verb = threading.RLock()
os.register_at_fork(after_in_child=lambda: globals().update(_one_verb=threading.RLock()))  # (no verb runs there)
_ending: list[int] = []  # the exit code of the program's verb, for _end_by_signal
_SIGNALS = {129: "SIGHUP", 130: "SIGINT", 141: "SIGPIPE", 143: "SIGTERM"}


def _end_by_signal() -> None:
    """At the exit of a program whose verb was interrupted (129, 130, 143) or whose stdout's reader left (141), after
    every other exit handler: the process ends by that signal, as a shell tool does (the shell still reads the code).
    It exited with the code instead, which bash takes for a signal the program handled and carries on past: Ctrl-C of
    `for t in ...; do kprof run ...; done` went on to the next run, and xargs, make and find -exec went on past a 141
    where they stop on a process the signal ended."""
    import contextlib
    import signal

    if not _ending or _ending[0] not in _SIGNALS:
        return
    for stream in (sys.stdout, sys.stderr):  # what is buffered (the interrupt's line), before the process ends
        with contextlib.suppress(Exception):
            stream.flush()
    sig = getattr(signal, _SIGNALS[_ending[0]])
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


def _db_given(argv: list[str], flag: str = "--db") -> str | None:
    """What `flag` was given (`--db X` or `--db=X`): by default the ledger, which a suggested `kprof audit` names."""
    return next((b for a, b in zip(argv, argv[1:]) if a == flag), None) or next(
        (a.removeprefix(f"{flag}=") for a in argv if a.startswith(f"{flag}=")), None)


def _main(argv: list[str], prog: str = "kprof") -> int:
    import signal

    from .._signals import STOPS

    main_thread = threading.current_thread() is threading.main_thread()
    # SIGHUP (a dropped ssh session) as SIGTERM, where not ignored (nohup); Python's SIGINT raises KeyboardInterrupt.
    # A handler set from C (getsignal gives None) is left as it is: Python cannot put it back
    previous = {s: h for s in STOPS if (h := signal.getsignal(s)) is not None} if main_thread else {}
    for sig in set(previous) - {signal.SIGINT}:
        if previous[sig] != signal.SIG_IGN:
            signal.signal(sig, _terminated)
    restore = None  # the SIGBUS handler's, once installed (inside the try: an interrupt of the imports is handled)
    verb = next((a for a in argv if not a.startswith("-")), "")  # ("": --help, --version)
    try:
        from ._render import as_typed, db_given
        from ._sigbus import LINE, _line, install

        restore = install()  # a read of a damaged mapping: one line, exit 3 (see _sigbus)
        _utf8(argv)
        db_given[:] = [db] if (db := _db_given(argv)) else []  # given, once argv is UTF-8 text
        _line[0] = as_typed(LINE.decode()).encode()
        _here(verb, argv)
        # built here (see _app): a Ctrl-C while cyclopts loads is an interrupt, as in a verb; the launcher's names it
        app = sys.modules[__name__].app if prog == "kprof" else _app(prog)
        result = app(argv)
    except (KeyboardInterrupt, SystemExit) as exc:
        code = 130 if isinstance(exc, KeyboardInterrupt) else exc.code
        if code not in _SIGNALS or code == 141:  # a plain exit of a verb's own
            raise
        if main_thread:  # a second Ctrl-C (or SIGTERM) while the line is written: the line, not a traceback
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
        from ._render import error

        error(f"interrupted ({'Ctrl-C' if code == 130 else _SIGNALS[code]}): {_interrupted_note(verb, argv, exc)}")
        return code
    except KprofError as exc:
        from ._render import error

        if (limit := hit(exc.__context__)) is not None:  # raised for a limit it ran into (ulimit -n, -v), worded so
            error(f"{limit} (every row stored before stays)" if verb in _WRITERS else limit)
            return 2
        if str(exc):  # OutputClosed says nothing: the reader of stdout went away
            error(exc.cli if isinstance(exc, SettingError) else str(exc))
        return exc.exit_code
    except Exception as exc:
        from ._render import error

        if _cyclopts_error(exc):  # one line, as every other usage error (cyclopts' own is a multi-line panel)
            verb = next((a for a in argv if a in {name for name, _t, _h in VERBS}), None)
            said = _stream(verb, argv) or _missing(exc, argv) or _one_pair(exc, verb, argv) or _dashed(exc) or (
                str(exc)[:-1] if str(exc).endswith(".") and not str(exc).endswith("...") else str(exc))
            error(f"{said}; see `{prog} {verb + ' ' if verb else ''}--help`")
            return 2
        left = "; ".join(getattr(exc, "__notes__", ())) or "every row stored before stays"  # (a merge's batches)
        if (limit := hit(exc)) is not None:  # a resource limit (ulimit -n, -v), not damage: a traceback before
            error(f"{limit} ({left})" if verb in _WRITERS else limit)
            return 2
        if not _ledger_failure(exc):
            raise

        if _write_refused(exc):
            error(f"writing the ledger failed ({type(exc).__name__}: {exc}): the disk is full, past a file size "
                  f"limit (ulimit -f) or failing; nothing of the failed transaction was stored ({left}; `kprof audit` "
                  f"confirms it). Free space and run again")
            return 2
        error(f"the ledger file is damaged ({type(exc).__name__}: {exc}); run `kprof audit` for the full report")
        return 3
    finally:
        if restore is not None:
            restore()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return result if isinstance(result, int) else 0
