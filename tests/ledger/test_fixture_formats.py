"""Every committed ledger format stays readable: opening a file of an older format rebuilds its views from the log
(one transaction; events and log untouched), after which it answers exactly as when it was built and audits clean."""

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile

import lmdb
import msgspec
import pytest

from kprof.ledger import Ledger, _codec
from kprof import synth
from kprof.ledger._reducer import NO_ROW, CurrentRow, HistoryEntry, Sealed
from kprof.ledger.audit import audit

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "ledgers")
VERSIONS = range(1, _codec.FORMAT_VERSION + 1)
SPECS = [synth.spec(i) for i in range(48)]


def _copy(tmp_path, version: int):
    path = str(tmp_path / f"synthetic-v{version}.db")
    shutil.copyfile(os.path.join(FIXTURES, f"synthetic-v{version}.db"), path)
    with open(os.path.join(FIXTURES, f"synthetic-v{version}.json")) as f:
        return path, json.load(f)


def _answers(led: Ledger):
    view = synth.view(led)
    rows = view.get_many(SPECS)
    return [r.status for r in rows], view.missing(SPECS), view.root, rows[0]


def _raw(path: str, names) -> dict:
    """Every (key, value) of the named sub-databases, read with py-lmdb alone (no upgrade, no decoding)."""
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=16)
    try:
        with env.begin() as txn:
            return {name: list(txn.cursor(env.open_db(name.encode(), txn=txn, create=False))) for name in names}
    finally:
        env.close()


def _log(led: Ledger) -> list:
    with led.read() as txn:
        return list(led.iter_log(txn))


def test_the_current_format_has_its_fixture():
    assert os.path.exists(os.path.join(FIXTURES, f"synthetic-v{_codec.FORMAT_VERSION}.db")), \
        "run `python fixtures/build.py` to commit the current format's fixture"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_reader_of_each_format_answers_as_built(tmp_path, version):
    path, expect = _copy(tmp_path, version)
    led = Ledger.open(path, readonly=True)
    statuses, missing, root, first = _answers(led)
    assert statuses == expect["statuses"]
    assert missing == [s for s, status in zip(SPECS, statuses) if status != "ok"]  # failed and stale included
    assert root == expect["view_root"] and led.last_seq == expect["last_seq"]
    assert first.citation == expect["citation_of_spec_0"]
    assert first.metrics["time_ms"] == expect["time_ms_of_spec_0"]
    assert led.format_version == _codec.FORMAT_VERSION
    led.close()


@pytest.mark.parametrize("version", VERSIONS[:-1])
def test_a_writer_opening_an_older_file_rewrites_its_views_and_nothing_else_and_a_reader_nothing(tmp_path, version):
    """The upgrade replays the log through the Reducer: the events and the log are the same bytes after it, every
    view value is a named record, and a key's history holds the seqs the log gives its events."""
    path, expect = _copy(tmp_path, version)
    with open(path, "rb") as f:
        before = f.read()
    stored = _raw(path, ("events", "log"))  # the bytes of the two record trees, read before any upgrade
    led = Ledger.open(path, readonly=True)  # a reader reads an upgraded copy: `query` never writes the file
    assert led.format_version == _codec.FORMAT_VERSION
    led.close()
    with open(path, "rb") as f:
        assert f.read() == before
    led = Ledger.open(path)  # a writer's open upgrades the file itself
    with open(path, "rb") as f:
        assert f.read() != before
    assert led.format_version == _codec.FORMAT_VERSION
    led.close()
    assert _raw(path, ("events", "log")) == stored  # every event and log entry the same bytes after it
    led = Ledger.open(path, readonly=True)
    log = _log(led)
    assert [seq for seq, _eid, _data in log] == list(range(1, expect["last_seq"] + 1))
    assert all(_codec.event_id(data) == eid for _seq, eid, data in log)
    with led.read() as txn:
        current = dict(txn.cursor(led.dbs["current"]))
        history = {k: msgspec.msgpack.decode(v, type=HistoryEntry) for k, v in txn.cursor(led.dbs["history"])}
    for key, raw in current.items():
        row = msgspec.msgpack.decode(msgspec.msgpack.decode(raw, type=Sealed).body, type=CurrentRow)
        assert history[key].status == row.kind
    assert sorted(seq for h in history.values() for seq in h.seqs) == list(range(1, expect["last_seq"] + 1))
    retracted = synth.event(1).key  # re-measured, and the re-measurement retracted: three events
    assert history[retracted].seqs == [2, 48, 49] and history[retracted].status == "m"
    assert all(h.status == NO_ROW for k, h in history.items() if k not in current)
    led.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_ledger_of_each_format_audits_clean_and_accepts_appends(tmp_path, version):
    path, _ = _copy(tmp_path, version)
    assert audit(path).ok
    led = Ledger.open(path)
    led.append([synth.event(100)])
    led.close()
    assert audit(path).ok


