"""A damaged ledger is refused by every reader (exit 3, one line naming the key and `kprof audit`), never read
as another answer: `query`, `count-missing`, `show` and `run` (which reads the rows it needs the same way, so
never writes into such a file). The sweep over every page is tests/ledger/test_corruption_sweep.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from kprof.cli import _sigbus, main
from kprof.errors import UsageError
from kprof.ledger import Ledger, _codec
from kprof.ledger._reducer import CurrentRow, HistoryEntry, Sealed


@pytest.fixture
def rows(h, local_gpu, tmp_path):
    """A ledger of two ok rows of this machine; returns (db, specs, event ids)."""
    db = str(tmp_path / "profile.db")
    specs = [h.gemm(m=32), h.gemm(m=64)]
    eids = h.append(db, *[h.make_event(s, local_gpu) for s in specs])
    return db, specs, eids


def _tamper(db: str, fn) -> None:
    with Ledger.open(db) as ledger:
        ledger.write(lambda txn: fn(txn, ledger.dbs))


def _verbs(h, db, specs, citation):
    args = [*h.spec_args(*specs), "--db", db, "--json"]
    return {"query": ["query", h.GEMM, "--backend", h.CPU, *args],
            "count-missing": ["count-missing", h.GEMM, "--backend", h.CPU, *args],
            "show": ["show", citation, "--db", db]}


def _answers(h, db, specs, capsys) -> dict:
    out = {}
    for verb in ("query", "count-missing"):
        assert main(_verbs(h, db, specs, "")[verb]) == 0, verb
        out[verb] = json.loads(capsys.readouterr().out)
    return out


def test_a_tampered_event_is_refused_where_it_is_read_and_answers_stay_as_before(h, rows, capsys):
    """query and count-missing answer from the current rows, each verified by its digest: a damaged event
    body leaves their answers exactly as before; `show`, which prints the event, re-hashes it and refuses."""
    db, specs, (eid, _other) = rows
    before = _answers(h, db, specs, capsys)

    def flip(txn, dbs):  # one byte of the event's bytes, in place: the view rows still name it
        data = bytearray(txn.get(eid, db=dbs["events"]))
        data[-3] ^= 1
        txn.put(eid, bytes(data), db=dbs["events"])

    _tamper(db, flip)
    assert _answers(h, db, specs, capsys) == before
    assert main(_verbs(h, db, specs, "kprof." + eid.hex()[:16])["show"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and eid.hex() in err and "kprof audit" in err, err
    assert main(["audit", "--db", db, "--json"]) == 3
    capsys.readouterr()


def test_export_refuses_a_tampered_event_and_writes_no_segment(h, rows, capsys, tmp_path):
    """A damaged event is never passed on: a merge would store its bytes under a new id, as a clean row."""
    db, _specs, (eid, _other) = rows

    def flip(txn, dbs):
        data = bytearray(txn.get(eid, db=dbs["events"]))
        data[-3] ^= 1
        txn.put(eid, bytes(data), db=dbs["events"])

    _tamper(db, flip)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for output in (str(out_dir / "s.kseg"), str(out_dir)):  # a file, and a directory of content-named segments
        assert main(["export", "-o", output, "--db", db]) == 3
        out, err = capsys.readouterr()
        assert out == "" and eid.hex() in err and "do not hash to its id" in err and "kprof audit" in err, err
        assert os.listdir(out_dir) == []


@pytest.mark.parametrize("where", ["summary", "event id", "digest", "kind"])
def test_a_tampered_current_row_is_refused_by_every_reader_and_run_writes_nothing(h, rows, capsys, where):
    db, specs, _eids = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key, value = next(iter(txn.cursor(ledger.dbs["current"])))
    # Each flip lands on a payload byte that still decodes to a valid row (so only the digest can tell): the kind
    # letter, a byte inside the event id, the last mantissa byte of the summary's measured_at, the digest itself.
    body = bytes(msgspec.msgpack.decode(value, type=Sealed).body)
    row, start = msgspec.msgpack.decode(body, type=CurrentRow), value.index(body)
    stamp = msgspec.msgpack.encode(row.summary.measured_at)
    at = {"summary": start + body.index(stamp) + len(stamp) - 1, "event id": start + body.index(row.event_id) + 5,
          "digest": len(value) - 2, "kind": start + body.index(b"\xa1" + row.kind.encode()) + 1}[where]
    data = bytearray(value)
    data[at] ^= 1 if where != "kind" else ord("m") ^ ord("f")  # a kind letter to the other valid one
    flipped = msgspec.msgpack.decode(bytes(data), type=Sealed)
    assert msgspec.msgpack.decode(bytes(flipped.body), type=CurrentRow) != row or where == "digest"  # still a row

    def flip(txn, dbs):
        txn.put(key, bytes(data), db=dbs["current"])

    _tamper(db, flip)
    for verb in ("query", "count-missing"):
        assert main(_verbs(h, db, specs, "")[verb]) == 3, verb
        out, err = capsys.readouterr()
        assert out == "" and key.hex() in err and "kprof audit" in err, (verb, err)
    before = h.digest(db)
    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(*specs), "--db", db, "--json"]) == 3
    assert h.digest(db) == before and key.hex() in capsys.readouterr().err


def test_a_lost_current_row_is_refused_not_read_as_missing(h, rows, capsys):
    db, specs, _eids = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key = next(iter(txn.cursor(ledger.dbs["current"])))[0]
    _tamper(db, lambda txn, dbs: txn.delete(key, db=dbs["current"]))
    for verb in ("query", "count-missing"):
        assert main(_verbs(h, db, specs, "")[verb]) == 3
        assert key.hex() in capsys.readouterr().err


def test_a_flipped_history_status_does_not_change_the_count(h, rows, capsys):
    db, specs, _eids = rows
    want = h.read_json(capsys, "count-missing", db, *specs)

    def flip(txn, dbs):
        for k, v in list(txn.cursor(dbs["history"])):
            entry = msgspec.msgpack.decode(v, type=HistoryEntry)
            txn.put(k, _codec.encode(HistoryEntry("f" if entry.status == "m" else "m", entry.seqs)), db=dbs["history"])

    _tamper(db, flip)
    assert h.read_json(capsys, "count-missing", db, *specs) == want


def test_a_ledger_view_needs_the_contract_from_its_caller(rows):
    with Ledger.open(rows[0], readonly=True) as ledger, pytest.raises(UsageError, match="kprof.api.view"):
        ledger.view("single_gemm", "torch-cpu", "any")


@pytest.mark.skipif(not hasattr(_sigbus.signal, "SIGBUS"), reason="no SIGBUS here")
def test_a_sigbus_while_reading_a_mapping_prints_one_line_and_exits_3(tmp_path):
    """A load from a page the file no longer holds faults in C (as LMDB's reads do); the handler ends the
    process with one line and exit 3, instead of a bare `Bus error` (135) or a hang."""
    path = tmp_path / "mapped"
    code = f"""
import ctypes, mmap, os
from kprof.cli import _sigbus
f = open({str(path)!r}, "wb+"); f.write(b"x" * 8192); f.flush()
m = mmap.mmap(f.fileno(), 8192)
os.truncate({str(path)!r}, 0)
_sigbus.install()
buf = (ctypes.c_char * 8192).from_buffer(m)
ctypes.string_at(ctypes.addressof(buf) + 4096, 4)
print("not reached")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, b"", _sigbus.LINE)


