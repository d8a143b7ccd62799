"""What `audit` reports for each kind of damage to the log, the event store, the meta and the views, and what it
accepts: retraction targets, meta values, damaged format versions, short scope-index keys, a format 1 written into
a format-2 file."""

import json

import msgspec
import pytest

from kprof.cli import main
from kprof.errors import IntegrityError, UsageError
from kprof.ledger import Ledger, _codec, build
from kprof import synth
from kprof.ledger._audit_worker import Findings, Shard
from kprof.ledger._reducer import pack_seq
from kprof.ledger.audit import audit
from kprof.ledger.build import failed, measured, retraction


def _eid(event) -> bytes:
    return _codec.event_id(_codec.encode(event))


NEWER = "(damaged, or a newer kprof's fields: audit it with that kprof)"


def _swap_event(led: Ledger, seq: int, data: bytes) -> bytes:
    """Stores `data` as the event logged at `seq` (new id, old event removed), bypassing append's checks."""
    new = _codec.event_id(data)

    def work(txn):
        old = txn.get(pack_seq(seq), db=led.dbs["log"])
        txn.delete(old, db=led.dbs["events"])
        txn.put(new, data, db=led.dbs["events"])
        txn.put(pack_seq(seq), new, db=led.dbs["log"])

    led.write(work)
    return new


def test_int_metrics_and_stats_audit_clean(ledger_path):
    """A row built in memory with int numbers stores the same summary that replaying its decoded event derives."""
    e = synth.event(1)
    stats = msgspec.structs.replace(e.stats, median=2, p10=1, max=3)
    with Ledger.open(ledger_path) as led:
        led.append([build.measured(e.provenance, {"time_ms": 1, "tflops": 2, "energy_j": None}, stats, e.method,
                                   measured_at=5)])
    report = audit(ledger_path)
    assert report.ok, report.findings


def test_event_whose_key_does_not_match_its_provenance(ledger_path):
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 6)))
        event = synth.event(2)
        forged = msgspec.structs.replace(event, provenance=synth.event(99).provenance)  # key of event 2 kept
        eid = _swap_event(led, 3, _codec.encode(forged))
    report = audit(ledger_path)
    assert not report.ok
    assert f"keys: event {eid.hex()[:16]}: key {event.key.hex()[:16]} does not match its provenance" in report.findings


def test_event_whose_provenance_is_not_canonical(ledger_path):
    """Bytes kprof's encoder did not write (shape fields out of order) are named, though the key recomputes."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 6)))
        event = synth.event(2)
        shuffled = dict(reversed(list(event.provenance.shape.items())))
        loose = msgspec.structs.replace(event, provenance=msgspec.structs.replace(event.provenance, shape=shuffled))
        data = msgspec.msgpack.Encoder().encode(loose)  # insertion order, not the canonical sorted order
        assert data != _codec.encode(event)
        eid = _swap_event(led, 3, data)
    report = audit(ledger_path)
    assert f"events: event {eid.hex()[:16]}: its provenance is not in canonical form {NEWER}" in report.findings
    assert not any(f.startswith("keys:") for f in report.findings)


def test_an_event_a_newer_kprof_wrote_is_named_so_not_as_a_forged_key(ledger_path):
    """A newer kprof's event, its provenance holding a field this kprof does not know, keyed by the hash of those
    bytes (as the newer kprof's encoder writes them): its key was reported as not matching its provenance (a
    forgery) beside the non-canonical provenance; it is one finding, which says a newer kprof's fields may be why."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 6)))
        doc = msgspec.msgpack.decode(_codec.encode(synth.event(2)))
        doc["provenance"]["power"] = "loaded"
        doc["key"] = _codec.key_of(msgspec.msgpack.encode(doc["provenance"]))
        eid = _swap_event(led, 3, msgspec.msgpack.encode(doc))
        led.rebuild_views()
    report = audit(ledger_path)
    assert report.findings == [f"events: event {eid.hex()[:16]}: its provenance is not in canonical form {NEWER}"]


def test_a_gap_in_the_log(ledger_path):
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 8)))
        eid = led.write(lambda txn: txn.pop(pack_seq(5), db=led.dbs["log"]))
    report = audit(ledger_path)
    assert "log: sequence 5 expected, found 6" in report.findings
    assert f"log: event {eid.hex()[:16]} is stored but not in the log" in report.findings