def test_a_reader_of_an_older_file_refuses_to_answer_once_a_writer_has_written_it(tmp_path):
    """A reader of an older file reads a copy made as it opened (upgraded there; the file untouched); a writer opened
    after it upgrades the file itself and answers the same. Once the file is written, the copy's answers may no longer
    be the ledger's (a simulator's loop of missing() then run() never ended): each read of the reader says to open it
    again, and a reader opened again sees the new row."""
    from kprof.errors import LedgerError

    path, _ = _copy(tmp_path, 1)
    reader = Ledger.open(path, readonly=True)
    old = _answers(reader)
    writer = Ledger.open(path)
    assert writer.format_version == _codec.FORMAT_VERSION
    assert _answers(writer) == old
    writer.append([synth.event(100)])
    with pytest.raises(LedgerError, match="changed since this reader copied it; open it again"):
        synth.view(reader).get_many(SPECS)
    writer.close()
    reader.close()
    with Ledger.open(path, readonly=True) as again:
        assert synth.view(again).get(**synth.spec(100)) is not None
    report = audit(path)
    assert report.ok, report.findings


def test_an_older_file_that_cannot_be_written_is_read_through_an_upgraded_copy(tmp_path, monkeypatch):
    """A reader that cannot write an older file (read-only media; here the file is opened as this user could not
    write it) reads a copy that LMDB makes in a temporary directory, upgraded there: the same answers, the file
    untouched, the copy removed when the reader closes. Messages still name the file."""
    from kprof.ledger import store

    path, expect = _copy(tmp_path, 3)
    with open(path, "rb") as f:
        before = f.read()
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    real_access = os.access
    monkeypatch.setattr(store.os, "access", lambda p, mode: False if p == path and mode == os.W_OK
                        else real_access(p, mode))
    led = Ledger.open(path, readonly=True)
    statuses, _missing, root, first = _answers(led)
    assert statuses == expect["statuses"] and root == expect["view_root"]
    assert first.citation == expect["citation_of_spec_0"]
    assert led.path == path and led.readonly and led.format_version == _codec.FORMAT_VERSION
    assert len(os.listdir(temp)) == 1
    with pytest.raises(Exception, match="read-only"):
        led.append([synth.event(100)])
    led.close()
    assert os.listdir(temp) == []
    with open(path, "rb") as f:
        assert f.read() == before


def test_an_upgraded_copy_goes_when_its_reader_is_collected_or_the_process_exits(tmp_path, monkeypatch):
    """A reader never closed (a simulator's, perf_api's cached ledgers) leaves no upgraded copy behind."""
    from kprof.ledger import store

    path, _ = _copy(tmp_path, 3)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    led = Ledger.open(path, readonly=True)
    assert _answers(led) and len(os.listdir(temp)) == 1
    del led
    gc.collect()
    assert os.listdir(temp) == []
    script = ("import sys\nfrom kprof import synth\nfrom kprof.ledger import Ledger\n"
              "held = Ledger.open(sys.argv[1], readonly=True)\nsynth.view(held).get_many([synth.spec(0)])\n"
              "import os, tempfile\nprint(len(os.listdir(tempfile.gettempdir())))\n")
    done = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(temp)})
    assert done.returncode == 0 and done.stdout == "1\n", done.stderr  # the copy, while the reader is open
    assert os.listdir(temp) == []


