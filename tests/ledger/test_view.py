"""View.get under a GPU key the ledger has never held rows of: an error naming the keys it holds, not None."""

import json

import msgspec
import pytest

from kprof.errors import UnknownGpuKeyError, UsageError
from kprof.ledger import _codec
from kprof import synth
from kprof.ledger.build import failed, retraction

OLDER = msgspec.structs.replace(synth.CONTRACT, timing="another method")  # another contract, same revision


def test_get_under_an_unknown_gpu_key_names_the_keys_held(ledger):
    ledger.append(list(synth.events(0, 3)) + [synth.event(5, gpu="Other GPU")])
    view = synth.view(ledger, gpu="No Such GPU")
    with pytest.raises(UnknownGpuKeyError) as err:
        view.get(**synth.spec(0))
    e = err.value
    assert isinstance(e, UsageError) and e.exit_code == 2
    assert (e.table, e.backend, e.gpu_key, e.db) == (synth.TABLE, synth.BACKEND, "No Such GPU", ledger.path)
    assert e.known == [("Other GPU", 1), (synth.GPU, 3)]
    assert str(e) == (f"ledger {ledger.path} has no single_gemm/synthetic rows for GPU key 'No Such GPU': it holds "
                      f"single_gemm/synthetic rows for GPU keys 'Other GPU' (1 row), 'Synthetic GPU' (3 rows); pass "
                      f"one of those as the GPU key, or measure this one with `kprof run single_gemm --backend "
                      f"synthetic --db {ledger.path} --spec '{json.dumps(synth.spec(0))}'` on that GPU (`kprof scopes --db {ledger.path}` lists every "
                      f"table, backend and GPU key it holds)")


def test_get_with_no_rows_of_the_table_and_backend_names_the_backends_and_tables_held(ledger):
    """(A mistyped backend or table said only that the ledger held no rows of it: the backends it holds the table's
    rows under, else the tables and backends it holds, are named.)"""
    ledger.append(list(synth.events(0, 2)))
    other = ledger.view(synth.TABLE, "other-backend", synth.GPU, contract=synth.CONTRACT, args_type=synth.SynthArgs)
    with pytest.raises(UnknownGpuKeyError) as err:
        other.get(**synth.spec(0))
    assert err.value.held == [(synth.TABLE, synth.BACKEND)]
    assert str(err.value) == (
        f"ledger {ledger.path} has no single_gemm/other-backend rows for GPU key 'Synthetic GPU': it holds no "
        f"single_gemm/other-backend rows for any GPU key; its single_gemm rows are of backend synthetic: pass that "
        f"backend, or measure them with `kprof run single_gemm --backend other-backend --db {ledger.path} --spec "
        f"'{json.dumps(synth.spec(0))}'` "
        f"(`kprof scopes --db {ledger.path}` lists every table, backend and GPU key it holds)")
    table = ledger.view("rms_norm", synth.BACKEND, synth.GPU, contract=synth.CONTRACT, args_type=synth.SynthArgs)
    with pytest.raises(UnknownGpuKeyError, match="; it holds rows of single_gemm/synthetic only: pass one of those, "
                                                 "or measure them with `kprof run rms_norm --backend synthetic --db "):
        table.get(**synth.spec(0))


def test_the_commands_an_unknown_gpu_key_names_take_a_ledger_path_with_a_space_whole(tmp_path):
    """`--db my runs/p.db` was named unquoted: the command copied ran with `--db my` and a stray `runs/p.db`. Each
    command named reads the ledger's path back whole, as a shell splits it."""
    import re
    import shlex

    from kprof.ledger import Ledger

    path = str(tmp_path / "my runs" / "p.db")
    (tmp_path / "my runs").mkdir()
    with Ledger.open(path) as led:
        led.append(list(synth.events(0, 1)))
        with pytest.raises(UnknownGpuKeyError) as err:
            synth.view(led, gpu="No Such GPU").get(**synth.spec(0))
    commands = re.findall(r"`(kprof [^`]*)`", str(err.value))
    assert len(commands) == 2, str(err.value)
    for command in commands:
        argv = shlex.split(command)
        assert argv[argv.index("--db") + 1] == path, command


