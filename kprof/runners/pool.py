"""The local pool: the usable devices of this host (kprof.runners.devices) measure a run's specs, one spawned
worker each.

How (`Pool`): each worker is a process started with the spawn method (never forked from a process holding CUDA
or LMDB state) that sees only its device (CUDA_VISIBLE_DEVICES set to the GPU's UUID before torch is imported),
prepares it once, then measures the specs it is handed one at a time, writing each event as a one-event
segment and sending its path back. The parent merges each segment as it arrives (a kill keeps everything
finished), and hands the worker its next spec. A worker that dies fails only its in-flight spec (error kind
`crash`, with its exit code) and a fresh worker takes the device over, as it does after a spec that left the device
unusable (a sticky CUDA error: `kprof.runners.worker._recover`); one that runs a spec past
KPROF_SPEC_TIMEOUT_S (default 900 s) is killed and that spec fails as `timeout`. A device whose workers die
MAX_RESTARTS + 1 times in a row is given up, and so is one whose worker (a fresh one too) does not start within
KPROF_WORKER_START_S; the specs left when no device remains fail as `crash`. A worker whose run
is killed (SIGKILL: no cleanup runs) ends itself, even inside a spec that hangs.

"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import uuid
from multiprocessing.connection import wait
from typing import Callable, Iterator, NamedTuple

import msgspec

from .. import _scratch
from .._children import watch_parent
from .._limits import hit
from ..errors import SettingError, UsageError
from ..ledger._codec import event_decoder
from ..ledger.events import Environment, Event, Origin
from ..settings import env_seconds
from .chunk import Chunk
from .devices import Device
from .registry import Entry

__all__ = ["Pool", "Result"]

MAX_RESTARTS = 3
SPEC_TIMEOUT_S = 900.0
START_TIMEOUT_S = 600.0  # a worker's import of torch, CUDA context and first-use wake
LEAST_SPEC_S, LEAST_START_S = 1.0, 10.0  # less is refused: no spec, no worker start, could fit in it


class Result(NamedTuple):
    """One finished spec: its event (measured or failed), and the one-event segment holding it (None for an
    event made here: a worker that died or hung)."""

    index: int
    event: Event
    segment: str | None
    seconds: float
    timed_seconds: float
    device: str


# --- the worker process -----------------------------------------------------------------------------------

def _worker_main(conn, visible: str | None, table: str, backend: str, contract: bytes, gpu_key: str,
                 spool: str) -> None:
    """A spawned worker: sees only its device, prepares it, then measures what it is sent until told to stop. Ctrl-C
    reaches the whole process group: the parent handles it and stops its workers, so a worker ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unsent: list[str] = []  # the segment written and not yet sent to the parent
    writing = threading.Lock()  # held while a segment is written: the watch below ends the process between writes
    # A run killed away (SIGKILL, the OOM killer) while this worker is inside a spec that hangs, or runs for minutes:
    # the pipe says so only at its next use, so the worker would hold its device, orphaned, for as long as the spec took
    watch_parent(then=lambda: _leave(spool, unsent, writing))
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before anything imports torch
    from ..ledger.events import Contract
    from ..merge import segment
    from .chunk import measure_chunk
    from .worker import _record, prepare_device

    try:
        from .registry import lookup

        entry = msgspec.structs.replace(lookup(table, backend),
                                        contract=msgspec.msgpack.decode(contract, type=Contract))
        device = prepare_device(entry, gpu_key)
    except Exception as exc:  # noqa: BLE001 - a device that cannot measure says why, and the parent decides
        if (limit := hit(exc)) is not None:  # a process limit (ulimit -v: torch's libraries not mapped), named so
            exc = UsageError(limit)
        conn.send(("refused", type(exc).__name__, str(exc), getattr(exc, "cli", str(exc))))  # a SettingError's 2 ways
        return
    try:
        conn.send(("ready", msgspec.msgpack.encode(_record(Environment, device.env))))
        while (message := conn.recv()) is not None:
            chunk = Chunk.decode(message)
            for outcome, data in measure_chunk(chunk, device):
                with writing:  # a file named in the spool: where another worker ended removed it, the write fails
                    unsent.append(segment.write(os.path.join(spool, f"{uuid.uuid4().hex}.kseg"), [data],
                                                chunk.origin.ledger_id, 1))
                conn.send(("event", outcome.index, unsent[0], data, outcome.seconds, outcome.timed_seconds))
                unsent.clear()
            if getattr(device, "lost", None):  # a failure left the device unusable: a fresh worker takes it over
                return
            conn.send(("idle",))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent is gone (killed): end without a traceback
        _leave(spool, unsent)
    except UsageError:
        if os.path.isdir(spool):  # a segment the disk refused: the parent names the worker's death
            raise
        _leave(spool, unsent)  # the spool is gone: the run was killed and another of its workers ended first