def test_a_log_key_that_is_not_a_sequence_number_is_named_as_such(ledger_path):
    """A 9-byte key among the log's 8-byte sequence numbers is named as what it is, not read as a number (which
    reported a gap at some huge seq and every sequence after it as out of place)."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 8)))
        bad = pack_seq(3) + b"\x01"  # sorts between seq 3 and seq 4
        led.write(lambda txn: txn.put(bad, bytes(32), db=led.dbs["log"]))
    report = audit(ledger_path)
    assert report.findings == [f"log: entry {bad.hex()[:24]} after seq 3: a key of 9 bytes, not a sequence number "
                               f"(8)"], report.findings


def test_a_log_header_count_the_walk_disagrees_with_is_named(ledger_path):
    """The entry count in the `log` sub-database's record (in LMDB's main tree) is checked against the walk: one
    more than the walk finds is structural damage, though every entry read back is well formed."""
    import struct

    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 8)))
    with open(ledger_path, "r+b") as f:
        data = f.read()
        at = data.rfind(b"log") + 3 + 4 + 2 + 2 + 3 * 8  # the record's name, then pad, flags, depth, 3 page counts
        assert struct.unpack_from("<Q", data, at) == (8,)  # md_entries
        f.seek(at)
        f.write(struct.pack("<Q", 9))
    report = audit(ledger_path)
    assert report.findings == ["structure: log: header counts 9 entries, walk found 8"], report.findings


def test_an_event_logged_twice(ledger_path):
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 8)))

        def work(txn):
            txn.put(pack_seq(9), txn.get(pack_seq(3), db=led.dbs["log"]), db=led.dbs["log"])
            txn.put(b"last_seq", _codec.encode(9), db=led.dbs["meta"])

        led.write(work)
    eid = _codec.event_id(_codec.encode(synth.event(2)))
    report = audit(ledger_path)
    assert report.findings == [f"log: seq 9: event {eid.hex()[:16]} logged twice"], report.findings


def test_meta_last_seq_disagrees_with_the_log(ledger_path):
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 4)))
        led.write(lambda txn: txn.put(b"last_seq", _codec.encode(7), db=led.dbs["meta"]))
    report = audit(ledger_path)
    assert report.findings == ["log: meta says last_seq 7, log ends at 4"], report.findings


def test_event_bytes_that_do_not_decode_as_an_event(ledger_path):
    """Stored bytes whose id recomputes but which are not an event's map (short, or fields in another order)
    are named, whichever shard reads them."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 6)))
        event = synth.event(2)
        reordered = msgspec.msgpack.encode({"key": event.key, "type": "measured"})  # key first, not type
        short = _swap_event(led, 3, b"\x81\xa1a\x01")
        swapped = _swap_event(led, 4, reordered)
    report = audit(ledger_path)
    for eid in (short, swapped):
        assert any(f.startswith(f"events: event {eid.hex()[:16]}: cannot be decoded") for f in report.findings)
    assert not report.ok


def test_an_event_stored_but_never_logged_is_named_alone(ledger_path):
    """The log itself is intact, so the events pass merges the store with the log by position; the unlogged
    events put the two out of step, and every other event is still matched with its seq (nothing else named)."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 40)))
        extra = [_codec.encode(synth.event(100 + i)) for i in range(6)]  # ids spread over the store's order
        led.write(lambda txn: [txn.put(_codec.event_id(data), data, db=led.dbs["events"]) for data in extra])
    report = audit(ledger_path)
    assert sorted(report.findings) == sorted(f"log: event {_codec.event_id(data).hex()[:16]} is stored but not in the log"
                                             for data in extra)


def test_logged_ids_that_share_their_first_eight_bytes_are_matched_exactly(ledger_path):
    """The log's ids are ordered by their first 8 bytes unless two share them; ids that do (forged here, stored
    under ids their bytes do not hash to) are ordered by all 32, so each stored event still finds its seq: only
    the forgery is named, never a logged event as unlogged."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 30)))
        data = _codec.encode(synth.event(200))
        forged = [bytes([0x10 + i]) * 8 + bytes([0xFF - j]) * 24 for i in range(3) for j in range(3)]  # logged in
        # descending order within each shared head

        def work(txn):
            for seq, eid in enumerate(forged, 31):
                txn.put(eid, data, db=led.dbs["events"])
                txn.put(pack_seq(seq), eid, db=led.dbs["log"])
            txn.put(b"last_seq", _codec.encode(30 + len(forged)), db=led.dbs["meta"])

        led.write(work)
    with Ledger.open(ledger_path, readonly=True) as led, led.read() as txn:
        seqs, last, walked = Shard(led, 0, 2, Findings()).log(txn)
        logged = {eid: int.from_bytes(seq, "big") for seq, eid in txn.cursor(led.dbs["log"])}
    assert seqs == logged and last == walked == 30 + len(forged)
    report = audit(ledger_path)
    assert sorted(report.findings) == sorted(f"events: event {eid.hex()[:16]}: stored bytes hash to another id "
                                             "(altered or damaged)" for eid in forged)