def test_bulk_reads_under_an_unknown_gpu_key_answer_missing(ledger):
    ledger.append(list(synth.events(0, 2)))
    view = synth.view(ledger, gpu="No Such GPU")
    specs = [synth.spec(0), synth.spec(1)]
    assert [r.status for r in view.get_many(specs)] == ["missing", "missing"]
    assert view.missing(specs) == specs and view.count_missing(specs) == 2


def test_get_under_a_known_gpu_key_is_none_for_a_missing_stale_or_failed_spec(ledger):
    ledger.append(list(synth.events(0, 2)) + [synth.event(2, revision=0)])
    view = synth.view(ledger)
    assert view.get(**synth.spec(0)) is not None
    assert view.get(**synth.spec(2)) is None  # stale: only a row of an older revision
    assert view.get(**synth.spec(9)) is None  # missing


def test_a_scope_whose_rows_were_all_retracted_is_known(ledger):
    ev = synth.event(0)
    ledger.append([ev])
    ledger.append([retraction(_codec.event_id(_codec.encode(ev)), ev.key, "bad clocks")])
    assert ledger.scopes() == [(synth.TABLE, synth.BACKEND, synth.GPU, 0)]
    assert synth.view(ledger).get(**synth.spec(0)) is None


def test_a_row_of_a_newer_profiler_revision_is_not_stale_to_an_older_kprof(ledger):
    """Stale means only rows of an older revision (or another contract) exist; a newer kprof's row cannot be read
    as this one's, so to the older kprof the spec is missing, in lookups and in `rows()` alike."""
    ledger.append([synth.event(0, revision=2), synth.event(1, revision=0), synth.event(1, revision=2)])
    view = synth.view(ledger)
    rows = view.get_many([synth.spec(0), synth.spec(1)])
    assert [r.status for r in rows] == ["missing", "stale"]
    assert rows[1].provenance.profiler_revision == 0  # the older row, though the newer one was measured later
    assert [(r.status, r.provenance.profiler_revision) for r in view.rows()] == [("stale", 0)]
    assert [r.status for r in synth.view(ledger, revision=3).get_many([synth.spec(0)])] == ["stale"]


def test_rows_give_one_row_per_shape_as_get_many_does(ledger):
    """Stale means only rows of an older revision or contract exist: a shape with a row of this contract (ok or
    failed) is that row alone; a shape with several older rows is the one of the highest revision (the newest of
    those)."""
    ledger.append([synth.event(0), synth.event(0, revision=0)])  # ok, and an older row of the same shape
    ledger.append([failed(synth.event(1).provenance, "oom", "out of memory"), synth.event(1, revision=0)])
    ledger.append([synth.event(2, revision=0), synth.event(2, contract=OLDER, seed=1)])  # two older rows
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(3)]
    answers = [(r.spec, r.status, r.event_id) for r in view.get_many(specs)]
    assert [a[1] for a in answers] == ["ok", "failed", "stale"]
    assert answers[2][2] == _codec.event_id(_codec.encode(synth.event(2, contract=OLDER, seed=1)))  # the newest
    assert sorted((r.spec["m"], r.status, r.event_id) for r in view.rows()) == [(s["m"], st, e) for s, st, e in answers]


def test_a_stale_row_is_of_this_timing_where_its_revision_has_one(ledger):
    """An older kprof's rows of one spec timed two ways (cupti and events, both revision 5): a query under cupti read
    the events row as the stale one (measured later), showing its time as the spec's, and a ceiling note said the
    calibration was timed with events though a cupti one of that revision was there. Of the highest revision, the
    row of the query's own timing is the stale one; a higher revision of another timing still wins."""
    ledger.append([synth.event(3, revision=0), synth.event(3, revision=0, contract=OLDER, seed=1)])
    ledger.append([synth.event(4, revision=0), synth.event(4, contract=OLDER, seed=1)])
    view = synth.view(ledger)
    rows = view.get_many([synth.spec(3), synth.spec(4)])
    assert [(r.status, r.provenance.timing, r.provenance.profiler_revision) for r in rows] == [
        ("stale", synth.CONTRACT.timing, 0), ("stale", OLDER.timing, 1)]
    assert sorted((r.status, r.event_id) for r in view.rows()) == sorted((r.status, r.event_id) for r in rows)


