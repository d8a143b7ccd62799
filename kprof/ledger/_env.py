"""The LMDB environments of this process: one per file, shared by every Ledger on it (LMDB allows one per file per
process), counted, grown when a write fills the map, and forgotten by a forked child, which must not use or
close its parent's. `kprof.ledger.store` opens ledgers through it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import lmdb

from ..errors import LedgerError

_live: "weakref.WeakSet" = weakref.WeakSet()  # every open Ledger of this process
# LMDB allows one environment per file per process: every Ledger on a file shares it, counted.
_envs: dict[str, list] = {}  # realpath -> [env, users]


# Files whose environment a forked child inherited. The child can neither use nor close it: closing
# aborts the inherited transactions, and that frees the parent's reader slots in the shared lock file
# (the parent's snapshot would lose its protection from writers). The lmdb package allows one
# environment per file per process, so the child cannot open the file again either.
_inherited: set[str] = set()
_FORK_FIX = "open the ledger in a spawned process (multiprocessing 'spawn' or 'forkserver', or a subprocess)"


# The read transactions open in this process: id -> (environment, transaction, thread id). A forked child
# keeps its copies alive for good, and a map is grown only when no other snapshot of this process reads it.
_reads: dict[int, tuple[lmdb.Environment, lmdb.Transaction, int]] = {}
GROW_WAIT_S = 10.0  # how long a map change waits for this process's other snapshots (other threads') to end
CREATE_WAIT_S = 1.0  # how long an open waits for a writer creating the file to write its header and sub-databases


# A forked child's copies of the parent's environments and read transactions, held so that the child never
# uses or closes them itself. Freeing them is harmless since py-lmdb 1.7 (its handles check the process id
# before they abort a transaction or close an environment; LMDB 0.9.23 and later keep a forked child's close
# off the parent's reader slots): a child that exits normally leaves the parent's snapshots protected.
_inherited_handles: list = []


def _forget_after_fork() -> None:
    for ledger in list(_live):
        ledger._forked = True
    _inherited_handles.extend([env for env, _users in _envs.values()] + [txn for _env, txn, _t in _reads.values()])
    _inherited.update(_envs)
    _envs.clear()
    _reads.clear()


def _open_reads(env: lmdb.Environment) -> tuple[int, bool]:
    """(how many read transactions this process has open on env, whether one is this thread's own: waiting
    would not end that one)."""
    threads = [thread for e, _txn, thread in list(_reads.values()) if e is env]
    return len(threads), threading.get_ident() in threads


def _change_map(env: lmdb.Environment, path: str, size: int) -> None:
    """env.set_mapsize(size), which ends every transaction this process has open on the file: first waits for
    other threads' reads to end, and refuses with a clear error where they do not (or one is this thread's)."""
    deadline = time.monotonic() + GROW_WAIT_S
    while (reads := _open_reads(env))[0]:
        if reads[1] or time.monotonic() > deadline:
            raise LedgerError(f"ledger {path}'s memory map must change size (the file grew past it), and this "
                              f"process holds {reads[0]} read(s) open on it; end them (finish iterating "
                              f"view.rows() or iter_log()), or open the ledger with a larger map_size")
        time.sleep(0.01)
    env.set_mapsize(size)


def _write_txn(env: lmdb.Environment, path: str, fn):
    """fn(txn) in one write transaction; the map grown and fn retried when it is full, or another process's
    size adopted when it moved."""
    while True:
        try:
            with env.begin(write=True) as txn:
                return fn(txn)
        except lmdb.MapFullError:
            _change_map(env, path, env.info()["map_size"] * 2)
        except lmdb.MapResizedError:
            _change_map(env, path, 0)


def _read_only_file(path: str) -> LedgerError:
    return LedgerError(f"ledger {path} is read-only for this user; open it read-only or fix its permissions")


os.register_at_fork(after_in_child=_forget_after_fork)


def _release(real: str, env: lmdb.Environment) -> None:
    shared = _envs.get(real)
    if shared is not None and shared[0] is env:
        shared[1] -= 1
        if shared[1] > 0:
            return
        del _envs[real]
    env.close()
