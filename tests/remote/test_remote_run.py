"""Real remote runs of torch-cpu single_gemm: a local Ray cluster (one per module, shared) and submitit's
LocalExecutor measure the chunks, return segments, and the segments are merged into the ledger at $KPROF_DB as
they arrive; remote-run.json records the run; --fresh merges nothing; a conflict merges nothing of its segment."""

from __future__ import annotations

import json
import os
import time

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

    def racing(remote, device, output_dir, need):
        executor = real(remote, device, output_dir, need)
        submit = executor.submit

        def submit_while_the_ledger_changes(chunks, first=0):
            h.hand_row(db, SPECS[0], GPU, time_ms=123.0)
            yield from submit(chunks, first)

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
    assert "4 of 4 ok, 0 missing" in captured.out
    assert "measured 4 of 4 spec(s) on remote sub (submitit local) in " in captured.out
    assert "4 event(s) merged; record out/remote-run.json" in captured.out
    assert captured.err.count("chunk ") == 2 and "merged" in captured.err
    # each progress line names its chunk by the index remote-run.json and the failure lines use
    lines = [ln for ln in captured.err.splitlines() if not ln.startswith("note: other processes took")]  # a busy host
    assert sorted(ln.split(":")[0] for ln in lines) == ["chunk 0", "chunk 1"]
    assert "(2 of 2 chunk(s) done)" in captured.err
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


def test_more_chunks_than_the_cluster_has_slots_all_run(ray_cluster, remote_yaml, db):
    """workers=4 on a 2-CPU cluster: the chunks past the two free slots start as the first ones finish (they once
    waited forever for slots held by finished workers)."""
    remote_yaml(RAY)
    res = run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", remote_set=["workers=4"], output_dir="out")
    assert res.exit_code == 0 and [r["status"] for r in res.results] == ["ok"] * 4
    record = _record()
    assert [c["status"] for c in record["chunks"]] == ["merged"] * 4 and record["merged"]["added"] == 4
    assert sorted(os.listdir("out/segments")) == [f"chunk-000{j}.kseg" for j in range(4)]


def test_a_ray_task_no_node_can_hold_is_refused_with_workers_set_too(remote_yaml):
    """Tasks of 8 GPUs on two nodes of 4: none would ever start, and Ray waited for good ("No available node types
    can fulfill resource request"), where `workers` was set; without it, 8 GPUs in all passed for one slot."""
    import types

    from kprof.errors import UsageError
    from kprof.runners.remote_config import load_remote

    path = remote_yaml(RAY)
    nodes = [{"Alive": True, "Resources": {"GPU": 4.0, "CPU": 32.0}}] * 2 + [{"Alive": False,
                                                                              "Resources": {"GPU": 8.0}}]  # a dead one
    executor = remote_module.RayExecutor.__new__(remote_module.RayExecutor)
    executor._ray = types.SimpleNamespace(nodes=lambda: nodes, cluster_resources=lambda: {"GPU": 8.0, "CPU": 64.0})
    for overrides in (["workers=2"], []):
        executor.remote, executor.gpus = load_remote("ray", path, overrides), 8
        with pytest.raises(UsageError, match=r"no node of the Ray cluster has 8 GPU\(s\) for a task \(its nodes have "
                                             r"4, 4\), so none would start; add GPUs or lower"):
            executor.workers()
        executor.gpus = 4
        assert executor.workers() == 2  # one task a node at once, or the two chunks asked for


