import json
import os

import msgspec
import pytest

from kprof.cli import main
from kprof.ledger import Ledger, _codec, build
from kprof import synth
from kprof.ledger._reducer import HistoryEntry


def test_audit_clean_ledger_exits_0_with_json(ledger_path, capsys):
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 40)))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["events"] == 40 and doc["last_seq"] == 40 and doc["findings"] == []


def test_audit_lists_damaged_view_and_exits_3(ledger_path, capsys):
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 10)))
    key = synth.event(3).key
    led.write(lambda txn: txn.delete(key, db=led.dbs["current"]))
    led.write(lambda txn: txn.put(b"\0" * 32, b"m" + b"\1" * 32, db=led.dbs["current"]))
    led.close()
    assert main(["audit", "--db", ledger_path]) == 3
    out = capsys.readouterr().out
    assert "finding(s)" in out
    assert f"current: entry {key.hex()[:24]} of the log's replay is not stored" in out
    assert "current: stored entry " + "00" * 12 + " is not derivable from the log" in out


def test_audit_reports_altered_event_bytes(ledger_path, capsys):
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 5)))
    eid, data = next(iter(led.iter_log()))[1:]
    led.write(lambda txn: txn.put(eid, data.replace(b"single_gemm", b"single_gemn"), db=led.dbs["events"]))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert f"events: event {eid.hex()[:16]}: stored bytes hash to another id (altered or damaged)" in doc["findings"]


def test_audit_of_missing_file_is_a_usage_error(tmp_path, capsys):
    assert main(["audit", "--db", str(tmp_path / "none.db")]) == 2
    assert "; pass --db or set KPROF_DB" in capsys.readouterr().err
    assert main(["audit", "--remeasure", "1", "--db", str(tmp_path / "none.db")]) == 2
    assert "; pass --db or set KPROF_DB" in capsys.readouterr().err
    assert not (tmp_path / "none.db").exists()


def test_audit_and_remeasure_of_missing_file_speak_to_python_callers(tmp_path):
    from kprof.errors import LedgerPathError
    from kprof.ledger.audit import audit
    from kprof.remeasure import remeasure

    for call in (audit, lambda path: remeasure(path, 1)):
        with pytest.raises(LedgerPathError, match=r"no ledger (file )?at .*none\.db; pass db=\.\.\. or set KPROF_DB"):
            call(str(tmp_path / "none.db"))
    assert not (tmp_path / "none.db").exists()


def test_audit_lists_a_logged_event_missing_from_the_store(ledger_path, capsys):
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 12)))
    seq, eid, _data = list(led.iter_log())[7]
    led.write(lambda txn: txn.delete(eid, db=led.dbs["events"]))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert f"log: seq {seq}: event {eid.hex()[:16]} is not in the event store" in doc["findings"]


def test_audit_lists_a_stored_view_entry_no_replay_derives(ledger_path, capsys):
    """Every rebuilt entry is stored (the fast subset check passes), but a view holds one more: the counts
    disagree, and the detailed pass names the entry."""
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 10)))
    led.write(lambda txn: txn.put(b"\x42" * 40, b"\x07" * 32, db=led.dbs["history"]))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"] == ["views: history: stored entry " + "42" * 12 + " is not derivable from the log"]


def test_audit_lists_a_scope_index_entry_that_holds_a_value(ledger_path, capsys):
    """The shards test their scope-index entries for presence only; the structure walk finds the value, and
    the detailed pass names the entry."""
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 10)))
    with led.read() as txn:
        entry = list(txn.cursor(led.dbs["scope_index"]).iternext(values=False))[4]
    led.write(lambda txn: txn.put(entry, b"x", db=led.dbs["scope_index"]))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"] == [f"views: scope_index: entry {entry.hex()[:24]} differs from the log's replay"]


