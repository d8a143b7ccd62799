"""comm_check.py's gloo dry run at a tiny size: every table measured, everything in its tarball, nothing left in the
temporary directory (its working copy of the ledger and snapshots was left there, one per run). The figures are
never asserted: timings do not belong in pass/fail tests."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path


def test_comm_check_gloo_dry_run_leaves_only_its_tarball(tmp_path):
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    script = Path(__file__).with_name("comm_check.py")
    proc = subprocess.run([sys.executable, str(script), "--backend", "gloo", "--world-sizes", "2", "--max-bytes", "1024",
                           "--budget-s", "0.02", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# a dry run on gloo" in proc.stdout and proc.stdout.count("2    1/1") == 4, proc.stdout
    with tarfile.open(out / "comm_check.tar.gz") as t:
        assert "comm_check/comm_check.json" in t.getnames()
    assert os.listdir(tmp) == []
