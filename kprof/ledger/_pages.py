"""Page accounting of the LMDB file: the structural check LMDB's cursors cannot make.

A cursor walk proves each tree reads back in order, but not that LMDB's free list is sound: a damaged free
list that names a page still in use reads clean, and the next write transaction takes that page and
overwrites live data. So, for the snapshot a read transaction sees, this walks every tree from its root (the
free list's, the main database's, each named sub-database's) through its branch pages, collects the overflow
runs its leaves point to, reads the free list's page numbers, and checks that every page from 2 (0 and 1
hold the meta pages) to the snapshot's last page is either used by exactly one tree or listed free exactly
once, never both, and that each tree's page counts match its header.

On-disk layout read (LMDB 0.9, 64-bit): a page starts with pgno u64, pad u16, flags u16, lower u16,
upper u16 (an overflow page's page count, u32, in place of lower/upper); node offsets (u16) follow. A node
is lo u16, hi u16, flags u16, key size u16, then the key and the data. A branch node's child is
lo | hi << 16 | flags << 32; a leaf node's data size is lo | hi << 16. A meta page holds, after its
header, magic u32, version u32, address, map size, then two database records (free list, main), the last
page number and the transaction id. A database record: pad u32 (the page size, in the free list's), flags
u16, depth u16, branch, leaf and overflow page counts, entries, root (u64 each).
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

MAGIC = 0xBEEFC0DE
P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF2 = 0x01, 0x02, 0x04, 0x20
F_BIGDATA, F_SUBDATA = 0x01, 0x02
P_INVALID = (1 << 64) - 1
HEADER, NODE = 16, 8
DB_RECORD = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
META_DBS = 16 + 24  # the two database records start after the page header, magic, version, address, map size


class Tree:
    """One B-tree's pages as walked, against its header's counts."""

    def __init__(self, name: str, record: tuple):
        self.name = name
        _pad, self.flags, self.depth, self.branch, self.leaf, self.overflow, self.entries, self.root = record
        self.pages: list[np.ndarray] = []
        self.counts = {"branch": 0, "leaf": 0, "overflow": 0}


class Pages:
    def __init__(self, buf, psize: int, last: int, found: list[str]):
        self.u8 = np.frombuffer(buf, np.uint8)
        self.words = np.frombuffer(buf, "<u2", len(buf) // 2)  # page fields and nodes lie at even offsets
        self.psize, self.last, self.found = psize, last, found

    def u16(self, at: np.ndarray) -> np.ndarray:
        """The 16-bit words at these even byte offsets."""
        return self.words[at.astype(np.int64) >> 1].astype(np.int64)

    def u32(self, at: np.ndarray) -> np.ndarray:
        return self.u16(at) | (self.u16(at + 2) << 16)

    def u64(self, at: np.ndarray) -> np.ndarray:
        """The 64-bit words at these byte offsets (any alignment: a node's data follows its key)."""
        at = at.astype(np.int64)
        out = np.zeros(len(at), np.uint64)
        for i in range(8):
            out |= self.u8[at + i].astype(np.uint64) << np.uint64(8 * i)
        return out

    def valid(self, pgnos: np.ndarray, what: str) -> np.ndarray:
        """The page numbers that lie in 2..last; the others are findings."""
        bad = (pgnos < 2) | (pgnos > self.last)
        if bad.any():
            self.found.append(f"{what} names page {int(pgnos[bad][0])}, outside 2..{self.last} "
                              f"({int(bad.sum())} such)")
        return pgnos[~bad].astype(np.int64)

    def nodes(self, pages: np.ndarray) -> np.ndarray:
        """The byte offset in the file of each node of the given pages."""
        base = pages * self.psize
        lower = self.u16(base + 12)
        n = np.maximum((lower - HEADER) // 2, 0)
        n = np.minimum(n, (self.psize - HEADER) // 2)  # a damaged `lower` cannot send the reads off the page
        page_of = np.repeat(np.arange(len(pages)), n)
        first = np.cumsum(n) - n
        index = np.arange(int(n.sum())) - np.repeat(first, n)
        ptr_at = base[page_of] + HEADER + 2 * index
        offset = self.u16(ptr_at)
        ok = (offset >= HEADER) & (offset + NODE <= self.psize) & (offset % 2 == 0)
        if not ok.all():
            self.found.append(f"page {int(pages[page_of[~ok][0]])}: a node offset lies outside its page")
        return base[page_of[ok]] + offset[ok]

    def walk(self, tree: Tree, subtrees: list[Tree] | None = None) -> None:
        """Walks a tree level by level from its root: branch pages give the next level; leaves give overflow
        runs (F_BIGDATA) and, where `subtrees` is given (the main database), named sub-databases' records."""
        if tree.root == P_INVALID:
            return
        level = self.valid(np.array([tree.root], np.uint64), f"{tree.name}: the root")
        depth = 0
        while len(level):
            depth += 1
            if depth > 64:
                self.found.append(f"{tree.name}: deeper than 64 levels (a cycle among its pages)")
                return
            tree.pages.append(level)
            parse = subtrees is not None or tree.overflow or tree.flags & 0x04  # DUPSORT: subtrees in leaves
            if depth == tree.depth and not parse:
                # the leaf level, by the header's depth: no page of it is read (the shards' cursor walks read
                # them all, and LMDB checks each page's kind); a wrong depth shows in the counts below
                tree.counts["leaf"] += len(level)
                break
            flags = self.u16(level * self.psize + 10)
            branch, leaf = level[(flags & P_BRANCH) != 0], level[(flags & (P_LEAF | P_LEAF2)) != 0]
            odd = level[(flags & (P_BRANCH | P_LEAF | P_LEAF2)) == 0]
            if len(odd):
                self.found.append(f"{tree.name}: page {int(odd[0])} is neither a branch nor a leaf "
                                  f"({len(odd)} such)")
            tree.counts["branch"] += len(branch)
            tree.counts["leaf"] += len(leaf)
            if len(leaf) and parse:  # LEAF2 pages (fixed-size duplicates) hold bare keys: nothing to follow
                self._leaves(tree, level[((flags & P_LEAF) != 0) & ((flags & P_LEAF2) == 0)], subtrees)
            if not len(branch):
                break
            at = self.nodes(branch)
            child = self.u16(at) | (self.u16(at + 2) << 16) | (self.u16(at + 4) << 32)
            level = self.valid(child.astype(np.uint64), f"{tree.name}: a branch")
        if tree.depth and depth != tree.depth:
            self.found.append(f"{tree.name}: its header says depth {tree.depth}, the walk went {depth} deep")

    def _leaves(self, tree: Tree, leaf: np.ndarray, subtrees: list[Tree] | None) -> None:
        at = self.nodes(leaf)
        flags, ksize = self.u16(at + 4), self.u16(at + 6)
        data = at + NODE + ksize
        big = (flags & F_BIGDATA) != 0
        if big.any():
            start = self.valid(self.u64(data[big]), f"{tree.name}: an overflow node")
            count = self.u32(start * self.psize + 12)
            count = np.clip(count, 1, self.last + 1 - start)
            tree.counts["overflow"] += int(count.sum())
            first = np.cumsum(count) - count
            run = np.repeat(start, count) + (np.arange(int(count.sum())) - np.repeat(first, count))
            tree.pages.append(run)
            head = self.u16(start * self.psize + 10)
            if ((head & P_OVERFLOW) == 0).any():
                self.found.append(f"{tree.name}: overflow page {int(start[(head & P_OVERFLOW) == 0][0])} is not "
                                  f"marked as one")
        sub = np.flatnonzero((flags & F_SUBDATA) != 0)
        for i in sub.tolist():  # named sub-databases (main) or sorted-duplicate subtrees: a few
            record = DB_RECORD.unpack(bytes(self.u8[data[i]:data[i] + DB_RECORD.size]))
            name = bytes(self.u8[at[i] + NODE:at[i] + NODE + ksize[i]]).decode("utf-8", "replace")
            child = Tree(name if subtrees is not None else f"{tree.name} (duplicates)", record)
            self.walk(child)
            if subtrees is not None:
                subtrees.append(child)
            tree.pages.extend(child.pages)


def check(path: str, txnid: int) -> list[str]:
    """Findings of the page accounting of the snapshot with this transaction id ([] when sound). When
    neither meta page is that snapshot's any more (a writer committed twice since), there is nothing to
    account for, and no finding."""
    return ["pages: " + text for text in _check(path, txnid)]


def _check(path: str, txnid: int) -> list[str]:
    found: list[str] = []
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file: refused at opening
            return ["the file is empty"]
    try:
        head = bytes(buf[:HEADER + 160])
        psize = DB_RECORD.unpack_from(head, META_DBS)[0]
        if psize < 512 or psize & (psize - 1) or len(buf) < 2 * psize:
            return [f"meta page 0 gives page size {psize}"]
        meta = None
        for i in (0, 1):
            page = bytes(buf[i * psize:i * psize + HEADER + 160])
            magic, _version = struct.unpack_from("<II", page, HEADER)
            last, txn = struct.unpack_from("<QQ", page, META_DBS + 2 * DB_RECORD.size)
            if magic == MAGIC and txn == txnid:
                meta = (page, last)
        if meta is None:
            return []
        page, last = meta
        if (last + 1) * psize > len(buf):
            return [f"the snapshot's last page {last} lies past the file's end ({len(buf)} bytes)"]
        pages = Pages(buf, psize, last, found)
        free = Tree("free list", DB_RECORD.unpack_from(page, META_DBS))
        main = Tree("main", DB_RECORD.unpack_from(page, META_DBS + DB_RECORD.size))
        named: list[Tree] = []
        pages.walk(free, subtrees=None)
        listed = _free_pages(pages, free)
        pages.walk(main, subtrees=named)  # the named trees' pages join main's as they are walked
        for tree in (free, main, *named):
            own = tree.counts
            for kind in ("branch", "leaf", "overflow"):
                if own[kind] != getattr(tree, kind):
                    found.append(f"{tree.name}: its header counts {getattr(tree, kind)} {kind} pages, "
                                 f"the walk found {own[kind]}")
        used = np.concatenate(free.pages + main.pages) if free.pages or main.pages else np.empty(0, np.int64)
        _account(used, listed, last, found)
        del pages
    finally:
        buf.close()
    return found


def _free_pages(pages: Pages, free: Tree) -> np.ndarray:
    """The page numbers the free list's records name: each record's data is a count, then that many pages
    (in overflow pages when long)."""
    if not free.pages:
        return np.empty(0, np.int64)
    level_pages = np.concatenate(free.pages)
    u16 = pages.u16(level_pages * pages.psize + 10)
    leaves = level_pages[(u16 & P_LEAF) != 0]
    out = []
    at = pages.nodes(leaves)
    for node in at.tolist():
        lo, hi, flags, ksize = struct.unpack(
            "<HHHH", bytes(pages.u8[node:node + NODE]))
        size, data = lo | hi << 16, node + NODE + ksize
        if flags & F_BIGDATA:
            start = int(pages.u64(np.array([data]))[0])
            if not 2 <= start <= pages.last:
                pages.found.append(f"a free-list record's overflow page {start} is outside 2..{pages.last}")
                continue
            data = start * pages.psize + HEADER
        if size < 8 or data + size > len(pages.u8):
            pages.found.append(f"a free-list record of {size} bytes is damaged")
            continue
        ids = np.frombuffer(bytes(pages.u8[data:data + size]), "<u8")
        count = int(ids[0])
        if count != len(ids) - 1:
            pages.found.append(f"a free-list record says {count} pages and holds {len(ids) - 1}")
            count = min(count, len(ids) - 1)
        out.append(ids[1:1 + count])
    listed = np.concatenate(out) if out else np.empty(0, np.uint64)
    return pages.valid(listed, "the free list")


def _account(used: np.ndarray, listed: np.ndarray, last: int, found: list[str]) -> None:
    """Every page of 2..last used once or free once, never both (counted per page: one bincount each)."""
    uses = np.bincount(used, minlength=last + 1)[2:]
    frees = np.bincount(listed, minlength=last + 1)[2:]
    for mask, text in ((uses > 1, "is used twice by the trees"), (frees > 1, "is listed free twice"),
                       ((uses > 0) & (frees > 0), "is in use and listed free"),
                       ((uses == 0) & (frees == 0), "is neither used nor free")):
        pages = np.flatnonzero(mask)
        if len(pages):
            found.append(f"page {int(pages[0]) + 2} {text} ({len(pages)} such)"
                         + (": the next write would overwrite live data" if "listed free" in text and "twice"
                            not in text else ""))
