"""A large lookup on two cores: a forked child answers the tail of a spec list while the parent answers
the head, both inside the parent's one read transaction.

The child reads through the transaction it inherited instead of opening the ledger again: reads touch
only the memory map and the child's own copy of the transaction, and the parent keeps the transaction
(and with it the reader slot that pins the snapshot) open until the child has exited, so both halves
read one snapshot by construction. Opening the ledger in the child would instead close the inherited
environment, and that aborts the inherited transactions, which frees the *parent's* reader slots.
The child never returns into the parent's code: it leaves by os._exit, so no `with` block, finalizer or
atexit handler of the parent's runs in it.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from contextlib import suppress
from typing import Callable, TypeVar

T = TypeVar("T")

MIN_ITEMS = 40_000  # below this, the fork and its copy-on-write faults cost about what half the work saves
PARENT_SHARE = 0.55  # the child's half runs slower: its view of the map starts cold and its writes copy pages


def worth_it(n: int) -> bool:
    """Whether to split n items: Linux, two usable cores, and a single-threaded process."""
    return n >= MIN_ITEMS and sys.platform == "linux" and len(os.sched_getaffinity(0)) > 1 and _single_threaded()


def _single_threaded() -> bool:
    """Whether this process runs one thread, counting threads that are not Python's (a library's pool). A fork
    copies only the calling thread: a lock another thread holds would stay locked in the child forever."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no /proc: cannot tell
        return False


def split(items: list, head: Callable[[list], T], tail: Callable[[list], bytes]) -> tuple[T, memoryview | None]:
    """(head(first part), tail(the rest)), tail run in a forked child meanwhile; its bytes are None when
    the child failed or could not be started. If head raises, the child is killed and reaped before the
    error leaves, so it never outlives the caller's read transaction."""
    cut = int(len(items) * PARENT_SHARE)
    r, w = os.pipe()
    try:
        pid = os.fork()
    except (OSError, RuntimeError):  # no process to spare, or a subinterpreter: the caller answers alone
        os.close(r)
        os.close(w)
        return head(items[:cut]), None
    if pid == 0:
        code = 1
        try:
            gc.disable()  # a collection writes to every tracked object: copy-on-write faults for nothing
            os.close(r)
            data = tail(items[cut:])
            with open(w, "wb") as pipe:
                pipe.write(len(data).to_bytes(8, "big"))
                pipe.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with open(r, "rb") as pipe:
        try:
            mine = head(items[:cut])
            data = pipe.read()  # to EOF before reaping: the child may be blocked on a full pipe
        except BaseException:
            with suppress(ProcessLookupError):  # reaped already by a SIGCHLD handler elsewhere
                os.kill(pid, signal.SIGKILL)
            raise
        finally:
            clean = _reap(pid)
    whole = len(data) >= 8 and len(data) == 8 + int.from_bytes(data[:8], "big")  # not cut short
    return mine, memoryview(data)[8:] if clean and whole else None


def _reap(pid: int) -> bool:
    """Whether the child exited cleanly. A SIGCHLD handler elsewhere may have reaped it already: then the
    length its bytes announce is what vouches for them."""
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    except ChildProcessError:
        return True
