import json
import os
import stat
import sys

import pytest

from kprof import api
from kprof.cli import main
from kprof.errors import SettingError
from kprof.ledger import Ledger, _codec
from kprof.method import effective_entry
from kprof.runners.registry import lookup

FP8 = {"m": 32, "n": 32, "k": 32, "dtype": "fp8_e4m3"}  # a CUDA-only dtype: the CPU backend refuses the spec
HUGE = {"m": 1 << 40, "n": 32, "k": 32, "dtype": "fp32"}  # 128 TiB of inputs on any machine: an oom row


def _run(capsys, h, db, *specs, extra=(), table="single_gemm", rc=0) -> dict:
    code = main(["run", table, "--backend", h.CPU, *h.spec_args(*specs), "--db", db, "--json", *extra])
    out = capsys.readouterr().out
    assert code == rc, out
    return json.loads(out)


def _history(capsys, db, ref) -> dict:
    assert main(["show", ref, "--db", db, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _merge_while_measured(monkeypatch, segment: str, report_dir: str, m: int) -> None:
    """Merges `segment` into the run's ledger as the spec of that `m` is measured, before its row is stored (another
    writer storing a row for the key meanwhile)."""
    import kprof.runners.fill as fill
    from kprof.merge.merge import merge_into

    keep = fill._State._keep

    def keep_after_a_merge(self, res, errored):
        if self.canonical[res.index]["m"] == m:
            merge_into(self.ledger, [segment], report_dir)
        return keep(self, res, errored)

    monkeypatch.setattr(fill._State, "_keep", keep_after_a_merge)


def _last_seq(db) -> int:
    led = Ledger.open(db, readonly=True)
    try:
        return led.last_seq
    finally:
        led.close()


# ---- JIT, --force, --fresh --------------------------------------------------------------------------------

def test_jit_measures_only_missing_specs(ledger_path, capsys, h, local_gpu):
    a, b, c = h.gemm(), h.gemm(n=48), h.gemm(k=16)
    first = _run(capsys, h, ledger_path, a, b)
    assert first["mode"] == "jit" and first["count"] == 2 and first["missing_count"] == 0
    assert first["gpu_name"] == local_gpu and first["db"] == ledger_path
    assert [r["status"] for r in first["results"]] == ["ok", "ok"]
    assert _last_seq(ledger_path) == 2

    second = _run(capsys, h, ledger_path, a, b, c)
    assert [r["event"] for r in second["results"][:2]] == [r["event"] for r in first["results"]]
    assert second["results"][2]["status"] == "ok"
    assert _last_seq(ledger_path) == 3  # only c was measured

    # a third identical run measures nothing, and starts nothing: no device is prepared, the file is not written
    before = h.digest(ledger_path)
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(a, b, c), "--db", ledger_path]) == 0
    out, err = capsys.readouterr()
    assert "measured 0 spec(s)" in out and "devices:" not in err, err
    assert _last_seq(ledger_path) == 3 and h.digest(ledger_path) == before
    for r in second["results"]:
        assert len(_history(capsys, ledger_path, r["key"])["history"]) == 1


def test_jit_measures_a_repeated_spec_once(ledger_path, capsys, h):
    """Once the first copy of a spec is measured, its repeats (also with the fields in another order) are no
    longer missing."""
    a = h.gemm()
    doc = _run(capsys, h, ledger_path, a, a, dict(reversed(a.items())))
    assert len({r["key"] for r in doc["results"]}) == 1
    assert _last_seq(ledger_path) == 1, "one key was measured more than once (sibling events, no parent link)"
    assert len({r["event"] for r in doc["results"]}) == 1


def test_a_run_makes_its_ledger_view_once_not_twice_a_spec(ledger_path, capsys, h, monkeypatch):
    """Each spec's check before it is measured and before its row is stored made a View (defining its shapes' msgspec
    Struct, about 0.7 ms): a tenth or more of a tiny spec's time outside its timing. The run's ledger has one."""
    made = []
    view = Ledger.view
    monkeypatch.setattr(Ledger, "view", lambda self, *a, **k: made.append(1) or view(self, *a, **k))
    _run(capsys, h, ledger_path, h.gemm(m=1))
    one, made[:] = len(made), []
    doc = _run(capsys, h, ledger_path + "-6", *(h.gemm(m=m) for m in range(1, 7)))
    assert [r["status"] for r in doc["results"]] == ["ok"] * 6 and _last_seq(ledger_path + "-6") == 6
    assert len(made) == one, (one, len(made))  # as many for 6 specs as for 1: none per spec


def test_a_metric_that_does_not_apply_is_null_as_the_readme_says(ledger_path, capsys, h):
    """A copy's tflops and a CPU row's energy_j are null, in the family's order of metrics."""
    r = _run(capsys, h, ledger_path, {"bytes": 4096}, table="memcpy")["results"][0]
    assert list(r["metrics"]) == ["time_ms", "tflops", "memory_bandwidth_gbps", "energy_j"]
    assert r["metrics"]["tflops"] is None and r["metrics"]["energy_j"] is None
    assert r["metrics"]["time_ms"] > 0 and r["metrics"]["memory_bandwidth_gbps"] > 0


def test_run_result_has_the_query_contract(ledger_path, capsys, h):
    doc = _run(capsys, h, ledger_path, h.gemm())
    assert list(doc) == ["table", "backend", "gpu_name", "db", "mode", "count", "missing_count", "view_root",
                         "results"]
    r = doc["results"][0]
    assert h.RESULT_FIELDS <= set(r) and set(r) - h.RESULT_FIELDS <= {"error"}
    assert set(r["metrics"]) == h.METRICS and r["metrics"]["energy_j"] is None
    assert r["citation"] == "kprof." + r["event"][:16]
    # the run's rows are what a later query reads
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--json"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["view_root"] == doc["view_root"]
    assert q["results"][0]["event"] == r["event"] and q["results"][0]["metrics"] == r["metrics"]


def test_force_remeasures_all_with_parent_links(ledger_path, capsys, h):
    specs = (h.gemm(), h.gemm(m=48))
    first = _run(capsys, h, ledger_path, *specs)
    forced = _run(capsys, h, ledger_path, *specs, extra=["--force"])
    assert forced["mode"] == "force" and forced["missing_count"] == 0
    assert _last_seq(ledger_path) == 4
    for old, new in zip(first["results"], forced["results"]):
        assert new["status"] == "ok" and new["key"] == old["key"] and new["event"] != old["event"]
        shown = _history(capsys, ledger_path, new["citation"])
        assert shown["event"]["parent"] == old["event"]
        assert [e["event"] for e in shown["history"]] == [old["event"], new["event"]]
        assert shown["current"] == new["event"]
    assert forced["view_root"] != first["view_root"]


def test_fresh_measures_all_and_writes_nothing(tmp_path, ledger_path, capsys, h):
    doc = _run(capsys, h, ledger_path, h.gemm(), HUGE, extra=["--fresh"], rc=1)
    assert not os.path.exists(ledger_path) and os.listdir(tmp_path) == []
    assert doc["mode"] == "fresh" and doc["count"] == 2 and doc["missing_count"] == 1  # the failed spec
    ok, err = doc["results"]
    assert ok["status"] == "ok" and ok["citation"] is None and ok["event"] and ok["key"]
    assert set(ok["metrics"]) == h.METRICS and ok["metrics"]["time_ms"] > 0 and ok["stats"]["n"] >= 3
    assert ok["provenance"]["shape"] == h.gemm()
    assert err["status"] == "error" and err["error"]["kind"] == "oom" and err["citation"] is None
    assert err["metrics"] is None


