"""The memo of bulk lookups (kprof.ledger._memo): a repeated request is answered from it, exactly as the ledger
would answer it now (any write of the scope between two lookups changes the answer), and it stays bounded."""

import pytest

from kprof.errors import IntegrityError, SpecError
from kprof.ledger import Ledger, _codec, _memo
from kprof import synth
from kprof.ledger.build import failed, retraction
from kprof.ledger.view import View


def _eid(event) -> bytes:
    return _codec.event_id(_codec.encode(event))


def _fields(rows):
    return [(r.spec, r.status, r.key, r.event_id, r.summary, r.provenance) for r in rows]


@pytest.fixture
def lookups(monkeypatch):
    """lookups(ledger): how many lookups of that Ledger's views reached the file (its memo answered the others)."""
    counted: dict[tuple, int] = {}
    columns, flags = View._columns, View._shape_flags

    def counting_columns(self, txn, shapes):
        counted[id(self.ledger), "rows"] = counted.get((id(self.ledger), "rows"), 0) + 1
        return columns(self, txn, shapes)

    def counting_flags(self, txn, shapes):
        counted[id(self.ledger), "flags"] = counted.get((id(self.ledger), "flags"), 0) + 1
        return flags(self, txn, shapes)

    monkeypatch.setattr(View, "_columns", counting_columns)
    monkeypatch.setattr(View, "_shape_flags", counting_flags)
    return lambda ledger: {op: counted.get((id(ledger), op), 0) for op in ("rows", "flags")}


def _fresh(path: str, specs):
    """The answers of a Ledger opened afresh (an empty memo)."""
    with Ledger.open(path, readonly=True) as led:
        view = synth.view(led)
        return _fields(view.get_many(specs)), view.missing(specs)


def test_a_repeated_request_is_answered_from_the_memo_as_the_file_answers_it(ledger, lookups):
    ledger.append(list(synth.events(0, 50)))
    ledger.append([failed(synth.event(7).provenance, "oom", "CUDA out of memory")])
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(0, 100, 3)]
    first_rows, first_todo = view.get_many(specs), view.missing(specs)
    again = [dict(s) for s in specs]  # equal specs, other dicts: the rows carry the caller's own
    rows, todo = view.get_many(again), view.missing(again)
    assert lookups(ledger) == {"rows": 1, "flags": 1}
    assert _fields(rows) == _fields(first_rows) == _fresh(ledger.path, specs)[0]
    assert all(row.spec is spec for row, spec in zip(rows, again))
    assert todo == first_todo == _fresh(ledger.path, specs)[1] == specs[17:]
    assert all(a is b for a, b in zip(todo, again[17:]))
    root, queried = view.query(specs)
    assert root.hex() == view.root and _fields(queried) == _fields(rows) and lookups(ledger)["rows"] == 1
    assert len(ledger.memo) == 2  # get_many and query share an answer; missing keeps its own


def test_what_a_caller_does_to_its_rows_does_not_reach_the_memo(ledger, lookups):
    ledger.append(list(synth.events(0, 2)) + [synth.event(2, revision=0)])
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(3)]
    expected = _fields(view.get_many(specs))
    rows = view.get_many(specs)
    with pytest.raises(TypeError):
        rows[0].metrics["time_ms"] *= 1000
    rows[1].summary.metrics.clear()
    rows[2].provenance.shape.clear()
    for row in rows:
        row.to_json()["metrics"].clear()
    assert lookups(ledger)["rows"] == 1 and _fields(view.get_many(specs)) == expected == _fresh(ledger.path, specs)[0]


def test_every_write_of_the_scope_between_two_lookups_changes_the_answer(ledger_path, lookups):
    """A writer (another Ledger on the file) appends, re-measures, fails and retracts between a reader's lookups
    of the same specs: each lookup answers as a reader with an empty memo does."""
    writer = Ledger.open(ledger_path)
    writer.append(list(synth.events(0, 10)))
    reader = Ledger.open(ledger_path, readonly=True)
    view = synth.view(reader)
    specs = [synth.spec(i) for i in range(20)]
    fail = failed(synth.event(3).provenance, "oom", "CUDA out of memory")
    writes = [
        [synth.event(12)],  # a missing row becomes ok
        [synth.event(4, seed=1)],  # an ok row re-measured: another event behind it
        [fail],  # an ok row becomes failed
        [retraction(_eid(fail), fail.key, "a bad node")],  # and ok again
        [retraction(_eid(synth.event(12)), synth.event(12).key, "wrong")],  # an ok row becomes missing
        [synth.event(5, revision=2)],  # a row of another contract in the scope: no change to this view's rows
    ]
    seen = []
    for batch in writes:
        before = (_fields(view.get_many(specs)), view.missing(specs))
        assert before == _fresh(ledger_path, specs)
        writer.append(batch)
        after = (_fields(view.get_many(specs)), view.missing(specs))
        assert after == _fresh(ledger_path, specs)
        seen.append(after != before)
    assert seen == [True, True, True, True, True, False]
    assert lookups(reader) == {"rows": 1 + len(writes), "flags": 1 + len(writes)}  # once per root
    reader.close()
    writer.close()


def test_stale_rows_follow_writes_of_another_contract(ledger, lookups):
    ledger.append(list(synth.events(0, 6)))  # revision 1
    view2 = synth.view(ledger, revision=2)
    specs = [synth.spec(i) for i in range(8)]
    assert [r.status for r in view2.get_many(specs)] == ["stale"] * 6 + ["missing"] * 2
    ledger.append([synth.event(2, revision=2), synth.event(6, seed=1)])  # one row current, one stale more
    rows = view2.get_many(specs)
    assert [r.status for r in rows] == ["stale", "stale", "ok", "stale", "stale", "stale", "stale", "missing"]
    assert rows[6].event_id == _eid(synth.event(6, seed=1)) and lookups(ledger)["rows"] == 2


