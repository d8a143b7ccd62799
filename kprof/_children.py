"""Child processes (an audit's shards, a run's pool workers, a collective's ranks): spawned, each ending itself once
the process that started it has gone (killed, or ended without waiting) rather than working on for no one. No kprof
imports."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

__all__ = ["watch_parent", "in_processes", "cpus"]


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


def in_processes(work, jobs: int, *args) -> list:
    """work(i, jobs, *args) for each i in range(jobs), each in a spawned process of its own (LMDB handles cannot
    cross a fork) that ends once this one has gone; per i, its result or the exception it raised
    (BrokenProcessPool where a process died: the pool cannot say which one the OS stopped)."""
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=watch_parent)
    try:
        out = []
        for future in [pool.submit(work, i, jobs, *args) for i in range(jobs)]:
            try:
                out.append(future.result())
            except Exception as exc:  # noqa: BLE001 - the caller reports it
                out.append(exc)
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
