"""Which file a ledger is, before LMDB is given it: the path (`--db`, $KPROF_DB, ./profile.db), and whether an
existing path can be a ledger at all (LMDB creates `<path>-lock` beside any file it opens), and whether a
read-only open must do without the lock file."""

from __future__ import annotations

import os
import stat
import sys
import time

from ..errors import LedgerError, UsageError

__all__ = ["default_path", "ledger_path"]

# LMDB's magic number (lmdb.h MDB_MAGIC), the first field of the meta page that opens every LMDB file, after the
# 16-byte page header; native byte order. Only this is read of LMDB's format: enough to tell a file LMDB wrote from
# a text, SQLite or random file before LMDB opens it (an LMDB open creates `<path>-lock` beside any file it is given).
_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, sys.byteorder)
_MAGIC_AT = 16


def _header_written(path: str, deadline: float) -> bool:
    """Whether the file holds more than 0 bytes, waiting until `deadline` for a writer that is creating it
    (LMDB creates the file, then writes its header) before taking it for truncated."""
    while os.path.getsize(path) == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def default_path() -> str:
    return os.environ.get("KPROF_DB") or "profile.db"


def ledger_path(db: str | os.PathLike | None = None) -> str:
    """The ledger file to use: `db` when given, else $KPROF_DB, else ./profile.db. An empty `db` is refused rather
    than taken for the default: `--db ""` (often an unset shell variable) must not silently name ./profile.db."""
    if db is None:
        return default_path()
    path = os.fspath(db)
    if not path.strip():
        raise UsageError(f"--db {path!r} is empty; pass the ledger file (e.g. --db profile.db), or omit --db to use "
                         f"$KPROF_DB, else ./profile.db")
    return path


def _not_a_ledger(path: str, what: str, damaged: str = "") -> LedgerError:
    fix = f"; if it held a ledger, {damaged}: restore it from a copy" if damaged else ""
    return LedgerError(f"{path} is not a kprof ledger ({what}); check that --db (or $KPROF_DB) names the ledger "
                       f"file{fix}")


def _recognize(path: str, deadline: float) -> None:
    """Refuses an existing path that cannot be a ledger before LMDB is given it: a directory, a device or pipe, an
    empty file, a file without LMDB's magic number. Nothing is created (LMDB would leave `<path>-lock` beside it).
    A file of LMDB's whose contents are damaged passes, for the open to name the damage (exit 3)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise LedgerError(f"cannot open ledger {path}: {exc.strerror}; check the path and its permissions") from None
    if stat.S_ISDIR(mode):
        raise LedgerError(f"ledger path {path} is a directory, not a kprof ledger; pass the ledger file, e.g. "
                          f"{os.path.join(path, 'profile.db')}")
    if not stat.S_ISREG(mode):
        raise _not_a_ledger(path, "not a regular file: a device, pipe or socket")
    if not _header_written(path, deadline):
        raise _not_a_ledger(path, "an empty file, 0 bytes", "the file was truncated")
    try:
        with open(path, "rb") as f:
            head = f.read(_MAGIC_AT + len(_LMDB_MAGIC))
    except OSError as exc:
        raise LedgerError(f"cannot read ledger {path}: {exc.strerror}; check its permissions") from None
    if head[_MAGIC_AT:] != _LMDB_MAGIC:
        kind = "an SQLite database" if head.startswith(b"SQLite format 3") else "not an LMDB file"
        raise _not_a_ledger(path, kind, "its header is damaged")


def _without_lock(path: str) -> bool:
    """Whether a read-only open must do without LMDB's lock file: there is none, and this user cannot create it
    (a ledger in a read-only directory, or a copy on a share).

    The lock file holds LMDB's reader table: a reader registered there keeps writers from reusing the pages of
    the snapshot it reads. A reader without it is safe only while no writer commits, so it is used only here:
    every process that opens the file keeps its lock file, so none has it open now, and a writer would have to
    create the lock file in a directory that this user cannot write (another user's writer, starting during the
    read; the read rows' digests are checked, so even then a reused page is an integrity error, not a wrong
    row). Where a lock file exists that this user cannot open, its owner may be writing: the open is refused,
    as LMDB itself does (it drops the lock only on a read-only filesystem, where no writer can exist)."""
    directory = os.path.dirname(os.path.abspath(path))
    return not os.path.lexists(path + "-lock") and not os.access(directory, os.W_OK)