def _leave(spool: str, unsent: list[str], writing: threading.Lock | None = None) -> None:
    """A worker's end without its parent: no segment that nothing will merge, and the last one out removes the spool
    (what is left there, the next pool sweeps: kprof._scratch). A segment being written lands first (`writing`; a
    write that hangs is waited for 10 s), so neither it nor its temporary file outlives the worker."""
    if writing is not None:
        writing.acquire(timeout=10)
    with contextlib.suppress(OSError):
        for path in unsent:
            os.unlink(path)
        os.rmdir(spool)


class _Worker:
    def __init__(self, ctx, device: Device, args: tuple):
        self.device = device
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, device.visible, *args),
                                   name=f"kprof-worker-{device.label}", daemon=True)
        self.process.start()
        child.close()
        self.state = "starting"  # starting -> ready -> busy -> ready ... | refused | dead
        self.env = Environment()
        self.item: tuple | None = None  # (index, spec, parent) in flight
        self.since = time.monotonic()
        self.refusal: tuple[str, str, str] | None = None  # (type, message, its words for the verbs)

    def send(self, chunk: Chunk, item) -> None:
        self.item, self.state, self.since = item, "busy", time.monotonic()
        self.conn.send(chunk.encode())

    def stop(self, kill: bool = False) -> None:
        if self.process.is_alive():
            if kill:
                self.process.kill()
            else:
                try:
                    self.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                self.process.join(10)
                if self.process.is_alive():
                    self.process.kill()
        self.process.join(10)
        self.conn.close()


def timeouts() -> tuple[float, float]:
    """(seconds a spec may take, seconds a worker may take to start): KPROF_SPEC_TIMEOUT_S, KPROF_WORKER_START_S."""
    return (env_seconds("KPROF_SPEC_TIMEOUT_S", SPEC_TIMEOUT_S, least=LEAST_SPEC_S,
                        why="a spec's build, check and timing take longer, so every spec would time out"),
            env_seconds("KPROF_WORKER_START_S", START_TIMEOUT_S, least=LEAST_START_S,
                        why="a worker imports torch and prepares its device first, so no worker would start"))


