"""A large lookup on two cores: a forked child answers the tail of a spec list while the parent answers
the head, both inside the parent's one read transaction.

The child reads through the transaction it inherited instead of opening the ledger again. Reads only
touch the memory map and the child's own copy of the transaction, and the parent keeps the transaction
(and with it the reader slot that pins the snapshot) open until the child has exited: both halves see
one snapshot by construction. Opening the ledger in the child would instead close the inherited
environment, whose cleanup aborts the inherited transactions and so frees the *parent's* reader slots.
The child never unwinds: it leaves by os._exit, so no `with` block, finalizer or atexit handler of the
parent's runs in it.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

MIN_ITEMS = 20_000  # below this, the fork and copy-on-write faults cost more than half the work saves


def worth_it(n: int) -> bool:
    """Whether to split n items: Linux, two usable cores, and a single-threaded process (a fork copies only
    the calling thread; a lock another thread holds would stay locked in the child forever)."""
    return (n >= MIN_ITEMS and sys.platform == "linux" and len(os.sched_getaffinity(0)) > 1
            and len(os.listdir("/proc/self/task")) == 1)


class _Child:
    def __init__(self, pid: int, fd: int):
        self.pid, self.fd = pid, fd

    def result(self) -> bytes | None:
        """The child's bytes, or None when it failed. Reads to EOF before reaping: the child may be
        blocked writing to a full pipe."""
        with open(self.fd, "rb", closefd=False) as pipe:
            data = pipe.read()
        _pid, status = os.waitpid(self.pid, 0)
        self.pid = 0
        return data if os.waitstatus_to_exitcode(status) == 0 else None


@contextmanager
def forked(work: Callable[[], bytes]) -> Iterator[_Child]:
    """Runs work() in a forked child; `child.result()` waits for its bytes. Leaving the block without
    the result (an exception in the parent's half) kills and reaps the child, before the caller's read
    transaction can end under it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            gc.disable()  # a collection would write to every tracked object's header: copy-on-write faults
            os.close(r)
            data = work()
            with open(w, "wb") as pipe:
                pipe.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    child = _Child(pid, r)
    try:
        yield child
    finally:
        if child.pid:
            os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
        os.close(r)
