"""Which file a ledger is, before LMDB opens it (and creates `<path>-lock` beside it): the path (`--db`, $KPROF_DB,
./profile.db), whether an existing path can be a ledger, and whether an open uses the lock."""

from __future__ import annotations

import errno
import os
import stat
import sys
import time

from ..errors import LedgerError, LedgerPathError, UsageError

__all__ = ["ledger_path"]

# LMDB's magic number (lmdb.h MDB_MAGIC, native byte order), first in the meta page that opens every LMDB file, after
# its 16-byte page header: all that is read of LMDB's format, enough to tell its files from text, SQLite or noise.
_LMDB_MAGIC, _MAGIC_AT = (0xBEEFC0DE).to_bytes(4, sys.byteorder), 16


def ledger_path(db: str | os.PathLike | None = None) -> str:
    """The ledger file: `db`, else $KPROF_DB (spaces around it dropped), else ./profile.db; a blank one is refused."""
    if db is not None and not isinstance(db, (str, os.PathLike)):
        raise UsageError(f"db={db!r} is not a path ({type(db).__name__}); pass the ledger file's path as a str")
    env = os.environ.get("KPROF_DB", "")  # an empty one is unset; a blank one stays blank, refused below
    path = os.fspath(db) if db is not None else env.strip() or env or "profile.db"
    names = ("KPROF_DB=",) * 2 if db is None else ("db=", "--db ")  # as a Python keyword, and as a verb's flag
    if not path.strip():
        raise LedgerPathError(*(f"{n}{path!r} is {'blank' if db is None else 'empty'}; pass the ledger file (e.g. {n}"
                                f"{eg}), or {'unset it' if db is None else 'omit ' + n.strip('= ')} to use "
                                f"{'./profile.db' if db is None else '$KPROF_DB, else ./profile.db'}"
                                for n, eg in zip(names, ("'profile.db'", "profile.db"))))
    if os.path.basename(path) in ("", ".", "..") and not os.path.isdir(path):  # x.db/: LMDB would make x.db, where
        file = os.path.normpath(path)  # a look at x.db/ (run's own re-read of its rows) finds nothing
        file = os.path.join(file, "profile.db") if os.path.basename(file) in ("", ".", "..") else file
        raise LedgerPathError(*(f"{n}{path!r} names a directory (it ends in {os.path.basename(path) or os.sep!r}), not "
                                f"a ledger file; pass the file, e.g. {n}{repr(file) if n == 'db=' else file}"
                                for n in names))
    return path


def _not_a_ledger(path: str, what: str, damaged: str = "") -> LedgerPathError:
    fix = f"; if it held a ledger, {damaged}: restore it from a copy" if damaged else ""
    return LedgerPathError(*(f"{path} is not a kprof ledger ({what}); check that {db.strip(' =')} (or $KPROF_DB) names "
                             f"the ledger file{fix}" for db in ("db=", "--db ")))


def _recognize(path: str, deadline: float, readonly: bool) -> None:
    """Refuses, creating nothing, a path that cannot be a ledger (a directory, device or pipe, empty file, file without
    LMDB's magic number; a writer's of several hard links). A damaged LMDB file passes: the open names it (exit 3)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise LedgerError(f"cannot open ledger {path}: {exc.strerror}; check the path and its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        raise LedgerPathError(f"ledger path {path} is a directory, not a kprof ledger; pass the ledger file, e.g. "
                              f"{os.path.join(path, 'profile.db')}")
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_ledger(path, "not a regular file: a device, pipe or socket")
    if st.st_nlink > 1 and not readonly:  # LMDB's lock file is `<name>-lock`: one per name, where writers exclude
        raise LedgerError(f"ledger {path} has {st.st_nlink} hard links, each name with a lock file of its own: writers "
                          f"through two names would commit over each other's rows; keep one name (remove the other "
                          f"links, or `cp` the file; a symbolic link shares the lock)")
    while os.path.getsize(path) == 0:  # until `deadline`, a writer creating the file may not have written its header
        if time.monotonic() > deadline:
            raise _not_a_ledger(path, "an empty file, 0 bytes", "the file was truncated")
        time.sleep(0.01)
    try:
        with open(path, "rb") as f:
            head = f.read(_MAGIC_AT + len(_LMDB_MAGIC))
    except OSError as exc:
        raise LedgerError(f"cannot read ledger {path}: {exc.strerror}; check its permissions") from None
    if head[_MAGIC_AT:] != _LMDB_MAGIC:
        kind = "an SQLite database" if head.startswith(b"SQLite format 3") else "not an LMDB file"
        raise _not_a_ledger(path, kind, "its header is damaged")


def _with_lock(path: str, real: str, readonly: bool) -> bool:
    """Whether LMDB opens the file with its lock file `<real path>-lock`, given its blocks first (32 KiB: 510 readers;
    one made keeps its size): LMDB writes it through a map, where a page no block backs (a full disk) faults (SIGBUS).
    A reader does without one where none is and this user cannot make it (a read-only directory; no writer commits)."""
    lock = real + "-lock"
    if readonly and not os.path.lexists(lock) and not os.access(os.path.dirname(os.path.abspath(real)), os.W_OK):
        return False
    try:  # one this user cannot open or write is left to LMDB's open, which names it
        with os.fdopen(os.open(lock, os.O_RDWR | os.O_CREAT, 0o666), "rb") as f:  # as umask allows, as the file
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size or 32768)
    except (OSError, AttributeError) as exc:  # (macOS has no posix_fallocate: there LMDB sizes it, as it did)
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise LedgerError(f"cannot open ledger {path}: its lock file {lock} cannot take its 32 KiB "
                              f"({exc.strerror}): the disk is full or past a file size limit (ulimit -f); free "
                              f"space and run again") from None
    return True