def test_a_write_to_another_scope_keeps_the_answers(ledger, lookups):
    ledger.append(list(synth.events(0, 10)))
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(20)]
    rows = view.get_many(specs)
    ledger.append([synth.event(3, gpu="Other GPU")])
    assert _fields(view.get_many(specs)) == _fields(rows) and lookups(ledger)["rows"] == 1


def test_a_rebuild_of_the_views_is_a_new_stamp(ledger, lookups):
    """rebuild_views rewrites the views without an event: a row it repairs is answered anew, though the view root
    (read from `scopes`, which the damage spared) is the same. The damaged row itself is never an answer: the memo
    holds only verified answers, and a lookup that reaches the damage raises."""
    ledger.append(list(synth.events(0, 10)))
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(10)]
    want = _fields(view.get_many(specs))
    k1, k2 = synth.event(1).key, synth.event(2).key

    def damage(txn):  # key 1's current row made key 2's: a damaged view, as the audit would name it
        txn.put(k1, txn.get(k2, db=ledger.dbs["current"]), db=ledger.dbs["current"])

    ledger.write(damage)
    assert _fields(view.get_many(specs)) == want and lookups(ledger)["rows"] == 1  # verified before the damage
    with pytest.raises(IntegrityError, match=k1.hex()):
        view.get_many(specs[:5])  # another request reaches the file, and the damage
    ledger.rebuild_views()
    assert _fields(view.get_many(specs)) == want and lookups(ledger)["rows"] == 3


def test_canonical_values_of_other_spellings_share_an_answer_and_each_call_keeps_its_spec_dicts(ledger, lookups):
    ledger.append(list(synth.events(0, 4)))
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(6)]
    structs = [synth.SynthArgs(**s) for s in specs]
    reordered = [dict(reversed(list(s.items()))) for s in specs]  # another field order: the same keys
    rows = view.get_many(specs)
    for other in (structs, reordered):
        again = view.get_many(other)
        assert [(r.status, r.key, r.event_id) for r in again] == [(r.status, r.key, r.event_id) for r in rows]
        assert [r.spec for r in again] == specs and all(type(r.spec["m"]) is int for r in again)
        assert view.missing(other) == other[4:]
    assert lookups(ledger) == {"rows": 1, "flags": 1}
    floats = [dict(s, m=float(s["m"])) for s in specs]  # an integral float for an int field: refused, as everywhere
    with pytest.raises(SpecError, match='field "m" = .* is a float') as err:
        view.get_many(floats)
    assert err.value.index == 0


def test_a_request_that_is_refused_is_refused_again(ledger):
    ledger.append(list(synth.events(0, 4)))
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(4)]
    view.get_many(specs)
    bad = specs[:2] + [dict(specs[2], m="big")] + specs[3:]
    for _ in range(2):
        with pytest.raises(SpecError, match='field "m"') as err:
            view.get_many(bad)
        assert err.value.index == 2


def test_the_memo_is_bounded_least_recently_used_first(ledger, monkeypatch):
    monkeypatch.setattr(_memo, "MAX_ENTRIES", 4)
    ledger.append(list(synth.events(0, 100)))
    ledger.memo.max_specs = 50
    view = synth.view(ledger)
    requests = [[synth.spec(i) for i in range(a, a + 20)] for a in range(0, 100, 20)]
    for specs in requests:
        view.get_many(specs)
        assert ledger.memo.specs <= 50 and len(ledger.memo) <= 4
    assert ledger.memo.specs == 40 and len(ledger.memo) == 2  # the last two requests
    view.missing([synth.spec(i) for i in range(51)])  # more specs than the memo holds: answered, not kept
    assert ledger.memo.specs == 40
    for specs in requests[:4]:
        view.missing(specs[:5])
    assert len(ledger.memo) == 4 and ledger.memo.specs == 20  # four entries at most, each of 5 specs
    ledger.append([synth.event(200)])  # a new root: the view's answers go at its next lookup
    view.missing(requests[0][:1])
    assert len(ledger.memo) == 1 and ledger.memo.specs == 1


def test_memo_unit_stamps_and_bounds():
    memo = _memo.Memo(max_specs=10)
    memo.put(b"v", b"s1", "rows", b"d1", 4, "a")
    memo.put(b"w", b"t1", "rows", b"d1", 4, "b")
    assert memo.get(b"v", b"s1", "rows", b"d1") == "a" and memo.get(b"v", b"s1", "flags", b"d1") is None
    assert memo.get(b"v", b"s2", "rows", b"d1") is None  # another stamp: the view's answers are gone
    assert memo.get(b"v", b"s1", "rows", b"d1") is None and memo.get(b"w", b"t1", "rows", b"d1") == "b"
    memo.put(b"w", b"t1", "rows", b"d2", 4, "c")
    memo.put(b"w", b"t1", "rows", b"d3", 4, "d")  # 12 > 10: the least recently used goes
    assert memo.get(b"w", b"t1", "rows", b"d1") is None and memo.specs == 8
    memo.put(b"w", b"t1", "rows", b"d4", 11, "e")
    assert memo.get(b"w", b"t1", "rows", b"d4") is None and memo.specs == 8