def test_starting_ray_keeps_the_sigterm_handler_it_found(remote_yaml, monkeypatch):
    """ray.init puts its own SIGTERM handler in (sys.exit(15)): a remote run stopped by SIGTERM ended with exit 15
    and no word of what it left, where kprof's handler says so and exits 143. The handler found is put back."""
    import signal

    import ray

    from kprof.runners.remote_config import load_remote

    def ray_init(**_kwargs):  # what ray.init does to the handler
        signal.signal(signal.SIGTERM, lambda signum, frame: exit(signum))

    def ours(signum, frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", ray_init)
    before = signal.signal(signal.SIGTERM, ours)
    try:
        remote_module.RayExecutor(load_remote("ray", remote_yaml(RAY)), "cpu")
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


class _InProcess:
    """An executor measuring each chunk here (run_chunk, as a worker would) and returning `tamper(j, segment)`."""

    def __init__(self, workers=2, tamper=lambda j, seg: seg, during=lambda j: None):
        self.n, self.tamper, self.during = workers, tamper, during
        self.failures, self.infos = {}, {}

    def workers(self):
        return self.n

    def submit(self, chunks, first=0):
        for j, chunk in enumerate(chunks, first):
            self.during(j)
            segment, self.infos[j] = remote_module.run_chunk(chunk.encode())
            yield j, self.tamper(j, segment)

    def describe(self):
        return {"engine": "in-process"}

    def close(self):
        return []


def _in_process(monkeypatch, executor):
    monkeypatch.setattr(remote_module, "executor_for", lambda remote, device, output_dir, need: executor)


def _other_segment() -> bytes:
    """A good segment of a spec the run does not ask for."""
    from kprof.ledger.events import Origin
    from kprof.runners.chunk import Chunk
    from kprof.runners.registry import lookup

    chunk = Chunk.of(lookup("single_gemm", "torch-cpu"), GPU, [{"m": 2, "n": 8, "k": 8, "dtype": "fp32"}], None,
                     Origin())
    return remote_module.run_chunk(chunk.encode())[0]


def _deep_segment(tmp_path="deep.kseg") -> bytes:
    """A whole segment whose one event holds, in a field no schema declares, arrays nested a million deep (skipped by
    the decoder, recursively: a RecursionError where it was decoded)."""
    from kprof import synth
    from kprof.ledger import _codec
    from kprof.merge import segment

    data = _codec.encode(synth.event(7))
    segment.write(tmp_path, [bytes([data[0] + 1]) + data[1:] + b"\xa1z" + b"\x91" * 1_000_000 + b"\xc0"])
    with open(tmp_path, "rb") as f:
        data = f.read()
    os.unlink(tmp_path)
    return data


@pytest.mark.parametrize("returned, why", [
    (lambda seg: b"", "not a kprof segment"),
    (lambda seg: None, "the worker returned NoneType, not a segment's bytes"),
    (lambda seg: b"hello world" * 10, "not a kprof segment"),
    (lambda seg: seg[: len(seg) // 2], "truncated"),
    (lambda seg: _other_segment(), "event(s) of keys the chunk did not ask for"),
    (lambda seg: _deep_segment(), "an event of the segment does not decode (maximum recursion depth"),
], ids=["empty", "none", "junk", "truncated", "foreign", "deep"])
def test_what_is_not_a_segment_of_the_chunks_keys_is_refused_and_kept_apart(remote_yaml, db, capsys, monkeypatch,
                                                                            returned, why):
    remote_yaml(RAY)
    _in_process(monkeypatch, _InProcess(tamper=lambda j, seg: returned(seg) if j == 1 else seg))
    res = run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out")
    record = _record()
    assert [c["status"] for c in record["chunks"]] == ["merged", "refused"] and why in record["chunks"][1]["error"]
    assert res.exit_code == 1 and [r["status"] for r in res.results] == ["ok", "missing", "ok", "missing"]
    assert res.failures == [f"chunk 1 (2 specs): refused: {record['chunks'][1]['error']}"]
    assert os.listdir("out/segments") == ["chunk-0000.kseg"] and record["segments"] == ["out/segments/chunk-0000.kseg"]
    kept = [] if "NoneType" in why else ["chunk-0001.bin"]  # the bytes refused, for inspection
    assert (os.listdir("out/refused") if os.path.exists("out/refused") else []) == kept
    assert all(os.path.join("out", "refused", name) in record["chunks"][1]["error"] for name in kept)  # named
    args = ["query", "single_gemm", "--backend", "torch-cpu", "--db", db, "--json", "--spec",
            json.dumps({"m": 2, "n": 8, "k": 8, "dtype": "fp32"})]
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["results"][0]["status"] == "missing"
    assert main(["merge", "out/segments", "--db", "again.db", "--output-dir", "m"]) == 0  # segments/ merges


def test_a_run_skips_the_keys_another_run_holds_and_ends_its_claims_as_chunks_merge(remote_yaml, db, monkeypatch, h):
    """Another run holds the first spec's key: this run sends the other three, waits, and reads the row the other
    run stored. While it runs, the keys it sent are held; each chunk's are free once it merged."""
    from kprof.runners.claims import Claims

    remote_yaml(RAY)
    from kprof.api import _keys, _prepare

    entry, canonical, gpu_key, _ = _prepare("single_gemm", "torch-cpu", SPECS, None, db, {})
    keys = [_keys(entry, gpu_key).key(s) for s in canonical]
    other = Claims(db, "other").__enter__()
    assert other.take([keys[0]]) == ([keys[0]], {})
    seen = []

    def during(j):
        with Claims(db, f"probe{j}") as probe:
            seen.append(sorted(k for k in probe.take(keys)[1]))
        if j == 1:  # the other run stores its row and ends
            h.hand_row(db, SPECS[0], GPU, time_ms=123.0)
            other.release()

    _in_process(monkeypatch, _InProcess(during=during))
    res = run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out")
    assert res.exit_code == 0 and res.measured == 3 and _record()["measured"] == 3
    assert res.results[0]["metrics"]["time_ms"] == 123.0  # the other run's row, not measured twice
    # chunk 0 (specs 1 and 3) about to run: every key held, by the two runs; chunk 1 (spec 2) about to run: chunk
    # 0's keys are free again
    assert seen == [sorted(keys), sorted([keys[0], keys[2]])]
    with Claims(db, "after") as probe:
        assert probe.take(keys)[1] == {}  # the run ended its claims


def test_a_run_that_waited_for_every_spec_says_so(remote_yaml, db, capsys, monkeypatch, h):
    """Another run holds every key and stores the rows while this one waits: nothing is sent, and the summary and
    remote-run.json say the rows were waited for, as a local run's line does (it said "nothing to measure")."""
    import types

    from kprof.api import _keys, _prepare
    from kprof.runners import claims as claims_module
    from kprof.runners.claims import Claims

    remote_yaml(RAY)
    entry, canonical, gpu_key, _ = _prepare("single_gemm", "torch-cpu", SPECS, None, db, {})
    other = Claims(db, "other").__enter__()
    other.take([_keys(entry, gpu_key).key(s) for s in canonical])

    def sleep(_seconds):  # while this run waits, the other stores its rows and ends
        for spec in SPECS:
            h.hand_row(db, spec, GPU)
        other.release()

    monkeypatch.setattr(claims_module, "time", types.SimpleNamespace(sleep=sleep))
    _in_process(monkeypatch, _InProcess())
    rc = run_remote_cli("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out", json=False)
    assert rc == 0 and _record()["waited_for"] == 4 and _record()["chunks"] == []
    assert ("nothing left to measure: no spec sent to remote ray (in-process); 4 spec(s) another run was measuring "
            "were waited for; 0 event(s) merged") in capsys.readouterr().out


def test_a_remote_run_waiting_for_keys_another_run_holds_says_so_as_a_local_run_does(remote_yaml, db, capsys,
                                                                                      monkeypatch, h):
    """Another run holds one key: the remote run sends the others, then waits for it, and said nothing while it did
    (a local run prints `waiting: ...`); under --json too, on stderr, with stdout the document alone."""
    import types

    from kprof.api import _keys, _prepare
    from kprof.runners import claims as claims_module
    from kprof.runners.claims import Claims

    remote_yaml(RAY)
    entry, canonical, gpu_key, _ = _prepare("single_gemm", "torch-cpu", SPECS, None, db, {})
    other = Claims(db, "other").__enter__()
    other.take([_keys(entry, gpu_key).key(canonical[0])])

    def sleep(_seconds):  # while this run waits, the other stores its row and ends
        h.hand_row(db, SPECS[0], GPU)
        other.release()

    monkeypatch.setattr(claims_module, "time", types.SimpleNamespace(sleep=sleep))
    _in_process(monkeypatch, _InProcess())
    rc = run_remote_cli("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out", json=True)
    out, err = capsys.readouterr()
    assert rc == 0 and json.loads(out)["missing_count"] == 0 and _record()["waited_for"] == 1
    assert (f"waiting: another run on {db} is measuring 1 of these spec(s); each is read once that run stores it "
            f"(measured here if it ends without)") in err, err
    assert err.count("waiting:") == 1


def test_rows_a_busy_host_timed_are_named_as_a_local_run_names_them(remote_yaml, db, capsys, monkeypatch):
    """The worker's host ran past its cores while it timed the rows (their notes say host_busy): a local run says so
    under its table, a remote run said nothing, and the table alone does not show it. The fix it names is the remote
    run's own (`kprof run --force` measured on this machine, under its own CPU's key)."""
    remote_yaml(RAY)
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))  # the worker's host, here in-process
    _in_process(monkeypatch, _InProcess())
    specs = SPECS + SPECS[:1]  # a spec twice: one row timed
    assert run_remote_cli("single_gemm", "torch-cpu", specs, remote="ray", output_dir="out", json=False) == 0
    assert ("note: other processes took their host's cores while 4 of these CPU row(s) were timed: other work slowed "
            "them (their notes say host_busy); measure again on a quieter host with the same command with --force and "
            "a new --output-dir") in capsys.readouterr().err  # `kprof run --force` measured them here, not remotely


def test_a_remote_run_in_a_directory_whose_name_is_not_utf8_records_it_escaped(tmp_path, remote_yaml, capsys,
                                                                              monkeypatch):
    """Run in a directory named with byte 0xff (relative paths), the chunks merged, then remote-run.json's absolute
    path of remote.yaml (a surrogate) was a traceback, exit 1, and no snapshot; it is recorded with the byte escaped."""
    here = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"x\xff"))
    os.mkdir(here)
    monkeypatch.chdir(here)
    monkeypatch.setenv("KPROF_DB", "profile.db")
    remote_yaml(RAY)
    os.replace(tmp_path / "remote.yaml", os.path.join(here, "remote.yaml"))
    _in_process(monkeypatch, _InProcess())
    rc, doc = _cli_json(capsys)
    assert rc == 0 and doc["missing_count"] == 0
    assert _record()["config"] == f"{tmp_path}/x\\xff/remote.yaml"
    with open("out/job.meta.json") as f:
        assert json.load(f)["cwd"] == f"{tmp_path}/x\\xff"


