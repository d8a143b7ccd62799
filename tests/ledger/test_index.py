"""The in-memory key index (kprof.ledger._index): its answers are LMDB's, exactly, through appends,
failures, retractions, older snapshots and rebuilt views; it is read only once lookups have earned it."""

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kprof.ledger import Ledger, _codec, _index, synth
from kprof.ledger.build import failed, retraction
from kprof.ledger.replay import rebuild_views


def _tune(monkeypatch, **constants):
    for name, value in constants.items():
        monkeypatch.setattr(_index, name, value)


def _written(tmp_path, n: int):
    """(path, writer) of a ledger holding synthetic events 0..n-1."""
    path = str(tmp_path / "x.db")
    writer = Ledger.open(path)
    writer.append(list(synth.events(0, n)))
    return path, writer


@pytest.fixture
def eager(monkeypatch):
    """Every lookup may use the index, and the first one reads it."""
    _tune(monkeypatch, INDEX_FROM=1, MIN_RENT=0, BUILD_FRACTION=0)


def _through_lmdb(path):
    """A reader of the same file that never uses an index: the answers to match."""
    ref = Ledger.open(path, readonly=True)
    ref.indexer.usable = lambda txn, n: None
    return ref


def _answers(ledger, specs):
    view = synth.view(ledger)
    rows = view.get_many(specs)
    return view.missing(specs), [(r.status, r.event_id, r.summary) for r in rows]


def _event(i, s, op):
    if op == 1:
        return failed(synth.event(i).provenance, "oom", f"attempt {s}", measured_at=1.8e9 + i + s)
    return synth.event(i, seed=s)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=30),
       st.lists(st.tuples(st.integers(0, 15), st.integers(0, 3), st.integers(0, 2)), max_size=30),
       st.booleans())
def test_the_index_answers_as_lmdb_through_any_tail(tmp_path_factory, before, after, same_object):
    """Measurements, failures and retractions before the index is read and after (its tail, from the log),
    written by another ledger object or by the reader itself: `missing` and `get_many` answer exactly what a
    reader without an index does, at every step."""
    saved = (_index.INDEX_FROM, _index.MIN_RENT, _index.BUILD_FRACTION)
    _index.INDEX_FROM, _index.MIN_RENT, _index.BUILD_FRACTION = 1, 0, 0
    path = str(tmp_path_factory.mktemp("i") / "x.db")
    writer = Ledger.open(path)
    reader = writer if same_object else Ledger.open(path, readonly=True)
    ref = _through_lmdb(path)
    specs = [synth.spec(i) for i in range(18)]
    appended = []

    def step(i, s, op):
        if op == 2 and appended:
            ev = appended[(i * 7 + s) % len(appended)]
            writer.append([retraction(_codec.event_id(_codec.encode(ev)), ev.key, "step")])
            return
        ev = _event(i, s, op)
        writer.append([ev])
        appended.append(ev)

    try:
        for t in before:
            step(*t)
        assert _answers(reader, specs) == _answers(ref, specs)
        assert reader.indexer.builds == 1 and reader.indexer.index is not None
        for t in after:
            step(*t)
            assert _answers(reader, specs) == _answers(ref, specs)
        assert reader.indexer.builds == 1  # every change came from the log's tail, none by reading it again
        if after:
            assert reader.indexer.index.tail.last_seq == writer.last_seq
    finally:
        _index.INDEX_FROM, _index.MIN_RENT, _index.BUILD_FRACTION = saved
        for led in {id(x): x for x in (writer, reader, ref)}.values():
            led.close()


def test_a_snapshot_older_than_the_index_is_answered_from_itself(tmp_path, eager):
    """A read transaction begun before the index was read (another thread's, say) sees its own state."""
    path, writer = _written(tmp_path, 20)
    reader = Ledger.open(path, readonly=True)
    view = synth.view(reader)
    shapes = view.shapes.to_shapes([synth.spec(i) for i in range(30)])[0]
    old = reader.env.begin()
    try:
        writer.append(list(synth.events(20, 30)) + [failed(synth.event(3).provenance, "oom", "x")])
        assert view.missing([synth.spec(i) for i in range(30)]) == [synth.spec(3)]  # reads the index now
        built = reader.indexer.index
        assert built is not None and reader.indexer.builds == 1
        assert view._shape_flags(old, shapes) == bytes([1] * 20 + [0] * 10)
        assert reader.indexer.index is built and reader.indexer.builds == 1  # no reason to drop it
    finally:
        old.abort()
        reader.close(), writer.close()