@pytest.mark.parametrize("case", ["absent", "other key", "a retraction"])
def test_a_logged_retraction_of_a_target_append_refuses_is_named(ledger_path, capsys, case):
    """A retraction logged (not appended) whose target is not stored, is another key's event, or is itself a
    retraction: the audit names it as an events finding (exit 3), and the other shard's finding is still listed."""
    _base(ledger_path, retract=case == "a retraction")
    key, seq = synth.event(0).key, 47
    if case == "absent":
        target = b"\x77" * 32
    elif case == "other key":
        target = _eid(synth.event(5))
    else:
        e = synth.event(1, seed=1)
        key, seq = e.key, 48
        target = _eid(retraction(_eid(e), e.key, "bad", at=1.9e9))
    forged = retraction(target, key, "forged", at=2e9)
    data = _codec.encode(forged)
    rid = _codec.event_id(data)

    def log_it(txn, dbs):
        txn.put(rid, data, db=dbs["events"])
        txn.put(pack_seq(seq), rid, db=dbs["log"])
        txn.put(b"last_seq", _codec.encode(seq), db=dbs["meta"])

    _tamper(ledger_path, log_it)
    other = _other_shard_key(key)
    _tamper(ledger_path, _flip_current(other))
    problem = {"absent": "which is not stored", "other key": "of another key", "a retraction": "itself a retraction"}
    rc, doc = _json_audit(ledger_path, capsys)
    assert rc == 3 and doc["ok"] is False
    findings = doc["findings"]
    assert f"events: retraction {rid.hex()[:16]} names event {target.hex()[:16]}, {problem[case]}" in findings
    assert f"views: current: entry {other.hex()[:24]} differs from the log's replay" in findings
    assert not [f for f in findings if f.startswith("structure:")], findings


@pytest.mark.parametrize("name,value,finding", [
    ("last_seq", 46.0, "meta: last_seq is 46.0, not a count"),
    ("last_seq", "46", "meta: last_seq is '46', not a count"),
    ("ledger_id", None, "meta: ledger_id is missing"),
    ("ledger_id", 7, "meta: ledger_id is 7, not 32 hex digits"),
    ("ledger_id", "abc", "meta: ledger_id is 'abc', not 32 hex digits"),
    ("ledger_id", "z" * 32, f"meta: ledger_id is {'z' * 32!r}, not 32 hex digits"),
    ("views_rebuilt", 0, "meta: views_rebuilt is 0, not a count of rebuilds"),
    ("views_rebuilt", 1.0, "meta: views_rebuilt is 1.0, not a count of rebuilds"),
    ("created_at", None, "meta: created_at is missing"),
    ("created_at", "yesterday", "meta: created_at is 'yesterday', not a time"),
    ("created_at", b"\xc1", "meta: created_at: its bytes do not decode (c1)"),  # bytes: stored as they are
])
def test_damaged_meta_values_are_meta_findings(ledger_path, capsys, name, value, finding):
    _base(ledger_path)
    key = name.encode()

    def damage(txn, dbs):
        if value is None:
            txn.delete(key, db=dbs["meta"])
        else:
            txn.put(key, value if type(value) is bytes else _codec.encode(value), db=dbs["meta"])

    _tamper(ledger_path, damage)
    rc, doc = _json_audit(ledger_path, capsys)
    assert rc == 3 and doc["ok"] is False
    assert finding in doc["findings"], doc["findings"]


@pytest.mark.parametrize("raw", [_codec.encode("2"), b"\xc1"], ids=["a string", "undecodable"])
def test_a_damaged_format_version_is_a_structure_finding(ledger_path, capsys, raw):
    _base(ledger_path)
    _tamper(ledger_path, lambda txn, dbs: txn.put(b"format_version", raw, db=dbs["meta"]))
    rc, doc = _json_audit(ledger_path, capsys)
    assert rc == 3 and doc["ok"] is False
    assert [f for f in doc["findings"] if f.startswith("structure:") and "format version is damaged" in f], doc
    with pytest.raises(IntegrityError, match="format version is damaged"):
        Ledger.open(ledger_path, readonly=True)
    report = audit(ledger_path)
    assert not report.ok and report.counts == {"structure": 1}


@pytest.mark.parametrize("length", [10, 32])
def test_a_scope_index_entry_with_a_short_key_is_named_with_other_damage(ledger_path, length):
    """A scope_index entry of `length` bytes (no room for a row key after the scope and shape ids) does not crash
    the shards: it is named, and a damaged current entry in the same file is still listed."""
    _base(ledger_path)
    short = []

    def add_short(txn, dbs):
        k, _v = list(txn.cursor(dbs["scope_index"]))[5]
        short.append(k[:length])
        txn.put(k[:length], b"", db=dbs["scope_index"])

    _tamper(ledger_path, add_short)
    key = synth.event(0).key
    _tamper(ledger_path, _flip_current(key))
    report = audit(ledger_path)
    assert not report.ok
    assert not [f for f in report.findings if f.startswith("structure:")], report.findings
    assert f"views: scope_index: stored entry {short[0].hex()[:24]} is not derivable from the log" in report.findings
    assert f"views: current: entry {key.hex()[:24]} differs from the log's replay" in report.findings