def test_a_remote_run_builds_its_result_document_once(remote_yaml, db, capsys, monkeypatch):
    """--json and the snapshot each built the document (at 100k specs, hundreds of MB each), as a local run did
    before; it is built once."""
    from kprof import api

    remote_yaml(RAY)
    _in_process(monkeypatch, _InProcess())
    built = []
    to_json = api.QueryResult.to_json
    monkeypatch.setattr(api.QueryResult, "to_json", lambda self: built.append(1) or to_json(self))
    rc, doc = _cli_json(capsys)
    assert rc == 0 and len(built) == 1
    with open("out/results.json") as f:
        assert json.load(f) == doc


def test_a_failed_submitit_job_reports_its_reason_and_the_summary_says_so(remote_yaml, db, capsys):
    """Both jobs refuse their chunk (the rows are keyed by another CPU): each failure names the worker's reason, not
    the log path submitit's error text ends with; the summary counts what came back."""
    remote_yaml(RAY)
    rc = run_remote_cli("single_gemm", "torch-cpu", SPECS, remote="sub", remote_set=[], output_dir="out",
                        gpu_name="Another CPU", json=False, command="kprof run --remote sub")
    captured = capsys.readouterr()
    assert rc == 1
    failures = [ln for ln in captured.err.splitlines() if ln.startswith("error: chunk ") and ": failed: job " in ln]
    assert len(failures) == 2
    assert all("UsageError: this worker's CPU is" in ln and "--gpu-name" in ln for ln in failures), failures
    # the progress lines and the failure lines name the chunks alike (progress said `chunk 2/2` of chunk 1)
    progress = [ln for ln in captured.err.splitlines() if ln.startswith("chunk ")]
    assert sorted(ln.split(":")[0] for ln in progress) == ["chunk 0", "chunk 1"], progress
    assert sorted(ln.split(" (")[0] for ln in failures) == ["error: chunk 0", "error: chunk 1"]
    assert "measured 0 of 4 spec(s) on remote sub (submitit local) in " in captured.out
    assert ", 2 of 2 chunk(s) failed (see above); 0 event(s) merged" in captured.out