def test_views_rebuilt_under_the_index_retire_it(tmp_path, eager):
    """`rebuild_views` changes the views without logging an event. Views damaged by hand (a row taken out)
    are what the index reads; once they are rebuilt, the reader sees the row again."""
    path, writer = _written(tmp_path, 10)
    key = synth.event(4).key
    with writer.env.begin(write=True) as txn:  # the damage: key 4's row gone, its history saying so
        txn.delete(key, db=writer.dbs["current"])
        txn.put(key, b"-" + txn.get(key, db=writer.dbs["history"])[1:], db=writer.dbs["history"])
    reader = Ledger.open(path, readonly=True)
    view = synth.view(reader)
    specs = [synth.spec(i) for i in range(10)]
    assert view.missing(specs) == [synth.spec(4)]
    built = reader.indexer.index
    rebuild_views(writer)
    assert view.missing(specs) == []
    assert [r.status for r in view.get_many(specs)] == ["ok"] * 10
    assert reader.indexer.index is not built and reader.indexer.builds == 2
    rebuild_views(writer)  # counted again
    assert view.missing(specs) == [] and reader.indexer.builds == 3
    reader.close(), writer.close()


def test_a_long_tail_retires_the_index_and_the_rent_starts_over(tmp_path, monkeypatch):
    _tune(monkeypatch, INDEX_FROM=1, MIN_RENT=30, BUILD_FRACTION=0, CHUNK=4, TAIL_FRACTION=0.1)
    path, writer = _written(tmp_path, 40)
    reader = Ledger.open(path, readonly=True)
    ref = _through_lmdb(path)
    specs = [synth.spec(i) for i in range(60)]
    assert _answers(reader, specs) == _answers(ref, specs) and reader.indexer.builds == 1  # rent 60 >= 30
    writer.append(list(synth.events(40, 44)))  # a tail of 4: max(CHUNK, 0.1 * 40) allows it
    assert _answers(reader, specs) == _answers(ref, specs) and reader.indexer.builds == 1
    writer.append(list(synth.events(44, 46)))  # 6 past the index: retired
    view = synth.view(reader)
    assert view.missing(specs[:20]) == synth.view(ref).missing(specs[:20])
    assert reader.indexer.index is None and reader.indexer.rent == 20
    assert _answers(reader, specs) == _answers(ref, specs) and reader.indexer.builds == 2  # rent 80 >= 30
    reader.close(), ref.close(), writer.close()


def test_the_index_is_read_once_lookups_have_earned_it(tmp_path, monkeypatch):
    """Rent or buy: the keys looked up through LMDB (lookups shorter than INDEX_FROM not counted) reach
    max(MIN_RENT, BUILD_FRACTION x the keys held), then the index is read, once."""
    _tune(monkeypatch, INDEX_FROM=50, MIN_RENT=100)
    path, writer = _written(tmp_path, 1000)
    reader = Ledger.open(path, readonly=True)
    view = synth.view(reader)
    small = [synth.spec(i) for i in range(49)]
    for _ in range(30):
        view.missing(small)
    assert reader.indexer.rent == 0 and reader.indexer.builds == 0
    specs = [synth.spec(i) for i in range(900, 1100)]  # 200 a lookup; 0.5 x 1000 held = 500 to earn
    view.missing(specs), view.get_many(specs)
    assert reader.indexer.rent == 400 and reader.indexer.builds == 0
    assert view.missing(specs) == specs[100:]
    assert reader.indexer.builds == 1 and reader.indexer.rent == 0
    for _ in range(3):
        assert view.missing(specs) == specs[100:]
    assert reader.indexer.builds == 1
    reader.close(), writer.close()


def test_find_is_exact_where_keys_share_their_first_bytes():
    """Positions of keys in the index, exactly: keys sharing their first 8 bytes (one bucket, the same head),
    the smallest and largest keys there are, and absent keys beside present ones."""
    rng = np.random.default_rng(5)
    held = {os.urandom(32) for _ in range(3000)}
    head = os.urandom(8)
    twins = {head + os.urandom(24) for _ in range(12)}
    held |= twins | {b"\0" * 32, b"\xff" * 32, b"\0" * 31 + b"\1"}
    ordered = sorted(held)
    keys = _index.as_rows(ordered)
    index = _index.KeyIndex(1, 0, None, keys, np.ones(len(keys), np.uint8))
    absent = [head + os.urandom(24) for _ in range(20)] + [os.urandom(32) for _ in range(500)] + \
        [b"\0" * 31 + b"\2", b"\xff" * 31 + b"\xfe", ordered[7][:31] + bytes([ordered[7][31] ^ 1])]
    query = list(held) + absent
    order = rng.permutation(len(query))
    query = [query[i] for i in order]
    want = [ordered.index(k) if k in held else -1 for k in query]
    assert index.find(_index.as_rows(query)).tolist() == want
    empty = _index.KeyIndex(1, 0, None, np.zeros((0, 4), np.uint64), np.zeros(0, np.uint8))
    assert empty.find(_index.as_rows(query[:5])).tolist() == [-1] * 5