def test_a_format_version_damaged_to_an_older_one_only_rebuilds_the_views(ledger_path):
    """Opening a file of an older format rebuilds its views from the log (their layout is all that changed between
    formats): a version damaged to 1 costs that rebuild, and the answers and the audit stay as they were."""
    _base(ledger_path, retract=True)
    with Ledger.open(ledger_path, readonly=True) as led:
        view = synth.view(led)
        before = view.root, [r.status for r in view.get_many([synth.spec(i) for i in range(42)])]
    _tamper(ledger_path, lambda txn, dbs: txn.put(b"format_version", _codec.encode(1), db=dbs["meta"]))
    with Ledger.open(ledger_path, readonly=True) as led:
        view = synth.view(led)
        assert (view.root, [r.status for r in view.get_many([synth.spec(i) for i in range(42)])]) == before
        assert led.format_version == _codec.FORMAT_VERSION
    assert audit(ledger_path).ok


def test_history_entries_of_another_layout_are_named_by_the_audit(ledger_path):
    """Format 1's history layout (key + seq -> event id) under the current version: every entry is named, and the
    keys whose history is then absent read as their current rows say."""
    _base(ledger_path)

    def old_layout(txn, dbs):
        entries = list(txn.cursor(dbs["history"]))
        txn.drop(dbs["history"], delete=False)
        for k, _v in entries:
            txn.put(k + (1).to_bytes(8, "big"), b"x" * 32, db=dbs["history"])
    _tamper(ledger_path, old_layout)
    report = audit(ledger_path)
    assert not report.ok and report.counts == {"views": 80}
    assert all("history: " in f for f in report.findings)


def test_damaged_view_entries_are_repaired_by_rebuilding_the_views(ledger_path):
    """What the audit names in the views (a row's bytes damaged, a row dropped, a history entry damaged), reads
    refuse, and `rebuild_views` repairs from the log: the audit is clean again and the answers are as before."""
    _base(ledger_path, retract=True)
    with Ledger.open(ledger_path, readonly=True) as led:
        specs = [synth.spec(i) for i in range(42)]
        before = [(r.status, r.event_id) for r in synth.view(led).get_many(specs)]

    def damage(txn, dbs):
        keys = [k for k, _v in txn.cursor(dbs["current"])]
        raw = txn.get(keys[0], db=dbs["current"])
        txn.put(keys[0], raw[:-1] + bytes([raw[-1] ^ 1]), db=dbs["current"])
        txn.delete(keys[1], db=dbs["current"])
        txn.put(keys[2], b"\xc1", db=dbs["history"])
    _tamper(ledger_path, damage)
    report = audit(ledger_path, jobs=1)
    assert not report.ok and report.counts == {"views": 3}, report.findings
    with Ledger.open(ledger_path) as led:
        with pytest.raises(IntegrityError):
            synth.view(led).get_many(specs)
        assert led.rebuild_views() == 47
        assert [(r.status, r.event_id) for r in synth.view(led).get_many(specs)] == before
    assert audit(ledger_path, jobs=1).ok


def _base(path: str, retract: bool = False) -> None:
    """40 keys, 6 of them re-measured; with `retract`, key 1's latest event retracted (seq 47)."""
    with Ledger.open(path) as led:
        led.append(list(synth.events(0, 40)))
        led.append(list(synth.events(0, 6, seed=1)))
        if retract:
            e = synth.event(1, seed=1)
            led.append([retraction(_eid(e), e.key, "bad", at=1.9e9)])


def _tamper(path: str, fn) -> None:
    """Writes to the file as a damage would, bypassing append's checks (py-lmdb under the ledger)."""
    with Ledger.open(path) as led:
        led.write(lambda txn: fn(txn, led.dbs))


