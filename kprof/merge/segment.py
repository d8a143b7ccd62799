"""Segments: a self-verifying file of ledger events, the unit remote and pool workers ship back, and the way a
team shares rows without sharing LMDB files.

    magic  b"KPROFSEG"
    header u32 length (big-endian) + msgpack SegmentHeader (format, source ledger id, created at, events)
    events per event: u32 length + the event's canonical bytes (as the ledger stores them), in log order
    footer b"KPROFEND" + blake3 (32 bytes) of every byte before the footer

A segment is written and read as a stream: never held whole in memory. `read` checks the structure and the
footer's digest as it goes, and yields each event's bytes; `runs` yields them in runs of consecutive events, each
with a digest of its bytes (a merge's second pass holds each run to the first's). The file is read and hashed a
block at a time: blake3 hashes a long buffer ~4x faster than the same bytes fed one event at a time. Whoever
consumes the events recomputes ids and keys (see kprof.merge.merge). Any damage (a flipped byte, a cut, events
reordered, trailing bytes) raises SegmentError naming what failed and at which byte: where the structure breaks,
or at the end, where the digest is compared. A consumer that writes nothing before the stream is exhausted writes
nothing from a damaged file.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import time
from contextlib import contextmanager, suppress
from typing import BinaryIO, Iterable, Iterator, NamedTuple

import msgspec
from blake3 import blake3

from .._limits import hit
from .._outdir import new_file
from ..errors import UsageError

__all__ = ["SegmentHeader", "SegmentError", "Run", "FORMAT", "write", "read", "runs", "header_of", "named"]

MAGIC, FOOTER = b"KPROFSEG", b"KPROFEND"
FORMAT = 1
_LEN = 4
_MAX_EVENT = 1 << 26  # 64 MiB: no event comes near; a damaged length past it is named, not allocated
BLOCK = 1 << 20  # bytes read (and hashed) at a time
RUN = 10_000  # events per run of `read`
RUN_BYTES = 1 << 27  # 128 MiB: a run ends early past it (10,000 events of 64 MiB would be held at once, 640 GB)
_length = struct.Struct(">I")
_AGAIN = "copy the file again from where it was written, or export it again from its ledger"  # a damaged one's fix


class SegmentHeader(msgspec.Struct, frozen=True):
    format: int
    ledger_id: str  # the ledger the events were exported from ("" for a worker's fresh segment)
    created_at: float
    events: int


class SegmentError(UsageError):
    """The segment is not a whole, unaltered segment: rejected whole (exit 2), nothing written."""


class Run(NamedTuple):
    """Consecutive events of a segment, as `runs` yields them."""

    events: list[bytes]  # each event's bytes, in order
    digest: bytes  # blake3 of the run's bytes as the file holds them (each event's length, then its bytes)


def write(path: str, events: Iterable[bytes], ledger_id: str = "", count: int | None = None) -> str:
    """Writes the canonical event bytes to a new segment at `path` (refused if it exists), streamed; returns the
    path written. `count`, when known, goes in the header; otherwise the events are counted in a first pass over
    a list.

    `path` an existing directory: the segment is named by its content there, `<first 32 hex digits of its
    digest>.kseg`, so a directory of segments can be committed to git and shared: a name never changes its bytes,
    and a file already there under that name is kept as it is.

    The bytes go to a temporary file of this writer's own beside the target, which takes the segment's name only
    once whole (never over a file another writer placed there meanwhile); a failed or interrupted write leaves
    nothing. A write the disk refuses (full, or past a file size limit) is a UsageError naming why."""
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if directory != path and os.path.lexists(path):
        raise UsageError(f"segment {path} exists; give a new path (segments are never overwritten)")
    if count is None:
        events = list(events)
        count = len(events)
    _drop_killed(directory)
    try:
        fd, tmp = new_file(directory, ".kseg-", ".part")  # its mode as the umask allows, as open() makes one
    except OSError as e:  # a limit (ulimit -n) named as such, else where to write it instead
        raise UsageError(f"cannot write segment {path}: {hit(e)}" if hit(e) else f"cannot write segment {path} "
                         f"({e.strerror or e}); give a path in a writable directory") from None
    with suppress(OSError):  # held while the file is open, till it is placed (see _drop_killed)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with os.fdopen(fd, "wb") as f:
            digest = _stream(f, events, SegmentHeader(FORMAT, ledger_id, time.time(), count))
            target = named(path, digest) if directory == path else path
            try:
                _place(tmp, target)
            except FileExistsError:
                if directory != path:
                    raise UsageError(f"segment {path} exists; give a new path (segments are never overwritten)") \
                        from None
                # that content is there already under its name: kept as it is
        return target
    except OSError as e:
        raise UsageError(f"cannot write segment {path} ({e.strerror or e}); free space on its disk or raise the "
                         f"file size limit, or give another path; nothing was written") from None
    finally:  # (placed by a rename, or, unlocked once closed, removed by another write's _drop_killed meanwhile)
        with suppress(FileNotFoundError):
            os.unlink(tmp)


def _drop_killed(directory: str) -> None:
    """Removes the `.kseg-*.part` files in `directory` that no writer holds: writes killed before their end (SIGKILL,
    Ctrl-\\, the OOM killer), which no cleanup removed. An empty one is let be: a writer locks its file before it
    writes a byte, so an empty unlocked one may be a live writer's, and holds nothing."""
    with suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith(".kseg-") and name.endswith(".part")):
                continue
            part = os.path.join(directory, name)
            with suppress(OSError):
                st = os.lstat(part)  # a regular file only: a pipe's open would wait for a writer
                if stat.S_ISREG(st.st_mode) and st.st_size:
                    with open(part, "rb") as f:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused while its writer lives
                        os.unlink(part)


