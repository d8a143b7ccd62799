"""The audit's page accounting (kprof.ledger._pages): sound files account for every page; a damaged free list
is named before a writer could take a live page from it."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import lmdb
import msgspec
import pytest

from kprof.ledger import Ledger, _pages, synth
from kprof.ledger.audit import audit
from kprof.ledger.build import retraction

FIXTURES = "fixtures/ledgers"


def _check(path: str) -> list[str]:
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=32)
    try:
        with env.begin() as txn:
            return _pages.check(path, txn.id())
    finally:
        env.close()


def _ledger(path: str, batches: int = 6, per: int = 40) -> str:
    """A ledger whose commits have left pages on the free list (each commit frees the pages it copied)."""
    with Ledger.open(path) as led:
        for b in range(batches):
            led.append(list(synth.events(b * per, (b + 1) * per)))
            led.append(list(synth.events(b * per, b * per + 5, seed=b + 1)))  # re-measurements rewrite rows
    return path


def _latest_meta(data: bytes, psize: int = 4096) -> tuple[int, int]:
    """(free list root, last page) of the newer meta page."""
    best = None
    for i in (0, 1):
        free_root = struct.unpack_from("<Q", data, i * psize + 80)[0]
        last, txnid = struct.unpack_from("<QQ", data, i * psize + 136)
        if best is None or txnid > best[0]:
            best = (txnid, free_root, last)
    return best[1], best[2]


def _free_record(data: bytes, psize: int = 4096) -> tuple[int, list[int]]:
    """(file offset of the first free-list record's page list, its pages), the free list's root being a leaf."""
    root, _last = _latest_meta(data, psize)
    base = root * psize
    assert struct.unpack_from("<H", data, base + 10)[0] & 0x02, "the free list's root is a leaf here"
    node = base + struct.unpack_from("<H", data, base + 16)[0]
    lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, node)
    assert not flags & 0x01, "an inline record"
    at = node + 8 + ksize
    count = struct.unpack_from("<Q", data, at)[0]
    return at + 8, list(struct.unpack_from(f"<{count}Q", data, at + 8))


def _live_pages(data: bytes, psize: int = 4096) -> list[int]:
    """The pages no free-list record names (the free list's root being one leaf of inline records)."""
    root, last = _latest_meta(data, psize)
    base, free = root * psize, set()
    lower = struct.unpack_from("<H", data, base + 12)[0]
    for i in range((lower - 16) // 2):
        node = base + struct.unpack_from("<H", data, base + 16 + 2 * i)[0]
        _lo, _hi, flags, ksize = struct.unpack_from("<HHHH", data, node)
        assert not flags & 0x01
        count = struct.unpack_from("<Q", data, node + 8 + ksize)[0]
        free.update(struct.unpack_from(f"<{count}Q", data, node + 16 + ksize))
    return [pg for pg in range(2, last + 1) if pg not in free]


def test_sound_ledgers_account_for_every_page(tmp_path):
    assert _check(_ledger(str(tmp_path / "a.db"))) == []
    for name in ("synthetic-v1.db", "synthetic-v2.db"):
        assert _check(f"{FIXTURES}/{name}") == []


def test_sound_after_retractions_upgrade_growth_and_overflow_pages(tmp_path):
    p = str(tmp_path / "r.db")
    with Ledger.open(p) as led:
        led.append(list(synth.events(0, 30)))
        ev = synth.event(3)
        eid = led.append([synth.event(3, seed=7)]).added[0]
        led.append([retraction(eid, ev.key, "bad run")])
    assert _check(p) == []
    v1 = str(tmp_path / "v1.db")
    shutil.copy(f"{FIXTURES}/synthetic-v1.db", v1)
    Ledger.open(v1).close()  # the writer upgrades it to format 2 in place
    assert _check(v1) == []
    small = str(tmp_path / "grown.db")
    with Ledger.open(small, map_size=1 << 20) as led:  # grows its map several times
        for b in range(8):
            led.append(list(synth.events(b * 300, (b + 1) * 300)))
    assert _check(small) == []
    big = str(tmp_path / "big.db")  # events of ~40 KB live in overflow pages
    with Ledger.open(big) as led:
        events = [msgspec.structs.replace(e, stats=msgspec.structs.replace(e.stats, samples=[0.01] * 5000))
                  for e in synth.events(0, 12)]
        led.append(events)
        led.append([synth.event(0, seed=3)])
    with Ledger.open(big, readonly=True) as led, led.read() as txn:
        assert txn.stat(led.dbs["events"])["overflow_pages"] > 0
    assert _check(big) == []


def test_free_list_naming_live_pages_is_found_before_a_writer_takes_them(tmp_path):
    p = _ledger(str(tmp_path / "f.db"))
    data = bytearray(Path(p).read_bytes())
    at, freed = _free_record(bytes(data))
    live = _live_pages(bytes(data))[:len(freed)]
    assert len(live) == len(freed) and not set(live) & set(freed)
    struct.pack_into(f"<{len(live)}Q", data, at, *live)
    Path(p).write_bytes(data)
    found = _check(p)
    assert any(f"page {min(live)} is in use and listed free ({len(live)} such)" in f for f in found), found
    assert any("neither used nor free" in f for f in found), found  # the pages it no longer lists
    report = audit(p)
    assert not report.ok and any("is in use and listed free" in f for f in report.findings), report.findings


def test_a_page_dropped_from_the_free_list_is_named(tmp_path):
    p = _ledger(str(tmp_path / "l.db"))
    data = bytearray(Path(p).read_bytes())
    at, freed = _free_record(bytes(data))
    assert len(freed) >= 2
    struct.pack_into("<Q", data, at - 8, len(freed) - 1)  # the record's count: its last page falls out
    Path(p).write_bytes(data)
    assert any(f"page {freed[-1]} is neither used nor free (1 such)" in f for f in _check(p)), _check(p)


@pytest.mark.parametrize("field,value", [(b"branch", 1), (b"leaf", 1)])
def test_a_tree_header_count_that_disagrees_is_named(tmp_path, field, value):
    p = _ledger(str(tmp_path / "h.db"))
    data = bytearray(Path(p).read_bytes())
    # the main database's record in the newer meta page: branch pages at +96, leaf pages at +104
    newer = max((0, 1), key=lambda i: struct.unpack_from("<Q", data, i * 4096 + 144)[0])
    at = newer * 4096 + (96 if field == b"branch" else 104)
    struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] + value)
    Path(p).write_bytes(data)
    assert any("main: its header counts" in f and field.decode() in f for f in _check(p)), _check(p)
