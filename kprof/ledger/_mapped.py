"""What a reading process keeps mapped of the ledger file: the pages of the trees its lookups read.

LMDB reads through one shared, read-only mapping of the whole file. A lookup faults in the pages its B-tree walk
reads, and with each fault the kernel maps the page cache's pages around it: 16 pages (fault-around), or a whole
large folio where the file was cached by a sequential read (~140 KiB a fault, measured on a 6.18 kernel; LMDB's
MADV_RANDOM does not stop either). Appends interleave the trees page by page, so most of those neighbours belong
to trees a lookup never reads (events, log, scope index). On a 1M-event ledger cached whole, a reader's first
100,000-key lookup mapped 745 MiB of the file and a few more 970 MiB, where the two trees lookups read (`current`,
`history`) take ~420 MiB. Mapped page-cache pages are shared and reclaimable, but they count in the process's
resident set (RSS), which is what a user's monitor and a container's accounting of the process show.

So a long-lived reader trims its mapping: at the end of a read transaction, once it has looked up CHECK_EVERY
keys or more since the last check, it reads its RssFile (one line of /proc/self/status), and when that grew by
more than SLACK since the last trim, it
drops its mappings of every page of the file outside those two trees (madvise MADV_DONTNEED: on a shared read-only
file mapping it only unmaps; the pages stay in the page cache, and a later read maps them again with a minor
fault). The trees' pages stay mapped, so a reader in its steady state faults, and trims, no more. Which pages are
the trees' is read from the transaction's snapshot: the main database's records give each tree's root and depth,
and the branch pages (~1.5% of a tree) give the leaves, read with pread so the walk itself maps nothing. Only the
pages that are mapped now (bit 63 of /proc/self/pagemap) are advised, in runs.

It is an economy, never a matter of correctness: a page unmapped wrongly (a tree a writer has changed since) is
mapped again when read. A CLI verb (one lookup, then exit) never trims, nor does a system without /proc or madvise.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import threading

CHECK_EVERY = 4096  # keys looked up (through LMDB) before the process's RssFile is read again
SLACK = 128 << 20  # mapped-file growth (bytes) since the last trim that makes the next check trim
KEEP = (b"current", b"history")  # the trees bulk lookups read (views and the key index); main is kept too
MADV_DONTNEED = 4
_DUPSORT = 0x04
_PRESENT = 1 << 63  # a pagemap entry's "page present" bit


@functools.cache
def madvise():
    """libc's madvise, or None. Looked up at the first trim, not at import, in the process's own symbols: at
    import, ctypes and a library search (find_library) had cost every CLI verb, which never trims, ~40 ms."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def rss_file() -> int | None:
    """This process's resident file-backed memory (bytes), or None where /proc does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def mappings(path: str) -> list[tuple[int, int]]:
    """(start address, length) of each shared read-only mapping of this file from its start (LMDB's)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) < 6 or fields[4] != str(st.st_ino) or fields[3] != dev:
                continue
            perms, offset = fields[1], int(fields[2], 16)
            if perms[0] == "r" and perms[1] == "-" and perms[3] == "s" and offset == 0:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end - start))
    return out