def _place(tmp: str, target: str) -> None:
    """Gives the whole file `tmp` the name `target`, never over an existing file (FileExistsError)."""
    try:
        os.link(tmp, target)  # atomic, and refuses an existing target
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: checked, then renamed
        if os.path.lexists(target):
            raise FileExistsError(target) from None
        os.replace(tmp, target)


def _stream(f: BinaryIO, events: Iterable[bytes], header: SegmentHeader) -> bytes:
    """Writes a whole segment to `f` and syncs it; returns its digest."""
    digest = blake3()

    def put(data: bytes) -> None:
        f.write(data)
        digest.update(data)

    head = msgspec.msgpack.encode(header)
    put(MAGIC)
    put(len(head).to_bytes(_LEN, "big") + head)
    written = 0
    for data in events:
        put(len(data).to_bytes(_LEN, "big"))
        put(data)
        written += 1
    if written != header.events:
        raise ValueError(f"segment header says {header.events} events, {written} were given")
    f.write(FOOTER + digest.digest())
    f.flush()
    os.fsync(f.fileno())
    return digest.digest()


def named(directory: str, digest: bytes) -> str:
    """Where the segment of this digest lies in a directory of content-named segments."""
    return os.path.join(directory, digest.hex()[:32] + ".kseg")


def _exact(f: BinaryIO, n: int, what: str, at: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise SegmentError(f"truncated at byte {at + len(data)}: {what} needs {n} bytes, {len(data)} remain (the file "
                           f"was cut short); {_AGAIN}")
    return data


def header_of(path: str) -> SegmentHeader:
    """The segment's header, read and decoded (its events and footer are not checked: `read` does that)."""
    with _about(path), _opened(path) as f:
        return _header(f)[0]


@contextmanager
def _about(path: str) -> Iterator[None]:
    """A SegmentError raised inside names the segment file (a merge of several must say which one is damaged)."""
    try:
        yield
    except SegmentError as exc:
        if path in str(exc):
            raise
        raise SegmentError(f"segment {path}: {exc}") from None


def _opened(path: str) -> BinaryIO:
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a pipe without a writer blocked the open for good, and
            raise UsageError(f"segment {path} is not a regular file (a pipe, device or socket): a merge reads each "
                             f"segment twice, checked and then merged; save it to a file and pass its path")
        return open(path, "rb")  # one with a writer (`<(cat x.kseg)`) was empty when read again: "not a segment"
    except OSError as exc:
        raise UsageError(f"cannot read segment {path}: {exc.strerror}; check the path") from None


def _header(f: BinaryIO) -> tuple[SegmentHeader, bytes]:
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        raise SegmentError("not a kprof segment: it does not begin with KPROFSEG; give a .kseg file `kprof export` "
                           "wrote (a ledger is merged by exporting it first)")
    size = int.from_bytes(_exact(f, _LEN, "the header's length", len(MAGIC)), "big")
    if size > 4096:
        raise SegmentError(f"the header's length ({size} bytes) is damaged; {_AGAIN}")
    raw = _exact(f, size, "the header", len(MAGIC) + _LEN)
    try:
        header = msgspec.msgpack.decode(raw, type=SegmentHeader)
    except msgspec.DecodeError as exc:
        raise SegmentError(f"the header does not decode ({exc}); {_AGAIN}") from None
    if header.format != FORMAT:  # every kprof that wrote segments wrote format 1: an older one is damage
        fix = ("a newer kprof wrote it; upgrade kprof to merge it" if header.format > FORMAT else
               "no kprof writes an older one (the header is damaged); export the segment again")
        raise SegmentError(f"segment format {header.format}; this kprof reads format {FORMAT}: {fix}")
    return header, MAGIC + size.to_bytes(_LEN, "big") + raw


def read(path: str, digests: list | None = None) -> Iterator[bytes]:
    """Each event's bytes, in order. The footer's digest is checked at the end: the generator raises
    SegmentError there (or wherever the structure breaks) for a damaged segment, so a consumer must not commit
    anything before it is exhausted. `digests`: the checked digest is appended to it (a second read of the file
    can then be held to the first)."""
    for run in runs(path, RUN, digests):
        yield from run.events


def runs(path: str, size: int, digests: list | None = None) -> Iterator[Run]:
    """The events in runs of `size` >= 1 (the last run of the file may be shorter, and so may one whose events pass
    RUN_BYTES), checked as `read` checks them: the footer's digest at the end, where the generator raises for a
    damaged segment. Each run carries the digest of its own bytes, so a second read can be held to the first run by
    run."""
    with _about(path), _opened(path) as f:
        header, head = _header(f)
        whole = blake3(head)
        reader = _Blocks(f, len(head), whole)
        first = 0
        while first < header.events:
            reader.start_run()
            events, held = [], 0
            for i in range(first, min(first + size, header.events)):
                events.append(reader.event(i))
                held += len(events[-1])
                if held > RUN_BYTES:  # the same cut in every read of the file: a merge's passes find the same runs
                    break
            first += len(events)
            yield Run(events, reader.end_run())
        at = reader.offset
        reader.unhashed()
        footer = reader.take(len(FOOTER) + 32, "the footer")
        if footer[:len(FOOTER)] != FOOTER:
            raise SegmentError(f"no footer at byte {at}: the header says {header.events} events, and the bytes "
                               f"there are not the footer (events added, removed or damaged); {_AGAIN}")
        if footer[len(FOOTER):] != whole.digest():
            raise SegmentError(f"the footer's digest does not match the bytes before it: the segment was altered "
                               f"or damaged; {_AGAIN}")
        if reader.rest():
            raise SegmentError(f"bytes follow the footer at byte {reader.offset} (one segment a file: merge segments "
                               f"joined into one as their own files); {_AGAIN}")
        if digests is not None:
            digests.append(footer[len(FOOTER):])


class _Blocks:
    """A file read BLOCK bytes at a time, taken from in pieces; what is taken is hashed a block at a time into the
    file's digest (`whole`) and into the current run's."""

    def __init__(self, f: BinaryIO, offset: int, whole):
        self.f, self.whole, self.run = f, whole, None
        self.buf, self.pos, self.mark = b"", 0, 0  # the block; the next byte to take; the first not yet hashed
        self.base = offset  # the file offset of buf[0]

    @property
    def offset(self) -> int:
        return self.base + self.pos

    def event(self, i: int) -> bytes:
        """Event i's bytes (its length, then that many bytes)."""
        buf, pos = self.buf, self.pos
        if pos + _LEN <= len(buf):  # the common case, inline: both in this block
            n = _length.unpack_from(buf, pos)[0]
            end = pos + _LEN + n
            if end <= len(buf) and 0 < n <= _MAX_EVENT:
                self.pos = end
                return buf[pos + _LEN:end]
        at = self.offset
        n = _length.unpack(self.take(_LEN, f"the length of event {i}"))[0]
        if n == 0 or n > _MAX_EVENT:
            raise SegmentError(f"event {i} at byte {at}: a length of {n} bytes is damaged; {_AGAIN}")
        return self.take(n, f"event {i}")

    def take(self, n: int, what: str) -> bytes:
        start, end = self.pos, self.pos + n
        if end <= len(self.buf):
            self.pos = end
            return self.buf[start:end]
        return self._straddling(n, what)

    def _straddling(self, n: int, what: str) -> bytes:
        """The rest of this block and the start of the next (no copy of the whole block)."""
        at, rest = self.offset, self.buf[self.pos:]
        self.pos = len(self.buf)
        self._hash()
        more = self.f.read(max(BLOCK, n - len(rest)))
        self.base += len(self.buf)
        self.buf, self.pos, self.mark = more, 0, 0
        if len(rest) + len(more) < n:
            raise SegmentError(f"truncated at byte {at + len(rest) + len(more)}: {what} needs {n} bytes, "
                               f"{len(rest) + len(more)} remain (the file was cut short); {_AGAIN}")
        self.pos = n - len(rest)
        return rest + more[:self.pos]

    def _hash(self) -> None:
        if self.pos > self.mark and self.whole is not None:
            piece = memoryview(self.buf)[self.mark:self.pos]
            self.whole.update(piece)
            if self.run is not None:
                self.run.update(piece)
        self.mark = self.pos

    def start_run(self) -> None:
        self._hash()
        self.run = blake3()

    def end_run(self) -> bytes:
        self._hash()
        digest, self.run = self.run.digest(), None
        return digest

    def unhashed(self) -> None:
        """What is taken from here on is not hashed (the footer, which holds the digest)."""
        self._hash()
        self.whole = None

    def rest(self) -> bool:
        """Whether any byte follows what was taken."""
        return len(self.buf) > self.pos or bool(self.f.read(1))
