"""A large lookup on two cores: a helper process answers the tail of a spec list while this process
answers the head, from the same committed state of the ledger.

The helper is a Python process of its own (started afresh, not forked) that opens the same ledger
read-only and lives as long as the ledger is open here, so its memory map and its heap stay warm from one
lookup to the next. A forked child was the first design: it starts with no page-table entries for the map
and shares this process's heap copy-on-write, so it takes a page fault for nearly every page it touches;
on the 2-core VM kprof is sized for a fault costs ~6 µs, and the forked half ran twice as slow as serial
code (the split gained nothing on `missing`). The helper pays its faults once.

One snapshot: a request names this process's read snapshot (the ledger's id, the transaction id, the last
sequence number), and the helper answers only from a read transaction that names the same (the same
committed state of the same file); otherwise it says so, and this process answers the tail itself. The
helper holds no transaction between requests, so it never pins old pages.

Lifecycle: the first lookup large enough to split starts the helper in the background and is answered here
alone; later lookups use the helper once it has said it is ready. It is stopped when the ledger's environment
is released here, and it exits by itself when this process dies (its stdin reaches end of file). A forked
child of this process never talks to its parent's helper.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

import msgspec

from .. import _process

MIN_ITEMS = 40_000  # below this, sending the specs and their answers costs about what half the work saves
# This process's share of a split lookup, per helper op. The helper decodes the request straight into
# canonical shapes, and this process decodes the answer of a get_many and builds every row after it. On the
# 2-core VM, with the key index read (see _index), five alternated rounds of 100,000-spec lookups, fresh specs
# each: `get_many` medians 247k (0.5), 313k (0.45), 277k (0.42), 262k (0.38) specs/s; `missing` 681k (0.5),
# 698k (0.45), 648k (0.55): even within the noise (±20%).
PARENT_SHARE = {"flags": 0.5, "tail": 0.44}
READY = b"R"
OK, MOVED, REFUSED = b"o", b"m", b"r"  # an answer's tag
ANSWER_TIMEOUT_S = 120.0  # a helper silent this long is taken for hung: stopped, and the lookup done here

_encode = msgspec.msgpack.encode


def worth_it(n: int) -> bool:
    """Whether to split n items: enough of them, a second usable core, and pipes `select` can wait on."""
    return n >= MIN_ITEMS and sys.platform != "win32" and _cores() > 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


PIPE_BYTES = 1 << 20  # answers run to megabytes: a larger pipe means fewer switches between the processes


def write_frame(stream, payload: bytes, tag: bytes = b"") -> None:
    """A frame: 8-byte big-endian length of tag + payload, the tag, the payload (written as is: no copy)."""
    for part in ((len(tag) + len(payload)).to_bytes(8, "big") + tag, payload):
        view = memoryview(part)
        while view:  # an unbuffered pipe may take part of a write
            view = view[stream.write(view):]
    stream.flush()


def read_frame(stream) -> memoryview | None:
    """One frame's bytes (read into one buffer, no further copy), or None at end of file or a frame cut short."""
    head = _read_into(stream, bytearray(8))
    return None if head is None else _read_into(stream, bytearray(int.from_bytes(head, "big")))


def _read_into(stream, buf: bytearray) -> memoryview | None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = stream.readinto(view[got:])
        if not n:
            return None
        got += n
    return view


def _widen(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):  # not Linux, or above the system's pipe-max-size
        pass


