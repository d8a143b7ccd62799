"""Read-path and audit contracts: an int msgpack cannot carry named by its index,
`show` of retracted keys and of default fields, `rows()` and other contracts' failed
rows; the audit's retraction targets, meta values, damaged format versions, short scope-index keys and a format 1
written into a format-2 file."""

import json

import msgspec
import pytest

from kprof.cli import main
from kprof.errors import IntegrityError, SpecError
from kprof.ledger import Ledger, _codec, synth
from kprof.ledger._reducer import pack_seq
from kprof.ledger.audit import audit
from kprof.ledger.build import failed, measured, retraction


def _eid(event) -> bytes:
    return _codec.event_id(_codec.encode(event))


# ---- read path: an int no key can hold ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1])
def test_an_int_msgpack_cannot_carry_is_named_by_its_index(ledger, bad):
    """SynthArgs does not bound its ints: a spec holding one past 64 bits is named by its index, by the lookups
    and by the memo's digest of the request alike (no OverflowError), and later lookups answer as before."""
    ledger.append(list(synth.events(0, 10)))
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(100)]
    at = 80
    specs[at] = dict(specs[at], m=bad)
    for lookup in (view.missing, view.get_many):
        with pytest.raises(SpecError, match="past the 64-bit integers") as err:
            lookup(specs)
        assert err.value.index == at
    assert view.missing(specs[:at]) == specs[10:at]


# ---- read path: show and rows() -----------------------------------------------------------------------------


A_SPEC, B_SPEC, SHARED_PREFIX = 11603, 50987, "0ad2e6cd"  # two synth keys that share their first 8 hex digits


@pytest.mark.parametrize("retracted", ["both", "one"])
def test_show_of_a_prefix_two_keys_share_is_ambiguous_even_when_retracted(ledger_path, capsys, retracted):
    a, b = synth.event(A_SPEC), synth.event(B_SPEC)
    assert a.key.hex()[:8] == b.key.hex()[:8] == SHARED_PREFIX and a.key != b.key
    with Ledger.open(ledger_path) as led:
        led.append([a, b])
        gone = [a, b] if retracted == "both" else [b]
        led.append([retraction(_eid(e), e.key, "withdrawn", at=1.9e9) for e in gone])
        assert led.resolve(a.key.hex()).key == a.key and led.resolve(b.key.hex()).key == b.key
    assert main(["show", SHARED_PREFIX, "--db", ledger_path]) == 2
    assert "ambiguous" in capsys.readouterr().err
    assert main(["show", SHARED_PREFIX, "--db", ledger_path, "--json"]) == 2
    captured = capsys.readouterr()
    assert "ambiguous" in captured.err and captured.out == ""


def test_show_json_lists_every_field_and_ids_as_hex(ledger_path, capsys):
    """msgspec leaves fields at their default out of builtins (the records omit them when encoded): show --json
    still lists them all, profiler_revision 1 and measured_at 0.0 among them, and every id as hex."""
    first = synth.event(0)
    assert first.provenance.profiler_revision == 1
    again = synth.event(0, seed=3)
    second = measured(again.provenance, again.metrics, again.stats, again.method, measured_at=0.0,
                      parent=_eid(first))
    with Ledger.open(ledger_path) as led:
        led.append([first])
        led.append([second])
    cite = f"kprof.{_eid(second).hex()[:16]}"
    assert main(["show", cite, "--db", ledger_path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    event = doc["event"]
    assert set(event["provenance"]) == {f.name for f in msgspec.structs.fields(type(first.provenance))}
    assert event["provenance"]["profiler_revision"] == 1
    assert event["provenance"]["algorithm"] == synth.CONTRACT.algorithm
    assert event["measured_at"] == 0.0 and event["parent"] == _eid(first).hex()
    assert event["key"] == first.key.hex() and event["event"] == _eid(second).hex()
    assert {f.name for f in msgspec.structs.fields(type(second))} <= set(event)
    older = doc["history"][0]
    assert older["event"] == _eid(first).hex() and older["parent"] is None
    assert older["provenance"]["profiler_revision"] == 1 and older["key"] == first.key.hex()


def test_rows_leave_out_another_contracts_failed_row_as_get_many_does(ledger):
    ledger.append([synth.event(0)])  # ok under this contract (revision 1)
    ledger.append([synth.event(2, revision=0)])  # measured under revision 0 only: stale
    ledger.append([failed(synth.event(1, revision=0).provenance, "crash", "boom", measured_at=1.9e9)])  # failed, rev 0
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(3)]
    assert [r.status for r in view.get_many(specs)] == ["ok", "missing", "stale"]
    rows = {r.spec["m"]: r.status for r in view.rows()}
    assert rows == {synth.spec(0)["m"]: "ok", synth.spec(2)["m"]: "stale"}


# ---- audit -------------------------------------------------------------------------------------------------


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
])
def test_damaged_meta_values_are_meta_findings(ledger_path, capsys, name, value, finding):
    _base(ledger_path)
    key = name.encode()

    def damage(txn, dbs):
        if value is None:
            txn.delete(key, db=dbs["meta"])
        else:
            txn.put(key, _codec.encode(value), db=dbs["meta"])

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


def test_format_1_written_into_a_format_2_file_names_the_history_entries(ledger_path):
    """Format 2 keeps 32-byte history keys; a file that says format 1 has them where format 1 keeps key + seq
    (40 bytes): the audit names them instead of its shards crashing."""
    _base(ledger_path)
    _tamper(ledger_path, lambda txn, dbs: txn.put(b"format_version", _codec.encode(1), db=dbs["meta"]))
    with Ledger.open(ledger_path, readonly=True) as led, led.read() as txn:
        keys = [k for k, _v in txn.cursor(led.dbs["history"])]
    assert keys and all(len(k) == 32 for k in keys)
    report = audit(ledger_path)
    assert not report.ok
    assert not [f for f in report.findings if f.startswith("structure:")], report.findings
    named = [f for f in report.findings if f.startswith("views: history: entry ")]
    assert named and all("has 32 bytes where the file's format 1 keeps key + seq (40)" in f for f in named)
    assert f"views: history: entry {keys[0].hex()[:24]} has 32 bytes where the file's format 1 keeps key + seq (40)" \
        in report.findings