def test_an_interrupted_submitit_run_cancels_its_jobs_and_says_how_to_resume(remote_yaml, db, capsys, monkeypatch):
    """Ctrl-C while the jobs run: they are cancelled, as Ray's tasks are (they ran on, measuring specs no run would
    merge and the next run measured again), remote-run.json says so, and the line names a new --output-dir (the
    same command is refused: the directory holds this run's remote-run.json)."""
    submitit = pytest.importorskip("submitit")
    remote_yaml(RAY)
    jobs = []
    real_map_array = submitit.AutoExecutor.map_array

    def map_array(self, fn, *iterables):
        jobs.extend(real_map_array(self, fn, *iterables))
        return jobs

    def interrupted(jobs, poll_frequency):
        # once each job's task is running: a local job's cancel reaches its controller, which stops only the tasks it
        # has started; one interrupted while it started its task (a slow start, on a loaded host) left it running on
        # to return its chunk
        deadline = time.monotonic() + 120
        while not all(job.stderr() or job.stdout() for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", map_array)
    monkeypatch.setattr(submitit.helpers, "as_completed", interrupted)
    args = ["run", "single_gemm", "--backend", "torch-cpu", "--remote", "sub", "--output-dir", "out"]
    for spec in SPECS:
        args += ["--spec", json.dumps(spec)]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "the same command with a new --output-dir" in err, err
    assert len(jobs) == 2
    for job in jobs:  # cancelled: no job returns its chunk
        with pytest.raises(Exception):
            job.result()
    record = _record()
    assert [c["status"] for c in record["chunks"]] == ["cancelled"] * 2 and record["merged"]["added"] == 0


def test_an_interrupt_as_a_chunk_merges_leaves_its_merge_recorded(remote_yaml, db, monkeypatch):
    """Ctrl-C just as a chunk's merge commits: the chunk's record is finished first, then the run stops. It was left
    `returned` with its rows uncounted, so remote-run.json said 0 merged of a ledger holding the chunk's rows."""
    import signal

    from kprof.ledger import Ledger
    from kprof.merge import merge as merge_module

    remote_yaml(RAY)
    real = merge_module.merge_into

    def merge_into(*args, **kwargs):
        out = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # the merge is committed; the record is not written yet
        return out

    monkeypatch.setattr(merge_module, "merge_into", merge_into)
    _in_process(monkeypatch, _InProcess())
    with pytest.raises(KeyboardInterrupt):
        run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out")
    record = _record()
    with Ledger.open(db, readonly=True) as ledger:
        stored = ledger.last_seq
    assert record["chunks"][0]["status"] == "merged" and record["chunks"][0]["added"] == 2
    assert record["merged"]["added"] == stored == 2 and record["segments"] == ["out/segments/chunk-0000.kseg"]


def test_an_interrupt_as_a_result_comes_back_leaves_no_chunk_submitted(remote_yaml, db, monkeypatch):
    """Ctrl-C after the engine gave a chunk's result up (no longer queued or running) and before the run took it:
    the record ended with that chunk `submitted`, as if still out; it says the chunk was cut off, nothing merged."""
    def during(j):
        if j == 1:
            raise KeyboardInterrupt

    remote_yaml(RAY)
    _in_process(monkeypatch, _InProcess(during=during))
    with pytest.raises(KeyboardInterrupt):
        run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out")
    chunks = _record()["chunks"]
    assert [c["status"] for c in chunks] == ["merged", "cancelled"]
    assert chunks[1]["error"] == "the run stopped as its result came back; nothing of it was merged"


def test_nothing_to_measure_says_so(remote_yaml, db, capsys, h):
    remote_yaml(RAY)
    for spec in SPECS:
        h.hand_row(db, spec, GPU)
    rc = run_remote_cli("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out", json=False)
    assert rc == 0
    assert "nothing to measure: no spec sent to remote ray (ray); 0 event(s) merged; record out/remote-run.json" \
        in capsys.readouterr().out


def test_a_time_limit_fails_the_chunk_and_stores_no_crash_row(monkeypatch):
    """submitit's time-limit signal handler raises UncompletedJobError in whatever the job runs: it stops the chunk
    (the job fails with it), not a spec (no `failed` row of kind crash is made)."""
    submitit = pytest.importorskip("submitit")
    from kprof.ledger.events import Origin
    from kprof.runners import worker
    from kprof.runners.chunk import Chunk
    from kprof.runners.registry import lookup

    def time_limit(runner, spec):
        raise submitit.core.utils.UncompletedJobError("Job not requeued because: timed-out and not checkpointable.")

    monkeypatch.setattr(worker, "_fits_in_memory", time_limit)
    chunk = Chunk.of(lookup("single_gemm", "torch-cpu"), GPU, SPECS[:2], None, Origin())
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="timed-out"):
        remote_module.run_chunk(chunk.encode())