def tree_pages(fd: int, psize: int, record: bytes, npages: int):
    """The page numbers (numpy int64) of one tree, its branch pages read with pread, its leaves named by them
    (not read). Pages outside the file are left out (a damaged file: the audit names it). The layout read is
    _pages' (LMDB 0.9's)."""
    import numpy as np

    from ._pages import DB_RECORD, HEADER

    _pad, flags, depth, _b, _l, _o, _n, root = DB_RECORD.unpack(record)
    if flags & _DUPSORT or not depth or root >= npages:
        return np.zeros(0, np.int64)
    level = np.array([root], np.int64)
    levels = [level]
    for _ in range(depth - 1):  # the levels above the leaves are branch pages
        buf = b"".join([os.pread(fd, psize, p * psize) for p in level.tolist()])
        if len(buf) != psize * len(level):
            break
        words = np.frombuffer(buf, "<u2").reshape(len(level), psize // 2).astype(np.int64)
        count = np.clip((words[:, 6] - HEADER) // 2, 0, (psize - HEADER) // 2)  # `lower` gives the node count
        page = np.repeat(np.arange(len(level)), count)
        nth = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        at = words[page, HEADER // 2 + nth] // 2  # each node's offset in its page, in words
        ok = (at >= HEADER // 2) & (at + 2 < psize // 2)
        page, at = page[ok], at[ok]
        child = words[page, at] | (words[page, at + 1] << 16) | (words[page, at + 2] << 32)
        level = child[(child >= 2) & (child < npages)]
        levels.append(level)
    return np.concatenate(levels)


def _main_record(fd: int, psize: int, txn_id: int) -> bytes | None:
    """The main database's record (it names the others) in the meta page of this snapshot, or of the newer."""
    from ._pages import DB_RECORD, META_DBS

    main, txn_at = META_DBS + DB_RECORD.size, META_DBS + 2 * DB_RECORD.size + 8  # after free list; last page
    metas = [os.pread(fd, txn_at + 8, i * psize) for i in (0, 1)]
    if any(len(m) < txn_at + 8 for m in metas):
        return None
    txns = [struct.unpack_from("<Q", m, txn_at)[0] for m in metas]
    meta = metas[txns.index(txn_id)] if txn_id in txns else metas[txns.index(max(txns))]
    return meta[main:main + DB_RECORD.size]


def _present(start: int, npages: int):
    """Which of the npages pages from `start` are mapped in this process (numpy bool), or None."""
    import numpy as np

    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), 8 * npages, 8 * (start // mmap.PAGESIZE))
    except OSError:
        return None
    if len(raw) != 8 * npages:
        return None
    return (np.frombuffer(raw, "<u8") & np.uint64(_PRESENT)) != 0


class Mapped:
    """One ledger object's trimming (see the module docstring). Thread-safe: a thread that finds another
    trimming leaves it to that one."""

    def __init__(self, ledger):
        self.ledger = ledger
        self.pending = 0  # keys looked up since the last check
        self.trims = 0  # trims made (tests and the benchmark read it)
        self.error: str | None = None  # why trimming was turned off, where a trim failed
        self.baseline = rss_file()  # RssFile after the last trim (or at opening); None without /proc
        self.enabled = self.baseline is not None
        self._lock = threading.Lock()

    def read_keys(self, n: int) -> None:
        """Counts n keys looked up through LMDB; Ledger.read checks, when its transaction ends, whether to trim."""
        self.pending += n

    def check(self, txn) -> None:
        """After a read transaction that looked up CHECK_EVERY keys or more: trims if the mapping grew by SLACK."""
        from .. import _process

        self.pending = 0
        if not self.enabled or _process.one_shot or not self._lock.acquire(blocking=False):
            return
        try:
            now = rss_file()
            if now is None:
                self.enabled = False
            elif now - self.baseline > SLACK:
                try:
                    self.trim(txn)
                except (OSError, ValueError, IndexError) as exc:  # an economy never fails a lookup
                    self.enabled, self.error = False, f"{type(exc).__name__}: {exc}"
                self.baseline = rss_file() or now
        finally:
            self._lock.release()

    def trim(self, txn) -> int:
        """Unmaps the mapped pages outside the KEEP trees of txn's snapshot; the bytes advised."""
        import numpy as np

        from ._pages import DB_RECORD

        path = self.ledger.real_path
        psize, advise = self.ledger.env.stat()["psize"], madvise()
        if psize != mmap.PAGESIZE or advise is None:
            self.enabled = False
            return 0
        advised = 0
        with open(path, "rb", buffering=0) as f:
            npages = os.fstat(f.fileno()).st_size // psize
            keep = np.zeros(npages, bool)
            keep[:2] = True  # the meta pages
            for record in [_main_record(f.fileno(), psize, txn.id())] + [txn.get(name) for name in KEEP]:
                if record is not None and len(record) == DB_RECORD.size:  # a named tree's record, in main
                    keep[tree_pages(f.fileno(), psize, record, npages)] = True
        for start, length in mappings(path):
            n = min(npages, length // psize)
            drop = ~keep[:n]
            present = _present(start, n)
            if present is not None:
                drop &= present
            edges = np.diff(np.concatenate(([0], drop.view(np.int8), [0])))
            for first, end in zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()):
                if advise(start + first * psize, (end - first) * psize, MADV_DONTNEED) != 0:
                    self.enabled = False  # refused here (EINVAL, EPERM): not tried again
                    return advised
                advised += (end - first) * psize
        self.trims += 1
        return advised
