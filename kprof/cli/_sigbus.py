"""One line and exit 3, not a bare `Bus error` (exit 135), where a read of the ledger's mapping faults.

LMDB reads its file through a memory map: a page the file no longer holds (truncated behind a reader's back, a
failing disk) faults with SIGBUS inside LMDB's C code. A handler installed with `signal.signal` cannot help
there: CPython's C-level handler only sets a flag for the interpreter and returns, the faulting load runs again
and faults again, and the process hangs. So the handler is installed at the C level (libc `signal`, through
ctypes): it runs inside the fault, writes one line to stderr and calls `_exit(3)`.

What is guaranteed: a SIGBUS in the main thread of a `kprof` process, while a verb runs, prints the line and exits
3; nothing after the fault runs (no cleanup: LMDB readers need none, and an interrupted write transaction is never
committed). The handler calls back into Python (ctypes takes the GIL the faulting thread holds), which is not
async-signal-safe in general: a fault inside the allocator could deadlock instead. Where ctypes or libc's `signal`
is unavailable, nothing is installed and the default action (exit 135) stays.
"""

from __future__ import annotations

import os
import signal

LINE = b"kprof: the ledger file is damaged (SIGBUS while reading it); run `kprof audit`\n"

_line = [LINE]  # the line as a verb gives it: its `kprof audit` names the --db given, as typed (see kprof.cli.main)
_installed: list = []  # the C callback, kept alive while installed
_said: list = [lambda: (_line[0], b"")]  # what a fault writes, on stderr and on stdout (see `say`)


def _on_sigbus(signum: int) -> None:
    line, out = _said[0]()
    if out:
        os.write(1, out)
    os.write(2, line)
    os._exit(3)


def say(what=lambda: (_line[0], b"")) -> None:
    """Sets what a fault from now on writes: what() gives the line for stderr and what goes to stdout (the audit, whose
    report the fault is: its finding, as a document where --json asks for one); say() puts back the one line."""
    _said[0] = what


def install():
    """Installs the handler; returns a function that puts back the handler it replaced as it was (a no-op where none
    was installed): its whole `struct sigaction`, kept as bytes, flags and mask too. libc `signal` gave back the
    function alone, and put it back without its flags: faulthandler's SA_ONSTACK, a Go runtime's (which refuses a
    handler without it), a handler taking siginfo (SA_SIGINFO) then read garbage."""
    if not hasattr(signal, "SIGBUS"):
        return lambda: None
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        previous = ctypes.create_string_buffer(1024)  # past any libc's struct sigaction (glibc's: 152 bytes)
        if libc.sigaction(signal.SIGBUS, None, previous) != 0:
            return lambda: None
        callback = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_sigbus)
        libc.signal(signal.SIGBUS, ctypes.cast(callback, ctypes.c_void_p))
    except (ImportError, OSError, AttributeError):
        return lambda: None
    _installed.append(callback)

    def restore() -> None:
        libc.sigaction(signal.SIGBUS, previous, None)
        _installed.remove(callback)

    return restore
