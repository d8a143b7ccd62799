"""`kprof audit --remeasure N`: re-measures random current rows of the local device and reports drift."""

import json

import msgspec
import pytest

from kprof.cli import main


def _run(h, capsys, *specs):
    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(*specs), "--db", "p.db"]) == 0
    capsys.readouterr()


def _set_times(monkeypatch, time_ms: float) -> None:
    """Re-measurements stay real, their times set: a CPU time on a busy host is no pass/fail criterion (a 32^3 GEMM
    read 0.007 ms once and 16 ms the next time)."""
    import kprof.runners.worker as worker

    real = worker.measure_specs

    def set_times(entry, specs, gpu_key, **kw):
        for out in real(entry, specs, gpu_key, **kw):
            m = dict(out.event.metrics, time_ms=time_ms)
            yield msgspec.structs.replace(out, event=msgspec.structs.replace(out.event, metrics=m))

    monkeypatch.setattr(worker, "measure_specs", set_times)


def test_remeasure_reports_each_row_and_writes_nothing(h, capsys, local_gpu, monkeypatch):
    for spec in (h.gemm(32, 32, 32), h.gemm(48, 48, 48), h.gemm(64, 64, 64)):
        h.append("p.db", h.make_event(spec, local_gpu, time_ms=0.5))
    _set_times(monkeypatch, 0.6)
    before = h.digest("p.db")
    assert main(["audit", "--remeasure", "2", "--tolerance", "100", "--db", "p.db", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checked"] == 2 and doc["candidates"] == 3 and doc["drifted"] == 0
    assert local_gpu in doc["gpu_keys"]
    assert len(doc["rows"]) == 2  # every row checked is reported, not only the ones that drifted
    for r in doc["rows"]:
        assert r["ok"] and r["new_ms"] > 0 and r["citation"].startswith("kprof.")
        assert abs(r["drift"] - (r["new_ms"] / r["stored_ms"] - 1)) < 1e-12
    assert h.digest("p.db") == before


def test_remeasure_exits_1_when_a_row_drifts(h, capsys, local_gpu):
    # a stored row claiming a 1000x faster GEMM than this machine runs must be caught
    spec = h.gemm(96, 96, 96)
    h.append("p.db", h.make_event(spec, local_gpu, time_ms=1e-6))
    assert main(["audit", "--remeasure", "5", "--db", "p.db", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["checked"] == 1 and doc["drifted"] == 1
    row = doc["rows"][0]
    assert row["spec"] == spec and not row["ok"] and row["drift"] > 100


    assert row["first_drift"] > 100  # measured twice: the confirmation drifts as well


def test_a_drift_that_does_not_repeat_is_not_a_drift(h, capsys, local_gpu, monkeypatch):
    """A row over the tolerance is measured once more, after the others: a transient (the first re-measurement
    here reads 100x slow) clears, and the row says what its first measurement read. The measurements are real;
    their times are set (the stored 0.5 ms, or 100x it once), so the test does not depend on this machine's load."""
    import kprof.runners.worker as worker

    for spec in (h.gemm(32, 32, 32), h.gemm(48, 48, 48)):
        h.append("p.db", h.make_event(spec, local_gpu, time_ms=0.5))
    real, calls = worker.measure_specs, []

    def first_slow(entry, specs, gpu_key, **kw):
        calls.append(len(specs))
        for out in real(entry, specs, gpu_key, **kw):
            slow = 100 if len(calls) == 1 and out.index == 0 else 1
            m = dict(out.event.metrics, time_ms=0.5 * slow)
            yield msgspec.structs.replace(out, event=msgspec.structs.replace(out.event, metrics=m))

    monkeypatch.setattr(worker, "measure_specs", first_slow)
    assert main(["audit", "--remeasure", "2", "--tolerance", "0.05", "--db", "p.db", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert calls == [2, 1] and doc["drifted"] == 0
    (again,) = [r for r in doc["rows"] if r["first_drift"] is not None]
    assert again["ok"] and again["first_drift"] == 99.0 and again["drift"] == 0.0
    assert [r["first_drift"] for r in doc["rows"]].count(None) == 1


def test_a_drift_slower_while_the_host_was_busy_is_said_to_be_maybe_the_host_s(h, capsys, local_gpu, monkeypatch):
    """A CPU re-measurement that other work slowed (its notes say host_busy, as `run` then says on stderr) read as a
    plain DRIFT: the report gave no sign that the host, not the row, may have moved. One that drifted faster is the
    row's whatever the host did (other work only slows a row). The times and the notes are set; the rest is real."""
    import kprof.runners.worker as worker

    slow, fast = h.gemm(32, 32, 32), h.gemm(48, 48, 48)
    for spec in (slow, fast):
        h.append("p.db", h.make_event(spec, local_gpu, time_ms=0.5))
    real = worker.measure_specs

    def busy(entry, specs, gpu_key, **kw):
        for out in real(entry, specs, gpu_key, **kw):
            m = dict(out.event.metrics, time_ms=5.0 if specs[out.index] == slow else 0.05)
            method = msgspec.structs.replace(out.event.method, notes={**out.event.method.notes,
                                                                      "host_busy": "load 4.10 over 2 cores"})
            yield msgspec.structs.replace(out, event=msgspec.structs.replace(out.event, metrics=m, method=method))

    monkeypatch.setattr(worker, "measure_specs", busy)
    assert main(["audit", "--remeasure", "2", "--db", "p.db", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["drifted"] == 2 and doc["host_busy"] == 1
    assert {r["host_busy"] for r in doc["rows"]} == {"load 4.10 over 2 cores"}
    assert main(["audit", "--remeasure", "2", "--db", "p.db"]) == 1
    captured = capsys.readouterr()
    (slow_line,) = [line for line in captured.out.splitlines() if "'m': 32" in line]
    (fast_line,) = [line for line in captured.out.splitlines() if "'m': 48" in line]
    assert slow_line.endswith("(host busy)") and "host busy" not in fast_line
    assert ("note: other work took the host's cores while 1 row(s) that drifted slower were re-measured (host_busy "
            "in --json): the drift may be the host's, not the row's") in " ".join(captured.err.split())


def test_a_failed_remeasurement_is_a_failure_not_a_drift(h, capsys, local_gpu, monkeypatch):
    """A row whose re-measurement fails has no time to compare: it is counted as failed (exit 1: the row could
    not be checked), printed FAIL with the error, and not measured a second time as a drift would be."""
    import kprof.runners.worker as worker
    from kprof.ledger.build import failed

    h.append("p.db", h.make_event(h.gemm(32, 32, 32), local_gpu, time_ms=0.5))
    real, calls = worker.measure_specs, []

    def failing(entry, specs, gpu_key, **kw):
        calls.append(len(specs))
        for out in real(entry, specs, gpu_key, **kw):
            event = failed(out.event.provenance, "unsupported", "this build cannot run it")
            yield msgspec.structs.replace(out, event=event)

    monkeypatch.setattr(worker, "measure_specs", failing)
    assert main(["audit", "--remeasure", "1", "--db", "p.db", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert calls == [1] and (doc["drifted"], doc["failed"]) == (0, 1)
    assert doc["rows"][0]["error"] == "unsupported: this build cannot run it" and doc["rows"][0]["drift"] is None
    assert main(["audit", "--remeasure", "1", "--db", "p.db"]) == 1
    out = capsys.readouterr().out
    assert "0 drifted past 5.0%, 1 failed to measure" in out and "FAIL " in out and "DRIFT" not in out


def test_a_stored_row_its_backend_now_refuses_fails_alone(h, capsys, local_gpu, monkeypatch):
    """An ok fp8 row of torch-cpu (stored before that backend refused fp8 at validation) cannot be re-measured:
    it is counted as failed, with the reason, and the audit goes on with the other rows (exit 1, not 2)."""
    import kprof.runners.gemm as gemm
    from kprof.ledger import KeyMaker, ShapeCodec
    from kprof.ledger.build import measured
    from kprof.ledger.events import Method, Stats
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    contract = effective_entry(lookup(h.GEMM, h.CPU)).contract  # same fields, so the same key as the wider CUDA args give
    prov = KeyMaker(h.GEMM, h.CPU, local_gpu, contract, ShapeCodec(gemm.SingleGemmArgs)).provenance(
        h.gemm(16, 16, 16, "fp8_e4m3"))
    stats = Stats(n=1, median=0.5, p10=0.5, p90=0.5, mean=0.5, stdev=0.0, cv=0.0, min=0.5, max=0.5, samples=[0.5])
    metrics = {"time_ms": 0.5, "tflops": 1.0, "memory_bandwidth_gbps": 2.0, "energy_j": None}
    h.append("p.db", measured(prov, metrics, stats, Method(timer="cpu", l2="warm")))
    h.append("p.db", h.make_event(h.gemm(32, 32, 32), local_gpu, time_ms=0.5))
    _set_times(monkeypatch, 0.5)
    assert main(["audit", "--remeasure", "5", "--tolerance", "100", "--db", "p.db", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["checked"], doc["failed"], doc["drifted"]) == (2, 1, 0)
    bad = next(r for r in doc["rows"] if r["spec"]["dtype"] == "fp8_e4m3")
    good = next(r for r in doc["rows"] if r["spec"]["dtype"] == "fp32")
    assert bad["new_ms"] is None and "now refuses this spec" in bad["error"] and "fp8_e4m3" in bad["error"]
    assert good["ok"] and good["new_ms"] > 0
    assert main(["audit", "--remeasure", "5", "--tolerance", "100", "--db", "p.db"]) == 1
    out = capsys.readouterr().out
    assert "-> no time (not re-measurable" in out and "None" not in out


def test_remeasure_rejects_bad_counts(h, capsys):
    _run(h, capsys, h.gemm())
    assert main(["audit", "--remeasure", "0", "--db", "p.db"]) == 2
    assert "--remeasure 0" in capsys.readouterr().err
    for given, shown in (("-1", "-1"), ("0", "0"), ("1e400", "inf")):  # it read `--tolerance -1.0`, `0.0`
        assert main(["audit", "--remeasure", "1", "--tolerance", given, "--db", "p.db"]) == 2
        assert f"error: --tolerance {shown}: give a relative tolerance" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, named", [({"n": 1.5}, "n=1.5 is not a whole number"),
                                           ({"n": True}, "n=True is not a whole number"),
                                           ({"n": "2"}, "n='2' is not a whole number"),
                                           ({"tolerance": "0.1"}, "tolerance='0.1' is not a number"),
                                           ({"device": "gpu"}, "device='gpu' is not a device kind"),
                                           ({"device": "cpu", "timer": "events"},
                                            "timer='events' picks CUDA rows, and device='cpu'")])
def test_the_python_remeasure_refuses_bad_arguments_before_anything_is_measured(h, capsys, monkeypatch, kwargs,
                                                                                named):
    """From Python, n=1.5 or n='2' and tolerance='0.1' raised a raw TypeError, device='gpu' re-measured nothing and
    reported no drift, and device='cpu' with a CUDA timer was refused naming the gloo backend: each is a UsageError
    naming the argument as passed."""
    import re

    import kprof.runners.worker as worker
    from kprof.errors import UsageError
    from kprof.remeasure import remeasure

    _run(h, capsys, h.gemm())
    monkeypatch.setattr(worker, "measure_specs", lambda *a, **kw: pytest.fail("measured"))
    with pytest.raises(UsageError, match=re.escape(named)):
        remeasure("p.db", **{"n": 1, **kwargs})


def test_the_python_remeasure_reads_the_default_ledger_as_the_verb_does(h, capsys, local_gpu, monkeypatch):
    """db=None is $KPROF_DB, else ./profile.db, as every verb's (it raised a raw TypeError from os.stat)."""
    from kprof.remeasure import remeasure

    h.append("p.db", h.make_event(h.gemm(), local_gpu, time_ms=0.5))
    _set_times(monkeypatch, 0.5)
    monkeypatch.setenv("KPROF_DB", "p.db")
    report = remeasure(None, 1)
    assert (report.db, len(report.rows), report.drifted) == ("p.db", 1, 0)


def test_a_bad_setting_is_refused_before_anything_is_measured(h, capsys, monkeypatch):
    """Every KPROF_* setting, checked as `kprof run` checks it: a CUDA-only one too, on CPU rows (it was ignored)."""
    import kprof.runners.worker as worker

    _run(h, capsys, h.gemm())
    monkeypatch.setattr(worker, "measure_specs", lambda *a, **kw: pytest.fail("measured"))
    for name, bad in (("KPROF_ENERGY_S", "lots"), ("KPROF_SPEC_TIMEOUT_S", "-1"), ("KPROF_CPU_WORKERS", "x")):
        monkeypatch.setenv(name, bad)
        assert main(["audit", "--remeasure", "1", "--db", "p.db"]) == 2
        assert f"{name}={bad!r} is not" in capsys.readouterr().err
        monkeypatch.delenv(name)


def test_a_flag_of_the_other_mode_is_refused_not_ignored(h, capsys, refused):
    """--jobs belongs to the audit, --tolerance to --remeasure: given to the other, each was silently dropped."""
    _run(h, capsys, h.gemm())
    refused(["audit", "--remeasure", "1", "--jobs", "0", "--db", "p.db"], "--jobs 0 applies to the audit",
            "drop --jobs")
    refused(["audit", "--tolerance", "-1", "--db", "p.db"], "--tolerance applies to `kprof audit --remeasure N` only",
            "drop --tolerance")
    refused(["audit", "--tolerance", "0.1", "--db", "p.db"], "--tolerance applies")
    assert main(["audit", "--jobs", "1", "--db", "p.db"]) == 0


def test_a_stored_row_without_a_positive_time_fails_alone(h, capsys, local_gpu, monkeypatch):
    """A row merged from elsewhere may hold any float, or none: a time of 0 or null cannot be compared (no
    division by it, no traceback). It is counted as failed, naming the stored value, and not measured; the other
    rows are checked as ever."""
    for m, time_ms in ((16, 0.0), (24, None), (40, float("nan"))):
        event = h.make_event(h.gemm(m, 16, 16), local_gpu)
        h.append("p.db", msgspec.structs.replace(event, metrics={**event.metrics, "time_ms": time_ms}))
    h.append("p.db", h.make_event(h.gemm(32, 32, 32), local_gpu, time_ms=0.5))
    _set_times(monkeypatch, 0.5)
    assert main(["audit", "--remeasure", "5", "--tolerance", "1000", "--db", "p.db", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["checked"], doc["failed"], doc["drifted"]) == (4, 3, 0)
    bad = sorted((r["spec"]["m"], r["error"]) for r in doc["rows"] if r["error"])
    assert [m for m, _ in bad] == [16, 24, 40]
    assert all("not a positive time" in e for _, e in bad) and "is 0.0," in bad[0][1] and "is None," in bad[1][1]
    assert main(["audit", "--remeasure", "5", "--tolerance", "1000", "--db", "p.db"]) == 1
    out = capsys.readouterr().out
    assert out.count("no time -> no time (not comparable") == 3 and "3 failed to measure" in out


def test_the_show_a_row_without_a_positive_time_names_runs_in_a_shell_on_that_ledger(h, capsys, local_gpu, tmp_path):
    """`kprof audit --remeasure N --db 'team ledgers/p.db'` of a row whose stored time is 0 said "`kprof show
    kprof.<hex>` shows where the row came from": pasted, that looks in $KPROF_DB or ./profile.db, another ledger
    (no ledger there: exit 2). The command names the ledger audited, quoted for a shell, and shows the row."""
    import os
    import shlex
    import subprocess
    import sys

    db = str(tmp_path / "team ledgers" / "p.db")
    os.mkdir(os.path.dirname(db))
    event = h.make_event(h.gemm(16, 16, 16), local_gpu)
    h.append(db, msgspec.structs.replace(event, metrics={**event.metrics, "time_ms": 0.0}))
    prog = (sys.executable, "-m", "kprof")
    assert main(["audit", "--remeasure", "1", "--db", db], prog=prog) == 1
    out = " ".join(capsys.readouterr().out.split())
    command = out[out.index(f"`{shlex.join(prog)} show"):].split("`")[1]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    env.pop("KPROF_DB", None)
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shlex.split(command)[4] in done.stdout, (command, done.stdout, done.stderr)


def test_nothing_to_remeasure_is_said(h, capsys, local_gpu):
    """A ledger of another machine's rows (or of only failed and stale ones here) re-measured nothing and printed
    "0 drifted", exit 0, as if a check had passed: a note on stderr says nothing was re-measured and whose rows
    the ledger holds. The exit stays 0: no row drifted or failed."""
    h.append("p.db", h.make_event(h.gemm(), "Another CPU"), h.make_event(h.gemm(48), local_gpu, kind="failed"),
             h.make_event(h.gemm(64), local_gpu, revision=0))
    assert main(["audit", "--remeasure", "3", "--db", "p.db", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["candidates"] == 0
    assert "note: nothing re-measured: p.db holds no current ok row of this machine's" in captured.err
    assert "it holds rows of 'Another CPU'" in captured.err


def test_rows_of_a_table_no_runner_here_measures_are_named(h, capsys, local_gpu, monkeypatch):
    """Rows of a plugin's table, audited without KPROF_RUNNERS naming its module, were left out without a word: the
    note said the ledger held no current ok row of this machine, as if it held none. They are named, with the fix."""
    from kprof.runners import registry

    registry.entries()
    mine = msgspec.structs.replace(registry.lookup(h.GEMM, h.CPU), table="my_gemm", runner="mine:Gemm")
    monkeypatch.setattr(registry, "REGISTRY", {**registry.REGISTRY, ("my_gemm", h.CPU): mine})
    h.append("p.db", h.make_event(h.gemm(), local_gpu, table="my_gemm"))
    monkeypatch.delitem(registry.REGISTRY, ("my_gemm", h.CPU))  # the plugin not loaded
    assert main(["audit", "--remeasure", "3", "--db", "p.db", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["unregistered"] == ["my_gemm/torch-cpu"]
    assert ("note: rows of my_gemm/torch-cpu were not drawn: no runner registered here measures them; set "
            "KPROF_RUNNERS to the module that registers them") in captured.err


def test_the_draw_of_rows_can_be_replayed_with_its_seed(h, capsys, local_gpu, monkeypatch):
    """An auditor could not re-measure the rows a report drew again: the CLI had no seed. The report now gives the
    seed it drew with, and --seed draws the same rows of the same ledger."""
    for m in range(16, 16 + 8 * 8, 8):
        h.append("p.db", h.make_event(h.gemm(m), local_gpu, time_ms=0.5))
    _set_times(monkeypatch, 0.5)

    def drawn(*extra):
        assert main(["audit", "--remeasure", "3", "--db", "p.db", "--json", *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        return doc["seed"], sorted(r["citation"] for r in doc["rows"])

    seed, rows = drawn()
    assert isinstance(seed, int) and drawn("--seed", str(seed)) == (seed, rows)
    assert drawn("--seed", "5") == drawn("--seed", "5")
    assert main(["audit", "--remeasure", "1", "--seed", "5", "--db", "p.db"]) == 0
    assert "--seed 5)" in capsys.readouterr().out
    assert main(["audit", "--seed", "5", "--db", "p.db"]) == 2
    assert "--seed applies to `kprof audit --remeasure N` only" in capsys.readouterr().err
    assert main(["audit", "--remeasure", "1", "--seed", "-1", "--db", "p.db"]) == 2
    assert "--seed -1: give a whole number >= 0" in capsys.readouterr().err


@pytest.fixture
def faulty_runner(monkeypatch):
    """The pool tests' runner (tests/runners/faulty_runner.py), registered for this test and its spawned workers."""
    import os
    import sys

    from kprof.runners import registry

    runners = os.path.join(os.path.dirname(__file__), "..", "runners")
    registry.entries()  # the catalog first: a registry that is not empty is taken as loaded
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))  # the test's runner leaves with the test
    monkeypatch.syspath_prepend(runners)  # spawned workers get this process's sys.path, and import KPROF_RUNNERS
    monkeypatch.setenv("KPROF_RUNNERS", "faulty_runner")
    monkeypatch.delitem(sys.modules, "faulty_runner", raising=False)  # imported afresh, into the copy
    import faulty_runner

    try:
        yield faulty_runner
    finally:  # not left imported: a later test's KPROF_RUNNERS import must register it again
        sys.modules.pop("faulty_runner", None)


def test_pool_on_remeasures_in_a_worker_where_a_crash_fails_its_row_alone(h, capsys, local_gpu, monkeypatch,
                                                                           faulty_runner):
    """KPROF_POOL=on, which gives a run's specs to workers so a runner that crashes its process fails its spec alone,
    was ignored by `audit --remeasure`: the rows were measured in this process, and a crash ended the audit with no
    report (the runner's exit status). Each row is measured in a worker: the crash is the row's failure."""
    def here(*_args):
        raise RuntimeError("measured in the calling process")

    monkeypatch.setattr(faulty_runner.Faulty, "build", here)
    h.append("p.db", h.make_event({"n": 1000, "act": "die"}, local_gpu, table="faulty", backend="cpu"),
             h.make_event({"n": 1001, "act": "ok"}, local_gpu, table="faulty", backend="cpu"))
    monkeypatch.setenv("KPROF_POOL", "on")
    assert main(["audit", "--remeasure", "2", "--tolerance", "1000", "--db", "p.db", "--json"]) == 1
    rows = {r["spec"]["act"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["die"]["error"].startswith("crash: the worker on cpu died (exit code -9)"), rows["die"]
    assert rows["ok"]["error"] is None and rows["ok"]["new_ms"] > 0


def test_a_spec_time_limit_bounds_a_hung_remeasurement_as_it_bounds_a_run(h, capsys, local_gpu, monkeypatch,
                                                                         faulty_runner):
    """KPROF_SPEC_TIMEOUT_S was ignored: the rows were measured in this process, where a hung kernel hung the audit
    for good. Set, each row is measured in a worker that is killed past it (the row fails as `timeout`, the others
    are measured), as `run` does; with KPROF_POOL=off as well it is refused before anything is measured."""
    _time_limit_bounds_remeasure(h, capsys, local_gpu, monkeypatch, faulty_runner)


def _time_limit_bounds_remeasure(h, capsys, local_gpu, monkeypatch, faulty_runner):
    def here(*_args):  # this process is never where the spec is measured: a hang here could not be stopped
        raise RuntimeError("measured in the calling process")

    monkeypatch.setattr(faulty_runner.Faulty, "build", here)
    h.append("p.db", h.make_event({"n": 1000, "act": "hang"}, local_gpu, table="faulty", backend="cpu"),
             h.make_event({"n": 1001, "act": "ok"}, local_gpu, table="faulty", backend="cpu"))
    monkeypatch.setenv("KPROF_SPEC_TIMEOUT_S", "1")
    monkeypatch.setenv("KPROF_POOL", "off")
    assert main(["audit", "--remeasure", "2", "--db", "p.db"]) == 2
    assert "KPROF_SPEC_TIMEOUT_S is set, but KPROF_POOL=off" in capsys.readouterr().err
    monkeypatch.delenv("KPROF_POOL")
    assert main(["audit", "--remeasure", "2", "--tolerance", "1000", "--db", "p.db", "--json"]) == 1
    rows = {r["spec"]["act"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["hang"]["error"].startswith("timeout: no result within 1 s (KPROF_SPEC_TIMEOUT_S)"), rows["hang"]
    assert rows["ok"]["error"] is None and rows["ok"]["new_ms"] > 0


def test_a_drift_faster_than_a_row_stored_while_the_host_was_busy_names_the_stored_row(h, capsys, local_gpu):
    """A row stored while other work took the host's cores (its notes say host_busy) and re-measured faster read as a
    plain DRIFT, as if the kernel had moved: the stored row, slowed then, may be the one off. It is marked, counted
    in host_busy, its note given as stored_host_busy, and stderr says to measure it again; still a drift (exit 1)."""
    import msgspec

    busy, quiet = h.gemm(32, 32, 32), h.gemm(48, 48, 48)
    for spec in (busy, quiet):
        ev = h.make_event(spec, local_gpu, time_ms=1e3)  # far slower than any real 32-48^3 GEMM: both drift faster
        if spec == busy:
            ev = msgspec.structs.replace(ev, method=msgspec.structs.replace(
                ev.method, notes={"host_busy": "load 5.00 over 2 cores: other work shared them"}))
        h.append("p.db", ev)
    assert main(["audit", "--remeasure", "2", "--db", "p.db", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["drifted"] == 2 and doc["host_busy"] == 1
    by_m = {r["spec"]["m"]: r for r in doc["rows"]}
    assert by_m[32]["stored_host_busy"].startswith("load 5.00") and by_m[48]["stored_host_busy"] is None
    assert main(["audit", "--remeasure", "2", "--db", "p.db"]) == 1
    captured = capsys.readouterr()
    (busy_line,) = [line for line in captured.out.splitlines() if "'m': 32" in line]
    (quiet_line,) = [line for line in captured.out.splitlines() if "'m': 48" in line]
    assert busy_line.endswith("(stored on a busy host)") and "busy" not in quiet_line
    err = " ".join(captured.err.split())
    assert "note: 1 row(s) that drifted faster were stored while other work took their host's cores" in err
    assert "kprof run --force" not in err  # (it named no table: a usage error as written)


def test_the_run_a_row_stored_while_the_host_was_busy_names_is_of_its_spec_ledger_and_method(h, capsys, local_gpu,
                                                                                             tmp_path, monkeypatch):
    """The note on a row stored while the host was busy said to measure it again "with `kprof run --force`": pasted,
    a usage error (no table, no backend), and with them it measures $KPROF_DB's or ./profile.db's rows. It names the
    run of that row's spec on the audited ledger, its thread count as the environment chose it, and --force."""
    import os
    import shlex
    import subprocess
    import sys

    import msgspec

    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    db = str(tmp_path / "team ledgers" / "p.db")
    (tmp_path / "team ledgers").mkdir()
    ev = h.make_event(h.gemm(32, 32, 32), local_gpu, time_ms=1e3)  # far slower than a real 32^3 GEMM: faster now
    h.append(db, msgspec.structs.replace(ev, method=msgspec.structs.replace(
        ev.method, notes={"host_busy": "load 5.00 over 2 cores: other work shared them"})))
    prog = (sys.executable, "-m", "kprof")
    assert main(["audit", "--remeasure", "1", "--db", db], prog=prog) == 1
    err = " ".join(capsys.readouterr().err.split())
    command = err[err.index("quiet host with `"):].split("`")[1]
    words = shlex.split(command)
    assert words[:11] == ["OMP_NUM_THREADS=1", *prog, "run", h.GEMM, "--backend", h.CPU, "--db", db, "--spec"], command
    assert json.loads(words[11]) == h.gemm(32, 32, 32) and words[12:] == ["--force"], command
    env = {k: v for k, v in os.environ.items() if k not in ("KPROF_DB", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(32, 32, 32)), "--db", db, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["metrics"]["time_ms"] < 1e3  # measured again, here


def test_nothing_to_remeasure_names_rows_of_an_older_revision(h, capsys, local_gpu):
    """A ledger whose rows here are all of an older profiler revision (kprof upgraded since they were measured),
    timed as this process times them, re-measured nothing, and the note blamed the timing method and the torch thread
    count (see OMP_NUM_THREADS): it names the stale rows and the fix, `kprof run`."""
    h.append("p.db", h.make_event(h.gemm(32), local_gpu, revision=0), h.make_event(h.gemm(64), local_gpu, revision=0))
    assert main(["audit", "--remeasure", "3", "--db", "p.db"]) == 0
    err = capsys.readouterr().err
    assert "2 of this machine's row(s) there are of an older profiler revision (stale): `kprof run`" in err
    assert "OMP_NUM_THREADS" not in err