def test_fresh_leaves_an_existing_db_untouched(ledger_path, capsys, h):
    first = _run(capsys, h, ledger_path, h.gemm())
    before = h.digest(ledger_path)
    doc = _run(capsys, h, ledger_path, h.gemm(), h.gemm(m=64), extra=["--fresh"])
    assert h.digest(ledger_path) == before and _last_seq(ledger_path) == 1
    assert doc["missing_count"] == 0 and all(r["citation"] is None for r in doc["results"])
    assert doc["results"][0]["event"] != first["results"][0]["event"]  # measured again, not read
    assert doc["view_root"] == first["view_root"]  # the ledger's state, unchanged
    # a follow-up count-missing still reports the fresh-only spec missing
    assert main(["count-missing", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(), h.gemm(m=64)),
                 "--db", ledger_path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing"] == [h.gemm(m=64)]


def test_force_and_fresh_are_mutually_exclusive(tmp_path, ledger_path, capsys, h):
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--force", "--fresh"]) == 2
    captured = capsys.readouterr()
    assert "--force" in captured.err and "--fresh" in captured.err
    assert os.listdir(tmp_path) == []


# ---- failures ---------------------------------------------------------------------------------------------

def test_failing_runner_is_an_error_row_and_a_failed_event(ledger_path, capsys, h):
    doc = _run(capsys, h, ledger_path, h.gemm(), HUGE, h.gemm(m=64), rc=1)
    assert doc["missing_count"] == 1
    assert [r["status"] for r in doc["results"]] == ["ok", "error", "ok"]
    err = doc["results"][1]
    assert err["error"]["kind"] == "oom" and "GiB" in err["error"]["message"]
    assert err["metrics"] is None and err["citation"].startswith("kprof.")
    # the failure is recorded: a later query shows it as failed, count-missing counts it
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(HUGE), "--db", ledger_path,
                 "--json"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["results"][0]["status"] == "failed" and q["results"][0]["event"] == err["event"]
    assert q["results"][0]["error"]["kind"] == "oom"
    shown = _history(capsys, ledger_path, err["citation"])
    assert shown["event"]["type"] == "failed" and shown["event"]["error_kind"] == "oom"


def test_jit_retries_failed_rows(ledger_path, capsys, h):
    first = _run(capsys, h, ledger_path, HUGE, rc=1)
    again = _run(capsys, h, ledger_path, HUGE, rc=1)
    assert again["results"][0]["status"] == "error"
    assert again["results"][0]["event"] != first["results"][0]["event"]
    assert _last_seq(ledger_path) == 2


def test_human_run_output_names_the_error(ledger_path, capsys, h):
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(), HUGE), "--db", ledger_path]) == 1
    out = capsys.readouterr().out
    assert "error" in out and "oom" in out and "measured 2 spec(s)" in out
    assert "1 of 2 ok, 1 missing" in out


def test_a_dtype_only_cuda_backends_take_is_refused_on_the_cpu_before_any_work(tmp_path, ledger_path, capsys, h,
                                                                               refused):
    refused(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(), FP8), "--db", ledger_path],
            "spec 1: field \"dtype\" = 'fp8_e4m3'", "use one of bf16, fp16, fp32")
    assert os.listdir(tmp_path) == []


def test_gpu_name_of_another_device_is_refused_before_any_work(tmp_path, ledger_path, capsys, h, local_gpu):
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--gpu-name", "NVIDIA H200", "--output-dir", str(tmp_path / "snap")]) == 2
    err = capsys.readouterr().err
    assert f"--gpu-name 'NVIDIA H200' differs from the device this run would measure on ({local_gpu!r}); omit " \
           f"--gpu-name, or run on a machine with that device" in err
    assert os.listdir(tmp_path) == []  # no db, no snapshot


def test_a_python_caller_is_told_of_another_devices_gpu_name_by_its_keyword(tmp_path, ledger_path, local_gpu):
    """api.run's refusal named the verb's flag (--gpu-name) to a caller who passed gpu_name=."""
    with pytest.raises(SettingError) as err:
        api.run("single_gemm", "torch-cpu", [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], gpu_name="NVIDIA H200",
                db=ledger_path)
    assert str(err.value) == (f"gpu_name='NVIDIA H200' differs from the device this run would measure on "
                              f"({local_gpu!r}); omit gpu_name, or run on a machine with that device")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("hook", ["progress", "watch", "waiting"])
def test_a_python_callers_hook_that_is_not_callable_is_refused_before_any_work(tmp_path, ledger_path, hook):
    """api.run(progress=3) measured and stored the first spec, then raised a bare TypeError ('int' object is not
    callable) from inside the fill; a hook that is not callable is a UsageError naming it, and nothing is written."""
    from kprof.errors import UsageError

    with pytest.raises(UsageError, match=f"^{hook}=3 is not callable; pass a function"):
        api.run("single_gemm", "torch-cpu", [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], db=ledger_path, **{hook: 3})
    assert os.listdir(tmp_path) == []


def test_a_python_callers_command_that_is_not_a_str_is_refused_before_any_work(tmp_path, ledger_path):
    """api.run(command=5) measured the spec, then its event was refused by the schema ('build events with
    kprof.ledger.build', a call the caller never made), leaving an empty ledger; it is refused first, naming it."""
    from kprof.errors import UsageError

    with pytest.raises(UsageError, match=r"^command=\['kprof', 'run'\] is not a str; pass the command line"):
        api.run("single_gemm", "torch-cpu", [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], db=ledger_path,
                command=["kprof", "run"])
    assert os.listdir(tmp_path) == []


def test_gpu_name_of_the_local_device_is_accepted(ledger_path, capsys, h, local_gpu):
    doc = _run(capsys, h, ledger_path, h.gemm(), extra=["--gpu-name", local_gpu])
    assert doc["gpu_name"] == local_gpu and doc["missing_count"] == 0


@pytest.mark.parametrize("table, spec", [
    ("rms_norm", {"tokens": 4, "hidden": 32, "dtype": "fp32"}),
    ("silu_mul", {"tokens": 4, "hidden": 32, "dtype": "bf16"}),
    ("attention_prefill", {"batch": 1, "seq_len": 8, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                           "causal": True, "dtype": "fp32"}),
    ("attention_decode", {"batch": 1, "kv_len": 16, "num_heads": 2, "num_kv_heads": 2, "head_dim": 8,
                          "dtype": "fp32"}),
])
def test_every_family_runs_ok(table, spec, ledger_path, capsys, h):
    doc = _run(capsys, h, ledger_path, spec, table=table)
    r = doc["results"][0]
    assert r["status"] == "ok" and r["spec"] == spec and set(r["metrics"]) == h.METRICS


# ---- --output-dir ----------------------------------------------------------------------------------------

# varying k first in the input, then m, then dtype; n constant: axes must follow declaration order m, n, k, dtype
SWEEP = [{"m": 16, "n": 32, "k": 16, "dtype": "fp32"}, {"m": 16, "n": 32, "k": 32, "dtype": "fp32"},
         {"m": 32, "n": 32, "k": 16, "dtype": "fp32"}, {"m": 32, "n": 32, "k": 32, "dtype": "bf16"}]


def _read(path):
    with open(path) as f:
        return json.load(f)