def test_a_killed_chunks_scratch_directory_is_removed_by_the_next_chunk(tmp_path, monkeypatch):
    """A remote chunk killed mid-measure (SIGKILL, a Slurm time limit) left its `kprof-chunk-*` directory in the
    worker's temporary directory for good, the next chunk there making one more: it now removes those no live chunk
    holds (an empty one once a minute old: its maker may be about to hold it), and its own."""
    import tempfile

    from kprof.ledger.events import Origin
    from kprof.runners.chunk import Chunk
    from kprof.runners.registry import lookup

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "kprof-chunk-killed").mkdir()
    (tmp_path / "kprof-chunk-killed" / "part.kseg").write_bytes(b"kprof")
    (tmp_path / "kprof-chunk-empty").mkdir()
    os.utime(tmp_path / "kprof-chunk-empty", (time.time() - 3600,) * 2)
    (tmp_path / "kprof-chunk-new").mkdir()  # a chunk starting now: not yet held
    chunk = Chunk.of(lookup("single_gemm", "torch-cpu"), GPU, [{"m": 2, "n": 8, "k": 8, "dtype": "fp32"}], None,
                     Origin())
    assert remote_module.run_chunk(chunk.encode())[0]
    assert os.listdir(tmp_path) == ["kprof-chunk-new"]


