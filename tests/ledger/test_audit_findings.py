"""What `audit` reports for each kind of damage to the log and the event store, and what it accepts."""

import msgspec

from kprof.ledger import Ledger, _codec, build, synth
from kprof.ledger._audit_worker import Findings, Shard
from kprof.ledger._reducer import pack_seq
from kprof.ledger.audit import audit


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
    assert f"events: event {eid.hex()[:16]}: its provenance is not in canonical form" in report.findings
    assert not any(f.startswith("keys:") for f in report.findings)


def test_a_gap_in_the_log(ledger_path):
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 8)))
        eid = led.write(lambda txn: txn.pop(pack_seq(5), db=led.dbs["log"]))
    report = audit(ledger_path)
    assert "log: sequence 5 expected, found 6" in report.findings
    assert f"log: event {eid.hex()[:16]} is stored but not in the log" in report.findings


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