class Pool:
    """Spawned workers on `devices`, one each, for one (entry, GPU key); a context manager.

    Entering starts them all and waits until each has prepared its device: a device that cannot measure (no GPU,
    another GPU, an environment that does not match) is dropped, and if none can, its reason is raised as a
    UsageError before the caller has touched the ledger."""

    def __init__(self, entry: Entry, gpu_key: str, devices: list[Device]):
        self.entry, self.gpu_key, self.devices = entry, gpu_key, list(devices)
        self._ctx = multiprocessing.get_context("spawn")
        # held by this process while it lives: a spool its run was killed away from (SIGKILL) the next pool removes
        self._spool, self._remove_spool = _scratch.make("kprof-pool-")
        self._args = (entry.table, entry.backend, msgspec.msgpack.encode(entry.contract), gpu_key, self._spool)
        self.workers: list[_Worker] = []
        self.dropped: list[dict] = []  # devices given up: {device, why}
        self.spec_timeout_s, self.start_timeout_s = timeouts()
        self._restarts: dict[str, int] = {}

    def __enter__(self) -> "Pool":
        try:
            self.workers = [_Worker(self._ctx, d, self._args) for d in self.devices]
            deadline = time.monotonic() + self.start_timeout_s
            while any(w.state == "starting" for w in self.workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    for w in self.workers:
                        if w.state == "starting":
                            self._drop(w, self._late)
                    break
                self._poll(left, on_event=None)
            if not any(w.state == "ready" for w in self.workers):
                raise self._refused()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None)

    def close(self, kill: bool = False) -> None:
        """Stops the workers: an idle one, or one whose spec's event came, is told to end (waited for up to 10 s); one
        inside a spec or still starting, or every one with `kill` (an interrupt, or an error, is in flight: a second
        Ctrl-C would find them waited for), is killed."""
        try:
            # one still starting has measured nothing: not waited for (an interrupt in start); nor is one inside a spec.
            # One whose last spec's event came (its item done) is only about to say idle: asked to stop, it ends itself
            # and what it holds (a collective's ranks and their directory), which a kill left behind.
            for w in self.workers:
                w.stop(kill=kill or w.state == "starting" or (w.state == "busy" and w.item is not None))
        finally:  # an interrupt while a worker is waited for (up to 10 s) too: the spool went with the run's end
            for w in self.workers:  # and the workers not yet stopped are killed, not left to the interpreter's exit
                with contextlib.suppress(OSError, ValueError):
                    w.process.kill()
            self.workers = []
            self._remove_spool()

    def _refused(self) -> UsageError:
        """Why no worker could prepare its device: the refusal itself where each gave the same one (a SettingError
        worded for the verbs too: KPROF_PROFILE_GPUS naming GPUs of another model than the key), else each device's
        reason."""
        first = next((w.refusal for w in self.workers if w.refusal), None)
        if first and first[0] in ("UsageError", "SettingError") and all(w.refusal == first for w in self.workers):
            return SettingError(first[1], first[2]) if first[0] == "SettingError" else UsageError(first[1])
        reasons = "; ".join(f"{d['device']}: {d['why']}" for d in self.dropped)
        return UsageError(f"no worker could prepare its device ({reasons})")

    @property
    def _late(self) -> str:
        return f"did not start within {self.start_timeout_s:g} s (KPROF_WORKER_START_S)"

    def _drop(self, w: _Worker, why: str) -> None:
        w.state = "dead"
        self.dropped.append({"device": w.device.label, "why": why})
        w.stop(kill=True)

    def _poll(self, timeout: float, on_event) -> None:
        """Waits up to `timeout` for messages and deaths, and handles them (events through on_event)."""
        live = [w for w in self.workers if w.state in ("starting", "ready", "busy")]
        if not live:
            return
        by_conn = {w.conn: w for w in live}
        by_sentinel = {w.process.sentinel: w for w in live}
        for ready in wait(list(by_conn) + list(by_sentinel), timeout=max(timeout, 0)):
            w = by_conn.get(ready)
            if w is not None:
                try:
                    while w.conn.poll():
                        self._message(w, w.conn.recv(), on_event)
                except (EOFError, OSError):
                    pass
                continue
            w = by_sentinel[ready]
            try:
                while w.conn.poll():  # what it sent before it ended counts
                    self._message(w, w.conn.recv(), on_event)
            except (EOFError, OSError):
                pass
            if w.state in ("starting", "ready", "busy"):
                self._died(w, on_event)

    def _message(self, w: _Worker, message: tuple, on_event) -> None:
        kind = message[0]
        if kind == "ready":
            w.state = "ready"
            w.env = msgspec.msgpack.decode(message[1], type=Environment)
        elif kind == "refused":
            w.refusal = (message[1], message[2], message[3])
            self._drop(w, f"{message[1]}: {message[2]}")
        elif kind == "event":
            _, index, path, data, seconds, timed = message
            on_event(w, index, path, seconds, timed, data=data)
        elif kind == "idle":
            w.state, w.item = "ready", None

    def _died(self, w: _Worker, on_event) -> None:
        w.process.join(5)  # its sentinel is ready: it has ended, and join reaps it for its exit code
        code = w.process.exitcode
        item = w.item
        w.state = "dead"
        w.stop(kill=True)
        replaced = self._replace(w, f"died (exit code {code})")
        if item is not None:
            rest = ("the rest of its share went to a fresh worker" if replaced else
                    f"{w.device.label} was given up ({self.dropped[-1]['why']})")
            on_event(w, item[0], None, time.monotonic() - w.since, 0.0,
                     failure=("crash", f"the worker on {w.device.label} died (exit code {code}) while measuring this "
                                       f"spec; {rest}"))

    def _replace(self, w: _Worker, why: str) -> bool:
        """Starts a fresh worker on w's device, or gives the device up (False) after MAX_RESTARTS in a row."""
        label = w.device.label
        self._restarts[label] = self._restarts.get(label, 0) + 1
        i = self.workers.index(w)
        if self._restarts[label] > MAX_RESTARTS:
            self.dropped.append({"device": label, "why": f"its worker {why} {MAX_RESTARTS + 1} times in a row"})
            return False
        self.workers[i] = _Worker(self._ctx, w.device, self._args)
        return True

    def measure(self, items: list[tuple[int, dict, bytes | None]], origin: Origin, failed_event: Callable,
                watch: Callable[[str, dict | None], None] | None = None,
                wanted: Callable[[int], bool] | None = None) -> Iterator[Result]:
        """Measures `items` ((index, canonical spec, parent event id)) across the workers, yielding each Result as
        it arrives. `failed_event(index, kind, message, environment)` makes the event of a spec whose worker died
        or hung; `wanted(index)`, asked as an item is sent, False skips it (no Result)."""
        queue = list(reversed(items))
        done: list[Result] = []
        outstanding = len(items)

        def on_event(w, index, path, seconds, timed, failure=None, data=None):
            nonlocal outstanding
            if failure is not None:
                event, path = failed_event(index, failure[0], failure[1], w.env), None
            else:  # the event as the worker sent it (its segment, which the caller merges, is checked there)
                event = event_decoder.decode(data)
                if w.item is not None and w.item[0] == index:
                    w.item, w.since = None, time.monotonic()  # its end of the spec (until "idle"): bounded anew
                self._restarts[w.device.label] = 0  # a worker that delivers resets its device's count
            done.append(Result(index, event, path, seconds, timed, w.device.label))
            outstanding -= 1
            if watch:
                watch(w.device.label, None)

        while outstanding:
            for w in self.workers:
                item = None
                while w.state == "ready" and w.item is None and queue and item is None:
                    item = queue.pop()
                    if wanted is not None and not wanted(item[0]):  # another writer stored its row meanwhile
                        item, outstanding = None, outstanding - 1
                if item is not None:
                    chunk = Chunk(self.entry.table, self.entry.backend, self.entry.contract, self.gpu_key,
                                  [item[1]], [item[2]], origin, item[0])
                    w.send(chunk, item)
                    if watch:
                        watch(w.device.label, item[1])
            if not any(w.state in ("starting", "ready", "busy") for w in self.workers):
                # every device given up: what is left fails, and what finished is kept
                reasons = "; ".join(f"{d['device']}: {d['why']}" for d in self.dropped)
                while queue:
                    index, _spec, _parent = queue.pop()
                    done.append(Result(index, failed_event(index, "crash", f"no worker left to measure it ({reasons})",
                                                           Environment()), None, 0.0, 0.0, ""))
                    outstanding -= 1
            else:
                now = time.monotonic()
                for w in self.workers:
                    if w.state == "starting" and now - w.since > self.start_timeout_s:  # a fresh worker, hung
                        self._drop(w, self._late)
                    if w.state == "busy" and now - w.since > self.spec_timeout_s:
                        item = w.item  # None: its spec's result came, and the worker hung in what follows it
                        w.state = "dead"
                        w.stop(kill=True)
                        if item is not None:
                            on_event(w, item[0], None, now - w.since, 0.0,
                                     failure=("timeout", f"no result within {self.spec_timeout_s:g} s "
                                                         f"(KPROF_SPEC_TIMEOUT_S); the worker on {w.device.label} was "
                                                         f"killed"))
                        self._replace(w, "hung")
                self._poll(0.5 if self.spec_timeout_s > 0.5 else self.spec_timeout_s / 2, on_event)
            while done:
                yield done.pop(0)
