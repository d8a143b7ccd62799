"""The Reducer, the one code that says how an event changes the views: statuses (ok, failed, stale, missing),
retractions, the view root, batching and order independence, rebuilding from the log, and events as the audit
decodes them."""

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kprof.errors import IntegrityError
from kprof.ledger import Ledger
from kprof import synth
from kprof.ledger import _codec
from kprof.ledger._reducer import pack_seq
from kprof.ledger.audit import audit
from kprof.ledger.build import failed, retraction


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=60), st.integers(0, 2**32))
def test_appends_in_any_batching_are_idempotent_and_root_is_order_independent(tmp_path_factory, idx, seed):
    d = tmp_path_factory.mktemp("l")
    evs = [synth.event(i) for i in idx]
    a = Ledger.open(str(d / "a.db"))
    for ev in evs:
        a.append([ev, ev])
    shuffled = evs[:]
    random.Random(seed).shuffle(shuffled)
    b = Ledger.open(str(d / "b.db"))
    b.append(shuffled)
    assert synth.view(a).root == synth.view(b).root
    assert a.last_seq == b.last_seq == len(set(idx))
    specs = [synth.spec(i) for i in range(41)]
    assert [r.status for r in synth.view(a).get_many(specs)] == [r.status for r in synth.view(b).get_many(specs)]
    a.close(), b.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 2), st.integers(0, 1)), min_size=1,
                         max_size=12), min_size=1, max_size=8))
def test_batches_of_new_repeated_and_remeasured_events(tmp_path_factory, batches):
    """Batches that mix new events, events already stored, new events of stored keys, failures and repeats
    within the batch, appended one call per batch and through append_batches: the ledger ends as if every event had been appended
    alone through the reducer, and audits clean."""
    d = tmp_path_factory.mktemp("l")
    events = [[_mixed_event(*t) for t in batch] for batch in batches]
    a = Ledger.open(str(d / "a.db"))
    for batch in events:
        a.append(batch)
    b = Ledger.open(str(d / "b.db"))
    for batch in events:
        for ev in batch:
            b.append([ev])
    c = Ledger.open(str(d / "c.db"))
    results = c.append_batches(iter(events))
    with c.read() as txn:  # one result per batch, and what they added is the log, in order
        assert len(results) == len(events)
        assert [eid for r in results for eid in r.added] == [eid for _seq, eid in txn.cursor(c.dbs["log"])]
    specs = [synth.spec(i) for i in range(13)]
    want = [(r.status, r.event_id) for r in synth.view(b).get_many(specs)]
    for other in (a, c):
        assert synth.view(other).root == synth.view(b).root
        assert [(r.status, r.event_id) for r in synth.view(other).get_many(specs)] == want
        with other.read() as txn:  # every view, entry by entry, as the one-by-one reducer wrote it
            for name in ("current", "scope_index", "history", "failures", "scopes", "log"):
                mine = list(txn.cursor(other.dbs[name]))
                with b.read() as txn_b:
                    assert mine == list(txn_b.cursor(b.dbs[name])), name
    assert a.last_seq == b.last_seq == c.last_seq == len(set(map(tuple, (t for batch in batches for t in batch))))
    a.close(), b.close(), c.close()
    for name in ("a.db", "c.db"):
        report = audit(str(d / name))
        assert report.ok, report.findings


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=40))
def test_missing_agrees_with_the_statuses_through_failures_successes_and_retractions(tmp_path_factory, steps):
    """`missing` tests the current rows for presence and reads the kind only of keys with a failure on record;
    it names exactly the specs whose row is not ok, whatever mix of measurements, failures and retractions
    (of either) came before."""
    ledger = Ledger.open(str(tmp_path_factory.mktemp("l") / "m.db"))
    appended = []
    for i, s, op in steps:
        if op == 2 and appended:  # retract one of the events appended so far
            ev = appended[(i * 7 + s) % len(appended)]
            ledger.append([retraction(_codec.event_id(_codec.encode(ev)), ev.key, "step")])
        else:
            ev = _mixed_event(i, s, op)
            ledger.append([ev])
            appended.append(ev)
    specs = [synth.spec(i) for i in range(11)] * 2
    view = synth.view(ledger)
    want = [spec for spec, row in zip(specs, view.get_many(specs)) if row.status != "ok"]
    assert view.missing(specs) == want
    ledger.close()


