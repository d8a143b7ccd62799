"""The LMDB environments of this process, one per file (all the lmdb package allows), shared and counted, grown when
a write fills the map, and forgotten by a forked child, which must neither use nor close its parent's."""

from __future__ import annotations

import os
import threading
import time
import weakref

import lmdb

from ..errors import IntegrityError, LedgerError

_live: "weakref.WeakSet" = weakref.WeakSet()  # every open Ledger of this process
_envs: dict[str, list] = {}  # realpath -> [env, users, (dev, ino) of the file it maps, page size, of its lock, dbs]
# (dbs: handles opened once: py-lmdb opens one in a write transaction, which waits for writers with the GIL held)
_lock = threading.RLock()  # held by each Ledger's open and close: never two environments of a file, nor a wrong count
_reads: dict[int, tuple] = {}  # this process's reads and writes: id -> (env, read txn or None, thread)
_mapping = threading.RLock()  # held by a map change, and while a read (from its map check on) or a write enters _reads
GROW_WAIT_S = 10.0  # how long a map change waits for this process's other snapshots (other threads') to end
CREATE_WAIT_S = 1.0  # how long an open waits for a writer creating the file to write its header and sub-databases

# Files whose environment a forked child inherited: it may not use, reopen or close it (closing aborts the inherited
# transactions, which frees the parent's reader slots in the lock file: its snapshots unprotected from writers).
_inherited: set[str] = set()
_FORK_FIX = ("open the ledger in a spawned process (multiprocessing 'spawn' or 'forkserver', or a subprocess), or in "
             "a child forked while the parent had it closed (kprof.perf_api.close_all() closes perf_api's)")
# The child's copies of the parent's environments and reads, held, never used or closed. Freed at exit harmlessly:
# py-lmdb (1.7) checks the process id before it aborts or closes one; LMDB (0.9.23) keeps it off the parent's slots.
_inherited_handles: list = []


def _forget_after_fork() -> None:
    _lock.release(), _mapping._at_fork_reinit()  # _lock: taken by the fork (below); _mapping: free in the child
    for ledger in list(_live):
        ledger._forked = True
    _inherited_handles.extend([entry[0] for entry in _envs.values()] + [txn for _env, txn, _t in _reads.values()])
    _inherited.update(_envs)
    _envs.clear()
    _reads.clear()


os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_forget_after_fork)


def _await_reads(env: lmdb.Environment, path: str, change: str, fix: str) -> None:
    """Waits, holding _mapping (no read begins meanwhile: see Ledger.read), for other threads' reads of `env` to end
    before a change that would end them; refuses where they do not, or where one is this thread's own."""
    deadline = time.monotonic() + GROW_WAIT_S
    while threads := [thread for e, _txn, thread in list(_reads.values()) if e is env]:
        if threading.get_ident() in threads or time.monotonic() > deadline:
            raise LedgerError(f"ledger {path}{change}, and this process holds {len(threads)} read(s) or write(s) open "
                              f"on it; end them (finish iterating view.rows() or iter_log()), {fix}")
        time.sleep(0.01)


def _change_map(env: lmdb.Environment, path: str, size: int) -> None:
    """env.set_mapsize(size), which ends every transaction this process has open on the file, once they end."""
    with _mapping:  # one at a time
        _await_reads(env, path, "'s memory map must change size (the file grew past it)",
                     "or open the ledger with a larger map_size")
        env.set_mapsize(size)


def _begin(env: lmdb.Environment, path: str) -> lmdb.Transaction:
    """A read, in the map size another process grew the map to; with no reader slot left, dead readers' are freed."""
    while True:
        try:
            return env.begin()
        except lmdb.MapResizedError:
            _change_map(env, path, 0)
        except lmdb.ReadersFullError:
            if not env.reader_check():
                raise LedgerError(f"ledger {path} has {env.max_readers()} reads open at once, over every process, "
                                  f"LMDB's most; end some (read from fewer threads or processes)") from None


def _write_txn(env: lmdb.Environment, path: str, fn, check=lambda: None):
    """fn(txn), then check(), in one write transaction, in _reads from before it begins (a map change meanwhile failed
    it with a raw LMDB error); retried after growing a full map or adopting another's size."""
    writing = object()
    while True:
        with _mapping:
            _reads[id(writing)] = (env, None, threading.get_ident())
        try:
            with env.begin(write=True) as txn:
                done = fn(txn)
                check()
                return done
        except lmdb.MapFullError:
            size = env.info()["map_size"] * 2
        except lmdb.MapResizedError:
            size = 0
        finally:
            _reads.pop(id(writing))
        _change_map(env, path, size)


def _read_only_file(path: str) -> LedgerError:
    return LedgerError(f"ledger {path} is read-only for this user; open it read-only or fix its permissions")


def _identity(path: str) -> tuple:
    """(device, inode, size, modified) of the file at `path`; () where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _check_file(path: str, real: str, entry: list) -> None:
    """Before each read and commit: the file and its lock file are those LMDB opened (a writer through a new lock would
    commit over this one's commits), and the file is not shorter than the pages LMDB uses (a read there: SIGBUS)."""
    env, _users, identity, psize, lock, _dbs, now = *entry, _identity(real)
    if now[:2] != identity or _identity(real + "-lock")[:2] != lock:
        what = f"ledger {path}" if now[:2] != identity else f"the lock file {real}-lock of ledger {path}"
        raise LedgerError(f"{what} was replaced or removed since this process opened it; open it again (add rows to "
                          f"a ledger in use with `kprof merge`, never by replacing it or removing its lock file)")
    have, need = now[2], 2 * psize  # first LMDB's two meta pages, which say how many pages it uses
    if have >= need:
        need = (env.info()["last_pgno"] + 1) * psize
        if have >= need or (_identity(real) or now)[2] >= need:  # read again: a writer may have grown it since
            return
    raise IntegrityError(f"ledger {path} is truncated: {have} bytes on disk, its header says {need}; run `kprof "
                         f"audit` for the full report, and restore the file from a copy")


def _release(real: str, env: lmdb.Environment) -> None:
    shared = _envs.get(real)  # (the caller holds _lock)
    if shared is not None and shared[0] is env:
        shared[1] -= 1
        if shared[1] > 0:
            return
        del _envs[real]
    env.close()
