"""One root error, one subclass per failure; each class's `exit_code` is the exit status a verb ends with when it raises
the error (kprof.cli.main returns it)."""

from __future__ import annotations

import functools
import json
import os
import shlex

__all__ = [
    "KprofError",
    "UsageError",
    "SettingError",
    "SpecError",
    "UnknownGpuKeyError",
    "measure_command",
    "LedgerError",
    "LedgerPathError",
    "LedgerVersionError",
    "IntegrityError",
    "SnapshotError",
    "OutputError",
    "OutputClosed",
    "MergeConflict",
    "names_ledger",
]


class KprofError(Exception):
    """Root of every error kprof raises on purpose. The message says what, where, and how to fix it."""

    exit_code = 1


class UsageError(KprofError):
    """Bad input from the caller: nothing was written."""

    exit_code = 2


class SettingError(UsageError):
    """A bad timing-method or GPU-key setting, worded twice: for Python callers (str(exc)), naming the keyword
    arguments they passed (`timer='x'`), and for the verbs (`cli`), naming their flags (`--timer x`)."""

    def __init__(self, python: str, cli: str | None = None):
        super().__init__(python)
        self.cli = python if cli is None else cli

    def __reduce__(self):  # pickled across processes with both wordings
        return type(self), (str(self), self.cli)


class SpecError(UsageError):
    """A spec that does not fit its table's KernelArgs."""

    def __init__(self, message: str, *, index: int | None = None, field: str | None = None, value=None):
        self.index = index
        self.field = field
        self.value = value
        self.reason = message  # the message without its "spec N: " (a JSONL file's specs are named by line too)
        where = f"spec {index}: " if index is not None else ""
        super().__init__(where + message)


class UnknownGpuKeyError(UsageError):
    """A lookup of one row under a GPU key for which the ledger has never held a row of that table/backend
    (almost always a mistyped key, or another machine's). `known` holds (gpu_key, rows) of the GPU keys it does
    hold for the table/backend; `held` the (table, backend) of every scope it holds, from the ledger's scopes
    (named where `known` is empty: a mistyped backend or table); `spec` the spec looked up and `timing` the method
    it was looked up under (the contract's timing), which the run named measures."""

    def __init__(self, table: str, backend: str, gpu_key: str, db: str, known: list[tuple[str, int]],
                 held: list[tuple[str, str]] = (), spec: dict | None = None, timing: str | None = None):
        self.table, self.backend, self.gpu_key, self.db, self.known = table, backend, gpu_key, db, known
        self.held = sorted({scope[:2] for scope in held})  # (table, backend, ...) tuples: their pairs
        self.spec, self.timing = spec, timing
        quoted = shlex.quote(db)  # as a shell takes it: the commands below are copied as they are
        given = f" --spec {shlex.quote(json.dumps(spec))}" if spec is not None else ""  # (without one: a usage error)
        what, run = f"{table}/{backend}", f"`{measure_command(f'run {table}', backend, db, timing)}{given}`"
        if known:
            held_keys = ", ".join(f"{g!r} ({rows} row{'s' if rows != 1 else ''})" for g, rows in known)
            fix = (f"it holds {what} rows for GPU key{'s' if len(known) != 1 else ''} {held_keys}; pass one of those "
                   f"as the GPU key, or measure this one with {run} on that GPU")
        else:
            backends = [b for t, b in self.held if t == table]
            there = (f"its {table} rows are of backend{'s' if len(backends) != 1 else ''} {', '.join(backends)}: pass "
                     f"{'one of those' if len(backends) != 1 else 'that backend'}, or" if backends else
                     f"it holds rows of {', '.join(f'{t}/{b}' for t, b in self.held)} only: pass one of those, or"
                     if self.held else "it holds no rows:")
            fix = f"it holds no {what} rows for any GPU key; {there} measure them with {run}"
        super().__init__(f"ledger {db} has no {what} rows for GPU key {gpu_key!r}: {fix} "
                         f"(`kprof scopes --db {quoted}` lists every table, backend and GPU key it holds)")

    def __reduce__(self):  # pickled across processes (a lookup in a process pool's worker) with its fields
        return type(self), (self.table, self.backend, self.gpu_key, self.db, self.known, self.held, self.spec,
                            self.timing)


