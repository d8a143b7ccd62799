"""Child processes (an audit's shards, a run's pool workers, a collective's ranks): spawned, each ending itself once
the process that started it has gone (killed, or ended without waiting) rather than working on for no one. No kprof
imports but its errors, the limits' words and the signals that stop a command."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import signal
import threading
import time
from multiprocessing import resource_tracker

from ._limits import hit
from ._signals import STOPS
from .errors import UsageError

__all__ = ["watch_parent", "in_processes", "Faulted", "cpus"]


def watch_parent(interval_s: float = 0.5, then=lambda: None) -> None:
    """Starts a daemon thread that ends this process (exit status 1) once its parent process has changed, after
    `then()` (what the process must not leave behind); the thread working may be inside a call that never returns."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        then()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kprof-parent-watch").start()


def cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity; all of the machine's where the platform has none)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return frozenset(range(os.cpu_count() or 1))


class Faulted(Exception):
    """A child process ended by a fault reading memory (SIGBUS, SIGSEGV): a mapped file's page it could not read."""


_FAULTS = (signal.SIGBUS, signal.SIGSEGV)
_GROUP = set(STOPS)  # a Ctrl-C, SIGTERM or SIGHUP of the group: the parent handles it, ends its children


def _child(conn, work, i: int, jobs: int, args: tuple) -> None:
    for sig in _GROUP:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP)  # blocked since it started (see in_processes): now ignored
    watch_parent()
    try:
        out = work(i, jobs, *args)
    except Exception as exc:  # noqa: BLE001 - the caller reports it
        out = exc
    try:
        if isinstance(out, Exception):  # one whose class takes other arguments pickles, then fails in the parent
            pickle.loads(pickle.dumps(out))
        conn.send(out)  # (pickled whole before a byte is sent)
    except Exception as exc:  # noqa: BLE001 - it does not pickle: what it was, as text; a limit that pickling ran
        # into (a large result under ulimit -v: MemoryError) as itself, no finding of the work (see in_processes)
        conn.send(exc if hit(exc) else RuntimeError(f"{type(out).__name__}: {out} (it could not be sent back: {exc})"))


def _ended(i: int, jobs: int, code: int) -> UsageError:
    """Why child i ended without its result where no fault did (a limit, a kill): the work did not finish."""
    if code >= 0:
        return UsageError(f"process {i + 1} of {jobs} exited ({code}) before it finished; run it again")
    name = next((s.name for s in signal.Signals if s == -code), f"signal {-code}")  # (SIGRTMIN+1: no member)
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    cpu = soft != resource.RLIM_INFINITY  # a CPU time limit (ulimit -t): SIGXCPU at its soft value, SIGKILL at its hard
    why = {"SIGXCPU": f"the CPU time limit: ulimit -t is {f'{soft} s' if cpu else 'unlimited'}",
           "SIGKILL": "the OOM killer, the job's time limit" + f", or the CPU time limit: ulimit -t is {hard} s" * cpu}
    more = " (or run more processes, --jobs: each does less)" * cpu
    return UsageError(f"process {i + 1} of {jobs} was ended by {name} ({why.get(name, 'a signal sent to it')}) before "
                      f"it finished: nothing is known of its part; raise the limit{more} and run it again")


def in_processes(work, jobs: int, *args, found=lambda out: False) -> list:
    """work(i, jobs, *args) for each i in range(jobs), each in a spawned process of its own (LMDB handles cannot
    cross a fork) that ends once this one has gone; per i, its result or the exception it raised, Faulted where a
    fault ended its process. A process ended otherwise (a CPU time limit, the OOM killer: no finding of the work), or
    one whose work ran into a limit (ulimit -v: a MemoryError; ulimit -n), is a UsageError saying which limit: raised
    where no other raised or `found(result)` something (an audit's damage found elsewhere stands), else in its place."""
    ctx, children = multiprocessing.get_context("spawn"), []
    resource_tracker.ensure_running()  # here: started by the first child's start, it unblocks the signals (below)
    try:
        for i in range(jobs):
            mine, theirs = ctx.Pipe(duplex=False)
            children.append((ctx.Process(target=_child, args=(theirs, work, i, jobs, args), daemon=True), mine))
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP)  # the child's from its start (a Ctrl-C while
            try:  # it starts was a KeyboardInterrupt traceback from it); here one waits the few ms till unblocked
                children[-1][0].start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
        out = []
        for i, (process, mine) in enumerate(children):
            try:
                out.append(mine.recv())
            except EOFError:  # it ended without sending: how says why
                process.join()
                code = process.exitcode
                out.append(Faulted(signal.Signals(-code).name) if -code in _FAULTS else _ended(i, jobs, code))
            if isinstance(out[-1], Exception) and (limit := hit(out[-1])) is not None:  # (MemoryError): no finding
                out[-1] = UsageError(f"process {i + 1} of {jobs} ran into a limit before it finished: {limit}")
        ended, others = [o for o in out if isinstance(o, UsageError)], [o for o in out if not isinstance(o, UsageError)]
        if ended and not any(isinstance(o, Exception) or found(o) for o in others):
            raise ended[0]
        return out
    finally:
        for process, mine in children:
            mine.close()
            if process.is_alive():
                process.kill()
            if process.pid is not None:  # none where its start failed (a limit): the error raised says so
                process.join()