def test_the_snapshot_names_the_timing_method_the_rows_were_asked_under(tmp_path, monkeypatch):
    """request.json left out --timer, --l2, --cuda-graph and --power: a CUDA request could not be told (or repeated)
    from it alone. It names the method as resolved, flags over their KPROF_* defaults."""
    import datetime

    from kprof.api import QueryResult
    from kprof.artifacts import snapshot

    monkeypatch.setenv("KPROF_CUDA_GRAPH", "1")
    res = QueryResult("single_gemm", "torch", "NVIDIA H200", "x.db", "jit", 0, 0, "", [])
    snapshot(str(tmp_path / "snap"), res, [], started_at=datetime.datetime.now(datetime.timezone.utc), seconds=0.0,
             method=dict(timer="events", l2="warm", cuda_graph=None, power="loaded"))
    assert _read(tmp_path / "snap" / "request.json")["timing"] == "events;l2=warm;graph;power=loaded"


def test_output_dir_snapshot(tmp_path, ledger_path, capsys, h, local_gpu):
    out_dir = tmp_path / "snap"
    doc = _run(capsys, h, ledger_path, *SWEEP, extra=["--output-dir", str(out_dir)])
    names = sorted(os.listdir(out_dir))
    assert names == ["curve.json", "curve.png", "job.meta.json", "request.json", "results.json"]
    for name in names:
        mode = os.stat(out_dir / name).st_mode
        assert mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) == 0, (name, oct(mode))
        assert mode & stat.S_IRUSR

    assert _read(out_dir / "results.json") == doc

    request = _read(out_dir / "request.json")
    assert request["table"] == "single_gemm" and request["backend"] == "torch-cpu" and request["mode"] == "jit"
    assert request["specs"] == SWEEP and request["gpu_name"] == local_gpu and request["db"] == ledger_path
    assert request["timing"] == effective_entry(lookup("single_gemm", "torch-cpu")).contract.timing  # the CPU's one method
    assert request["timing"].startswith("cpu-wall;l2=warm;eager;threads=")

    curve = _read(out_dir / "curve.json")
    assert curve["axes"] == ["m", "k", "dtype"]
    assert (curve["x"], curve["y"], curve["facets"]) == ("m", "k", ["dtype"])
    assert curve["fixedArgs"] == {"n": 32}
    assert (curve["table"], curve["backend"], curve["gpu_name"]) == ("single_gemm", "torch-cpu", local_gpu)
    assert len(curve["points"]) == 4
    for point, spec, r in zip(curve["points"], SWEEP, doc["results"]):
        assert {a: point[a] for a in ("m", "k", "dtype")} == {a: spec[a] for a in ("m", "k", "dtype")}
        assert "n" not in point
        assert point["status"] == "ok" and point["citation"] == r["citation"]
        assert point["time_ms"] == r["metrics"]["time_ms"]
    assert set(curve["metrics"]) == h.METRICS

    meta = _read(out_dir / "job.meta.json")
    for field in ("command", "versions", "host", "device", "mode", "count", "missing_count", "exit_code",
                  "duration_s", "view_root_before", "view_root_after"):
        assert field in meta, field
    assert meta["command"].startswith("kprof run")
    assert {"kprof", "python", "torch"} <= set(meta["versions"])
    assert meta["device"] == local_gpu and meta["mode"] == "jit"
    assert (meta["count"], meta["missing_count"], meta["exit_code"]) == (4, 0, 0)
    assert meta["duration_s"] > 0
    assert meta["view_root_after"] == doc["view_root"] and meta["view_root_before"] != meta["view_root_after"]


def test_a_snapshot_of_a_run_in_a_directory_whose_name_is_not_utf8_records_it_escaped(tmp_path, capsys, h,
                                                                                     monkeypatch):
    """A run in a directory named in another encoding (a byte 0xff) with relative paths measured and stored its rows,
    then its snapshot's record of the cwd (a surrogate) was a traceback, exit 1, and no snapshot."""
    here = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"x\xffy"))
    os.mkdir(here)
    monkeypatch.chdir(here)
    _run(capsys, h, "p.db", h.gemm(), extra=["--output-dir", "snap"])
    assert _read(os.path.join(here, "snap", "job.meta.json"))["cwd"] == f"{tmp_path}/x\\xffy"


@pytest.mark.parametrize("json_out", [True, False])
def test_a_run_builds_its_result_document_once_and_only_where_it_is_written(tmp_path, ledger_path, capsys, h,
                                                                         monkeypatch, json_out):
    """At 100k specs the document is hundreds of MB: built for --json and the snapshot alike, once; a table needs none."""
    built = []
    to_json = api.QueryResult.to_json
    monkeypatch.setattr(api.QueryResult, "to_json", lambda self: built.append(1) or to_json(self))
    flags = ["--json"] * json_out
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*SWEEP[:1]), "--db", ledger_path, *flags,
                 "--output-dir", str(tmp_path / "snap")]) == 0
    assert len(built) == 1 and (tmp_path / "snap" / "results.json").exists()
    if json_out:
        assert _read(tmp_path / "snap" / "results.json") == json.loads(capsys.readouterr().out)
    built.clear()
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*SWEEP[:1]), "--db", ledger_path]) == 0
    assert built == []