def measure_command(verb: str, backend: str, db: str | None, timing: str | None) -> str:
    """`kprof <verb> --backend B --db 'P'` (no --db where db is None) that measures under `timing` (a contract's,
    "cupti;l2=cold;eager;power=loaded", "cpu-wall;l2=warm;eager;threads=4") where the variables that choose a method
    are unset: its thread count as the variable that sets it (MKL's where set here, as it decides), a CUDA method's
    flags that are not the defaults or whose variable is set here (pasted where it is set, it would choose)."""
    timer, *parts = (timing or "cpu-wall").split(";")
    said = dict(part.partition("=")[::2] for part in parts)  # l2, eager or graph, power, threads
    # method.thread_variable's choice, read here from os.environ as the flags' variables below (method imports this)
    name = "MKL_NUM_THREADS" if os.environ.get("MKL_NUM_THREADS", "").strip() else "OMP_NUM_THREADS"
    words = [f"{name}={said.get('threads')}"] * ("threads" in said) + ["kprof", *verb.split(), "--backend", backend]
    words += ["--db", shlex.quote(db)] * bool(db)
    method = {"timer": (timer, "cupti"), "l2": (said.get("l2"), "cold"), "cuda_graph": ("graph" in said, False),
              "power": (said.get("power", "sustained"), "sustained")}  # each (value, default)
    for flag, (value, default) in method.items() if timer in ("cupti", "events") else ():  # cpu-wall has no flags
        if value != default or os.environ.get(f"KPROF_{flag.upper()}", "").strip():  # a variable here: it would choose
            words += [f"--{'no-' * (value is False)}cuda-graph"] if flag == "cuda_graph" else [f"--{flag} {value}"]
    return " ".join(words)


class LedgerError(UsageError):
    """The ledger file cannot be opened or used as asked (missing, locked, not a ledger). A usage error: the
    path or the call is what is wrong, and nothing was written."""

    exit_code = 2


class LedgerPathError(SettingError, LedgerError):
    """The ledger path (`db`) names no ledger (nothing there, not a ledger, empty): worded twice, as a SettingError,
    naming the keyword (`db=...`) for Python callers and the flag (`--db`) for the verbs."""

    @classmethod
    def absent(cls, path: str) -> "LedgerPathError":
        """Nothing at `path`, where a reader looks for the ledger: the message says where the path came from when it
        was not given ($KPROF_DB, or ./profile.db with KPROF_DB unset; a path given that is the same is that too) and
        the fix that fits it."""
        env = os.environ.get("KPROF_DB", "").strip()  # as ledger_path reads it: spaces around it dropped
        if env and path == env:  # "set KPROF_DB" would say to do what was done
            where, fix = " (named by $KPROF_DB)", "set KPROF_DB to the ledger file (or unset it), or pass {}"
        else:
            where = " (the path read where no {} is given and KPROF_DB is unset)" if not env and path == "profile.db" \
                else ""
            fix = "pass {} or set KPROF_DB"
        return cls(*(f"no ledger at {path}{where.format(db)}; {fix.format(db)}, or `kprof run` to create one"
                     for db in ("db=...", "--db")))


class Uncreated(LedgerError):
    """An LMDB file holding nothing, not even sub-databases: a ledger whose creation was killed before it committed.
    A reader finds no ledger there (exit 2); a writer's open makes it one."""


class LedgerVersionError(LedgerError):
    """The ledger was written by a newer kprof format than this one reads."""

    def __init__(self, path: str, found: int, supported: int):
        self.path, self.found, self.supported = path, found, supported
        super().__init__(
            f"ledger {path} has format version {found}, but this kprof reads versions up to {supported}; "
            f"upgrade kprof to read it"
        )

    def __reduce__(self):
        return type(self), (self.path, self.found, self.supported)


class IntegrityError(KprofError):
    """The ledger's contents are inconsistent or damaged (exit 3)."""

    exit_code = 3


def names_ledger(function):
    """`function` of the Python API, where an IntegrityError it raises says "run `kprof audit`": naming the ledger it
    was given (`db`), shell-quoted, where that is not the one `kprof audit` alone audits ($KPROF_DB, else
    ./profile.db). A verb's message stays as it was: its db is the --db typed, which kprof.cli names the same way."""

    @functools.wraps(function)
    def named(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except IntegrityError as exc:
            import inspect

            db = inspect.signature(function).bind(*args, **kwargs).arguments.get("db")
            env = os.environ.get("KPROF_DB", "")  # as kprof.ledger.ledger_path reads it
            if db is not None and os.fspath(db) != (env.strip() or env or "profile.db"):
                exc.args = (str(exc).replace("`kprof audit`", f"`kprof audit --db {shlex.quote(os.fspath(db))}`"),)
            raise

    return named


class MergeConflict(KprofError):
    """A merge found incoming events whose key holds another current row that is not their parent: nothing
    was merged, and the conflicts are reported (exit 3)."""

    exit_code = 3

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return type(self), (str(self), self.report)


class SnapshotError(KprofError):
    """`run --output-dir` could not write its snapshot after the run's rows were stored (the directory was
    checked before any work, so only a change since, or a full disk, gets here)."""


class OutputError(KprofError):
    """stdout could not take a verb's output (a full disk, an I/O error): exit 2. What the verb stored stays."""

    exit_code = 2


class OutputClosed(OutputError):
    """stdout's reader went away before the output was written (`kprof query ... | head -1`): nothing is said (the
    reader wants no more) and the exit is 141, as a shell reports a writer that SIGPIPE ended."""

    exit_code = 141