def test_a_damaged_scope_entry_is_refused_not_read_as_another_view_root(h, rows, capsys):
    """query reports the scope's view root from its `scopes` entry: a bit flipped in its accumulator fails the
    entry's digest (exit 3), never a different root."""
    db, specs, _eids = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        sid, value = next(iter(txn.cursor(ledger.dbs["scopes"])))

    def flip(txn, dbs):
        data = bytearray(value)
        data[len(data) // 2] ^= 1
        txn.put(sid, bytes(data), db=dbs["scopes"])

    _tamper(db, flip)
    assert main(_verbs(h, db, specs, "")["query"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and sid.hex() in err and "kprof audit" in err, err


@pytest.mark.parametrize("stale", [False, True])
def test_a_scope_entry_under_a_damaged_key_is_refused_not_read_as_a_scope_of_no_rows(h, rows, capsys, local_gpu,
                                                                                     stale):
    """A bit flipped in the key of a `scopes` entry left the scope without one: `query` read the view root of no rows
    beside its ok rows (exit 0, a root naming another state), and a scope of stale rows only read every spec
    `missing`. Rows indexed under a scope that has no entry are damage (exit 3)."""
    db, specs, _eids = rows
    if stale:  # the only rows of a spec of another profiler revision, in a scope of their own
        db = db.replace("profile.db", "stale.db")
        h.append(db, h.make_event(specs[0], local_gpu, revision=0))
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        sid, value = next(iter(txn.cursor(ledger.dbs["scopes"])))

    def move(txn, dbs):
        txn.delete(sid, db=dbs["scopes"])
        txn.put(bytes([sid[0] ^ 1]) + sid[1:], value, db=dbs["scopes"])

    _tamper(db, move)
    assert main(_verbs(h, db, specs, "")["query"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and f"scope {sid.hex()} has rows and no `scopes` entry" in err and "kprof audit" in err, err


def test_a_history_entry_under_a_damaged_key_is_refused_not_shown_as_retracted(h, rows, capsys):
    """A bit flipped in the key of a `history` entry left the key without one: `show` of its ok row's citation said
    "row: none (every measurement of this key is retracted)" with an empty history (exit 0), while `query` read the
    row ok. An event, or a current row, that its key's history lacks is damage (exit 3)."""
    db, specs, (eid, _other) = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key = msgspec.msgpack.decode(txn.get(eid, db=ledger.dbs["events"]))["key"]
        value = txn.get(key, db=ledger.dbs["history"])

    def move(txn, dbs):
        txn.delete(key, db=dbs["history"])
        txn.put(key[:-1] + bytes([key[-1] ^ 1]), value, db=dbs["history"])

    _tamper(db, move)
    for argv in (["show", "kprof." + eid.hex()[:16], "--db", db], ["show", eid.hex(), "--db", db, "--json"]):
        assert main(argv) == 3
        out, err = capsys.readouterr()
        assert out == "" and f"the history of key {key.hex()} lacks its event(s)" in err, err


def test_a_damaged_header_version_is_integrity_damage_not_a_path_error(h, rows, capsys):
    """A flipped bit in the LMDB version of the file's header (right after its magic number) read as "cannot open
    ledger ...: MDB_VERSION_MISMATCH; check the path and its permissions", exit 2, from every verb, `kprof audit`
    included: it is damage (exit 3), and the audit reports it as a finding."""
    from kprof.ledger._path import _MAGIC_AT

    db, specs, eids = rows
    with open(db, "r+b") as f:
        f.seek(_MAGIC_AT + 4)  # the version, after the magic number
        version = f.read(1)
        f.seek(_MAGIC_AT + 4)
        f.write(bytes([version[0] ^ 0x01]))  # 1 -> 0: another version, not garbage
    for verb, argv in _verbs(h, db, specs, f"kprof.{eids[0].hex()[:16]}").items():
        assert main(argv) == 3, verb
        err = capsys.readouterr().err
        assert "is damaged: LMDB finds its header invalid" in err and "restore the file from a copy" in err, verb
    assert main(["audit", "--db", db, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and doc["counts"] == {"structure": 1} and "header invalid" in doc["findings"][0]


@pytest.mark.parametrize("where", ["current", "events"])
def test_a_value_nested_past_the_decoders_depth_is_damage_naming_its_key(h, rows, capsys, where):
    """A stored value holding, past the fields this kprof reads, a field nested thousands of levels deep (a crafted
    file; a newer kprof's field is skipped) raised the decoder's RecursionError: a traceback. It is damage (exit 3)
    naming the row's key, or the event."""
    from kprof.ledger._reducer import seal_digest

    db, specs, (eid, _other) = rows
    deep = b"\x91" * 5000 + b"\xc0"  # [[[...[None]...]]]
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key, value = next(iter(txn.cursor(ledger.dbs["current"])))
        event = txn.get(eid, db=ledger.dbs["events"])
    body = bytes(msgspec.msgpack.decode(value, type=Sealed).body)
    assert body[0] == 0x93 and event[0] == 0x89  # an array of 3 fields, a map of 9
    body = b"\x94" + body[1:] + deep  # one more field, sealed as a writer seals it
    event = b"\x8a" + event[1:] + msgspec.msgpack.encode("newer") + deep
    crafted = _codec.event_id(event)

    def craft(txn, dbs):
        if where == "current":
            txn.put(key, _codec.encode(Sealed(msgspec.Raw(body), seal_digest(key, body))), db=dbs["current"])
        else:
            txn.put(crafted, event, db=dbs["events"])

    _tamper(db, craft)
    argvs = [_verbs(h, db, specs, "")[verb] for verb in ("query", "count-missing")] if where == "current" else [
        ["show", crafted.hex(), "--db", db, "--json"]]
    for argv in argvs:
        assert main(argv) == 3, argv
        out, err = capsys.readouterr()
        named = key.hex() if where == "current" else crafted.hex()[:16]
        assert out == "" and named in err and "RecursionError" not in err and "kprof audit" in err, err


@pytest.mark.parametrize("byte", [-1, 31, 30])  # in the row key, in the shape id's last bytes
def test_a_stale_row_under_a_damaged_scope_index_key_is_refused_not_read_as_missing(h, rows, capsys, local_gpu, byte):
    """A spec's row of an earlier profiler revision is found through `scope_index` (scope, shape, row key): a bit
    flipped in an entry's row key named a key the ledger never held, or in its shape id moved it to a shape of none,
    and `query` read the stale row `missing` (exit 0). A key the index names must have a history, as every key
    written has, and a shape none is under must have neighbours under their own rows' shapes (exit 3)."""
    db, _specs, _eids = rows
    spec = h.gemm(m=128)
    stale = h.make_event(spec, local_gpu, revision=0)
    h.append(db, stale)
    args = ["query", h.GEMM, "--backend", h.CPU, *h.spec_args(spec), "--db", db, "--json"]
    assert main(args) == 0 and [r["status"] for r in json.loads(capsys.readouterr().out)["results"]] == ["stale"]
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        entry = next(k for k in txn.cursor(ledger.dbs["scope_index"]).iternext(values=False) if k[32:] == stale.key)
    moved = bytearray(entry)
    moved[byte] ^= 1
    moved = bytes(moved)

    def move(txn, dbs):
        txn.delete(entry, db=dbs["scope_index"])
        txn.put(moved, b"", db=dbs["scope_index"])

    _tamper(db, move)
    assert main(args) == 3
    out, err = capsys.readouterr()
    assert out == "" and (moved[32:] if byte < 0 else moved).hex() in err and "kprof audit" in err, err


def test_view_rows_under_a_damaged_shape_id_are_refused_not_yielded_twice(h, rows, local_gpu):
    """view.rows() yields one row per spec: a bit flipped in the shape id of a spec's stale entry (the spec re-measured
    since) moved it to a shape of its own, and the spec was yielded twice, ok and stale. An entry must be under its
    row's shape (exit 3)."""
    from kprof import api
    from kprof.errors import IntegrityError

    db, specs, _eids = rows
    stale = h.make_event(specs[0], local_gpu, revision=0)
    h.append(db, stale)
    with Ledger.open(db, readonly=True) as ledger:
        assert [r.status for r in api.view(ledger, h.GEMM, h.CPU, local_gpu).rows()] == ["ok", "ok"]
        with ledger.read() as txn:
            entry = next(k for k in txn.cursor(ledger.dbs["scope_index"]).iternext(values=False) if k[32:] == stale.key)
    moved = entry[:16] + bytes([entry[16] ^ 0x80]) + entry[17:]

    def move(txn, dbs):
        txn.delete(entry, db=dbs["scope_index"])
        txn.put(moved, b"", db=dbs["scope_index"])

    _tamper(db, move)
    with Ledger.open(db, readonly=True) as ledger:
        with pytest.raises(IntegrityError, match=f"scope_index entry {moved.hex()} is not under its row's shape"):
            list(api.view(ledger, h.GEMM, h.CPU, local_gpu).rows())


def test_a_history_entry_naming_another_keys_event_is_refused_not_shown_as_its_history(h, rows, capsys):
    """A history entry whose seqs gained the seq of another key's event (its bytes still hash to its id) is damage:
    `show` of the row's citation refuses it (exit 3) instead of listing the other key's measurement as this key's."""
    db, specs, (eid, other) = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key = msgspec.msgpack.decode(txn.get(eid, db=ledger.dbs["events"]))["key"]
        seq_of = {e: seq for seq, e, _data in ledger.iter_log(txn)}

    def graft(txn, dbs):
        entry = msgspec.msgpack.decode(txn.get(key, db=dbs["history"]), type=HistoryEntry)
        txn.put(key, _codec.encode(HistoryEntry(entry.status, sorted([*entry.seqs, seq_of[other]]))), db=dbs["history"])

    _tamper(db, graft)
    assert main(["show", "kprof." + eid.hex()[:16], "--db", db]) == 3
    out, err = capsys.readouterr()
    assert out == "" and f"event {other.hex()} belongs to key" in err and "kprof audit" in err, err


def test_a_row_whose_event_is_gone_is_refused_naming_the_event(h, rows, capsys):
    """`show` of a key whose event bytes were lost names that event as not stored (exit 3)."""
    db, _specs, (eid, _other) = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key = msgspec.msgpack.decode(txn.get(eid, db=ledger.dbs["events"]))["key"]
    _tamper(db, lambda txn, dbs: txn.delete(eid, db=dbs["events"]))
    assert main(["show", key.hex()[:16], "--db", db]) == 3
    out, err = capsys.readouterr()
    assert out == "" and f"event {eid.hex()} is not stored" in err and "kprof audit" in err, err


def test_a_history_naming_a_seq_the_log_lacks_is_refused_naming_the_seq(h, rows, capsys):
    """`show` of a key whose history names a seq no longer in the log names that seq (exit 3)."""
    db, _specs, (eid, _other) = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key = msgspec.msgpack.decode(txn.get(eid, db=ledger.dbs["events"]))["key"]
        (seq,) = msgspec.msgpack.decode(txn.get(key, db=ledger.dbs["history"]), type=HistoryEntry).seqs
    _tamper(db, lambda txn, dbs: txn.delete(seq.to_bytes(8, "big"), db=dbs["log"]))
    assert main(["show", key.hex()[:16], "--db", db]) == 3
    out, err = capsys.readouterr()
    assert out == "" and f"names seq {seq}, which is not in the log" in err and "kprof audit" in err, err


def test_the_audit_a_damaged_ledger_s_error_names_is_of_that_ledger(h, rows, capsys, monkeypatch, tmp_path):
    """`kprof query ... --db team.db` on a damaged ledger said "run `kprof audit` for the full report": run as said,
    that audits $KPROF_DB or ./profile.db, another file, and may report it clean. The advice names the ledger given
    with --db (and stays as it was where none was: `kprof audit` reads the same default)."""
    db, specs, _eids = rows
    with Ledger.open(db, readonly=True) as ledger, ledger.read() as txn:
        key, value = next(iter(txn.cursor(ledger.dbs["current"])))
    _tamper(db, lambda txn, dbs: txn.put(key, value[:-1] + bytes([value[-1] ^ 1]), db=dbs["current"]))
    monkeypatch.chdir(tmp_path)
    count = ["count-missing", h.GEMM, "--backend", h.CPU, *h.spec_args(*specs), f"--db={db}"]
    for argv in (_verbs(h, db, specs, "")["query"], count, ["show", key.hex(), "--db", db]):
        assert main(argv) == 3, argv
        err = capsys.readouterr().err
        assert f"run `kprof audit --db {db}` for the full report" in err, err
    monkeypatch.setenv("KPROF_DB", db)
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(*specs)]) == 3
    assert "; run `kprof audit` for the full report" in capsys.readouterr().err


def test_the_audit_lmdb_s_own_damage_names_runs_in_a_shell_on_that_ledger(h, local_gpu, tmp_path, capsys):
    """A ledger whose main tree LMDB finds of the wrong page type (MDB_CORRUPTED, as it is opened) said "run `kprof
    audit --db team ledgers/p.db`": the path unquoted, so a shell ran `kprof audit --db team` with two stray
    arguments (a usage error) instead of the audit. Pasted as printed, it audits that ledger (exit 3, its damage)."""
    import shlex
    import struct

    import lmdb

    db = str(tmp_path / "team ledgers" / "p.db")
    os.mkdir(os.path.dirname(db))
    h.append(db, h.make_event(h.gemm(m=32), local_gpu))
    env = lmdb.open(db, subdir=False, lock=False)
    psize = env.stat()["psize"]
    env.close()
    with open(db, "r+b") as f:
        metas = [(struct.unpack_from("<Q", m, 144)[0], struct.unpack_from("<Q", m, 128)[0])
                 for m in (f.read(psize), f.read(psize))]
        f.seek(max(metas)[1] * psize)  # the main tree's root page, of the newer meta page
        f.write(b"\xab" * psize)
    prog = (sys.executable, "-m", "kprof")
    assert main(["scopes", "--db", db], prog=prog) == 3
    err = capsys.readouterr().err
    command = err[err.index(f"`{shlex.join(prog)} audit"):].split("`")[1]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))}
    env.pop("KPROF_DB", None)
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and db in done.stdout + done.stderr, (command, done.stdout, done.stderr)


@pytest.mark.skipif(not hasattr(_sigbus.signal, "SIGBUS"), reason="no SIGBUS here")
def test_the_audit_a_sigbus_names_is_of_the_ledger_given_as_typed(tmp_path):
    """A fault reading the mapping of `--db 'team ledgers/p.db'` said "run `kprof audit`": pasted, that audits
    $KPROF_DB or ./profile.db, another file (and the launcher's user may have no `kprof`). The line names the ledger
    given, quoted for a shell, in the command as typed."""
    import shlex

    db = str(tmp_path / "team ledgers" / "p.db")
    path = tmp_path / "mapped"
    code = f"""
import ctypes, mmap, os, sys
import kprof.cli as cli
def app(argv):
    f = open({str(path)!r}, "wb+"); f.write(b"x" * 8192); f.flush()
    m = mmap.mmap(f.fileno(), 8192)
    os.truncate({str(path)!r}, 0)
    buf = (ctypes.c_char * 8192).from_buffer(m)
    ctypes.string_at(ctypes.addressof(buf) + 4096, 4)
cli._app = lambda prog: app
sys.exit(cli.main(["scopes", "--db", {db!r}], prog=(sys.executable, "-m", "launcher", "kernel-profile")))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout == "", proc.stderr
    assert shlex.split(proc.stderr.split("`")[1]) == [sys.executable, "-m", "launcher", "kernel-profile", "audit",
                                                      "--db", db], proc.stderr