def test_a_snapshot_without_matplotlib_says_why_it_has_no_curve_png(tmp_path, ledger_path, capsys, h, monkeypatch):
    """Without matplotlib (no [plot] extra), run --output-dir left curve.png out of a snapshot with a curve to draw
    and said nothing; it writes the rest and says, on stderr, what installs the plot (nothing to draw: no note)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import raises ImportError
    for name, specs in (("sweep", SWEEP[:2]), ("one", SWEEP[:1])):
        out_dir = tmp_path / name
        code = main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path,
                     "--output-dir", str(out_dir)])
        err = capsys.readouterr().err
        assert code == 0 and set(os.listdir(out_dir)) == SNAPSHOT_FILES
        said = f"no curve.png in {out_dir}: matplotlib is not installed" in err and "pip install matplotlib" in err
        assert said == (name == "sweep"), err


def test_output_dir_records_failures_and_exit_code(tmp_path, ledger_path, capsys, h):
    out_dir = tmp_path / "snap"
    doc = _run(capsys, h, ledger_path, h.gemm(), HUGE, extra=["--output-dir", str(out_dir)], rc=1)
    meta = _read(out_dir / "job.meta.json")
    assert (meta["missing_count"], meta["exit_code"]) == (1, 1)
    curve = _read(out_dir / "curve.json")
    assert curve["axes"] == ["m"] and curve["x"] == "m" and curve["y"] is None and curve["facets"] == []
    assert curve["fixedArgs"] == {"n": 32, "k": 32, "dtype": "fp32"}
    assert [p["status"] for p in curve["points"]] == ["ok", "error"]
    # every point has every metric (an error's were left out: point["time_ms"] failed on it), null where none
    ok, error = curve["points"]
    assert set(ok) == set(error) == {"m", "status", "citation", *curve["metrics"]}
    assert all(error[m] is None for m in curve["metrics"]) and ok["time_ms"] > 0
    assert _read(out_dir / "results.json") == doc


def test_output_dir_reuse_is_refused_before_any_work(tmp_path, ledger_path, capsys, h):
    out_dir = tmp_path / "snap"
    _run(capsys, h, ledger_path, h.gemm(), extra=["--output-dir", str(out_dir)])
    db_before, seq = h.digest(ledger_path), _last_seq(ledger_path)
    files_before = {n: h.digest(out_dir / n) for n in os.listdir(out_dir)}
    code = main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(m=64)), "--db", ledger_path,
                 "--force", "--output-dir", str(out_dir), "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "already holds a snapshot" in captured.err
    assert h.digest(ledger_path) == db_before and _last_seq(ledger_path) == seq
    assert {n: h.digest(out_dir / n) for n in os.listdir(out_dir)} == files_before


def test_a_run_interrupted_while_its_snapshot_is_written_leaves_none_and_runs_again(tmp_path, ledger_path, capsys,
                                                                                      h, monkeypatch):
    """Ctrl-C while the plot is drawn (matplotlib's import takes a second) left the JSON files of a snapshot, so the
    same command, which the interrupt's note says to run again, was refused: the snapshot appears whole or not at
    all."""
    from kprof import artifacts

    out_dir = tmp_path / "snap"
    plot = artifacts._plot

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts, "_plot", interrupted)
    argv = ["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path, "--output-dir",
            str(out_dir), "--json"]
    assert main(argv) == 130
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err
    assert os.listdir(out_dir) == [] and _last_seq(ledger_path) == 1
    monkeypatch.setattr(artifacts, "_plot", plot)
    assert main(argv) == 0
    capsys.readouterr()
    assert {"request.json", "results.json", "curve.json", "job.meta.json"} <= set(os.listdir(out_dir))
    assert not [n for n in os.listdir(out_dir) if n.startswith(".")] and _last_seq(ledger_path) == 1


def test_an_interrupted_run_says_how_many_rows_it_stored_as_the_ledger_holds_them(ledger_path, capsys, h,
                                                                                   monkeypatch):
    """Ctrl-C or SIGTERM of a long fill said only "every row stored before it stays": how far it got took a
    `count-missing`. The line counts the rows this run stored as the ledger reads them, the one whose commit the
    signal came just after too."""
    append, appended = Ledger.append, []

    def append_then_interrupted(self, *args, **kwargs):
        result = append(self, *args, **kwargs)
        appended.append(result)
        if len(appended) == 2:  # the row is committed; the signal comes before the run goes on
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(Ledger, "append", append_then_interrupted)
    specs = [h.gemm(m=m) for m in (8, 16, 32, 64)]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path]) == 130
    err = capsys.readouterr().err
    assert "ledger (this run stored 2 row(s) of the 4 spec(s) it had to measure), and nothing half-written" in err
    assert main(["count-missing", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path,
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_count"] == 2


def test_an_interrupted_run_counts_no_row_a_merge_stored_for_a_spec_it_took(tmp_path, ledger_path, capsys, h,
                                                                            monkeypatch, local_gpu):
    """A merge (`kprof merge`, which takes no claims) stored the row of a spec the run had taken, before the run
    measured it: the run skipped it, and the interrupt's line counted that row as one this run stored (2 of 3, where
    it stored 1). The count leaves out a row another writer stored."""
    import kprof.runners.fill as fill
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    specs = [h.gemm(m=m) for m in (3, 5, 7)]
    team = str(tmp_path / "team.db")
    h.append(team, h.make_event(specs[0], local_gpu))
    seg = export(team, str(tmp_path / "team.kseg")).path
    to_measure, append = fill._State._to_measure, Ledger.append

    def after_a_merge(self, i):
        if self.canonical[i]["m"] == 3:
            merge_into(self.ledger, [seg], str(tmp_path))
        return to_measure(self, i)

    def append_then_interrupted(self, events, *args, **kwargs):
        result = append(self, events, *args, **kwargs)
        if events[0].provenance.shape["m"] == 5:  # the run's own row of m=5 is committed; then the signal
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(fill._State, "_to_measure", after_a_merge)
    monkeypatch.setattr(Ledger, "append", append_then_interrupted)
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path]) == 130
    assert "(this run stored 1 row(s) of the 3 spec(s) it had to measure)" in capsys.readouterr().err


def test_an_interrupted_run_counts_no_row_a_merge_stored_while_it_measured_the_spec(tmp_path, ledger_path, capsys, h,
                                                                                    monkeypatch, local_gpu):
    """A merge stored the row of a spec while the run measured it: the run's row is not stored (the key's row
    changed), and the interrupt's count must leave that row out as another writer's (the test above covers a spec
    skipped before it was measured, which the count never reads)."""
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    specs = [h.gemm(m=m) for m in (3, 5, 7)]
    team = str(tmp_path / "team.db")
    h.append(team, h.make_event(specs[0], local_gpu))
    seg = export(team, str(tmp_path / "team.kseg")).path
    append = Ledger.append

    def merged_meanwhile_then_interrupted(self, events, *args, **kwargs):
        if events[0].provenance.shape["m"] == 3:  # measured; the merge's row lands before the run's is stored
            merge_into(self, [seg], str(tmp_path))
        result = append(self, events, *args, **kwargs)
        if events[0].provenance.shape["m"] == 5:  # the run's own row of m=5 is committed; then the signal
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(Ledger, "append", merged_meanwhile_then_interrupted)
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path]) == 130
    assert "(this run stored 1 row(s) of the 3 spec(s) it had to measure)" in capsys.readouterr().err


def test_an_interrupted_run_reads_only_the_specs_it_measured_to_count_its_rows(ledger_path, capsys, h, monkeypatch):
    """The interrupt's count read the row of every spec the run had taken, all of a request's at once: a 100,000-spec
    run took 0.5 s more to end after Ctrl-C, however few it had measured (a second Ctrl-C meanwhile lost the count).
    It reads the rows of the specs it measured."""
    from kprof.ledger.view import View

    append, query, read = Ledger.append, View.query, None

    def append_then_interrupted(self, *args, **kwargs):
        nonlocal read
        append(self, *args, **kwargs)
        read = []  # the specs each read from here on names
        raise KeyboardInterrupt  # the first row is committed; then the signal

    def counted(self, specs, *args, **kwargs):
        specs = list(specs)
        if read is not None:
            read.append(len(specs))
        return query(self, specs, *args, **kwargs)

    monkeypatch.setattr(Ledger, "append", append_then_interrupted)
    monkeypatch.setattr(View, "query", counted)
    specs = [h.gemm(m=m) for m in range(1, 41)]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path]) == 130
    assert "(this run stored 1 row(s) of the 40 spec(s) it had to measure)" in capsys.readouterr().err
    assert read == [1], read  # the count read the one spec measured, not the 40 taken


class _Killed(BaseException):
    """The process ends here: no except or cleanup of the writer's runs (a SIGKILL), only the kernel's release of
    its flocks, which closing the fd does."""


def test_a_snapshot_of_many_lines_plots_them_in_order_without_a_legend_past_the_colours(tmp_path):
    """A sweep of 64 n by 2 dtypes drew 128 lines with a legend of 128 labels, in text order (n=1024 before n=128),
    over the plot and past the figure, and matplotlib's warning (tight layout not applied, with a source path) came
    on the run's stderr. The lines are in number order; past LEGEND_MAX, the title counts them instead."""
    import warnings

    from kprof import artifacts

    specs = [{"m": m, "n": 128 * i, "k": 8, "dtype": d} for i in range(1, 65) for d in ("bf16", "fp16") for m in (1, 2)]
    result = {"table": "single_gemm", "backend": "torch-cpu", "gpu_name": "cpu", "results": [
        {"spec": s, "status": "ok", "citation": f"kprof.{j:016x}", "metrics": {"time_ms": 0.1 * s["m"]}}
        for j, s in enumerate(specs)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = artifacts.write_snapshot(str(tmp_path / "snap"), {"specs": specs}, result, {}, ["m", "n", "k", "dtype"])
    assert "curve.png" in written
    labels = list(artifacts.plot_series(artifacts.curve(result, ["m", "n", "k", "dtype"]))[2])
    assert labels[:3] == ["n=128, dtype=bf16", "n=128, dtype=fp16", "n=256, dtype=bf16"] and len(labels) == 128


SNAPSHOT_FILES = {"request.json", "results.json", "curve.json", "job.meta.json"}


def _snapshot_of_two_rows(out_dir) -> None:
    from kprof import artifacts

    result = {"table": "single_gemm", "backend": "torch-cpu", "gpu_name": "cpu", "results": [
        {"spec": {"m": m, "n": 8, "k": 8, "dtype": "fp32"}, "status": "ok", "citation": f"kprof.{m:016x}",
         "metrics": {"time_ms": 0.1 * m}} for m in (8, 16)]}
    artifacts.write_snapshot(str(out_dir), {"specs": []}, result, {"command": "kprof run"}, ["m", "n", "k", "dtype"])


def _killed_at(monkeypatch, out_dir, kill_at: int) -> set[str]:
    """The files a snapshot write killed at its rename number `kill_at` (from 0) left in out_dir."""
    from kprof import _outdir

    rename, calls = os.rename, []

    def killed(src, dst):
        calls.append(dst)
        if len(calls) > kill_at:
            raise _Killed
        rename(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "rename", killed)
        m.setattr(_outdir.shutil, "rmtree", lambda *a, **kw: None)  # no cleanup runs in a killed process
        try:
            _snapshot_of_two_rows(out_dir)
        except _Killed:
            pass
    return {n for n in os.listdir(out_dir) if not n.startswith(".")}


@pytest.mark.parametrize("kill_at", [0, 1, 2, 3])
@pytest.mark.parametrize("held", [[], ["segments"]])
def test_a_snapshot_killed_among_its_renames_is_removed_and_written_again(tmp_path, monkeypatch, kill_at,
                                                                                 held):
    """A SIGKILL between the renames of the snapshot's files into --output-dir left part of a snapshot, which
    refused the same command again ("already holds a snapshot"), and its staging folder for good. The part is left
    beside the staging folder until the next write of the directory, which removes both and writes the snapshot:
    the command runs again, and a leftover staging folder is neither a snapshot nor left behind."""
    from kprof.errors import UsageError

    out_dir = tmp_path / "snap"
    out_dir.mkdir()
    for name in held:
        (out_dir / name).mkdir()
    left = _killed_at(monkeypatch, out_dir, kill_at) - set(held)
    whole = SNAPSHOT_FILES | {"curve.png"}
    assert len(left) == min(kill_at, len(whole)), left  # the files renamed before the kill
    if left == whole:  # the kill came after the last rename: that snapshot stands, and refuses a second
        with pytest.raises(UsageError, match="already holds a snapshot"):
            _snapshot_of_two_rows(out_dir)
    else:
        _snapshot_of_two_rows(out_dir)
    assert set(os.listdir(out_dir)) == whole | set(held)
    assert not [n for n in os.listdir(out_dir) if n.startswith(".")]  # no staging folder left


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_among_the_snapshot_s_renames_lets_them_finish(sig, tmp_path, monkeypatch):
    """A Ctrl-C (or SIGTERM, which kprof.cli raises as SystemExit) that came among the renames of the snapshot's
    files into --output-dir left those renamed before it, and removed the staging folder with the others: the same
    command run again was refused ("already holds a snapshot"). The renames finish, then the interrupt is handled."""
    import signal

    from kprof.cli import _terminated

    rename, out_dir = os.rename, tmp_path / "snap"

    def interrupted(src, dst):
        rename(src, dst)
        os.kill(os.getpid(), getattr(signal, sig))

    monkeypatch.setattr(os, "rename", interrupted)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with pytest.raises(KeyboardInterrupt if sig == "SIGINT" else SystemExit):
            _snapshot_of_two_rows(out_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert set(os.listdir(out_dir)) == SNAPSHOT_FILES | {"curve.png"}  # whole, no staging folder left


@pytest.mark.parametrize("fresh", [[], ["--fresh"]])
def test_an_interrupt_once_the_snapshot_is_placed_names_a_new_output_dir(tmp_path, monkeypatch, capsys, fresh):
    """An interrupt among the snapshot's renames (held till they finish) or after them said "the same command again",
    which then refused its --output-dir: it holds that whole snapshot. The line names a new --output-dir, as the
    remote run's does."""
    import signal

    rename = os.rename

    def interrupted(src, dst):
        rename(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "rename", interrupted)
    argv = ["run", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps({"m": 8, "n": 8, "k": 8,
                                                                                   "dtype": "fp32"}), "--db", "p.db"]
    assert main([*argv, *fresh, "--output-dir", "snap"]) == 143
    err = capsys.readouterr().err
    assert "the same command with a new --output-dir" in err and "again" not in err, err
    monkeypatch.setattr(os, "rename", rename)
    assert main([*argv, *fresh, "--output-dir", "snap"]) == 2  # refused, as the line says
    assert main([*argv, *fresh, "--output-dir", "snap2"]) == 0


def test_a_staging_folder_a_live_writer_holds_is_let_be(tmp_path):
    """A writer of a snapshot into the directory holds its staging folder (a flock; one open of it here stands for
    another process, as flocks of two opens conflict): it is not taken for a killed write's leftover (its files
    stay), and is no snapshot (the directory is not refused). Let go, it is a leftover, and removed."""
    import fcntl

    from kprof import artifacts

    out_dir = tmp_path / "snap"
    (out_dir / ".snapshot-live").mkdir(parents=True)
    (out_dir / ".snapshot-live" / "curve.json").write_text("{}")
    fd = os.open(out_dir / ".snapshot-live", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        artifacts.check_output_dir(str(out_dir))
        assert os.listdir(out_dir / ".snapshot-live") == ["curve.json"]
    finally:
        os.close(fd)
    artifacts.check_output_dir(str(out_dir))
    assert os.listdir(out_dir) == []


def test_an_empty_staging_folder_is_let_be(tmp_path):
    """A writer makes its staging folder, then locks it, then writes: an empty unlocked folder may be a live writer's
    between the two, and taking it would fail that writer after its rows are stored. It holds no part of a snapshot:
    it is let be, and the directory is not refused."""
    from kprof import artifacts

    out_dir = tmp_path / "snap"
    (out_dir / ".snapshot-new").mkdir(parents=True)
    artifacts.check_output_dir(str(out_dir))
    assert os.listdir(out_dir) == [".snapshot-new"]


def test_output_dir_that_is_a_file_is_refused(tmp_path, ledger_path, capsys, h):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--output-dir", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert not os.path.exists(ledger_path)


def test_job_meta_command_records_the_invocation(tmp_path, ledger_path, capsys, h, monkeypatch):
    """main(argv) is the CLI: the command in job.meta.json (and each event's origin) must be that argv,
    not sys.argv of whatever process hosts it."""
    monkeypatch.setattr("sys.argv", ["/opt/kprof-tools/driver.py", "--unrelated"])
    out_dir = tmp_path / "snap"
    doc = _run(capsys, h, ledger_path, h.gemm(), extra=["--output-dir", str(out_dir)])
    command = _read(out_dir / "job.meta.json")["command"]
    assert "--unrelated" not in command
    assert command.startswith("kprof run single_gemm") and "--spec" in command and "--output-dir" in command
    from kprof.ledger import Ledger, _codec

    with Ledger.open(ledger_path, readonly=True) as ledger:
        events = [ledger.event(bytes.fromhex(r["event"])) for r in doc["results"]]
    assert events and all(ev.origin.command == command for ev in events)


@pytest.mark.parametrize("merged", ["ok", "failed"])
def test_a_row_merged_while_its_spec_was_measured_is_kept_and_the_measurement_refused(tmp_path, capsys, h,
                                                                                        monkeypatch, merged, local_gpu):
    """A merge (which takes no claims) lands a row for a key this run is measuring: as in the pool's path, the
    run's event would supersede a row it never saw, so it is not stored. The merged row stands, the ledger audits
    clean, and it merges back into the team's ledger without conflict. A row stored since the run began is its
    answer, as a concurrent run's is: an ok one reads ok (exit 0), a failed one failed (exit 1), the merged row."""
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    spec_x, spec_y = {"m": 3, "n": 32, "k": 32, "dtype": "fp32"}, {"m": 5, "n": 32, "k": 32, "dtype": "fp32"}
    team, mine = str(tmp_path / "team.db"), str(tmp_path / "mine.db")
    if merged == "ok":
        _run(capsys, h, team, spec_x)
    else:
        h.append(team, h.make_event(spec_x, local_gpu, kind="failed"))
    seg = str(tmp_path / "team.kseg")
    export(team, seg)
    _merge_while_measured(monkeypatch, seg, str(tmp_path), m=3)
    out = _run(capsys, h, mine, spec_x, spec_y, rc=0 if merged == "ok" else 1)
    by_m = {r["spec"]["m"]: r for r in out["results"]}
    assert by_m[5]["status"] == "ok"
    with Ledger.open(team, readonly=True) as led:
        entry = effective_entry(lookup("single_gemm", h.CPU))
        team_event = led.view("single_gemm", h.CPU, local_gpu, entry.contract, entry.args).query([spec_x])[1][0]
        team_event = team_event.event_id.hex()
    assert by_m[3]["status"] == merged and by_m[3]["event"] == team_event  # the merged row, not this run's
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(spec_x), "--db", mine, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["event"] == team_event  # the merged row stands
    assert _last_seq(mine) == 2
    assert main(["audit", "--db", mine]) == 0
    back = str(tmp_path / "mine.kseg")
    export(mine, back)
    monkeypatch.undo()
    with Ledger.open(team) as led:
        assert merge_into(led, [back], str(tmp_path)) == (1, 1)


def test_a_failure_merged_before_the_run_reached_its_key_is_not_measured(tmp_path, capsys, h, monkeypatch, local_gpu):
    """A jit run took its keys, then a merge (which takes no claims) stored a failed row for one of them before the
    run reached it: the run measured the spec anyway, though the changed row meant its measurement could not be
    stored, and reported it `error`, kind conflict. A failure another run stored meanwhile was already its answer;
    so is a merged one now, as the README says of any row a merge stored before the run reached its key: not
    measured, the spec reads the merged failure (exit 1)."""
    import kprof.runners.fill as fill
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    spec_x, spec_y = {"m": 3, "n": 32, "k": 32, "dtype": "fp32"}, {"m": 5, "n": 32, "k": 32, "dtype": "fp32"}
    team, mine = str(tmp_path / "team.db"), str(tmp_path / "mine.db")
    h.append(team, h.make_event(spec_x, local_gpu, kind="failed"))
    seg = export(team, str(tmp_path / "team.kseg")).path
    to_measure, keep, measured = fill._State._to_measure, fill._State._keep, []

    def after_a_merge(self, i):
        if self.canonical[i]["m"] == 3:
            merge_into(self.ledger, [seg], str(tmp_path))
        return to_measure(self, i)

    def kept(self, res, errored):
        measured.append(self.canonical[res.index]["m"])
        return keep(self, res, errored)

    monkeypatch.setattr(fill._State, "_to_measure", after_a_merge)
    monkeypatch.setattr(fill._State, "_keep", kept)
    out = _run(capsys, h, mine, spec_x, spec_y, rc=1)
    assert measured == [5]
    with Ledger.open(team, readonly=True) as led:
        entry = effective_entry(lookup("single_gemm", h.CPU))
        team_event = led.view("single_gemm", h.CPU, local_gpu, entry.contract, entry.args).query([spec_x])[1][0]
    assert [r["status"] for r in out["results"]] == ["failed", "ok"]
    assert out["results"][0]["event"] == team_event.event_id.hex()
    assert main(["audit", "--db", mine]) == 0


def test_a_row_of_another_thread_count_stored_while_a_spec_was_measured_is_no_conflict(tmp_path, capsys, h,
                                                                                      monkeypatch):
    """`OMP_NUM_THREADS=1` and `=2` runs of the same specs at once on one ledger: the rows of each count have keys of
    their own, yet where the other count's row landed while a spec was measured, the run read it (stale under its
    own count) as its key's row changed, and refused its measurement: `error`, kind conflict, naming the other
    run's event, exit 1. It is stored, and both counts' rows stand."""
    from kprof.merge.export import export

    spec_x, spec_y = {"m": 3, "n": 32, "k": 32, "dtype": "fp32"}, {"m": 5, "n": 32, "k": 32, "dtype": "fp32"}
    other, mine = str(tmp_path / "other.db"), str(tmp_path / "mine.db")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = _run(capsys, h, other, spec_x)["results"][0]["event"]
    seg = export(other, str(tmp_path / "other.kseg")).path
    _merge_while_measured(monkeypatch, seg, str(tmp_path), m=3)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    out = _run(capsys, h, mine, spec_x, spec_y)
    assert [r["status"] for r in out["results"]] == ["ok", "ok"]
    assert out["results"][0]["event"] != one and out["results"][0]["provenance"]["timing"].endswith("threads=2")
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _run(capsys, h, mine, spec_x)["results"][0]["event"] == one
    assert main(["audit", "--db", mine]) == 0


def test_a_force_run_measures_though_another_thread_counts_row_was_re_measured_meanwhile(tmp_path, capsys, h,
                                                                                       monkeypatch):
    """`kprof run --force` with OMP_NUM_THREADS=2 beside one with =1: where the other count's row (stale under this
    count) was re-measured before a spec's turn, the run took it for the refresh it was asked for, skipped the spec
    and reported it `stale`, exit 1. Only a re-measurement under the spec's own key is that refresh."""
    import kprof.runners.fill as fill
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    spec_x = {"m": 3, "n": 32, "k": 32, "dtype": "fp32"}
    other, mine = str(tmp_path / "other.db"), str(tmp_path / "mine.db")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _run(capsys, h, other, spec_x)
    assert main(["merge", export(other, str(tmp_path / "first.kseg")).path, "--db", mine]) == 0
    capsys.readouterr()
    _run(capsys, h, other, spec_x, extra=["--force"])
    seg = export(other, str(tmp_path / "other.kseg")).path
    to_measure = fill._State._to_measure

    def after_the_other_count_re_measured(self, i):
        merge_into(self.ledger, [seg], str(tmp_path))
        return to_measure(self, i)

    monkeypatch.setattr(fill._State, "_to_measure", after_the_other_count_re_measured)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    row = _run(capsys, h, mine, spec_x, extra=["--force"])["results"][0]
    assert row["status"] == "ok" and row["provenance"]["timing"].endswith("threads=2")
    assert main(["audit", "--db", mine]) == 0


def test_a_row_merged_between_the_runs_check_of_its_key_and_its_append_stands(tmp_path, capsys, h, local_gpu,
                                                                               monkeypatch):
    """The run read its key's row, then appended its event in another transaction: a merge that stored the team's row
    in between was superseded by this run's event, which named no parent, as if the merged row had never been. The
    row is now read again under the write lock, and the merged row stands."""
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    spec_x = {"m": 3, "n": 32, "k": 32, "dtype": "fp32"}
    team, mine = str(tmp_path / "team.db"), str(tmp_path / "mine.db")
    team_event = _run(capsys, h, team, spec_x)["results"][0]["event"]
    seg = str(tmp_path / "team.kseg")
    export(team, seg)
    append, merged = Ledger.append, []

    def merged_just_before(self, events, **kwargs):  # the run's append: a merge commits first
        if not merged:
            merged.append(merge_into(self, [seg], str(tmp_path)))
        return append(self, events, **kwargs)

    monkeypatch.setattr(Ledger, "append", merged_just_before)
    out = _run(capsys, h, mine, spec_x)
    assert merged == [(1, 0)]
    assert out["results"][0]["status"] == "ok" and out["results"][0]["event"] == team_event
    monkeypatch.undo()
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(spec_x), "--db", mine, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["event"] == team_event
    assert _last_seq(mine) == 1 and main(["audit", "--db", mine]) == 0


def test_where_a_run_measured_is_a_log_line_on_stderr_in_either_mode(tmp_path, capsys, h):
    spec = {"m": 7, "n": 32, "k": 32, "dtype": "fp32"}
    for extra in ((), ("--json",)):
        db = str(tmp_path / f"p{len(extra)}.db")
        assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(spec), "--db", db, *extra]) == 0
        out, err = capsys.readouterr()
        assert "devices: cpu0" in err and "devices:" not in out


def test_a_run_over_a_stale_row_stores_its_measurement_with_the_stale_row_as_parent(ledger_path, capsys, h,
                                                                                      local_gpu):
    """The row a run supersedes may be another revision's (stale): that is its parent, not a concurrent change."""
    old = h.make_event(h.gemm(), local_gpu, revision=0, time_ms=0.25)
    h.append(ledger_path, old)
    out = _run(capsys, h, ledger_path, h.gemm())
    row = out["results"][0]
    assert row["status"] == "ok" and row["error"] is None, row
    assert _history(capsys, ledger_path, row["citation"])["event"]["parent"] == _codec.event_id(
        _codec.encode(old)).hex()


@pytest.mark.parametrize("load, noted", [(99.0, True), (0.0, False)])
def test_cpu_rows_timed_on_a_busy_host_are_named_in_a_note(ledger_path, capsys, h, monkeypatch, load, noted):
    """A CPU row times the host: where its load passed the cores, stderr says so (the table alone looked fine)."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--json"]) == 0
    err = capsys.readouterr().err
    assert ("note: the host's load average (99.0) passed its" in err and "1 CPU row(s)" in err) == noted
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path]) == 0
    assert "note: the host's load" not in capsys.readouterr().err  # nothing measured: nothing to say


def test_a_busy_host_note_counts_only_the_rows_it_timed(ledger_path, capsys, h, monkeypatch):
    """A spec past the machine's memory (an oom row, never built or timed) measured on a loaded host was counted
    among "these 2 CPU row(s) were timed" and, alone, drew "1 CPU row(s) ... measure again on a quieter host with
    `kprof run --force`", which gives the same oom."""
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(), HUGE), "--db", ledger_path,
                 "--json"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "passed its" in err and "these 1 CPU row(s) were timed" in err, err
    # this command again, with --force (it said `kprof run --force`, which names no table: a usage error as written)
    assert err.endswith("measure again on a quieter host with the same command with --force (and a new --output-dir, "
                        "where it had one)"), err
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(HUGE), "--db", ledger_path, "--json"]) == 1
    assert "note: the host's load" not in capsys.readouterr().err  # the oom again: nothing timed, nothing to say


