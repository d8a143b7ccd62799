"""What a reader keeps mapped of the ledger file (kprof.ledger._mapped): a trim unmaps every page outside the
trees lookups read and keeps theirs, lookups trim when the mapping has grown, and answers never change."""

import mmap
import struct
import sys

import numpy as np
import pytest

from kprof import _process
from kprof.ledger import Ledger, _mapped, _pages, synth

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or _mapped.madvise() is None,
                                reason="reads /proc/self and calls madvise (Linux)")

N = 20_000


@pytest.fixture(scope="module")
def ledger_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mapped") / "x.db")
    writer = Ledger.open(path)
    for start in range(0, N, 5_000):
        writer.append(list(synth.events(start, start + 5_000)))
    writer.close()
    return path


def _specs(n=N):
    return [synth.spec(i) for i in range(0, 2 * n, 2)]  # half of them held


def _audit_walk(path):
    """{tree name: its pages} as the audit's page accounting walks them (an independent reading of the file)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        psize = _pages.DB_RECORD.unpack_from(buf, _pages.META_DBS)[0]
        metas = []
        for i in (0, 1):
            page = bytes(buf[i * psize:i * psize + _pages.HEADER + 160])
            last, txn = struct.unpack_from("<QQ", page, _pages.META_DBS + 2 * _pages.DB_RECORD.size)
            metas.append((txn, last, page))
        _txn, last, page = max(metas)
        pages = _pages.Pages(buf, psize, last, [])
        named = []
        main = _pages.Tree("main", _pages.DB_RECORD.unpack_from(page, _pages.META_DBS + _pages.DB_RECORD.size))
        pages.walk(main, subtrees=named)
        out = {t.name: set(np.concatenate(t.pages).tolist()) if t.pages else set() for t in named}
        del pages
        return out
    finally:
        buf.close()


def _present_outside(ledger, txn):
    """(pages mapped outside the kept trees, kept pages mapped) of the ledger's mapping, as sets."""
    psize = ledger.env.stat()["psize"]
    with open(ledger.real_path, "rb") as f:
        npages = f.seek(0, 2) // psize
        keep = set()
        for record in [_mapped._main_record(f.fileno(), psize, txn.id())] + [txn.get(n) for n in _mapped.KEEP]:
            keep |= set(_mapped.tree_pages(f.fileno(), psize, record, npages).tolist())
    keep |= {0, 1}
    (start, length), = _mapped.mappings(ledger.real_path)
    present = set(np.flatnonzero(_mapped._present(start, min(npages, length // psize))).tolist())
    return present - keep, present & keep


def test_tree_pages_are_the_pages_the_audit_walks(ledger_path):
    walked = _audit_walk(ledger_path)
    ledger = Ledger.open(ledger_path, readonly=True)
    psize = ledger.env.stat()["psize"]
    with ledger.read() as txn, open(ledger_path, "rb") as f:
        npages = f.seek(0, 2) // psize
        for name in ("current", "history", "events", "log"):
            record = txn.get(name.encode())
            assert _pages.DB_RECORD.unpack(record)[2] >= 2, f"{name}: too shallow to test the branch walk"
            assert set(_mapped.tree_pages(f.fileno(), psize, record, npages).tolist()) == walked[name], name
    ledger.close()


def test_a_trim_unmaps_the_other_trees_and_keeps_the_looked_up_ones(ledger_path):
    ledger = Ledger.open(ledger_path, readonly=True)
    ledger.mapped.enabled = False  # trimmed by hand below, not by the lookups
    view = synth.view(ledger)
    specs = _specs()
    before = view.missing(specs), [(r.status, r.event_id, r.summary) for r in view.get_many(specs)]
    with ledger.read() as txn:
        for _ in txn.cursor(db=ledger.dbs["events"]):  # maps every page of a tree lookups never read
            pass
        outside, kept = _present_outside(ledger, txn)
        assert len(outside) > 100 and len(kept) > 100, (len(outside), len(kept))
        rss = _mapped.rss_file()
        advised = ledger.mapped.trim(txn)
        assert advised >= len(outside) * mmap.PAGESIZE
        outside_after, kept_after = _present_outside(ledger, txn)
    assert not outside_after, f"{len(outside_after)} pages outside the kept trees still mapped"
    assert kept_after == kept, "a kept tree's mapped pages were unmapped"
    assert _mapped.rss_file() <= rss - len(outside) * mmap.PAGESIZE + (1 << 20)
    assert ledger.mapped.trims == 1
    after = view.missing(specs), [(r.status, r.event_id, r.summary) for r in view.get_many(specs)]
    assert after == before
    ledger.close()


def test_lookups_trim_once_the_mapping_has_grown(ledger_path, monkeypatch):
    monkeypatch.setattr(_mapped, "SLACK", 0)
    reference = Ledger.open(ledger_path, readonly=True)
    reference.mapped.enabled = False
    expected = [(r.status, r.event_id) for r in synth.view(reference).get_many(_specs())]
    reference.close()

    ledger = Ledger.open(ledger_path, readonly=True)
    view = synth.view(ledger)
    assert [(r.status, r.event_id) for r in view.get_many(_specs(2_000))] == expected[:2_000]
    assert ledger.mapped.trims == 0, "fewer keys than CHECK_EVERY: no check"
    with ledger.read() as txn:
        for _ in txn.cursor(db=ledger.dbs["events"]):
            pass
    assert [(r.status, r.event_id) for r in view.get_many(_specs())] == expected
    assert ledger.mapped.trims == 1
    with ledger.read() as txn:
        assert not _present_outside(ledger, txn)[0]

    monkeypatch.setattr(_process, "one_shot", True)  # a CLI verb: it exits after its lookup
    with ledger.read() as txn:
        for _ in txn.cursor(db=ledger.dbs["events"]):
            pass
    view.missing(_specs())
    assert ledger.mapped.trims == 1
    ledger.close()


def test_a_trim_of_an_older_snapshot_leaves_later_answers_right(tmp_path):
    """A trim keeps the trees of its own snapshot: pages a writer has written since may be unmapped, and are
    read again when looked up."""
    path = str(tmp_path / "x.db")
    writer = Ledger.open(path)
    writer.append(list(synth.events(0, 5_000)))
    reader = Ledger.open(path, readonly=True)
    view = synth.view(reader)
    with reader.read() as old:
        writer.append(list(synth.events(5_000, 10_000)))
        assert len(view.missing([synth.spec(i) for i in range(10_000)])) == 0  # the new snapshot
        reader.mapped.trim(old)
    assert len(view.missing([synth.spec(i) for i in range(12_000)])) == 2_000
    rows = view.get_many([synth.spec(i) for i in range(9_990, 10_010)])
    assert [r.status for r in rows] == ["ok"] * 10 + ["missing"] * 10
    writer.close()
    reader.close()


def test_without_proc_a_reader_never_trims(ledger_path, monkeypatch):
    monkeypatch.setattr(_mapped, "rss_file", lambda: None)
    monkeypatch.setattr(_mapped, "SLACK", 0)
    ledger = Ledger.open(ledger_path, readonly=True)
    assert not ledger.mapped.enabled
    assert len(synth.view(ledger).missing(_specs())) == N // 2
    assert ledger.mapped.trims == 0
    ledger.close()


def test_a_failing_trim_turns_trimming_off_and_the_lookup_still_answers(ledger_path, monkeypatch):
    monkeypatch.setattr(_mapped, "SLACK", 0)

    def gone(self, txn):
        raise OSError("the file was replaced")

    monkeypatch.setattr(_mapped.Mapped, "trim", gone)
    ledger = Ledger.open(ledger_path, readonly=True)
    with ledger.read() as txn:
        for _ in txn.cursor(db=ledger.dbs["events"]):
            pass
    assert len(synth.view(ledger).missing(_specs())) == N // 2
    assert not ledger.mapped.enabled and "the file was replaced" in ledger.mapped.error
    ledger.close()
