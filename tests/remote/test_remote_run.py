"""Real remote runs of torch-cpu single_gemm: a local Ray cluster (one per module, shared) and submitit's
LocalExecutor measure the chunks, return segments, and the segments are merged into the ledger at $KPROF_DB as
they arrive; remote-run.json records the run; --fresh merges nothing; a conflict merges nothing of its segment."""

from __future__ import annotations

import json
import os

import pytest

from kprof import __version__
from kprof.cli import main
from kprof.cli._remote import run_remote_cli
from kprof.measure.env import cpu_model
from kprof.remote import run_remote
from kprof.runners import remote as remote_module

pytestmark = pytest.mark.slow

RAY = """
remotes:
  ray:
    kind: ray
    launch:
      ray:
        address: local
  sub:
    kind: slurm
    workers: 2
    launch:
      slurm: {time: 5, cluster: local, folder: logs/submitit}
"""
GPU = cpu_model()
SPECS = [{"m": 1, "n": 64, "k": 64, "dtype": "fp32"}, {"m": 8, "n": 64, "k": 64, "dtype": "fp32"},
         {"m": 16, "n": 32, "k": 64, "dtype": "fp32"}, {"m": 32, "n": 32, "k": 32, "dtype": "fp32"}]


def _cli_json(capsys, *, remote="ray", mode="jit", output_dir="out", remote_set=()):
    rc = run_remote_cli("single_gemm", "torch-cpu", [dict(s) for s in SPECS], remote=remote,
                        remote_set=list(remote_set), output_dir=output_dir, mode=mode, gpu_name=None, db=None,
                        timer=None, l2=None, cuda_graph=None, power=None, json=True, command="kprof run --remote")
    return rc, json.loads(capsys.readouterr().out)


def _query_json(capsys, db) -> dict:
    args = ["query", "single_gemm", "--backend", "torch-cpu", "--db", db, "--json"]
    for s in SPECS:
        args += ["--spec", json.dumps(s)]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def _record(output_dir="out") -> dict:
    with open(os.path.join(output_dir, "remote-run.json")) as f:
        return json.load(f)


def test_ray_measures_ships_and_merges_the_missing_specs(ray_cluster, remote_yaml, db, capsys, h):
    remote_yaml(RAY)
    rc, doc = _cli_json(capsys)
    assert rc == 0
    assert doc["mode"] == "jit" and doc["count"] == 4 and doc["missing_count"] == 0 and doc["db"] == db
    assert [r["status"] for r in doc["results"]] == ["ok"] * 4
    assert all(r["citation"] for r in doc["results"])
    query = _query_json(capsys, db)  # the rows as merged: identical when queried
    assert query["results"] == doc["results"] and query["view_root"] == doc["view_root"]

    record = _record()
    assert record["remote"] == "ray" and record["kind"] == "ray" and record["kprof_version"] == __version__
    assert record["engine"]["engine"] == "ray" and record["engine"]["address"] == "local"
    assert record["engine"]["job_ids"] and record["engine"]["hosts"]
    assert len(record["engine"]["gpus"]) == len(record["chunks"]) == 2  # one actor per CPU slot of the cluster
    assert record["measured"] == 4 and record["merged"] == {"added": 4, "existing": 0} and record["conflicts"] == 0
    assert [c["status"] for c in record["chunks"]] == ["merged", "merged"]
    names = sorted(os.listdir("out/segments"))
    assert len(names) == 2 and all(n.endswith(".kseg") for n in names)
    assert sorted(os.path.basename(p) for p in record["segments"]) == names
    assert {"request.json", "results.json", "remote-run.json"} <= set(os.listdir("out"))

    # JIT again: nothing is missing, nothing is submitted, the rows are the same
    root = h.view_root(db, GPU)
    rc, again = _cli_json(capsys, output_dir="out2")
    assert rc == 0 and again["results"] == doc["results"] and h.view_root(db, GPU) == root
    assert _record("out2")["measured"] == 0 and _record("out2")["chunks"] == []