def test_a_run_of_more_threads_than_cores_is_not_told_its_own_load_is_other_work(ledger_path, capsys, h, monkeypatch):
    """`OMP_NUM_THREADS=8 kprof run` of a minute's GEMMs on a quiet 2-core host took the load to 5.9 with its own
    threads: stderr said other work slowed the rows and to measure again on a quieter host, which would read the same.
    The rows say whether other work took their cores (host_busy, beyond their own threads): the note follows them."""
    import types

    import kprof.runners.worker as worker

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.86, 5.86, 5.86))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(worker, "cpus", lambda: frozenset({0, 1}))
    monkeypatch.setattr(worker.resource, "getrusage", lambda who: types.SimpleNamespace(ru_nivcsw=0))
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["results"][0]["provenance"]["timing"].endswith("threads=8"), out
    assert "load average" not in err and "quieter host" not in err, err


def test_cpu_rows_another_process_took_the_cores_of_are_named_in_a_note(ledger_path, capsys, h, monkeypatch):
    """A row flagged host_busy by the scheduler's involuntary switches (a neighbour holding a core, which the
    minute's load average misses) carried the flag in its notes only: `run` printed no note."""
    import itertools
    import types

    import kprof.runners.worker as worker

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    counts = itertools.count(0, 100_000)
    monkeypatch.setattr(worker.resource, "getrusage", lambda who: types.SimpleNamespace(ru_nivcsw=next(counts)))
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--json"]) == 0
    err = capsys.readouterr().err
    assert "note: other processes took this one's cores while 1 of these 1 CPU row(s) were timed" in err, err
    assert "their notes say host_busy" in err