def test_root_changes_with_every_view_change(ledger):
    view = synth.view(ledger)
    roots = {view.root}
    for i in range(5):
        ledger.append([synth.event(i)])
        roots.add(view.root)
    assert len(roots) == 6
    ledger.append([synth.event(0)])  # no-op: same root
    assert len({view.root} | roots) == 6
    ledger.append([synth.event(0, seed=9)])  # a re-measurement replaces the current row
    assert view.root not in roots


def test_statuses_ok_missing_stale_failed(ledger):
    ledger.append([synth.event(0), synth.event(1), synth.event(2, revision=0)])
    prov3 = synth.event(3).provenance
    ledger.append([failed(prov3, "oom", "CUDA out of memory")])
    view = synth.view(ledger)
    rows = view.get_many([synth.spec(i) for i in range(5)])
    assert [r.status for r in rows] == ["ok", "ok", "stale", "failed", "missing"]
    assert rows[0].metrics["time_ms"] == synth.event(0).metrics["time_ms"]
    assert rows[0].citation.startswith("kprof.") and rows[0].provenance == synth.event(0).provenance
    assert rows[2].provenance.profiler_revision == 0 and rows[2].metrics is not None
    assert rows[3].metrics is None and rows[3].to_json()["error"] == {"kind": "oom", "message": "CUDA out of memory"}
    assert rows[4].event_id is None and rows[4].metrics is None
    assert view.get(**synth.spec(0)) is not None and view.get(**synth.spec(2)) is None
    assert view.missing([synth.spec(i) for i in range(5)]) == [synth.spec(i) for i in (2, 3, 4)]
    assert {r.status for r in view.rows()} == {"ok", "stale", "failed"}


def test_last_attempt_failing_makes_the_row_failed_until_retracted(ledger):
    ev = synth.event(0)
    ledger.append([ev])
    bad = failed(ev.provenance, "wrong_result", "disagrees with the oracle")
    ledger.append([bad])
    view = synth.view(ledger)
    assert view.get(**synth.spec(0)) is None
    assert view.get_many([synth.spec(0)])[0].status == "failed"
    ledger.append([retraction(_codec.event_id(_codec.encode(bad)), bad.key, "flaky node")])
    row = view.get(**synth.spec(0))
    assert row is not None and row.metrics == ev.metrics
    assert audit(ledger.path).ok


def test_retraction_reverts_to_previous_row(ledger):
    old, new = synth.event(0, seed=1), synth.event(0, seed=2)
    ledger.append([old])
    ledger.append([new])
    view = synth.view(ledger)
    new_id = _codec.event_id(_codec.encode(new))
    assert view.get(**synth.spec(0)).event_id == new_id
    ledger.append([retraction(new_id, new.key, "bad clocks")])
    assert view.get(**synth.spec(0)).event_id == _codec.event_id(_codec.encode(old))
    ledger.append([retraction(_codec.event_id(_codec.encode(old)), old.key, "also bad")])
    assert view.get(**synth.spec(0)) is None
    assert audit(ledger.path).ok


def test_the_failures_view_holds_each_keys_latest_failure_not_retracted(ledger):
    """`failures` maps a key to its latest failed attempt that is not retracted, whatever row is current; checked
    entry by entry (the replay that audit compares with runs the same reducer, so it cannot tell a view never
    written)."""
    measured = synth.event(0, seed=1)
    f1, f2 = (failed(measured.provenance, "oom", f"attempt {s}", measured_at=1.8e9 + s) for s in (1, 2))
    def eid(event):
        return _codec.event_id(_codec.encode(event))

    def failure():
        with ledger.read() as txn:
            return txn.get(measured.key, db=ledger.dbs["failures"])

    ledger.append([measured])
    assert failure() is None
    ledger.append([f1])
    assert failure() == eid(f1)
    ledger.append([synth.event(0, seed=3)])  # measured again: the failure stays the latest one
    assert failure() == eid(f1)
    ledger.append([f2])
    assert failure() == eid(f2)
    ledger.append([retraction(eid(f2), measured.key, "bad clocks")])
    assert failure() == eid(f1)
    ledger.append([retraction(eid(f1), measured.key, "bad clocks")])
    assert failure() is None
    assert audit(ledger.path).ok


