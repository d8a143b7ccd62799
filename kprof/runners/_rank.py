"""A rank of a collective: the process `kprof.runners._ranks.RankGroup` starts as `python -m kprof.runners._rank`.

It initialises torch.distributed (gloo, or nccl on cuda:<rank> plus a gloo group for the CPU barrier) from the
coordinator's FileStore, then answers the coordinator's messages over its socket: a spec (build its buffers and
check the collective against the closed form), a batch of k timed iterations (its k times), done. It exits when
the coordinator's socket closes or its parent dies. See kprof.runners._comm_device for the recipe.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing import connection

import msgspec

from .._children import watch_parent
from ._case import Unsupported


class _Timed:
    """One spec on this rank: its buffers (checked once), and batches of timed iterations."""

    def __init__(self, torch, table: str, spec, rank: int, device, timer: str, cold: bool, barrier):
        from .comm import rank_buffers

        self.torch, self.timer, self.barrier = torch, timer, barrier
        self.cuda = device.type == "cuda"
        self.buffers = rank_buffers(table, spec, rank, device)
        self.sweep = None
        if cold:
            from ..measure._l2 import flusher

            self.sweep = flusher(rank)[0]
        self.session = None
        if timer == "cupti":
            from ..measure import _cupti

            self.session = _cupti.Session().__enter__()
        self.table, self.n = table, spec.world_size
        try:
            self.buffers.check()  # the oracle, before anything is timed
        except BaseException:
            self.close()
            raise

    def batch(self, k: int) -> list[float]:
        torch, op, reset = self.torch, self.buffers.op, self.buffers.reset
        times, windows = [], []
        for _ in range(k):
            if self.sweep is not None:
                self.sweep()  # evict L2 (a read sweep leaves clean lines) ...
            reset()  # ... then the input, just written by its producer as in a model
            if self.cuda:
                torch.cuda.synchronize()
            self.barrier()
            if not self.cuda:
                t0 = time.perf_counter_ns()
                op()
                times.append((time.perf_counter_ns() - t0) / 1e6)
            elif self.session is None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                op()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = self.session.timestamp()
                op()
                torch.cuda.synchronize()
                windows.append((t0, self.session.timestamp()))
        if self.session is not None:
            from ..measure._attribution import by_window, kernel_time_ms

            kernels, _ = self.session.collect()
            for group in by_window(kernels, windows):
                if not group:
                    raise Unsupported(f"{self.table} at world_size {self.n} launched no GPU work between its CUPTI "
                                      f"timestamps (NCCL does nothing for an in-place collective on one rank); "
                                      f"time world_size >= 2")
                times.append(kernel_time_ms(group))
        return times

    def close(self) -> None:
        if self.session is not None:
            self.session.__exit__(None, None, None)
            self.session = None
        self.buffers = self.sweep = None
        if self.cuda:
            self.torch.cuda.empty_cache()


def _uuid(rank: int, props) -> str:
    """The GPU's UUID as NVML spells it ("GPU-..."), from NVML where it answers, else from torch."""
    try:
        from ..measure._nvml_access import _nvml
        from ..measure.nvml import device_handle

        return str(_nvml().nvmlDeviceGetUUID(device_handle(rank)))
    except Exception:  # noqa: BLE001 - torch's copy of the same UUID
        text = str(getattr(props, "uuid", ""))
        return text if not text or text.startswith("GPU-") else f"GPU-{text}"


class _import_lane:
    """At most one torch import per CPU core at a time: world_size interpreters importing torch at once on a small
    host thrash (one import takes 3 s on a 2-core VM; 8 at once took 27-31 s to start there, busy with other work,
    and 22-29 s in lanes)."""

    def __init__(self, where: str, rank: int):
        self.path = os.path.join(where, f"import-lane{rank % (os.cpu_count() or 1)}.lock")

    def __enter__(self):
        import fcntl

        self.f = open(self.path, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        self.f.close()  # releases the lock


def _rank_main(fd: int, rank: int, world: int, backend: str, store: str, timeout_s: float) -> None:
    watch_parent(1.0)  # the coordinator gone (its socket may be held open by a collective that hangs): exit
    conn = connection.Connection(fd)
    try:
        import datetime
        import warnings

        warnings.simplefilter("ignore", FutureWarning)  # torch renames collectives; comm.py picks the new name
        with _import_lane(os.path.dirname(store), rank):
            import torch
            import torch.distributed as dist

        from .comm import COLLECTIVES

        info = {"rank": rank, "pid": os.getpid(), "torch": str(torch.__version__),
                "calls": {t: "torch.distributed." + next(n for n in c.calls if hasattr(dist, n))
                          for t, c in COLLECTIVES.items()}}
        kw = {}
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            props = torch.cuda.get_device_properties(device)
            v = torch.cuda.nccl.version()
            info.update(name=props.name, uuid=_uuid(rank, props),
                        nccl=".".join(map(str, v)) if isinstance(v, tuple) else str(v))
            kw["device_id"] = device
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)  # world_size processes share the host's cores
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kw)
        cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
        barrier = lambda: dist.barrier(group=cpu_group)  # noqa: E731
    except Exception as e:  # noqa: BLE001 - the coordinator reports it
        conn.send(("error", type(e).__name__, str(e)[:2000]))
        return
    conn.send(("ok", info))
    timed = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        try:
            if message[0] == "spec":
                _, table, raw, timer, cold, die = message
                if die == rank:
                    os._exit(3)  # the test hook: a rank that crashes
                from .comm import COLLECTIVES

                if timed is not None:
                    timed.close()
                timed = None
                spec = msgspec.convert(raw, COLLECTIVES[table].args)
                timed = _Timed(torch, table, spec, rank, device, timer, cold, barrier)
                conn.send(("ok", None))
            elif message[0] == "batch":
                conn.send(("ok", timed.batch(message[1])))
            elif message[0] == "done":
                if timed is not None:
                    timed.close()
                timed = None
                conn.send(("ok", None))
        except Exception as e:  # noqa: BLE001 - the coordinator decides what the spec's failure is
            conn.send(("error", type(e).__name__, str(e)[:2000]))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


if __name__ == "__main__":
    fd_, rank_, world_, backend_, store_, timeout_ = sys.argv[1:7]
    _rank_main(int(fd_), int(rank_), int(world_), backend_, store_, float(timeout_))
