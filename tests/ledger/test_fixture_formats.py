"""The committed format-1 ledger stays readable, audits clean and answers exactly as when it was built."""

import json
import os
import shutil

import pytest

from kprof.ledger import Ledger, synth
from kprof.ledger.audit import audit

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "ledgers")


@pytest.fixture
def v1(tmp_path):
    path = str(tmp_path / "synthetic-v1.db")
    shutil.copyfile(os.path.join(FIXTURES, "synthetic-v1.db"), path)
    with open(os.path.join(FIXTURES, "synthetic-v1.json")) as f:
        return path, json.load(f)


def test_v1_ledger_reads_as_built(v1):
    path, expect = v1
    led = Ledger.open(path, readonly=True)
    view = synth.view(led)
    rows = view.get_many([synth.spec(i) for i in range(48)])
    assert [r.status for r in rows] == expect["statuses"]
    assert view.root == expect["view_root"] and led.last_seq == expect["last_seq"]
    assert rows[0].citation == expect["citation_of_spec_0"]
    assert rows[0].metrics["time_ms"] == expect["time_ms_of_spec_0"]
    assert led.format_version == 1
    led.close()


def test_v1_ledger_audits_clean_and_accepts_appends(v1):
    path, _ = v1
    assert audit(path).ok
    led = Ledger.open(path)
    led.append([synth.event(100)])
    led.close()
    assert audit(path).ok
