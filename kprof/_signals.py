"""Ctrl-C (SIGINT), SIGTERM and SIGHUP held while a block runs, then handled as they would have been. No kprof
imports."""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["STOPS", "held"]

# What stops a command from outside, each handled alike (what was being written cleaned up, one line, the process then
# ended by it): Ctrl-C, `timeout` or `kill`, and SIGHUP, which a dropped ssh session or a closed terminal sends
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def held():
    """Runs the block with the STOPS recorded, not acted on; at its end, the first one recorded is handled as
    it would have been. For a block that must not be cut (a remote chunk's merge and its record, which an interrupt
    between left a merged chunk in remote-run.json as `returned`), or that cannot take a Python exception (torch's
    import, whose C++ calls back into Python: a KeyboardInterrupt raised there ended the process in `terminate
    called after throwing ... pybind11::error_already_set`, SIGABRT). Signals reach the main thread only; in another,
    the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []
    # None: a handler not set from Python, which Python cannot put back; SIG_IGN (nohup's SIGHUP): nothing to hold,
    # and one recorded first was the one handled, dropping a SIGTERM after it. Each left as it is
    handlers = {s: h for s in STOPS if (h := signal.getsignal(s)) not in (None, signal.SIG_IGN)}
    for s in handlers:
        signal.signal(s, lambda signum, _frame: seen.append(signum))
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for signum in seen[:1]:
            if callable(handlers[signum]):
                handlers[signum](signum, None)
            elif handlers[signum] == signal.SIG_DFL:
                signal.raise_signal(signum)