def test_a_rows_json_names_every_provenance_field_defaults_included(ledger):
    """Row.to_json() left out the fields at their default (profiler_revision 1, an empty layout): a reader of the
    Python API could not tell a revision-1 row from one of unknown revision."""
    ledger.append([synth.event(0)])
    (row,) = synth.view(ledger).get_many([synth.spec(0)])
    doc = row.to_json()["provenance"]
    assert doc == msgspec.structs.asdict(row.provenance) and doc["profiler_revision"] == 1
    doc["shape"].clear()  # a copy: the next read is whole
    assert synth.view(ledger).get_many([synth.spec(0)])[0].to_json()["provenance"]["shape"] == synth.spec(0)


def _newer_kprofs(event, **fields):
    """(event as the views read it, bytes, id) of `event` as a newer kprof writes it: its provenance holding fields
    this kprof does not know (its key hashes them; this kprof's decoding drops them)."""
    doc = msgspec.msgpack.decode(_codec.encode(event))
    doc["provenance"].update(fields)
    doc["key"] = _codec.key_of(msgspec.msgpack.encode(doc["provenance"]))
    doc["metrics"]["time_ms"] *= 3  # a row timed another way
    data = msgspec.msgpack.encode(doc)
    return _codec.event_decoder.decode(data), data, _codec.event_id(data)


def test_a_row_whose_provenance_has_fields_this_kprof_lacks_is_not_read_as_its_row(ledger):
    """A newer kprof's row (a provenance field added, e.g. the power state, at its non-default value) decodes here
    with that field dropped, into this kprof's contract: `get_many` and `rows()` read it as this spec's ok row (its
    time 3x) while `missing` counted the spec missing. Its key is not the one its decoded provenance hashes to: it
    is not this kprof's row, as a row of a newer profiler revision is not (missing, or stale where an older exists)."""
    ledger.append_checked([_newer_kprofs(synth.event(0), power="loaded")])
    ledger.append_checked([_newer_kprofs(synth.event(1), power="loaded")])
    ledger.append([synth.event(1, revision=0)])
    view = synth.view(ledger)
    specs = [synth.spec(0), synth.spec(1)]
    rows = view.get_many(specs)
    assert [r.status for r in rows] == ["missing", "stale"] and rows[1].provenance.profiler_revision == 0
    assert view.get(**synth.spec(0)) is None and view.missing(specs) == specs
    assert [(r.status, r.provenance.profiler_revision) for r in view.rows()] == [("stale", 0)]
    ledger.append([synth.event(0)])  # this kprof's own row of the spec: read as ever
    assert synth.view(ledger).get(**synth.spec(0)).metrics["time_ms"] == synth.event(0).metrics["time_ms"]


def test_a_rows_repr_says_what_a_reader_asks_for_not_its_internals(ledger):
    """A Row's repr was msgspec's: the key and event id as raw bytes, the summary with its 16 raw samples and the
    provenance (about 1.5 KB a row), which buried a list of rows printed at a prompt or in a log."""
    ledger.append([synth.event(0)])
    ok, missing = synth.view(ledger).get_many([synth.spec(0), synth.spec(1)])
    time_ms = synth.event(0).metrics["time_ms"]
    assert repr(ok) == (f"Row(spec={synth.spec(0)!r}, status='ok', citation={ok.citation!r}, time_ms={time_ms!r})")
    assert repr(missing) == f"Row(spec={synth.spec(1)!r}, status='missing', citation=None)"