@pytest.mark.parametrize("modes, mode", [(["--force", "--fresh=false"], "force"), (["--fresh", "--force=no"], "fresh")])
def test_a_mode_flag_set_false_does_not_combine_with_the_other(ledger_path, capsys, h, modes, mode):
    """`--force --fresh=false` (a script passing --fresh=$FRESH) was refused as --force and --fresh combined."""
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path, *modes,
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == mode


def test_a_fresh_run_on_a_busy_host_is_not_told_to_store_its_rows_with_force(ledger_path, capsys, h, monkeypatch):
    """`run --fresh` on a busy host pointed at the rows' notes (it stores none) and said to measure again with
    `kprof run --force`, which writes the ledger the user kept out of it."""
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path, "--fresh",
                 "--json"]) == 0
    err = capsys.readouterr().err
    assert "note: the host's load average (99.0) passed its" in err and "measure again on a quieter host with the " \
        "same command" in err, err
    assert "--force" not in err and "host_busy" not in err and not os.path.exists(ledger_path)


@pytest.mark.parametrize("pool", ["off", "on"])
def test_a_spec_whose_row_a_merge_stored_before_the_run_reached_it_is_not_measured(tmp_path, capsys, h, monkeypatch,
                                                                                    pool):
    """A merge lands the team's row of spec y while the run measures spec x: the run checks y's row just before it
    would measure it, finds the row it asks for, and skips it (its claim ended), in this process and on the pool."""
    import kprof.runners.fill as fill
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    monkeypatch.setenv("KPROF_POOL", pool)
    spec_x, spec_y = {"m": 3, "n": 32, "k": 32, "dtype": "fp32"}, {"m": 5, "n": 32, "k": 32, "dtype": "fp32"}
    team, mine = str(tmp_path / "team.db"), str(tmp_path / "mine.db")
    team_event = _run(capsys, h, team, spec_y)["results"][0]["event"]
    seg = str(tmp_path / "team.kseg")
    export(team, seg)
    keep, measured = fill._State._keep, []

    def keep_then_merge(self, res, errored):
        measured.append(self.canonical[res.index]["m"])
        keep(self, res, errored)
        if self.canonical[res.index]["m"] == 3:
            merge_into(self.ledger, [seg], str(tmp_path))

    monkeypatch.setattr(fill._State, "_keep", keep_then_merge)
    out = _run(capsys, h, mine, spec_x, spec_y)
    by_m = {r["spec"]["m"]: r for r in out["results"]}
    assert measured == [3] and out["missing_count"] == 0  # y was not measured
    assert by_m[3]["status"] == "ok" and by_m[5]["status"] == "ok" and by_m[5]["event"] == team_event
    assert _last_seq(mine) == 2 and main(["audit", "--db", mine]) == 0