def test_a_collectives_ranks_end_with_its_remote_chunk():
    """A remote worker is the engine's process, and Ray keeps it for its next task: the rank processes of a collective
    chunk lived on in it once the chunk had returned (~230 MB each; on nccl, CUDA contexts on GPUs that Ray then hands
    out as free), and their directory was left when Ray ended the worker. The ranks now end with the chunk."""
    from kprof.ledger.events import Origin
    from kprof.merge import segment
    from kprof.runners import _ranks
    from kprof.runners.chunk import Chunk
    from kprof.runners.registry import lookup

    _ranks.shutdown()
    chunk = Chunk.of(lookup("all_reduce", "gloo"), GPU, [{"message_size_bytes": 4096, "dtype": "fp32",
                                                         "world_size": 2}], None, Origin())
    data, _where = remote_module.run_chunk(chunk.encode())
    with open("chunk.kseg", "wb") as f:
        f.write(data)
    assert len(list(segment.read("chunk.kseg"))) == 1
    assert _ranks._group is None  # no rank process left running in this (the engine's) process, nor its directory


@pytest.mark.parametrize("text, reason", [
    ("Job (task=0) failed during processing with trace:\n----------------------\nTraceback (most recent call last):\n"
     '  File "x.py", line 1, in f\nsubmitit.core.utils.UncompletedJobError: Job not requeued because: timed-out and '
     "not checkpointable.\n\n----------------------\nYou can check full logs with 'job.stderr(0)' and "
     "'job.stdout(0)'or at paths:\n  - logs/17144_0_log.err\n  - logs/17144_0_log.out",
     "submitit.core.utils.UncompletedJobError: Job not requeued because: timed-out and not checkpointable."),
    ("Job 17144 (task: 0) with path logs/17144_0_result.pkl\nhas not produced any output (state: NO PROCESS AND NO "
     "RESULT)\nError stream produced:\n----------------------------------------\nsubmitit INFO (2025-01-01) - "
     "Loading pickle: logs/17144_submitted.pkl",
     "has not produced any output (state: NO PROCESS AND NO RESULT)"),
])
def test_a_job_reason_is_the_line_that_says_why(text, reason):
    assert remote_module.job_reason(RuntimeError(text)) == reason


def test_a_claims_directory_it_cannot_use_is_refused_before_a_ledger_or_a_job(remote_yaml, db, monkeypatch):
    """As a local run: `<db>-claims` a file is one line naming it, before the ledger is created or an engine
    started."""
    from kprof.errors import UsageError

    remote_yaml(RAY)
    started = []
    monkeypatch.setattr(remote_module, "executor_for", lambda *a: started.append(a))
    with open(f"{db}-claims", "w"):
        pass
    with pytest.raises(UsageError, match="-claims is not a directory; fix or remove"):
        run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out")
    assert started == [] and not os.path.exists(db)