def test_retracting_the_current_row_brings_back_the_latest_earlier_attempt_not_the_first(ledger):
    first, second, third = (synth.event(0, seed=s) for s in (1, 2, 3))
    for ev in (first, second, third):
        ledger.append([ev])
    ledger.append([retraction(_codec.event_id(_codec.encode(third)), third.key, "bad clocks")])
    assert synth.view(ledger).get(**synth.spec(0)).event_id == _codec.event_id(_codec.encode(second))


def test_a_retraction_leaves_the_later_of_two_earlier_failures_in_the_failures_view(ledger):
    measured = synth.event(0, seed=1)
    f1, f2 = (failed(measured.provenance, "oom", f"attempt {s}", measured_at=1.8e9 + s) for s in (1, 2))
    again = synth.event(0, seed=3)
    ledger.append([measured, f1, f2, again])
    ledger.append([retraction(_codec.event_id(_codec.encode(again)), again.key, "bad clocks")])
    with ledger.read() as txn:
        assert txn.get(measured.key, db=ledger.dbs["failures"]) == _codec.event_id(_codec.encode(f2))


def test_rebuilding_views_over_a_retraction_whose_target_is_gone_is_damage_not_a_crash(ledger):
    """A log whose retraction names an event no longer stored (its bytes and log entry lost) is not replayed as if
    the target were there: the rebuild refuses it, naming both."""
    ev = synth.event(0)
    eid = _codec.event_id(_codec.encode(ev))
    ledger.append([ev])
    ledger.append([retraction(eid, ev.key, "bad clocks")])
    ledger.write(lambda txn: txn.delete(eid, db=ledger.dbs["events"]) and txn.delete(pack_seq(1), db=ledger.dbs["log"]))
    with pytest.raises(IntegrityError, match=f"names event {eid.hex()[:16]}, which is not stored"):
        ledger.rebuild_views()


def test_a_key_whose_attempts_were_all_retracted_keeps_its_history_when_measured_again(ledger):
    """A key with no current row may have a history (format 2 keeps it as one entry): a new event of that key,
    extends the history instead of replacing it."""
    first = synth.event(0, seed=1)
    first_id = _codec.event_id(_codec.encode(first))
    ledger.append([first])
    ledger.append([retraction(first_id, first.key, "bad clocks")])
    view = synth.view(ledger)
    assert view.missing([synth.spec(0)]) == [synth.spec(0)]
    again = synth.event(0, seed=2)
    ledger.append([again])  # a new event id and a key with no current row
    with ledger.read() as txn:
        history = ledger.history_of(txn, first.key)
    assert [seq for seq, _eid in history] == [1, 2, 3]
    assert history[0][1] == first_id and history[2][1] == _codec.event_id(_codec.encode(again))
    assert view.missing([synth.spec(0)]) == [] and view.get(**synth.spec(0)).event_id == history[2][1]
    assert audit(ledger.path).ok


