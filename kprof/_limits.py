"""The process's resource limits (ulimit -n, ulimit -v): the one an error ran into, named with its value and fix (LMDB's
errors carry only the system's message, so they are matched by its text), and the memory map a ledger may ask for."""

from __future__ import annotations

import errno
import os
import resource


def hit(exc: BaseException | None) -> str | None:
    """The limit `exc` ran into, or the error it was raised while handling (a kprof error wrapping an OSError or
    LMDB's), as one line with its fix; None for any other error."""
    for err in (exc, getattr(exc, "__context__", None)):
        said, code = str(err) or type(err).__name__, getattr(err, "errno", None)
        if code == errno.ENFILE or os.strerror(errno.ENFILE) in said:  # (its text holds EMFILE's: first)
            return f"the system's table of open files is full ({said}); close files elsewhere and run again"
        if code == errno.EMFILE or os.strerror(errno.EMFILE) in said:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            return (f"too many open files ({said}): this process may have {soft} open (ulimit -n {soft}); raise the "
                    f"limit (e.g. ulimit -n 4096) and run again")
        if isinstance(err, MemoryError) or code == errno.ENOMEM or os.strerror(errno.ENOMEM) in said or \
                isinstance(err, ImportError) and "failed to map segment" in said:  # a library (torch) dlopen refused
            soft = resource.getrlimit(resource.RLIMIT_AS)[0]
            if soft == resource.RLIM_INFINITY:
                return f"out of memory ({said}); free memory (end other work) and run again"
            return (f"out of address space ({said}): ulimit -v allows this process {soft // 1024} KiB; raise the "
                    f"limit (ulimit -v unlimited) and run again")
    return None


def map_size(requested: int) -> int:
    """The memory map to open a ledger with: `requested`, within a quarter of the address space ulimit -v allows (the
    rest is the process's own: Python, torch, its threads). LMDB maps at least the pages the file uses, and a write
    that fills the map grows it (see ledger._env)."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return requested if soft == resource.RLIM_INFINITY else min(requested, soft // 4)