class Helper:
    """One helper process for one ledger file. Requests are serialized: a lookup that finds the helper busy
    (another thread's lookup) answers alone."""

    def __init__(self, path: str):
        import subprocess  # here, not at import: a CLI verb's start-up does not pay for it

        self.path = path
        self.lock = threading.Lock()
        self.ready = False
        self.broken = False
        self.pending = False  # a request is (being) sent and its answer not wholly read: the pipes are mid-frame
        self.served = 0  # tails answered (tests read it)
        # The helper imports this very kprof, wherever it was imported from here.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", "kprof.ledger._lookup_helper", path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     bufsize=0, close_fds=True, env=env)
        for stream in (self.proc.stdin, self.proc.stdout):
            _widen(stream.fileno())

    def usable(self, wait: float = 0.0) -> bool:
        """Whether the helper has opened the ledger and is alive; never blocks longer than `wait` seconds."""
        if self.ready or self.broken:
            return self.ready and not self.broken
        import select

        if select.select([self.proc.stdout], [], [], wait)[0]:
            if self.proc.stdout.read(1) == READY:
                self.ready = True
            else:  # it exited (the ledger could not be opened there, say)
                self.broken = True
        return self.ready

    def ask(self, request: list) -> bool:
        """Sends a request; False when it could not be sent."""
        try:
            payload = _encode(request)
        except Exception:  # a spec msgpack cannot carry (an object, an int past 64 bits): answered here, where
            return False   # validation names it
        self.pending = True
        try:
            write_frame(self.proc.stdin, payload)
            return True
        except (OSError, ValueError):  # a dead helper
            self.broken = True
            return False

    def answer(self) -> memoryview | None:
        """The answer's bytes; None when the helper refused the request, found another snapshot, or died."""
        import select

        if not select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)[0]:
            self.broken = True
            self.proc.kill()
            return None
        frame = read_frame(self.proc.stdout)
        if frame is None:
            self.broken = True
            return None
        self.pending = False
        if frame[:1] != OK:  # another snapshot there, or refused (the reason follows the tag)
            return None
        self.served += 1
        return frame[1:]

    def abandon(self) -> None:
        """An exchange was cut short (an interrupt while sending or waiting): the pipes are mid-frame, and the
        next request would read this one's answer. The helper is killed; the next lookup starts another."""
        self.broken = True
        self.proc.kill()

    def close(self) -> None:
        """Stops the helper: end of file on its stdin, which an idle helper answers by exiting. One still
        starting (or busy past a timeout) is killed: it holds no transaction between requests, so no
        snapshot is left pinned, and nobody waits for its imports."""
        import subprocess

        self._close_pipes()
        try:
            self.proc.wait(timeout=1 if self.ready else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


_helpers: dict[str, Helper] = {}  # real path of the ledger file -> its helper
_never: set[str] = set()  # files whose helper died before it was ready: not started again by this process
_inherited: list[Helper] = []  # a forked child keeps its parent's helpers referenced, and never uses them
_lock = threading.Lock()


def helper_for(path: str, wait: float = 0.0) -> Helper | None:
    """The ready helper for a ledger file; starts one (and returns None) where there is none yet. A helper
    that died after it was ready (killed, say) is replaced; one that never got ready is not retried."""
    real = os.path.realpath(path)
    with _lock:
        helper = _helpers.get(real)
        if helper is not None and helper.broken:
            del _helpers[real]
            if not helper.ready:
                _never.add(real)
            helper.close()
            helper = None
        if helper is None:
            if _process.one_shot or real in _never:  # a CLI verb: a helper would start after its only lookup
                return None
            helper = _helpers[real] = Helper(real)
        usable = helper.usable(wait)  # under the lock: only one thread reads the ready byte
    return helper if usable else None


def stop(path: str) -> None:
    """Stops the helper of a ledger file, if there is one (the ledger's environment was released)."""
    with _lock:
        helper = _helpers.pop(os.path.realpath(path), None)
    if helper is not None:
        helper.close()


def stop_all() -> None:
    for real in list(_helpers):
        stop(real)


def _forget_after_fork() -> None:
    """In a forked child: the parent's helpers are not this process's. Its copies of their pipes are closed
    (so a helper still sees end of file when the parent dies), the objects kept, never used nor reaped."""
    for helper in _helpers.values():
        helper._close_pipes()
    _inherited.extend(_helpers.values())
    _helpers.clear()


atexit.register(stop_all)
os.register_at_fork(after_in_child=_forget_after_fork)


def split(path: str, items: list, head, request: list, charge=None) -> tuple[Any, bytes] | None:
    """(head(first part of `items`), the helper's answer for the rest), or None: answer them all here (no
    helper ready yet, the helper busy or dead, another snapshot there, or the request refused, e.g. for an
    invalid spec, which the caller then names by its index). `request` is the helper's request without its
    specs. `charge(n)`, if given, is told how many items the helper was sent. If head raises, the helper's
    answer is read and dropped before the error leaves, so the next request pairs with its own answer; if
    anything cuts the exchange itself short (Ctrl-C while the request is sent or the answer read), the helper
    is abandoned, never asked again."""
    helper = helper_for(path)
    if helper is None or not helper.lock.acquire(blocking=False):
        return None
    try:
        cut = int(len(items) * PARENT_SHARE[request[0]])
        if not helper.ask([*request, items[cut:]]):
            return None
        if charge is not None:
            charge(len(items) - cut)
        try:
            mine = head(items[:cut])
        finally:
            tail = helper.answer()
        return None if tail is None else (mine, tail)
    finally:
        if helper.pending:
            helper.abandon()
        helper.lock.release()