def test_rebuild_views_reproduces_them(ledger):
    ledger.append(list(synth.events(0, 30)))
    ledger.append([failed(synth.event(40).provenance, "crash", "boom")])
    view = synth.view(ledger)
    before = view.root, [r.to_json() for r in view.get_many([synth.spec(i) for i in range(45)])]
    assert ledger.rebuild_views() == 31
    assert (view.root, [r.to_json() for r in view.get_many([synth.spec(i) for i in range(45)])]) == before
    assert audit(ledger.path).ok


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=80), st.lists(st.integers(0, 30), max_size=10))
def test_events_as_the_audit_decodes_them_derive_the_views_append_derives(idx, fails):
    """The audit replays events decoded as its shards decode them (provenance kept as bytes, then decoded) through
    the Reducer; they must derive exactly what the events as built in memory (some with int numbers) derive."""
    from kprof.ledger import build
    from kprof.ledger._audit_worker import audit_decoder, provenance_decoder
    from kprof.ledger._audit_worker import MemoryStore, replay_into
    from kprof.ledger.store import DBS

    def as_audited(ev):
        decoded = audit_decoder.decode(_codec.encode(ev))
        return msgspec.structs.replace(decoded, provenance=provenance_decoder.decode(decoded.provenance))

    def with_ints(ev):  # numbers given as ints: the stored summary holds them as floats either way
        return build.measured(ev.provenance, {"time_ms": 1, "tflops": 2, "energy_j": None},
                              msgspec.structs.replace(ev.stats, median=2, p10=1, max=3), ev.method, measured_at=5)

    events = [synth.event(i, seed=n, revision=1 + n % 2, gpu="NVIDIA H100" if i % 4 == 1 else synth.GPU)
              for n, i in enumerate(idx)]  # two scopes, two contracts
    events = [with_ints(ev) if n % 3 == 0 else ev for n, ev in enumerate(events)]
    events += [failed(synth.event(i).provenance, "oom", f"out of memory {i}") for i in fails]
    replay = [(seq, _codec.event_id(_codec.encode(ev)), ev) for seq, ev in enumerate(events, 1)]
    built, audited = (MemoryStore(None, {name: None for name in DBS}) for _ in range(2))
    replay_into(built, replay)
    replay_into(audited, [(seq, eid, as_audited(ev)) for seq, eid, ev in replay])
    assert audited.data == built.data


def _mixed_event(i: int, s: int, kind: int):
    """Event i of seed s: measured, or (kind 1) a failure of the same key."""
    if kind == 0:
        return synth.event(i, seed=s)
    return failed(synth.event(i).provenance, "oom", f"attempt {s}", measured_at=1.8e9 + i + s)


def test_every_view_value_is_a_named_record_sealed_to_its_key(tmp_path):
    """Format 4: `current` and `scopes` values are Sealed records whose digest binds their bytes to their key (a
    value moved under another key fails it), `history` values are HistoryEntry records; nothing is sliced by hand."""
    from kprof.ledger._reducer import CurrentRow, HistoryEntry, ScopeEntry, opened

    led = Ledger.open(str(tmp_path / "p.db"))
    led.append(list(synth.events(0, 6)))
    led.append([failed(synth.event(2).provenance, "oom", "out of memory", measured_at=1.8e9)])
    again = synth.event(3, seed=1)
    led.append([again, retraction(_codec.event_id(_codec.encode(again)), again.key, "capped", at=1.9e9)])
    with led.read() as txn:
        current = dict(txn.cursor(led.dbs["current"]))
        history = dict(txn.cursor(led.dbs["history"]))
        scopes = dict(txn.cursor(led.dbs["scopes"]))
    rows = {key: opened("current", key, raw, CurrentRow) for key, raw in current.items()}
    assert sorted(row.kind for row in rows.values()) == ["f"] + ["m"] * 5
    assert rows[synth.event(3).key].event_id == _codec.event_id(_codec.encode(synth.event(3)))  # the retraction undone
    entries = {key: msgspec.msgpack.decode(raw, type=HistoryEntry) for key, raw in history.items()}
    assert entries[synth.event(3).key] == HistoryEntry("m", [4, 8, 9])
    assert all(entries[key].status == row.kind for key, row in rows.items())
    (sid, raw), = scopes.items()
    assert opened("scopes", sid, raw, ScopeEntry).rows == 6
    a, b = list(current)[:2]
    with pytest.raises(IntegrityError, match=f"current: entry {b.hex()} is damaged: it fails its digest"):
        opened("current", b, current[a], CurrentRow)
    led.close()
