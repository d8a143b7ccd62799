"""merge_bench.py end to end at a tiny size: it builds, exports, merges and prints its table last. The figures
themselves are never asserted: timings do not belong in pass/fail tests."""

import json
import subprocess
import sys
from pathlib import Path


def test_merge_bench_runs_and_prints_its_table(tmp_path):
    script = Path(__file__).with_name("merge_bench.py")
    proc = subprocess.run([sys.executable, str(script), "--events", "2000", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("figure"))
    table = lines[header + 1:]
    assert len(table) == 8 and any(line.startswith("every event merged") and line.endswith("PASS") for line in table)
    doc = json.loads((tmp_path / "merge_bench.json").read_text())
    assert doc["merge"]["added"] == 2000 and doc["ledger_after"] == 4000 and doc["export"]["events"] == 2000