def _json_audit(path: str, capsys) -> tuple[int, dict]:
    rc = main(["audit", "--db", path, "--json"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, json.loads(captured.out)


def _other_shard_key(*keys: bytes) -> bytes:
    """A synth key (of 6..39) in the other audit shard than the given keys (SHARDS = 2: by the first byte's half)."""
    halves = {k[0] >= 128 for k in keys}
    assert len(halves) == 1
    return next(synth.event(i).key for i in range(6, 40) if (synth.event(i).key[0] >= 128) not in halves)


def _flip_current(key: bytes):
    def go(txn, dbs):
        v = txn.get(key, db=dbs["current"])
        txn.put(key, v[:-1] + bytes([v[-1] ^ 1]), db=dbs["current"])
    return go


def _killed_on_shard_1(shard: int, shards: int, path: str, sig: str = "SIGBUS") -> dict:
    """A shard's work whose process a signal ends on shard 1: SIGBUS, as a damaged page's fault does."""
    import os
    import signal

    from kprof.ledger import _audit_worker

    if shard == 1:
        os.kill(os.getpid(), getattr(signal, sig))
    return _audit_worker.main(shard, shards, path)


def test_a_shard_process_killed_is_a_structure_finding_not_a_hang(ledger_path):
    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    results = _shards(ledger_path, 2, _killed_on_shard_1)
    assert len(results) == 2 and results[1]["fatal"] is True
    assert results[1]["findings"] == ["structure: shard 1's process was killed by SIGBUS while it read the file: the "
                                      "file's pages are damaged"]
    assert all(r.get("fatal") or r["findings"] == [] for r in results)  # shard 0 either finished clean or was cut


@pytest.mark.parametrize("sig, why", [("SIGXCPU", "the CPU time limit: ulimit -t is"),
                                      ("SIGKILL", "the OOM killer, the job's time limit")])
def test_a_shard_ended_by_a_limit_is_no_finding_of_damage(ledger_path, sig, why):
    """A shard's process ended by a CPU time limit (ulimit -t: SIGXCPU, then SIGKILL) or the OOM killer was reported
    as "killed while it read the file: the file's pages are damaged" (exit 3) of a sound ledger; only a fault says
    so now, and a shard ended otherwise is a usage error naming the signal and the limit: the audit did not finish."""
    from functools import partial

    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    with pytest.raises(UsageError, match=f"process 2 of 2 was ended by {sig} \\({why}.*nothing is known of its part"):
        _shards(ledger_path, 2, partial(_killed_on_shard_1, sig=sig))


class _TwoArgs(Exception):
    def __init__(self, what: str, where: str):
        super().__init__(f"{what} at {where}")


def _raises_on_shard_1(shard: int, shards: int, path: str, kind: str) -> dict:
    """A shard's work that raises on shard 1 an exception the parent cannot get back as it is."""
    import threading

    from kprof.ledger import _audit_worker

    if shard == 1:
        raise _TwoArgs("bad page", "key 7") if kind == "unpickles" else ValueError("bad page", threading.Lock())
    return _audit_worker.main(shard, shards, path)


@pytest.mark.parametrize("kind", ["unpickles", "pickles"])
def test_a_shard_exception_that_does_not_pickle_is_its_shards_finding(ledger_path, kind):
    """A shard's exception whose class takes other arguments than its message was a TypeError traceback out of the
    audit (it pickled, then failed in the parent), and one that does not pickle ended its process: 'exited (1) before
    it finished; run it again', which fails again; each is its shard's finding, with its type and message."""
    from functools import partial

    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    results = _shards(ledger_path, 2, partial(_raises_on_shard_1, kind=kind))
    assert results[1]["fatal"] is True and "bad page" in results[1]["findings"][0]
    assert (_TwoArgs if kind == "unpickles" else ValueError).__name__ in results[1]["findings"][0]
    assert results[0]["findings"] == []


def test_a_shard_process_that_cannot_start_raises_its_error_and_leaves_none_running(ledger_path, monkeypatch):
    """A shard process whose start failed (out of file descriptors, ulimit -n; or processes) raised an AssertionError
    ('can only join a started process') from the clean-up, hiding the OSError that names the limit from a Python
    caller of audit; the error is raised as it is, and the shards started before it are ended."""
    import errno
    import multiprocessing
    import os

    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    spawn = multiprocessing.get_context("spawn").Process
    real, started = spawn.start, []

    def start(process):
        if started:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        real(process)
        started.append(process)

    monkeypatch.setattr(spawn, "start", start)
    with pytest.raises(OSError, match="Too many open files"):
        _shards(ledger_path, 2)  # (audit's: as many as there are usable CPUs)
    assert len(started) == 1 and started[0].exitcode is not None  # ended and reaped




def _out_of_memory_on_shard_1(shard: int, shards: int, path: str) -> dict:
    from kprof.ledger import _audit_worker

    if shard == 1:
        raise MemoryError  # what its replay raises under an address space limit (ulimit -v) too small for it
    return _audit_worker.main(shard, shards, path)


def test_a_shard_that_runs_out_of_memory_is_no_finding_of_damage(ledger_path):
    """`ulimit -v 200000; kprof audit` of a sound ledger: a shard's replay raised MemoryError, reported as the finding
    "structure: shard 0: MemoryError: ", exit 3, the ledger called damaged. A shard's work that ran into a limit is a
    usage error naming it (exit 2): the audit did not finish."""
    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    with pytest.raises(UsageError, match=r"process 2 of 2 ran into a limit before it finished: out of (memory|address "
                                         r"space) \(MemoryError\)"):
        _shards(ledger_path, 2, _out_of_memory_on_shard_1)

class _PicklesOutOfMemory:
    def __reduce__(self):
        raise MemoryError  # what pickling a large result raises under an address space limit (ulimit -v)


def _result_out_of_memory_on_shard_1(shard: int, shards: int, path: str) -> dict:
    from kprof.ledger import _audit_worker

    out = _audit_worker.main(shard, shards, path)
    return {**out, "scopes": _PicklesOutOfMemory()} if shard == 1 else out


def test_a_shard_whose_result_runs_out_of_memory_as_it_is_sent_is_no_finding_of_damage(ledger_path):
    """A shard's replay finished, then pickling its result to send it back raised MemoryError (ulimit -v): it was sent
    as the text 'RuntimeError: dict: {...the whole result...} (it could not be sent back: )', the finding "structure:
    shard 1: RuntimeError: ...", exit 3, a sound ledger called damaged. It is the usage error of a limit (exit 2)."""
    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    with pytest.raises(UsageError, match=r"process 2 of 2 ran into a limit before it finished: out of (memory|address "
                                         r"space) \(MemoryError\)"):
        _shards(ledger_path, 2, _result_out_of_memory_on_shard_1)


def _killed_by_a_real_time_signal(shard: int, shards: int, path: str) -> dict:
    import os
    import signal

    from kprof.ledger import _audit_worker

    if shard == 1:
        os.kill(os.getpid(), signal.SIGRTMIN + 1)  # (its default action ends the process)
    return _audit_worker.main(shard, shards, path)


def test_a_shard_ended_by_a_signal_python_names_no_member_of_is_named_by_number(ledger_path):
    """A shard's process ended by a real-time signal (SIGRTMIN+1, as a job's scheduler may send) was a ValueError
    traceback ('35 is not a valid Signals') out of the audit; it is the usage error of a shard ended by a signal,
    naming the signal's number."""
    import signal

    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    with pytest.raises(UsageError, match=f"process 2 of 2 was ended by signal {signal.SIGRTMIN + 1} \\(a signal sent "
                                         f"to it\\)"):
        _shards(ledger_path, 2, _killed_by_a_real_time_signal)


def _finding_on_0_killed_on_1(shard: int, shards: int, path: str) -> dict:
    """Shard 0 finds damage; shard 1's process is ended by SIGKILL (the OOM killer, a time limit)."""
    res = _killed_on_shard_1(shard, shards, path, "SIGKILL")
    res["findings"].append("events: planted damage")
    return res


def test_damage_one_shard_found_stands_when_another_is_ended_by_a_limit(ledger_path):
    """A shard ended by a limit or a kill (no finding of its own) raised a usage error ("raise the limit", exit 2) at
    once, and the damage another shard had found was dropped: a damaged ledger read as unfinished. The findings stand
    (exit 3), the unfinished shard among them; with nothing found elsewhere it is still the usage error."""
    from kprof.ledger.audit import _shards

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    results = _shards(ledger_path, 2, _finding_on_0_killed_on_1)
    assert "events: planted damage" in results[0]["findings"] and results[1]["fatal"] is True
    assert "process 2 of 2 was ended by SIGKILL" in results[1]["findings"][0]


@pytest.mark.parametrize("jobs", [1, 3])
def test_the_findings_do_not_depend_on_the_number_of_shards(ledger_path, jobs):
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 60)))
    _swap_event(led, 7, _codec.encode(msgspec.structs.replace(synth.event(6), measured_at=1.0)))
    led.close()
    base, other = audit(ledger_path), audit(ledger_path, jobs)
    assert not base.ok and base.events == other.events == 60
    assert sorted(base.findings) == sorted(other.findings) and base.counts == other.counts


