"""A runner of the pool tests (KPROF_RUNNERS=faulty_runner, with this folder on PYTHONPATH): a spec's `act` says
how its measurement goes. `ok` times a small CPU loop; `slow` first sleeps (runs overlap); `die` SIGKILLs its own
worker while it measures; `hang` never returns; `fail` raises (a failed row); `chatty` writes to stdout, as a
library may (a print, and a write to file descriptor 1, as C code does); `linger` delivers its row, then hangs as the
runner is let go (a teardown that never ends). Table `faulty`, backend `cpu`, and
`faulty_gpu` / `cuda2`: an entry whose every spec needs two GPUs. FAULTY_HANG_START=<file>: a `die` spec makes
the file, and a worker started once it exists hangs in its start (importing this module). FAULTY_GATE=<file>: a
`gate` spec waits (up to 120 s) until the file exists, so a test decides when its row comes."""

import multiprocessing
import os
import signal
import time
from typing import Literal

from kprof.ledger.events import Contract
from kprof.runners._args import KernelArgs, Size
from kprof.runners._case import Case
from kprof.runners.registry import Entry, register


_HANG_START = os.environ.get("FAULTY_HANG_START")
if _HANG_START and multiprocessing.parent_process() is not None and os.path.exists(_HANG_START):
    time.sleep(3600)


class FaultyArgs(KernelArgs, frozen=True):
    n: Size
    act: Literal["ok", "slow", "die", "hang", "fail", "chatty", "linger", "gate"] = "ok"


class Faulty:
    linger = False

    def __del__(self):
        if self.linger:
            time.sleep(3600)

    def build(self, spec: FaultyArgs, device: str) -> Case:
        if spec.act == "linger":
            self.linger = True
            time.sleep(1)
        if spec.act == "die":
            if _HANG_START:
                open(_HANG_START, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.act == "hang":
            time.sleep(3600)
        if spec.act == "slow":
            time.sleep(0.5)
        if spec.act == "gate":
            deadline = time.monotonic() + 120
            while not os.path.exists(os.environ["FAULTY_GATE"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        if spec.act == "chatty":
            print(f"a runner's own print, spec n={spec.n}", flush=True)
            os.write(1, b"a library's own write to fd 1\n")
        if spec.act == "fail":
            raise RuntimeError(f"spec n={spec.n} fails on purpose")

        def fn():
            return sum(range(spec.n))

        def check():
            if fn() != spec.n * (spec.n - 1) // 2:
                raise AssertionError("wrong sum")

        return Case(fn, check, flops=float(spec.n), bytes=0.0, algorithm="python sum")


register(Entry("faulty", "cpu", FaultyArgs, "test", "compute",
               Contract(algorithm="python sum", layout="-", numerics="int", timing="cpu-wall", profiler_revision=1),
               "faulty_runner:Faulty", device="cpu", description="the pool tests' runner"))
register(Entry("faulty_gpu", "cuda2", FaultyArgs, "test", "compute",
               Contract(algorithm="python sum", layout="-", numerics="int", timing="cupti;l2=cold;eager",
                        profiler_revision=1),
               "faulty_runner:Faulty", device="cuda", gpus=2, description="needs two GPUs"))