def test_fresh_merges_nothing(ray_cluster, remote_yaml, db, capsys, h):
    remote_yaml(RAY)
    h.hand_row(db, SPECS[0], GPU)
    root = h.view_root(db, GPU)
    rc, doc = _cli_json(capsys, mode="fresh", remote_set=["workers=1"])
    assert rc == 0 and doc["mode"] == "fresh"
    assert [r["status"] for r in doc["results"]] == ["ok"] * 4 and all(r["citation"] is None for r in doc["results"])
    assert h.view_root(db, GPU) == root
    record = _record()
    assert record["merged"] == {"added": 0, "existing": 0} and [c["status"] for c in record["chunks"]] == ["fresh"]
    assert len(os.listdir("out/segments")) == 1 and record["overrides"] == ["workers=1"]


def test_a_conflict_merges_nothing_of_its_segment_and_exits_3(ray_cluster, remote_yaml, db, capsys, h, monkeypatch):
    """While the remote measures, the ledger gets another row for the first spec (as a second run would): the
    returned segment's event for that key has no parent, the current row is the hand-made one: a conflict."""
    remote_yaml(RAY)
    real = remote_module.executor_for

    def racing(remote, device, output_dir):
        executor = real(remote, device, output_dir)
        submit = executor.submit

        def submit_while_the_ledger_changes(chunks):
            h.hand_row(db, SPECS[0], GPU, time_ms=123.0)
            yield from submit(chunks)

        executor.submit = submit_while_the_ledger_changes
        return executor

    monkeypatch.setattr(remote_module, "executor_for", racing)
    res = run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", remote_set=["workers=1"], output_dir="out")
    root = h.view_root(db, GPU)
    assert res.exit_code == 3 and res.merge_report == os.path.join("out", "merge-report.json")
    with open("out/merge-report.json") as f:
        report = json.load(f)
    assert report["conflicts"] == 1 and report["keys"][0]["current"]["metrics"]["time_ms"] == 123.0
    record = _record()
    assert record["conflicts"] == 1 and record["merged"] == {"added": 0, "existing": 0}
    assert [c["status"] for c in record["chunks"]] == ["conflict"] and record["merge_report"] == res.merge_report
    # nothing of the segment was merged: only the hand-made row, the others still missing
    assert [r["status"] for r in res.results] == ["ok", "missing", "missing", "missing"]
    assert res.view_root == root
    assert len(os.listdir("out/segments")) == 1  # the segment is kept, for inspection


def test_submitit_local_executor_measures_ships_and_merges(remote_yaml, db, capsys):
    remote_yaml(RAY)
    rc = run_remote_cli("single_gemm", "torch-cpu", SPECS, remote="sub", remote_set=[], output_dir="out",
                        mode="force", gpu_name=None, db=None, timer=None, l2=None, cuda_graph=None, power=None,
                        json=False, command="kprof run --remote sub")
    captured = capsys.readouterr()
    assert rc == 0
    assert "4 of 4 ok, 0 missing" in captured.out and "on remote sub (submitit local)" in captured.out
    assert "4 event(s) merged; record out/remote-run.json" in captured.out
    assert captured.err.count("chunk ") == 2 and "merged" in captured.err
    with open("out/results.json") as f:  # the run's snapshot, as `run --output-dir` writes it
        results = json.load(f)
    assert [r["status"] for r in results["results"]] == ["ok"] * 4
    assert _query_json(capsys, db)["results"] == results["results"]
    record = _record()
    engine = record["engine"]
    assert engine["engine"] == "submitit" and engine["cluster"] == "local" and len(engine["job_ids"]) == 2
    assert engine["hosts"] and engine["folder"] == "logs/submitit"
    assert record["merged"] == {"added": 4, "existing": 0} and [c["status"] for c in record["chunks"]] == ["merged"] * 2
    assert len(os.listdir("out/segments")) == 2