def test_the_library_audit_runs_no_more_shards_than_usable_cpus_and_row_keys(ledger_path, monkeypatch):
    """`audit(path, 256)` from Python spawned 256 shard processes over a ledger of three rows (only `kprof audit --jobs`
    was capped): the audit itself runs at most one per CPU this process may use and one per row key, and says how
    many it ran."""
    import os

    import kprof.ledger.audit as audit_module

    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 3)))
    asked, real = [], audit_module._shards
    monkeypatch.setattr(audit_module, "_shards", lambda path, jobs: asked.append(jobs) or real(path, min(jobs, 2)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4}, raising=False)
    report = audit(ledger_path, 256)
    assert report.ok and report.events == 3 and asked == [3] and report.shards == 3  # three keys
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert audit(ledger_path, 256).shards == 2 and asked[-1] == 2  # two CPUs


def test_audit_jobs_out_of_range_is_a_usage_error(ledger_path, capsys):
    Ledger.open(ledger_path).close()
    assert main(["audit", "--db", ledger_path, "--jobs", "0"]) == 2
    assert "--jobs 0" in capsys.readouterr().err


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 7, 16, 256])
def test_each_shards_key_range_is_exactly_the_keys_it_owns(shards):
    """A shard walks the ranged views over [lo, hi) and owns the keys `mine` says: the two agree on every first
    byte, for any number of shards (3 shards once walked keys they did not own)."""
    parts = [Shard(None, s, shards, Findings()) for s in range(shards)]
    for b in range(256):
        key = bytes([b]) + b"\0" * 31
        walking = [p.shard for p in parts if key >= p.lo and (p.hi is None or key < p.hi)]
        owning = [p.shard for p in parts if p.mine(key)]
        assert walking == owning and len(owning) == 1, (shards, b)