def test_a_ledger_it_cannot_open_is_refused_before_the_output_directory(remote_yaml, monkeypatch, tmp_path):
    """$KPROF_DB in a directory that is not there: exit 2 with nothing written, as a local run; the output directory
    was made (segments/, remote-run.json) and the engine started before the ledger was created."""
    from kprof.errors import UsageError

    remote_yaml(RAY)
    monkeypatch.setenv("KPROF_DB", str(tmp_path / "no-such-dir" / "p.db"))
    executor = _InProcess()
    closed = []
    executor.close = lambda: closed.append(True) or []
    _in_process(monkeypatch, executor)
    with pytest.raises(UsageError, match="cannot open ledger .*no-such-dir"):
        run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out")
    assert not os.path.exists("out") and closed == [True]


def test_the_remote_record_and_a_merge_report_are_strict_json_with_a_nan_in_them(tmp_path, monkeypatch):
    """The standard module writes a NaN as a bare NaN, which no strict JSON parser reads; kprof's records hold a
    metric's NaN as null, as every other JSON kprof writes."""
    import json

    import pytest

    from kprof.errors import MergeConflict
    from kprof.merge import _report
    from kprof.remote import _write_json

    def strict(path):
        with open(path) as f:
            return json.load(f, parse_constant=lambda name: pytest.fail(f"{path} holds a bare {name}"))

    _write_json(str(tmp_path / "remote-run.json"), {"chunks": [{"index": 0, "seconds": float("nan")}]})
    assert strict(tmp_path / "remote-run.json") == {"chunks": [{"index": 0, "seconds": None}]}
    row = {"key": "ab" * 32, "segment": "s.kseg",
           "current": {"segment": None, "parent": None, "event": "cd" * 32, "time_ms": float("inf")},
           "incoming": {"event": "ef" * 32, "time_ms": float("nan")}}
    monkeypatch.setattr(_report, "_report", lambda *a: {"keys": [row]})
    with pytest.raises(MergeConflict):
        _report.refuse(None, "p.db", [], [], str(tmp_path))
    assert strict(tmp_path / "merge-report.json")["keys"][0]["incoming"]["time_ms"] is None


@pytest.mark.parametrize("name,bad", [("KPROF_TIME_BUDGET_S", "abc"), ("KPROF_ENERGY_S", "-1"),
                                      ("KPROF_RANK_STEP_S", "1e300")])
def test_a_bad_setting_is_refused_before_anything_is_submitted(name, bad, remote_yaml, db, monkeypatch):
    """The workers inherit this environment (a Slurm job, submitit's local executor): a bad KPROF_* value is refused
    as a local run refuses it, before the output directory or a job is made, not found by every chunk."""
    remote_yaml(RAY)
    monkeypatch.setenv(name, bad)
    from kprof.errors import UsageError

    with pytest.raises(UsageError, match=f"{name}={bad!r} is not"):
        run_remote_cli("single_gemm", "torch-cpu", [dict(s) for s in SPECS], remote="sub", remote_set=[],
                       output_dir="out", mode="force", gpu_name=None, db=None, timer=None, l2=None, cuda_graph=None,
                       power=None, json=False, command="kprof run --remote sub")
    assert not os.path.exists("out") and not os.path.exists(db) and not os.path.exists("logs")


@pytest.mark.parametrize("name,bad", [("KPROF_TIME_BUDGET_S", "abc"), ("KPROF_ENERGY_S", "-1"),
                                      ("KPROF_WORKER_START_S", "0.000001"), ("KPROF_TIMER", "bogus"),
                                      ("KPROF_ENERGY_S", 0.25)])
