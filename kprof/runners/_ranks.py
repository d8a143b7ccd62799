"""Ranks of a collective: a coordinator (in the worker) and world_size rank processes it starts and asks, step by
step, to build, check and time (the recipe is the worker's device: kprof.runners._comm_device).

Ranks are `python -m kprof.runners._rank` processes (a fresh interpreter each, never a fork: the worker may
hold CUDA and LMDB state, and a pool worker, being a daemon, may not have multiprocessing children), each talking
to the coordinator over its own socket pair, each rank r on cuda:r of the worker's CUDA_VISIBLE_DEVICES (nccl) or
on the CPU (gloo, one thread). torch.distributed is initialised from a FileStore in a fresh temporary directory;
nccl ranks add a gloo group for the CPU barrier. Ranks log to files in that directory; a failure quotes the end.

One group lives per process (`group_for`): a spec of another backend or world size shuts it down and starts
another; it is shut down when the process exits (a multiprocessing finalizer, so pool workers too). A rank exits
when the coordinator's socket closes or its parent dies. Nothing waits forever: a group that does not start
within KPROF_RANK_START_S (default 300 s), or a step (a check, a batch) that takes longer than KPROF_RANK_STEP_S
(default 300 s), fails the spec as `timeout`; a rank that dies fails it as `crash`, naming the rank, its exit
code, its log's path and end (the logs of a failed group are kept, in `kprof-rank-logs-*`; the rest is removed); in
both cases the group is killed and the next spec starts a fresh one.

Test hook: `EXIT_RANK_FOR_TESTS`, when set to a rank number, makes that rank exit (code 3) on receiving the next
spec, as a crashed rank would; it is cleared as it is sent (`exit_rank_for_tests`; tests/runners/test_comm.py sets
it in-process).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from multiprocessing import connection, util

from .. import _scratch
from ..errors import KprofError
from ._case import Unsupported, WrongResult
from ..settings import env_seconds

__all__ = ["RankGroup", "RankError", "group_for", "shutdown", "EXIT_RANK_FOR_TESTS", "exit_rank_for_tests"]

EXIT_RANK_FOR_TESTS: int | None = None
START_S = 300.0
STEP_S = 300.0
_TAIL = 1500  # characters of a rank's log quoted in a failure


def start_s() -> float:
    """Seconds the ranks may take to start (KPROF_RANK_START_S)."""
    return env_seconds("KPROF_RANK_START_S", START_S, least=10.0,
                       why="the ranks import torch and initialize torch.distributed first, so no rank would start")


def step_s() -> float:
    """Seconds a rank may take to answer one step (KPROF_RANK_STEP_S)."""
    return env_seconds("KPROF_RANK_STEP_S", STEP_S, least=1.0,
                       why="a step is a batch of collectives and a barrier across the ranks, so every step would "
                           "time out")


class RankError(KprofError):
    """A rank failed, died or did not start: the spec fails, and the group is replaced."""


# --- the coordinator ------------------------------------------------------------------------------------------

class RankGroup:
    """world_size rank processes of one backend, started and initialised (torch.distributed) on construction."""

    def __init__(self, backend: str, world_size: int):
        self.backend, self.n = backend, world_size
        # held while this process lives: where it is killed (the OOM killer), the next group's start removes it
        self.dir, self._release = _scratch.make("kprof-ranks-", f"{backend}{world_size}-")
        self.conns: list[connection.Connection] = []
        self.procs: list[subprocess.Popen] = []
        self.logs = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self.keep_logs = False  # a failure quoted a rank's log: it stays where the message says
        started = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(),
                                                                        os.environ.get("PYTHONPATH")]))}
        try:
            for r in range(world_size):
                mine, theirs = socket.socketpair()
                with open(self.logs[r], "wb") as log:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "kprof.runners._rank", str(theirs.fileno()), str(r), str(world_size),
                         backend, os.path.join(self.dir, "store"), str(step_s())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=env, close_fds=True))
                theirs.close()
                self.conns.append(connection.Connection(mine.detach()))
            self.info = self._gather(start_s(), "start (import torch, init "
                                     f"torch.distributed {backend})", "KPROF_RANK_START_S")
        except BaseException:
            self.close(kill=True)
            raise
        self.start_s = time.perf_counter() - started

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def ask(self, message, what: str) -> list:
        """Sends `message` to every rank and returns their answers in rank order. A rank that answers with an
        error, dies, or is silent past KPROF_RANK_STEP_S raises; the group is then unusable and is killed (but for
        a wrong result: every rank finished the check's collective, so the group goes on)."""
        for r, c in enumerate(self.conns):
            try:
                c.send(message)
            except OSError:
                pass  # a dead rank is reported by _gather, with its exit code and log
        try:
            return self._gather(step_s(), what, "KPROF_RANK_STEP_S")
        except (KeyboardInterrupt, SystemExit):  # answers left in flight would answer the next step: never ask again
            self.close(kill=True)
            raise

    def _gather(self, timeout: float, what: str, knob: str) -> list:
        answers: dict[int, object] = {}
        errors: list[tuple[int, str, str]] = []
        deadline = time.monotonic() + timeout
        waiting = {c: r for r, c in enumerate(self.conns)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(waiting.values())
                tail = self._tail(ranks[0])
                self.close(kill=True)
                raise TimeoutError(f"{self._name(ranks)} of {self.n} did not answer within {timeout:g} s ({what}; {knob} "
                                   f"sets the limit); the rank group was killed{tail}")
            for c in connection.wait(list(waiting), timeout=min(left, 1.0)):
                r = waiting.pop(c)
                try:
                    reply = c.recv()
                except (EOFError, OSError):
                    self._died(r, what)
                if reply[0] == "ok":
                    answers[r] = reply[1]
                elif reply[1] == "WrongResult":  # every rank finished the check's collective: wait for them all
                    errors.append((r, reply[1], reply[2]))
                else:  # the others may wait in a collective for this rank: do not wait for them
                    self._failed(r, reply[1], reply[2], what)
            for c, r in list(waiting.items()):  # a rank can die without closing its socket first (a kill)
                if self.procs[r].poll() is not None and not c.poll():
                    self._died(r, what)
        if errors:
            raise WrongResult(errors[0][2])
        return [answers[r] for r in range(self.n)]

    def _failed(self, r: int, kind: str, text: str, what: str):
        if kind == "Unsupported":
            self.close(kill=True)
            raise Unsupported(f"rank {r}: {text}")
        tail = self._tail(r)
        self.close(kill=True)
        raise RankError(f"rank {r} of {self.n} failed ({what}): {kind}: {text}; the rank group was shut down, and the "
                        f"next spec starts a fresh one{tail}")

    def _died(self, r: int, what: str):
        p = self.procs[r]
        try:
            code = p.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        tail = self._tail(r)
        self.close(kill=True)
        raise RankError(f"rank {r} of {self.n} (pid {p.pid}) exited with code {code} ({what}); the rank group was "
                        f"shut down, and the next spec starts a fresh one{tail}")

    def _name(self, ranks: list[int]) -> str:
        return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"

    def _tail(self, r: int) -> str:
        """The rank's log for a failure's message: its path and its end. The logs are kept (`close` leaves them),
        moved out of the swept scratch directories first, so that the path quoted stays true."""
        if not self.keep_logs:  # the ranks write on through their open logs
            self.keep_logs, self.dir = True, _scratch.keep(self.dir, "kprof-ranks-", "kprof-rank-logs-")
            self.logs = [os.path.join(self.dir, os.path.basename(log)) for log in self.logs]
        try:
            with open(self.logs[r], "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _TAIL))
                text = f.read().decode(errors="replace").strip()
        except OSError as exc:
            return f"; rank {r}'s log {self.logs[r]} cannot be read ({exc.strerror})"
        return f"; rank {r}'s log {self.logs[r]} " + (f"ends: {text}" if text else "is empty")

    def close(self, kill: bool = False) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (0 if kill else 10)
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
        self._release()  # removes the directory, unless _tail moved it out to keep the logs a failure named
        for name in set(os.listdir(self.dir)) - set(map(os.path.basename, self.logs)) if self.keep_logs else ():
            path = os.path.join(self.dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def _package_root() -> str:
    """The directory holding the kprof package, so a rank imports this same kprof."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_group: RankGroup | None = None
_finalizer = None


def group_for(backend: str, world_size: int) -> RankGroup:
    """This process's rank group of (backend, world_size): the running one, or a fresh one (the old one shut down)."""
    global _group, _finalizer
    if _group is not None and (_group.backend, _group.n) == (backend, world_size) and _group.alive():
        return _group
    shutdown()
    _group = RankGroup(backend, world_size)
    if _finalizer is None:  # runs at exit of this process, a multiprocessing child (a pool worker) included
        _finalizer = util.Finalize(None, shutdown, exitpriority=20)
    return _group


def shutdown() -> None:
    """Stops this process's rank group, if any."""
    global _group
    if _group is not None:
        group, _group = _group, None
        group.close(kill=not group.alive())


def exit_rank_for_tests() -> int | None:
    """The test hook's rank (EXIT_RANK_FOR_TESTS), cleared: it is one-shot."""
    global EXIT_RANK_FOR_TESTS
    die, EXIT_RANK_FOR_TESTS = EXIT_RANK_FOR_TESTS, None
    return die
