"""Smoke test of the ledger benchmark script: it runs end to end at a tiny size and prints its table.

The figures themselves are never asserted: timings do not belong in pass/fail tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "ledger_bench.py")


@pytest.mark.slow
def test_ledger_bench_runs_and_prints_its_table(tmp_path):
    out = tmp_path / "out"
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--events", "2000", "--queries", "1000", "--batch", "500", "--repeat", "1",
         "--out", str(out), "--workdir", str(work)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("figure"))
    table = lines[header:]
    assert len(table) == 2 + 14, proc.stdout  # header, rule, 14 figures: the table is the last thing printed
    for figure in ("ingest events/s", "get_many specs/s", "missing specs/s", "repeated get_many specs/s",
                   "repeated missing specs/s", "first get_many", "first missing", "py-lmdb ceiling",
                   "py-lmdb sorted cursor", "audit seconds", "bytes on disk / event", "lookup peak RSS",
                   "lookup anonymous memory", "lookup file pages"):
        assert any(line.startswith(figure) for line in table), figure
    assert all(("PASS" in line or "FAIL" in line or "—" in line) for line in table[2:])

    figures = json.loads((out / "ledger_bench.json").read_text())
    assert figures["config"]["events"] == 2000
    assert figures["kprof"]["audit_ok"] is True
    assert figures["kprof"]["memo_specs"] >= 2 * 1000  # the memo holds the repeated get_many and missing answers
    assert not any(work.iterdir())  # the databases were removed