def test_shards_that_read_different_states_are_audited_again(tmp_path, monkeypatch):
    """Each shard reads its own snapshot: a writer committing between them makes counts disagree with no damage.
    Such an audit is taken again, and after three tries in one shard (one snapshot)."""
    import kprof.ledger.audit as audit_module

    path = str(tmp_path / "p.db")
    with Ledger.open(path) as led:
        led.append(list(synth.events(0, 30)))
    real, calls = audit_module._shards, []

    def shards(path, jobs, work=None):
        calls.append(jobs)
        out = real(path, jobs)
        if jobs > 1:  # a writer committed after shard 0 read: its snapshot is an older one
            out[0] = {**out[0], "snapshot": out[0]["snapshot"] - 1, "events": out[0]["events"] + 1}
        return out

    monkeypatch.setattr(audit_module, "_shards", shards)
    report = audit(path, jobs=2)
    assert report.ok and report.events == 30, report.findings
    assert calls == [2, 2, 2, 1]


def test_a_killed_audit_leaves_no_shard_running(tmp_path):
    """The shards end once their parent has gone, however it ended (here SIGKILL, which runs no cleanup)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys, time; from kprof._children import in_processes\n"
            "def work(i, n, seconds):\n"
            "    import os; print(os.getpid(), flush=True); time.sleep(seconds)\n"
            "if __name__ == '__main__': in_processes(work, 2, 120)\n")
    script = tmp_path / "parent.py"
    script.write_text(code.replace("print(os.getpid(), flush=True)", "open(sys.argv[1] + f'/{os.getpid()}', 'w')"))
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    deadline = time.monotonic() + 60
    while len([p for p in os.listdir(tmp_path) if p.isdigit()]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p) for p in os.listdir(tmp_path) if p.isdigit()]
    assert len(children) == 2
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)



@pytest.mark.parametrize("sig", ["SIGINT", "SIGHUP"])
def test_a_ctrl_c_that_reaches_a_shard_process_while_it_starts_is_left_to_the_parent(sig, tmp_path):
    """A Ctrl-C (or SIGTERM) of the process group reached a shard process that was still starting (importing kprof,
    before it set the signals aside): it printed a KeyboardInterrupt traceback under the interrupt's line, or its part
    read as "ended by SIGINT". A shard starts with them blocked, and ignores them from then on: the parent handles
    them (SIGHUP too, which a dropped ssh session sends the group). Here the signal reaches the shards alone (each sends it to itself as it starts): they finish their work."""
    import subprocess
    import sys

    (tmp_path / "shard_work.py").write_text(
        "import os, signal\n"
        "if os.environ.setdefault('FIRST_PID', str(os.getpid())) != str(os.getpid()):  # a shard, as it starts\n"
        f"    os.kill(os.getpid(), signal.{sig})\n"
        "def work(i, n):\n"
        "    return i\n")
    (tmp_path / "parent.py").write_text("from kprof._children import in_processes\nimport shard_work\n"
                                        "if __name__ == '__main__': print(in_processes(shard_work.work, 2))\n")
    done = subprocess.run([sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[0, 1]\n", ""), done.stderr

def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by init) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_an_lmdb_file_whose_creation_never_committed_reads_as_no_ledger_and_a_run_makes_it_one(tmp_path, capsys):
    import lmdb

    path = str(tmp_path / "p.db")
    lmdb.open(path, subdir=False).close()  # what a kill before the first commit leaves: LMDB's header, nothing more
    spec = '{"m": 4, "n": 32, "k": 32, "dtype": "fp32"}'
    assert main(["query", "single_gemm", "--backend", "torch-cpu", "--spec", spec, "--db", path]) == 2
    assert "creation never committed" in capsys.readouterr().err
    assert main(["audit", "--db", path]) == 2
    capsys.readouterr()
    assert main(["run", "single_gemm", "--backend", "torch-cpu", "--spec", spec, "--db", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_count"] == 0
    assert audit(path).ok


@pytest.mark.parametrize("jobs", [257, True, 2.0, "4"])
def test_the_library_audit_refuses_jobs_that_are_not_1_to_256_shards(ledger_path, jobs):
    Ledger.open(ledger_path).close()
    with pytest.raises(UsageError, match=f"--jobs {jobs!r}: the audit runs 1 to 256 shard processes"):
        audit(ledger_path, jobs)


@pytest.mark.parametrize("name", ["events", "current", "history", "failures", "scope_index", "scopes"])
def test_a_sub_database_header_count_the_walks_disagree_with_is_named(ledger_path, name):
    """Each sub-database's entry count in its record (in LMDB's main tree) is checked against the walks as the log's
    is: the shards' parts of `events` and the row-keyed views added up by the parent, the others walked whole."""
    import struct

    bad = failed(synth.event(1).provenance, "oom", "out of memory")
    with Ledger.open(ledger_path) as led:
        led.append([*synth.events(0, 8), bad, failed(synth.event(2).provenance, "oom", "out of memory")])
        led.append([retraction(_codec.event_id(_codec.encode(bad)), bad.key, "flaky node")])
        with led.read() as txn:
            n = txn.stat(led.dbs[name])["entries"]
    with open(ledger_path, "r+b") as f:
        data = f.read()
        at = data.rfind(name.encode()) + len(name) + 4 + 2 + 2 + 3 * 8  # as in the log's test above
        assert struct.unpack_from("<Q", data, at) == (n,)  # md_entries
        f.seek(at)
        f.write(struct.pack("<Q", n + 1))
    report = audit(ledger_path)
    assert report.findings == [f"structure: {name}: header counts {n + 1} entries, walk found {n}"], report.findings