def test_a_reader_of_an_older_file_collected_unclosed_closes_its_copys_environment(tmp_path):
    """Its copy was removed, but the copy's LMDB environment stayed open: the removed files' descriptors and mapping
    were held, one set per reader, until the process ran out of descriptors (a simulator opening readers in a loop)."""
    from kprof.ledger import store

    path, _ = _copy(tmp_path, 3)
    led = Ledger.open(path, readonly=True)
    env, copy = led.env, led.real_path
    assert _answers(led)[0].count("ok") and copy != os.path.realpath(path)
    del led
    gc.collect()
    assert copy not in store._envs
    with pytest.raises(lmdb.Error, match="closed"):
        env.stat()
    with Ledger.open(path, readonly=True) as again:  # and a reader opened after it reads as before
        assert _answers(again)[0].count("ok")


def test_the_upgraded_copy_of_a_killed_reader_goes_when_the_next_reader_opens(tmp_path, monkeypatch):
    """A reader killed by SIGKILL (the OOM killer, `timeout -s KILL`) runs no cleanup: its upgraded copy, as large as
    the ledger, stayed in the temporary directory for good, one per killed reader. The next reader's open removes
    it; the copy of a reader still alive in another process is left alone."""
    from kprof import _scratch

    path, _ = _copy(tmp_path, 3)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(_scratch, "SETTLE_S", -1.0)  # every copy old enough to be judged by its lock alone
    reader = ("import os, signal, sys\nfrom kprof import synth\nfrom kprof.ledger import Ledger\n"
              "held = Ledger.open(sys.argv[1], readonly=True)\nsynth.view(held).get_many([synth.spec(0)])\n"
              "print('open', flush=True)\nif sys.argv[2] == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
              "sys.stdin.read()\n")
    env = {**os.environ, "TMPDIR": str(temp)}
    killed = subprocess.run([sys.executable, "-c", reader, path, "kill"], capture_output=True, text=True, timeout=60,
                            env=env)
    assert killed.returncode == -9 and killed.stdout == "open\n", killed.stderr
    left = os.listdir(temp)
    assert len(left) == 1  # the killed reader's copy
    alive = subprocess.Popen([sys.executable, "-c", reader, path, "hold"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert alive.stdout.readline() == "open\n"
        held = set(os.listdir(temp)) - set(left)
        led = Ledger.open(path, readonly=True)
        assert _answers(led)
        mine = set(os.listdir(temp)) - held
        assert len(mine) == 1 and not mine & set(left)  # the killed reader's copy gone, the live reader's kept
        led.close()
        assert set(os.listdir(temp)) == held
    finally:
        alive.communicate("", timeout=60)
    assert os.listdir(temp) == []


def test_the_copy_of_a_reader_killed_just_now_goes_at_the_next_readers_open(tmp_path, monkeypatch):
    """A reader killed by SIGKILL and started again at once (a scheduler restarting an OOM-killed job) left its copy,
    as large as the ledger, for the next minute's opens to step over: only a directory a minute old was taken for
    left over, so copies piled up until the temporary directory was full. A copy holding a file was locked before it
    was written, so one no process holds goes at once; an empty one (its maker between making and locking it) stays."""
    path, _ = _copy(tmp_path, 2)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    reader = ("import os, signal, sys\nfrom kprof import synth\nfrom kprof.ledger import Ledger\n"
              "held = Ledger.open(sys.argv[1], readonly=True)\nsynth.view(held).get_many([synth.spec(0)])\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", reader, path], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "TMPDIR": str(temp)})
    assert killed.returncode == -9, killed.stderr
    assert len(os.listdir(temp)) == 1
    (temp / "kprof-upgraded-copy-being-made").mkdir()  # another process's, not locked yet
    led = Ledger.open(path, readonly=True)
    assert _answers(led) and len(os.listdir(temp)) == 2  # this reader's copy, and the one being made
    led.close()
    assert os.listdir(temp) == ["kprof-upgraded-copy-being-made"]
