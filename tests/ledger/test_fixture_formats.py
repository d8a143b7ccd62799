"""Every committed ledger format stays readable, audits clean and answers exactly as when it was built; a writer
upgrades an older file in place, to the same answers."""

import json
import os
import shutil

import pytest

from kprof.ledger import Ledger, _codec, synth
from kprof.ledger._reducer import NO_ROW, history_seqs, pack_seq
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


@pytest.mark.parametrize("version", VERSIONS)
def test_ledger_of_each_format_reads_as_built(tmp_path, version):
    path, expect = _copy(tmp_path, version)
    led = Ledger.open(path, readonly=True)
    statuses, missing, root, first = _answers(led)
    assert statuses == expect["statuses"]
    assert missing == [s for s, status in zip(SPECS, statuses) if status != "ok"]  # failed and stale included
    assert root == expect["view_root"] and led.last_seq == expect["last_seq"]
    assert first.citation == expect["citation_of_spec_0"]
    assert first.metrics["time_ms"] == expect["time_ms_of_spec_0"]
    assert led.format_version == version
    led.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_ledger_of_each_format_audits_clean_and_accepts_appends(tmp_path, version):
    path, _ = _copy(tmp_path, version)
    assert audit(path).ok
    led = Ledger.open(path)
    led.append([synth.event(100)])
    led.close()
    assert audit(path).ok


def test_a_writer_upgrades_a_format_1_file_to_the_same_answers(tmp_path):
    """Format 2 keeps a key's history as one entry (the status of its current row, then its events' seqs). A
    reader of a format-1 file answers `missing` from `current` and `failures` and `show` from the old layout;
    the first writer rewrites the history in one transaction; a reader opened before, in the same process,
    answers the same, and the file audits clean before and after."""
    path, expect = _copy(tmp_path, 1)
    with open(path, "rb") as f:
        before = f.read()
    reader = Ledger.open(path, readonly=True)
    old = _answers(reader)
    retracted = synth.event(1).key  # re-measured, and the re-measurement retracted: three events
    with reader.read() as txn:
        old_history = reader.history_of(txn, retracted)
        v1_entries = {k: v for k, v in txn.cursor(reader.dbs["history"])}
    assert [seq for seq, _eid in old_history] == [2, 48, 49]
    with open(path, "rb") as f:
        assert f.read() == before  # a reader writes nothing, not even an upgrade
    assert audit(path).ok

    writer = Ledger.open(path)  # shares the reader's environment: the upgrade runs all the same
    assert writer.format_version == _codec.FORMAT_VERSION == 3
    with writer.read() as txn:
        history = dict(txn.cursor(writer.dbs["history"]))
        current = dict(txn.cursor(writer.dbs["current"]))
        assert writer.history_of(txn, retracted) == old_history
    assert sum(len(history_seqs(v)) for v in history.values()) == len(v1_entries) == expect["last_seq"]
    for key, value in history.items():
        assert value[:1] == (current[key][:1] if key in current else NO_ROW)
        assert all(key + seq in v1_entries for seq in history_seqs(value))
    assert history[retracted] == b"m" + pack_seq(2) + pack_seq(48) + pack_seq(49)
    assert _answers(writer) == old
    writer.close()
    reader.close()

    again = Ledger.open(path, readonly=True)
    assert again.format_version == 3
    assert _answers(again) == old
    again.close()
    report = audit(path)
    assert report.ok, report.findings