def test_audit_lists_history_entries_whose_status_or_events_disagree_with_the_log(ledger_path, capsys):
    """A history entry's status byte (the kind of the key's current row, what `missing` reads) and its seqs are
    rebuilt and compared like every view: a measured row's key marked failed, and a seq dropped, are named."""
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 10)))
    led.append([synth.event(4, seed=1)])  # a re-measurement: key 4 holds two seqs
    marked, dropped = synth.event(2).key, synth.event(4).key
    with led.read() as txn:
        value = msgspec.msgpack.decode(txn.get(dropped, db=led.dbs["history"]), type=HistoryEntry)
        status = msgspec.msgpack.decode(txn.get(marked, db=led.dbs["history"]), type=HistoryEntry)
    assert len(value.seqs) == 2 and status.status == "m"
    led.write(lambda txn: txn.put(marked, _codec.encode(HistoryEntry("f", status.seqs)), db=led.dbs["history"]))
    led.write(lambda txn: txn.put(dropped, _codec.encode(HistoryEntry("m", value.seqs[:1])), db=led.dbs["history"]))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["findings"]) == sorted([f"views: history: entry {marked.hex()[:24]} differs from the log's replay",
                                              f"views: history: entry {dropped.hex()[:24]} differs from the log's replay"])


def test_audit_lists_a_retraction_entry_that_names_another_event(ledger_path, capsys):
    """The retractions view (target event id -> retraction's id) is compared value by value: an entry whose
    value names another event is listed, though every key is present and the counts agree."""
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 10)))
    target = _codec.event_id(_codec.encode(synth.event(3)))
    led.append([build.retraction(target, synth.event(3).key, "bad clocks")])
    led.write(lambda txn: txn.put(target, b"\x09" * 32, db=led.dbs["retracted"]))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"] == [f"views: retracted: entry {target.hex()[:24]} differs from the log's replay"]


