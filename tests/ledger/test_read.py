"""Read contracts: an int msgpack cannot carry named by its index, `show` of retracted keys and of default fields,
`rows()` and other contracts' failed rows."""

import json

import msgspec
import pytest

from kprof.cli import main
from kprof.errors import IntegrityError, SpecError, UsageError
from kprof.ledger import Ledger, _codec
from kprof import synth
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




def test_a_rows_stats_claim_no_samples_the_event_keeps(ledger):
    """A Row's stats are the view's summary, without the samples: they read as a Stats whose `samples` was [], beside
    an `n` of 16, so a spread recomputed from them had nothing to work on and no word that the event holds them."""
    event = synth.event(0)
    ledger.append([event])
    row = synth.view(ledger).get(**synth.spec(0))
    assert row.stats.n == 16 and row.stats.median == event.stats.median
    assert not hasattr(row.stats, "samples")
    assert ledger.event(row.event_id).stats.samples == event.stats.samples and len(event.stats.samples) == 16
    assert "samples" not in row.to_json()["stats"]


@pytest.mark.parametrize("given", ["citation", "hex", None, 123, b""])
def test_an_event_looked_up_by_anything_but_its_id_bytes_is_a_usage_error_not_damage(ledger, given):
    """`ledger.event(row.citation)` (or the id's hex, None, an int, an empty id) read as "ledger ... is damaged:
    reading sub-database `events` failed (TypeError, BadValsizeError ...); run `kprof audit`" (exit 3) of a sound
    ledger: it is the caller's argument, refused as a UsageError naming it and the fix, and the row's event_id still
    reads its event."""
    ledger.append([synth.event(0)])
    row = synth.view(ledger).get(**synth.spec(0))
    ref = {"citation": row.citation, "hex": row.event_id.hex()}.get(given, given)
    with pytest.raises(UsageError, match=r"is not an id's bytes; pass a Row's or ledger.resolve\(ref\)'s") as err:
        ledger.event(ref)
    assert not isinstance(err.value, IntegrityError) and repr(ref) in str(err.value)
    assert ledger.event(row.event_id).key == row.key == ledger.event(bytearray(row.event_id)).key
    assert row.measured_at.endswith("+00:00") and synth.view(ledger).get_many([synth.spec(1)])[0].measured_at is None


def test_show_names_every_key_it_returns_in_its_docstring(ledger_path):
    """help(kprof.api.show) listed its document's keys without `timing`, which it returns (and the README names)."""
    from kprof import api

    with Ledger.open(ledger_path) as led:
        led.append([synth.event(0)])
    doc = api.show(_eid(synth.event(0)).hex(), db=ledger_path)
    listed = api.show.__doc__.split("{", 1)[1].split("}", 1)[0].replace("\n", " ").split(", ")
    assert [name.strip() for name in listed] == list(doc)


def test_a_scope_whose_scopes_entry_is_gone_is_damage_not_the_root_of_an_empty_scope(ledger_path):
    """A `scopes` entry a damaged page hides (LMDB finds none): query answered its rows ok under the view root of a
    scope that holds none, a root naming no state the ledger was ever in. Rows found without their scope's entry
    are an IntegrityError naming the scope; the audit names it too."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 6)))
        view = synth.view(led)
        root, rows = view.query([synth.spec(i) for i in range(8)])
        assert [r.status for r in rows] == ["ok"] * 6 + ["missing"] * 2
        led.write(lambda txn: txn.delete(view.scope, db=led.dbs["scopes"]))
    with Ledger.open(ledger_path, readonly=True) as led:
        view = synth.view(led)
        for ask in (lambda: view.query([synth.spec(i) for i in range(8)]), lambda: view.get_many([synth.spec(0)])):
            with pytest.raises(IntegrityError, match=f"scope {view.scope.hex()} has rows and no `scopes` entry"):
                ask()
        with pytest.raises(IntegrityError):  # a spec never measured, too: the scope is damaged
            view.get_many([synth.spec(7)])
    assert audit(ledger_path).counts == {"views": 1}


def test_show_of_an_event_a_misrouted_lookup_skips_is_damage_not_nothing_found(ledger_path):
    """A damaged separator in a branch page of `events` (LMDB does not checksum pages) routed a prefix lookup to the
    leaf after the event's: set_range landed past it, and show answered "nothing in ... matches; check the --db and
    the reference" (exit 2) for a citation query had just printed. The id before where the lookup landed must sort
    before the prefix; one that does not is damage naming the lookup (exit 3). The misrouted landing is simulated (a
    cursor whose set_range lands one id late), as the ledger's lookup of nothing found checks its neighbours."""
    from kprof.ledger._resolve import _check_neighbours

    class Late:  # a cursor whose set_range lands on the id after the first one >= the key, as a misrouted one did
        def __init__(self, cursor):
            self.cursor = cursor

        def set_range(self, key):
            return self.cursor.set_range(key) and self.cursor.next()

        def __getattr__(self, name):
            return getattr(self.cursor, name)

    class Txn:
        def __init__(self, txn):
            self.txn = txn

        def cursor(self, db):
            return Late(self.txn.cursor(db))

    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 6)))
        ids = sorted(_eid(synth.event(i)) for i in range(6))
        with led.read() as txn:
            _check_neighbours(txn, led.dbs["events"], ledger_path, ids[2].hex()[:16])  # a lookup landing right
            with pytest.raises(IntegrityError, match=f"looking up {ids[2].hex()[:16]} in `events` skips event "
                                                     f"{ids[2].hex()}"):
                _check_neighbours(Txn(txn), led.dbs["events"], ledger_path, ids[2].hex()[:16])