def test_a_run_s_progress_total_leaves_out_a_spec_whose_row_a_merge_stored_meanwhile(tmp_path, capsys, h,
                                                                                     monkeypatch):
    """The progress total counted the specs whose row another writer stored while the run went on (a merge, a run it
    waited for): never measured here, they kept "about X left" above the work left. The total is the specs this run
    measures."""
    import kprof.runners.fill as fill
    from kprof.cli import run as run_module
    from kprof.merge.export import export
    from kprof.merge.merge import merge_into

    monkeypatch.setenv("KPROF_POOL", "off")
    specs = [{"m": 3, "n": 32, "k": 32, "dtype": "fp32"}, {"m": 5, "n": 32, "k": 32, "dtype": "fp32"},
             {"m": 7, "n": 32, "k": 32, "dtype": "fp32"}]
    team, mine = str(tmp_path / "team.db"), str(tmp_path / "mine.db")
    _run(capsys, h, team, specs[1])
    seg = str(tmp_path / "team.kseg")
    export(team, seg)
    keep, seen = fill._State._keep, []

    def keep_then_merge(self, res, errored):
        keep(self, res, errored)
        if self.canonical[res.index]["m"] == 3:
            merge_into(self.ledger, [seg], str(tmp_path))

    monkeypatch.setattr(fill._State, "_keep", keep_then_merge)
    monkeypatch.setattr(run_module, "_progress_lines", lambda: lambda done, count, spec, failed=0: seen.append(
        (done, count)))
    assert _run(capsys, h, mine, *specs)["missing_count"] == 0
    assert seen == [(1, 3), (2, 2)], seen  # the merged spec left the total once the run found its row