@pytest.mark.parametrize("change", ["dropped", "altered", "added"])
def test_a_scopes_entry_the_replay_does_not_derive_is_named(ledger_path, change):
    """The parent adds up the shards' scope entries and compares them with the stored `scopes` view: an entry
    lost, altered (sealed again, so its digest passes) or added is a views finding."""
    from kprof.ledger._reducer import ScopeEntry, opened, seal

    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 4)))
        with led.read() as txn:
            (sid, raw), = txn.cursor(led.dbs["scopes"])
        entry = opened("scopes", sid, raw, ScopeEntry)
        other = bytes(16)
        write = {"dropped": lambda txn: txn.delete(sid, db=led.dbs["scopes"]),
                 "altered": lambda txn: txn.put(sid, seal(sid, msgspec.structs.replace(entry, rows=5)),
                                                db=led.dbs["scopes"]),
                 "added": lambda txn: txn.put(other, seal(other, entry), db=led.dbs["scopes"])}[change]
        led.write(write)
    said = {"dropped": f"scopes: entry {sid.hex()} of the log's replay is not stored",
            "altered": f"scopes: entry {sid.hex()} ({entry.table}/{entry.backend}/{entry.gpu_key}) differs from the "
                       f"log's replay",
            "added": f"scopes: stored entry {other.hex()} is not derivable from the log"}[change]
    assert audit(ledger_path).findings == [f"views: {said}"]


@pytest.mark.parametrize("damage", ["altered", "unlogged"])
def test_findings_past_the_listed_many_are_counted_not_listed(ledger_path, damage):
    """Of each check, MAX_LISTED findings are listed and all are counted (events stored but not logged were counted
    only as far as they were listed)."""
    from kprof.ledger._audit_worker import MAX_LISTED

    n, check = MAX_LISTED + 10, {"altered": "events", "unlogged": "log"}[damage]
    with Ledger.open(ledger_path) as led:
        led.append([synth.event(n)])
        extra = [_codec.encode(synth.event(i)) for i in range(n)]
        if damage == "altered":
            led.append(list(synth.events(0, n)))
            extra = [data[:-1] + bytes([data[-1] ^ 1]) for data in extra]  # stored under their ids, altered
        led.write(lambda txn: [txn.put(_codec.event_id(_codec.encode(synth.event(i))), data, db=led.dbs["events"])
                               for i, data in enumerate(extra)])
    report = audit(ledger_path, jobs=1)
    assert report.counts[check] == n, report.counts  # (altered events also leave their rows out of the replay)
    assert len([f for f in report.findings if f.startswith(f"{check}: ")]) == MAX_LISTED