def test_a_bad_setting_in_the_ray_tasks_env_vars_is_refused_before_anything_is_submitted(name, bad, remote_yaml, db,
                                                                                          monkeypatch):
    """launch.ray.runtime_env's env_vars were passed to the tasks unchecked: a KPROF_* value a local run refuses
    failed only on the cluster, in every chunk. It is checked as the local one is, naming where it was given."""
    from kprof.errors import UsageError

    remote_yaml(RAY)
    monkeypatch.delenv(name, raising=False)
    value = repr(bad) if isinstance(bad, str) else bad
    with pytest.raises(UsageError) as info:
        run_remote_cli("single_gemm", "torch-cpu", [dict(s) for s in SPECS], remote="ray",
                       remote_set=[f"launch.ray.runtime_env={{env_vars: {{{name}: {value}}}}}"], output_dir="out",
                       mode="force", gpu_name=None, db=None, timer=None, l2=None, cuda_graph=None, power=None,
                       json=False, command="kprof run --remote ray")
    message = str(info.value)
    assert message.startswith("launch.ray.runtime_env env_vars") and name in message and repr(bad) in message
    assert name not in os.environ  # the check leaves this process's environment as it was
    assert not os.path.exists("out") and not os.path.exists(db) and not os.path.exists("logs")


@pytest.mark.parametrize("given", ["file", "remote-set"])
@pytest.mark.parametrize("runtime_env, why", [("{env_vars: [a]}", "runtime_env['env_vars'] must be of type Dict"),
                                              ("{env_vars: {1: x}}", "the key 1 is of type"),
                                              ("{pip: 5}", "runtime_env['pip'] must be of type str or List[str]")])
def test_a_runtime_env_ray_refuses_is_one_line_before_anything_is_written(runtime_env, why, given, remote_yaml, db):
    """A launch.ray.runtime_env that Ray refuses (env_vars as a list, a key that is not a string, pip as a number)
    reached Ray only when the first task was submitted: a traceback and exit 1, after the output directory and the
    ledger had been made. Ray's own RuntimeEnv checks it first: one line naming the field, exit 2, nothing written."""
    from kprof.errors import UsageError

    text = RAY if given == "remote-set" else RAY.replace("address: local", f"address: local\n        runtime_env: "
                                                                            f"{runtime_env}")
    assert text != RAY or given == "remote-set"
    remote_yaml(text)
    with pytest.raises(UsageError) as info:
        run_remote_cli("single_gemm", "torch-cpu", [dict(s) for s in SPECS], remote="ray",
                       remote_set=[f"launch.ray.runtime_env={runtime_env}"] if given == "remote-set" else [],
                       output_dir="out", mode="force", gpu_name=None, db=None, timer=None, l2=None, cuda_graph=None,
                       power=None, json=False, command="kprof run --remote ray")
    message = str(info.value)
    field = "--remote-set launch.ray.runtime_env" if given == "remote-set" else "field launch.ray.runtime_env"
    assert field in message and "is refused by Ray" in message and why in message, message
    assert "\n" not in message and info.value.exit_code == 2
    assert not os.path.exists("out") and not os.path.exists(db)


def _first_event_only(seg: bytes) -> bytes:
    """The segment with its first event alone: what a worker that stopped after one spec would ship."""
    import tempfile

    from kprof.merge import segment

    with tempfile.TemporaryDirectory() as tmp:
        whole, part = os.path.join(tmp, "whole.kseg"), os.path.join(tmp, "part.kseg")
        with open(whole, "wb") as f:
            f.write(seg)
        segment.write(part, list(segment.read(whole))[:1])
        with open(part, "rb") as f:
            return f.read()


def test_a_chunk_returning_fewer_events_than_specs_says_which_are_left_missing(remote_yaml, db, capsys, monkeypatch):
    """A worker's segment held one event for its chunk's two specs: the event merged and the chunk read `merged`
    with no word of the other spec, which stayed missing (exit 1) unexplained. The chunk now says how many of its
    specs came back without an event, and the run's failures list it."""
    remote_yaml(RAY)
    _in_process(monkeypatch, _InProcess(tamper=lambda j, seg: _first_event_only(seg) if j == 1 else seg))
    res = run_remote("single_gemm", "torch-cpu", SPECS, remote="ray", output_dir="out")
    chunk = _record()["chunks"][1]
    assert chunk["status"] == "merged" and chunk["events"] == 1 and chunk["added"] == 1
    assert "no event for 1 of the chunk's 2 specs" in chunk["error"] and "run again" in chunk["error"]
    assert res.exit_code == 1 and sorted(r["status"] for r in res.results) == ["missing", "ok", "ok", "ok"]
    assert res.failures == [f"chunk 1 (2 specs): merged: {chunk['error']}"]