def test_threads_looking_up_while_the_index_is_read_all_answer_right(tmp_path, eager):
    """Threads that find another reading the index or extending its tail answer through LMDB meanwhile."""
    path, writer = _written(tmp_path, 300)
    reader = Ledger.open(path, readonly=True)
    specs = [synth.spec(i) for i in range(0, 400, 3)]
    want = [s for s in specs if s["m"] > 300]
    wrong = []

    def look():
        view = synth.view(reader)
        for _ in range(20):
            got = view.missing(specs)
            if got != want:
                wrong.append(got)

    threads = [threading.Thread(target=look) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and reader.indexer.builds == 1
    reader.close(), writer.close()


def test_key_index_0_turns_it_off_and_a_bad_value_is_refused(tmp_path, eager, monkeypatch, capsys):
    from kprof.cli import main
    from kprof.errors import UsageError

    path = str(tmp_path / "x.db")
    with Ledger.open(path) as writer:
        writer.append(list(synth.events(0, 10)))
    monkeypatch.setenv("KPROF_KEY_INDEX", "0")
    with Ledger.open(path, readonly=True) as reader:
        assert synth.view(reader).missing([synth.spec(i) for i in range(12)]) == [synth.spec(10), synth.spec(11)]
        assert reader.indexer.builds == 0
    monkeypatch.setenv("KPROF_KEY_INDEX", "yes")
    with pytest.raises(UsageError, match="KPROF_KEY_INDEX='yes' is not one of 0, 1"):
        Ledger.open(path, readonly=True)
    spec = '{"m": 64, "n": 64, "k": 64, "dtype": "fp32"}'
    assert main(["count-missing", "single_gemm", "--backend", "torch-cpu", "--spec", spec, "--db", path]) == 2
    assert "KPROF_KEY_INDEX='yes'" in capsys.readouterr().err


def test_the_lookup_helper_reads_its_index_when_its_requester_holds_one(tmp_path, monkeypatch):
    """A split lookup counts whole in the requesting process; once that process holds an index, its next
    request has the helper read one too. Both follow the log's tail after, and every answer is exact."""
    import msgspec

    from kprof.ledger import _parallel

    path, writer = _written(tmp_path, 600)
    reader = Ledger.open(path, readonly=True)
    ref = _through_lmdb(path)
    view = synth.view(reader)
    specs = [synth.spec(i) for i in range(0, 1400, 2)]
    monkeypatch.setattr(_parallel, "worth_it", lambda n: n >= 2)
    _tune(monkeypatch, INDEX_FROM=1, MIN_RENT=10**9)
    helper = _parallel.helper_for(path, wait=60)
    assert helper is not None, "the lookup helper did not start"

    def helper_index():
        with reader.read() as txn:
            meta = reader.dbs["meta"]
            snapshot = [txn.get(b"ledger_id", db=meta), txn.id(), txn.get(b"last_seq", db=meta)]
        request = ["index", snapshot, view.table, view.backend, view.gpu_key, _codec.encode(view.contract),
                   synth.SynthArgs.__module__, synth.SynthArgs.__qualname__, False, []]
        assert helper.ask(request)
        return msgspec.msgpack.decode(bytes(helper.answer()))

    def want(op):  # answered in this process alone, through LMDB (the helper would answer with its index)
        with monkeypatch.context() as m:
            m.setattr(_parallel, "worth_it", lambda n: False)
            return op(synth.view(ref), specs)

    served = helper.served
    assert view.missing(specs) == want(lambda v, s: v.missing(s)) and helper.served == served + 1
    assert reader.indexer.rent == len(specs) and helper_index() == [0, False]  # the helper's half counted here
    _tune(monkeypatch, MIN_RENT=0)
    assert view.missing(specs) == want(lambda v, s: v.missing(s))  # read here; the request had gone out before
    assert reader.indexer.builds == 1 and helper_index() == [0, False]
    assert [r.status for r in view.get_many(specs)] == want(lambda v, s: [r.status for r in v.get_many(s)])
    assert helper_index() == [1, True]
    writer.append(list(synth.events(600, 700)) + [failed(synth.event(5).provenance, "oom", "x")])
    assert view.missing(specs) == want(lambda v, s: v.missing(s))
    assert [(r.status, r.event_id) for r in view.get_many(specs)] == \
        want(lambda v, s: [(r.status, r.event_id) for r in v.get_many(s)])
    assert helper_index() == [1, True] and reader.indexer.builds == 1
    reader.close(), ref.close(), writer.close()


def test_a_damaged_history_is_answered_through_lmdb_and_never_read_again(tmp_path, eager, monkeypatch):
    """A history key that is not 32 bytes (damage the audit names) leaves the index unread: lookups are answered
    through LMDB, and the ledger object does not scan `history` again at every lookup."""
    path, writer = _written(tmp_path, 10)
    with writer.env.begin(write=True) as txn:
        txn.put(b"\x01" * 31, b"m", db=writer.dbs["history"])
    reader = Ledger.open(path, readonly=True)
    scans = []
    build = _index._build
    monkeypatch.setattr(_index, "_build", lambda *a: scans.append(1) or build(*a))
    specs = [synth.spec(i) for i in range(12)]
    for _ in range(3):
        assert synth.view(reader).missing(specs) == specs[10:]
    assert scans == [1] and reader.indexer.index is None and not reader.indexer.enabled
    reader.close(), writer.close()