@pytest.mark.parametrize("first_byte", [0x01, 0xF1])  # a row key of each shard
def test_audit_lists_scope_index_entries_missing_or_extra(ledger_path, capsys, first_byte):
    """Each shard looks up its scope-index entries (by the row key's first byte) and the counts are added up: an
    entry removed and one added (a row key of either shard) are both named."""
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 10)))
    with led.read() as txn:
        removed = list(txn.cursor(led.dbs["scope_index"]).iternext(values=False))[6]
    extra = removed[:32] + bytes([first_byte]) + b"\x05" * 31
    led.write(lambda txn: txn.delete(removed, db=led.dbs["scope_index"]) and
              txn.put(extra, b"", db=led.dbs["scope_index"]))
    led.close()
    assert main(["audit", "--db", ledger_path, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["findings"]) == sorted([
        f"views: scope_index: entry {removed.hex()[:24]} of the log's replay is not stored",
        f"views: scope_index: stored entry {extra.hex()[:24]} is not derivable from the log"])


class _Cursor:
    """A cursor over given (key, value) pairs, in the given order (a B-tree whose keys are out of order)."""

    def __init__(self, items):
        self.items, self.at = items, 0

    def set_range(self, lo):
        self.at = next((i for i, (k, _) in enumerate(self.items) if k >= lo), len(self.items))
        return self.at < len(self.items)

    def first(self):
        self.at = 0
        return bool(self.items)

    def __iter__(self):
        while self.at < len(self.items):
            yield self.items[self.at]
            self.at += 1


def test_a_shards_range_walk_counts_its_entries_and_names_keys_out_of_order():
    """The views keyed by row key are walked where they are compared: each shard counts its range (the parent
    adds the counts up against the header's) and names a key that does not follow the one before."""
    from kprof.ledger._audit_worker import Findings, Shard

    keys = [bytes([b]) * 32 for b in (0x10, 0x30, 0x20, 0x70, 0x90, 0xA0)]  # 0x20 after 0x30
    for shard, count in ((0, 4), (1, 2)):
        found = Findings()
        work = Shard(None, shard, 2, found)
        walked = [k for k, _ in work._range(_Cursor([(k, b"") for k in keys]), "current")]
        assert walked == (keys[:4] if shard == 0 else keys[4:])
        assert work.walked == {"current": count}
        assert found.items == (["structure: current: keys out of order after " + "30" * 12] if shard == 0 else [])


def test_the_events_walk_names_an_event_id_out_of_order():
    """Shard 0 checks that each event id follows the one before as it walks the event store (a damaged page)."""
    from types import SimpleNamespace

    from kprof.ledger._audit_worker import Findings, Shard

    items = sorted((_codec.event_id(data), data) for data in (_codec.encode(synth.event(i)) for i in range(3)))
    items[1], items[2] = items[2], items[1]
    found = Findings()
    work = Shard(SimpleNamespace(dbs={"events": None}), 0, 1, found)
    n, logged, kept = work.events(SimpleNamespace(cursor=lambda _db: iter(items)), {eid: 1 for eid, _ in items})
    assert (n, logged, len(kept)) == (3, 3, 3)
    assert found.items == [f"structure: events: keys out of order at {items[2][0].hex()[:16]}"]


def test_audit_of_a_truncated_ledger_does_not_send_the_reader_to_itself(ledger_path, capsys):
    """The truncation error other verbs print ends "run `kprof audit` for the full report": in the audit's own
    report that is dropped, and the fix stays."""
    import os

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 200)))
    led.close()
    with open(ledger_path, "r+b") as f:
        f.truncate(os.path.getsize(ledger_path) // 2)
    for argv in (["audit", "--db", ledger_path], ["audit", "--db", ledger_path, "--json"]):
        assert main(argv) == 3
        out = capsys.readouterr().out
        assert "is truncated" in out and "restore the file from a copy" in out and "kprof audit" not in out


def test_audit_jobs_past_the_cpus_and_keys_run_as_many_shards_as_are_of_use(ledger_path, capsys, monkeypatch):
    """`kprof audit --jobs 256` spawned 256 shard processes whatever the host and the ledger (50 s on 2 cores over a
    ledger of two rows): it runs at most one per CPU and one per row key, says so, and finds what one shard finds."""
    import os

    from kprof.ledger import audit as audit_module

    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 3)))
    key = synth.event(1).key
    led.write(lambda txn: txn.delete(key, db=led.dbs["current"]))  # a damaged view: a finding, whatever the shards
    led.close()
    asked, shards = [], audit_module._shards
    monkeypatch.setattr(audit_module, "_shards", lambda path, jobs: asked.append(jobs) or shards(path, min(jobs, 2)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    docs, errs = [], []
    for jobs in ("256", "1"):
        assert main(["audit", "--db", ledger_path, "--json", "--jobs", jobs]) == 3
        out, err = capsys.readouterr()
        docs.append({k: v for k, v in json.loads(out).items() if k != "seconds"})
        errs.append(err)
    assert asked == [2, 1]  # two keys have a current row (four CPUs): two shards
    assert "note: --jobs 256: the audit ran 2 shard process(es), as many as are of use" in errs[0], errs[0]
    assert errs[1] == ""
    assert docs[0] == docs[1] and f"current: entry {key.hex()[:24]} of the log's replay is not stored" in \
        " ".join(docs[0]["findings"])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a process that may use two CPUs or more, to run one allowed only one")
def test_the_default_jobs_the_help_states_is_of_the_cpus_this_process_may_use(tmp_path):
    """`kprof audit --help` said "default: one per core, up to 8, here N" with N the machine's CPU count: a process
    allowed fewer CPUs (taskset, a container's cpuset) ran fewer shards than the help stated. The default now counts
    the CPUs this process may use, and the help states that number."""
    import subprocess
    import sys

    one = min(os.sched_getaffinity(0))
    code = ("from kprof.ledger.audit import JOBS; from kprof.cli import main; print(JOBS); "
            "main(['audit', '--help'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "COLUMNS": "400"}, preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "1"
    assert "default: one per CPU this process may use, up to 8, here 1)" in p.stdout