def test_a_run_off_a_terminal_reports_its_progress_on_stderr(ledger_path, capsys, h, monkeypatch):
    """A long fill whose stderr is a log (nohup, a batch job) said nothing until it ended: off a terminal, a line
    at most every PROGRESS_EVERY_S says how many specs are done of how many, the rate and the time left."""
    lines = _progress_lines(ledger_path, capsys, h, monkeypatch)
    assert all("/min); about " in ln and ln.endswith(" left") for ln in lines)


def _progress_lines(ledger_path, capsys, h, monkeypatch) -> list[str]:
    """The progress lines of a run of three specs, a line after each (PROGRESS_EVERY_S 0), checked to count them."""
    from kprof.cli import run as run_module

    monkeypatch.setattr(run_module, "PROGRESS_EVERY_S", 0.0)
    specs = [h.gemm(), h.gemm(n=48), h.gemm(k=16)]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["missing_count"] == 0
    lines = [ln for ln in err.splitlines() if ln.startswith("progress: ")]
    assert [ln.split(" spec(s)")[0] for ln in lines] == ["progress: 1 of 3", "progress: 2 of 3"], err
    return lines


def test_a_run_s_progress_counts_the_failed_specs_so_far(ledger_path, capsys, h, monkeypatch):
    """A long fill where most specs failed (out of memory) said so only at its end: neither the progress line off a
    terminal nor the bar counted them. Both count the failed rows so far, the line after its time left."""
    from kprof.cli import run as run_module

    monkeypatch.setattr(run_module, "PROGRESS_EVERY_S", 0.0)
    specs = [HUGE, {**HUGE, "n": 48}, h.gemm()]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json"]) == 1
    out, err = capsys.readouterr()
    assert [r["status"] for r in json.loads(out)["results"]] == ["error", "error", "ok"]
    lines = [ln for ln in err.splitlines() if ln.startswith("progress: ")]
    assert [ln.split(" spec(s)")[0] for ln in lines] == ["progress: 1 of 3", "progress: 2 of 3"], err
    assert lines[0].endswith(" left; 1 failed") and lines[1].endswith(" left; 2 failed"), err
    seen = []
    monkeypatch.setattr(run_module, "_progress_lines", lambda: lambda done, count, spec, failed=0: seen.append(failed))
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json",
                 "--force"]) == 1
    assert seen[-3:] == [1, 2, 2], seen  # the hook the bar updates with is told the same count


def test_a_run_off_a_terminal_says_what_it_measures_as_it_begins(ledger_path, capsys, h):
    """Off a terminal a fill printed nothing until its first minute had passed (its devices line comes at the end):
    a long fill's log showed nothing at its start. An opening line says how many specs it measures, how many are
    stored already, and on which devices."""
    specs = [h.gemm(), h.gemm(n=48), h.gemm(k=16)]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(specs[0]), "--db", ledger_path]) == 0
    capsys.readouterr()
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["results"]) == 3
    assert err.splitlines()[0] == "measuring 2 spec(s) (1 already have an ok row) on cpu0 (in this process)", err
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path]) == 0
    assert "measuring" not in capsys.readouterr().err  # nothing to measure: no opening line


def test_a_run_s_bar_has_its_total_before_the_first_spec_ends(ledger_path, capsys, h, monkeypatch):
    """On a terminal the bar read `0/?`, without a total or a time left, until the first spec finished (a minute or
    more for a large one): it has the total of the specs to measure from the start."""
    import sys

    from rich.progress import Progress

    from kprof.runners import fill

    seen, keep, update = [], fill._State._keep, Progress.update

    def keep_noting(self, res, errored):
        seen.append("a spec ended")
        keep(self, res, errored)

    def noting(self, task, **fields):
        if fields.get("description", "").startswith("measuring"):
            seen.append((fields["completed"], fields["total"]))
        update(self, task, **fields)

    monkeypatch.setattr(fill._State, "_keep", keep_noting)
    monkeypatch.setattr(Progress, "update", noting)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm-256color")
    specs = [h.gemm(), h.gemm(n=48)]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_count"] == 0
    assert seen[:2] == [(0, 2), "a spec ended"], seen


def test_a_run_on_a_dumb_terminal_reports_its_progress_in_lines(ledger_path, capsys, h, monkeypatch):
    """On a terminal that cannot redraw a bar (TERM=dumb: an editor's shell, a serial console) the bar drew nothing
    and, transient, left nothing: a run of hours said nothing until it ended. It reports in lines, as off a
    terminal."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    _progress_lines(ledger_path, capsys, h, monkeypatch)
    specs = [h.gemm(), h.gemm(n=48), h.gemm(k=16)]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a CI log that asks for colours: no bar drawn there
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TERM", "xterm-256color")
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json",
                 "--force"]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and sum(ln.startswith("progress: ") for ln in err.splitlines()) == 2, err


@pytest.mark.parametrize("runner", ["kprof.runners.gemm:NoSuchRunner", "no_such_module_here:Runner"])
def test_a_runner_that_does_not_load_is_refused_before_a_ledger_is_made(tmp_path, capsys, h, monkeypatch, runner):
    """A plugin entry whose runner does not load (a typo in its name, a module that does not import) was refused with
    exit 2 only once the run had made the ledger, its lock file and its claims directory: bad input left files
    behind. It is refused before anything is made, as every other bad input is."""
    import msgspec

    from kprof.runners import registry

    registry.entries()  # the catalog first: a registry that is not empty is taken as loaded
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    registry.register(msgspec.structs.replace(lookup(h.GEMM, h.CPU), table="typo_gemm", runner=runner))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "typo_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", "new.db"]) == 2
    assert "names runner" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
