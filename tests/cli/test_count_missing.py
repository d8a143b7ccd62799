import json
import os
import shlex

import pytest

from kprof import api
from kprof.cli import main


def _count(capsys, h, db, *specs, extra=(), table="single_gemm") -> dict:
    return h.read_json(capsys, "count-missing", db, *specs, extra=extra, table=table)


def test_nonexistent_db_is_a_usage_error_and_not_created(tmp_path, ledger_path, capsys, h):
    """A --db that names no file is a mistyped path, not a ledger with every row missing."""
    assert main(["count-missing", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no ledger at {ledger_path}; pass --db or set KPROF_DB, or `kprof run` to create one" in captured.err
    assert os.listdir(tmp_path) == []


def test_empty_db_all_missing(ledger_path, capsys, h, local_gpu):
    from kprof.ledger import Ledger

    Ledger.open(ledger_path).close()
    specs = [h.gemm(), h.gemm(m=64), h.gemm(dtype="bf16")]
    doc = _count(capsys, h, ledger_path, *specs)
    assert list(doc) == ["table", "backend", "gpu_name", "db", "count", "missing_count", "missing"]
    assert doc == {"table": "single_gemm", "backend": "torch-cpu", "gpu_name": local_gpu, "db": ledger_path,
                   "count": 3, "missing_count": 3, "missing": specs}


def test_the_python_result_gives_the_json_the_verb_prints(ledger_path, capsys, h, local_gpu):
    """CountResult had no to_json while its peer QueryResult (and Scope's peers) had one: a Python caller rebuilt the
    verb's document by hand."""
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu))
    specs = [h.gemm(), h.gemm(m=64)]
    doc = api.count_missing("single_gemm", h.CPU, specs, db=ledger_path).to_json()
    assert list(doc) == ["table", "backend", "gpu_name", "db", "count", "missing_count", "missing"]
    assert doc == _count(capsys, h, ledger_path, *specs)
    assert [s.to_json() for s in api.scopes(ledger_path)] == [
        {"table": "single_gemm", "backend": h.CPU, "gpu_name": local_gpu, "rows": 1}]


def test_after_run_nothing_missing(ledger_path, capsys, h):
    specs = [h.gemm(), h.gemm(n=48)]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json"]) == 0
    capsys.readouterr()
    doc = _count(capsys, h, ledger_path, *specs, h.gemm(n=80))
    assert set(doc) == h.COUNT_FIELDS
    assert doc["count"] == 3 and doc["missing_count"] == 1 and doc["missing"] == [h.gemm(n=80)]


def test_gpu_name_filters(ledger_path, capsys, h, local_gpu):
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu), h.make_event(h.gemm(m=64), "NVIDIA H200"))
    assert _count(capsys, h, ledger_path, h.gemm(), h.gemm(m=64))["missing"] == [h.gemm(m=64)]
    doc = _count(capsys, h, ledger_path, h.gemm(), h.gemm(m=64), extra=["--gpu-name", "NVIDIA H200"])
    assert doc["gpu_name"] == "NVIDIA H200" and doc["missing"] == [h.gemm()]
    doc = _count(capsys, h, ledger_path, h.gemm(), h.gemm(m=64), extra=["--gpu-name", "Other GPU"])
    assert doc["missing_count"] == 2


def test_stale_and_failed_count_as_missing(ledger_path, capsys, h, local_gpu):
    h.append(ledger_path,
             h.make_event(h.gemm(), local_gpu, revision=0),
             h.make_event(h.gemm(m=64), local_gpu, kind="failed"),
             h.make_event(h.gemm(m=128), local_gpu))
    doc = _count(capsys, h, ledger_path, h.gemm(), h.gemm(m=64), h.gemm(m=128), h.gemm(m=256))
    assert doc["count"] == 4 and doc["missing_count"] == 3
    assert doc["missing"] == [h.gemm(), h.gemm(m=64), h.gemm(m=256)]


def test_missing_are_canonical_specs_in_input_order(ledger_path, capsys, h):
    from kprof.ledger import Ledger

    Ledger.open(ledger_path).close()
    raw = ['{"dtype": "bf16", "k": 8, "n": 8, "m": 8}', '{"m": 4, "n": 4, "k": 4, "dtype": "fp32"}']
    assert main(["count-missing", "single_gemm", "--backend", h.CPU, "--spec", raw[0], "--spec", raw[1],
                 "--db", ledger_path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["missing"] == [h.gemm(8, 8, 8, "bf16"), h.gemm(4, 4, 4, "fp32")]
    assert [list(s) for s in doc["missing"]] == [["m", "n", "k", "dtype"]] * 2


def test_human_output(ledger_path, capsys, h, local_gpu):
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu))
    assert main(["count-missing", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(), h.gemm(m=2)),
                 "--db", ledger_path]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 single_gemm/torch-cpu spec(s) missing" in out and local_gpu in out and ledger_path in out


def test_unknown_table_and_backend(capsys, h, tmp_path):
    assert main(["count-missing", "gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--json"]) == 2
    err = capsys.readouterr().err
    assert "unknown table 'gemm'" in err and "single_gemm" in err and "rms_norm" in err
    assert main(["count-missing", "rms_norm", "--backend", "torch-rocm",
                 "--spec", '{"tokens": 1, "hidden": 8, "dtype": "fp32"}', "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no backend 'torch-rocm'" in captured.err and "torch-cpu" in captured.err
    assert os.listdir(tmp_path) == []


def test_empty_gpu_name_is_a_usage_error(ledger_path, capsys, h):
    assert main(["count-missing", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--gpu-name", " ",
                 "--db", ledger_path]) == 2
    assert "--gpu-name is empty" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["count-missing", "query"])
def test_a_backend_with_no_rows_beside_others_of_the_table_gets_a_note(verb, ledger_path, capsys, h, local_gpu):
    """(A --backend the ledger holds no rows of, where it holds the table's rows under another, answered "1 of 1
    missing" with no hint, as a mistyped --gpu-name did before its note.) The answer stays; one note names them."""
    h.append(ledger_path, h.make_event(h.gemm(), "NVIDIA H200", backend="torch"))
    argv = [verb, h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path, "--json"]
    assert main([*argv, "--gpu-name", "NVIDIA H200"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["missing_count"] == 1
    assert captured.err.strip() == (f"note: {ledger_path} has no single_gemm/torch-cpu rows for any GPU key; its "
                                    f"single_gemm rows are of backend torch")


@pytest.mark.parametrize("verb", ["count-missing", "query"])
def test_a_gpu_key_with_no_rows_beside_others_gets_a_note(verb, ledger_path, capsys, h, local_gpu):
    """A misspelled --gpu-name answered "2 of 2 missing" with no hint. The answer stays (exit 0, the same JSON);
    one note on stderr names the GPU keys the ledger holds for the table/backend."""
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu), h.make_event(h.gemm(m=64), local_gpu),
             h.make_event(h.gemm(), "NVIDIA H200"))
    argv = [verb, h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(), h.gemm(m=64)), "--db", ledger_path, "--json"]
    assert main([*argv, "--gpu-name", "NVIDIA H20"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["gpu_name"] == "NVIDIA H20" and doc["missing_count"] == 2
    held = ", ".join(f"{key!r} ({rows})" for key, rows in sorted([("NVIDIA H200", "1 row"), (local_gpu, "2 rows")]))
    assert captured.err.strip() == (f"note: {ledger_path} has no single_gemm/torch-cpu rows for GPU key 'NVIDIA H20'; "
                                    f"it holds: {held}")
    assert main([*argv, "--gpu-name", "NVIDIA H200"]) == 0  # a key it holds, one spec missing: no note
    assert capsys.readouterr().err == ""
    assert main([verb, "memcpy", "--backend", h.CPU, "--spec", '{"bytes": 64}', "--db", ledger_path]) == 0
    assert capsys.readouterr().err == ""  # no memcpy rows under any key: nothing to suggest


def test_every_spec_missing_where_some_have_rows_of_another_thread_count_gets_a_note(ledger_path, capsys, h,
                                                                                    monkeypatch):
    """count-missing counts stale rows as missing: on a host of another core count every CPU spec read missing, with
    nothing saying rows exist under another torch thread count. The answer stays; one note says how many are stale."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path]) == 0
    capsys.readouterr()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    argv = ["count-missing", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(), h.gemm(m=64)), "--db", ledger_path]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["missing_count"] == 2
    query = shlex.join(["kprof", "query", h.GEMM, "--backend", h.CPU, "--db", ledger_path, *argv[4:-2]])
    assert captured.err.strip() == ("note: 1 of the 2 spec(s) has a row of another timing or profiler revision "
                                    "(stale; one timed 'cpu-wall;l2=warm;eager;threads=1', where this command reads "
                                    "'cpu-wall;l2=warm;eager;threads=2') (a CPU row's timing names "
                                    "its torch thread count: OMP_NUM_THREADS, MKL_NUM_THREADS); "
                                    f"`OMP_NUM_THREADS=2 {query}` shows them")
    assert main([*shlex.split(query)[1:], "--json"]) == 0  # as named (it said `kprof query`: no table, a usage error)
    assert [r["status"] for r in json.loads(capsys.readouterr().out)["results"]] == ["stale", "missing"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(argv) == 0  # one ok row: not every spec missing, no note
    assert capsys.readouterr().err == ""


def test_a_row_stale_by_its_revision_is_not_said_to_be_of_another_thread_count(ledger_path, capsys, h, local_gpu,
                                                                                monkeypatch):
    """A row of an older profiler revision, timed as this command reads, got the note meant for another thread count:
    "one timed '...threads=2' (a CPU row's timing names its torch thread count: OMP_NUM_THREADS ...)", the very timing
    asked for, and a fix that changes nothing. The note names the revision instead, and the run and query of these
    specs and ledger (it said `kprof run` and `kprof query`, each a usage error as written: no table)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # a thread count set here would lead the commands
        monkeypatch.delenv(name, raising=False)
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu, revision=0))
    assert main(["count-missing", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path]) == 0
    err = capsys.readouterr().err.strip()
    command = shlex.join(["--backend", h.CPU, "--db", ledger_path, *h.spec_args(h.gemm())])
    assert err == ("note: 1 of the 1 spec(s) has a row of another timing or profiler revision (stale; one of profiler "
                   f"revision 0, where the runner is now at 1: `kprof run {h.GEMM} {command}` measures it again); "
                   f"`kprof query {h.GEMM} {command}` shows them")


def test_the_human_answer_names_the_run_that_measures_the_missing_specs(ledger_path, tmp_path, capsys, h, local_gpu,
                                                                        monkeypatch):
    """(count-missing said how many specs were missing and not how to fill them.) The line it adds is the exact
    `kprof run` of these specs, ledger, GPU key and method: run as printed, it leaves none missing."""
    import shlex

    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # a thread count set here would lead the command
        monkeypatch.delenv(name, raising=False)
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu))
    specs = tmp_path / "more specs.json"
    specs.write_text(json.dumps([h.gemm(m=8), h.gemm()]))
    for given in (["--spec", json.dumps(h.gemm(m=4)), "--spec", json.dumps(h.gemm()), "--gpu-name", local_gpu,
                   "--no-cuda-graph"], ["--specs", str(specs)]):
        argv = ["count-missing", h.GEMM, "--backend", h.CPU, *given, "--db", ledger_path]
        assert main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"1 of 2 single_gemm/torch-cpu spec(s) missing for {local_gpu!r} in {ledger_path}"
        command = shlex.split(lines[1].removeprefix("measure them: "))
        assert sorted(command) == sorted(["kprof", "run", h.GEMM, "--backend", h.CPU, "--db", ledger_path, *given])
        assert main(command[1:]) == 0
        capsys.readouterr()
        assert main(argv) == 0
        assert capsys.readouterr().out.splitlines() == [lines[0].replace("1 of 2", "0 of 2")]


@pytest.mark.parametrize("backend, env, gpu", [
    ("torch", {"KPROF_TIMER": "events", "KPROF_L2": "warm", "KPROF_CUDA_GRAPH": "1", "KPROF_POWER": "loaded"},
     "NVIDIA H200"),
    ("torch-cpu", {"OMP_NUM_THREADS": "1"}, None)])
def test_the_run_it_names_keeps_a_method_the_environment_chose(ledger_path, capsys, h, local_gpu, monkeypatch,
                                                                backend, env, gpu):
    """`KPROF_TIMER=events kprof count-missing ...` (or a CPU row's OMP_NUM_THREADS=1) named a `kprof run` without that
    method: pasted where the variable is unset, it measured other keys (the default method's, or every core's) and
    left these missing. The command now carries the method as the environment chose it: read as printed with the
    variables unset, it names the very keys count-missing counted."""
    import shlex

    h.append(ledger_path, h.make_event(h.gemm(), local_gpu))
    for name in ("KPROF_TIMER", "KPROF_L2", "KPROF_CUDA_GRAPH", "KPROF_POWER", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    given = ["--spec", json.dumps(h.gemm(m=4)), "--db", ledger_path, *(["--gpu-name", gpu] if gpu else [])]
    assert main(["count-missing", h.GEMM, "--backend", backend, *given]) == 0
    command = shlex.split(capsys.readouterr().out.splitlines()[1].removeprefix("measure them: "))
    assert main(["query", h.GEMM, "--backend", backend, *given, "--json"]) == 0
    key = json.loads(capsys.readouterr().out)["results"][0]["key"]
    prefix = [word for word in command if "=" in word and word.split("=")[0] in env]
    assert prefix == [f"{name}={value}" for name, value in env.items() if name.endswith("_THREADS")]
    for name in env:
        monkeypatch.delenv(name)
    for word in prefix:
        monkeypatch.setenv(*word.split("=", 1))
    argv = command[len(prefix) + 1:]
    assert argv[0] == "run"
    assert main(["query", *argv[1:], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["key"] == key


def test_the_run_it_names_for_a_table_of_one_s_own_names_its_module(ledger_path, tmp_path, capsys, h, monkeypatch):
    """`KPROF_RUNNERS=mykern.softmax kprof count-missing my_softmax ...` named `kprof run my_softmax ...`: pasted where
    the variable is unset, that is "unknown table 'my_softmax'". The command now begins with the KPROF_RUNNERS it
    needs (and only a table of one's own needs it)."""
    import importlib
    import pathlib
    import shlex
    import sys

    from kprof.runners import registry

    readme = (pathlib.Path(__file__).parent.parent.parent / "README.md").read_text()
    block = readme[readme.index("# mykern/softmax.py, then:"):]
    (tmp_path / "mykern").mkdir()
    (tmp_path / "mykern" / "__init__.py").write_text("")
    (tmp_path / "mykern" / "softmax.py").write_text(block[:block.index("```")])
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.entries()  # the catalog first: a registry that is not empty is taken as loaded
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KPROF_RUNNERS", " mykern.softmax ")
    h.append(ledger_path, h.make_event(h.gemm(), "some GPU"))
    try:
        importlib.import_module("mykern.softmax")  # as KPROF_RUNNERS has it imported where the registry loads
        for table, spec in (("my_softmax", {"tokens": 8, "vocab": 64}), (h.GEMM, h.gemm(m=8))):
            assert main(["count-missing", table, "--backend", h.CPU, "--spec", json.dumps(spec),
                         "--db", ledger_path]) == 0
            command = shlex.split(capsys.readouterr().out.splitlines()[1].removeprefix("measure them: "))
            assert command[:3] == (["KPROF_RUNNERS=mykern.softmax", "kprof", "run"] if table == "my_softmax" else
                                   ["kprof", "run", table])
    finally:
        for name in ("mykern.softmax", "mykern"):
            sys.modules.pop(name, None)


def test_the_kprof_runners_it_names_stays_an_assignment_in_a_shell(ledger_path, tmp_path, capsys, h, monkeypatch):
    """KPROF_RUNNERS='mykern.softmax, mykern' (spaces after a comma do not matter to it) was written as the one quoted
    word 'KPROF_RUNNERS=mykern.softmax, mykern': a shell takes a quoted word for a command to run, not an assignment
    ("command not found"). The value alone is quoted, so the shell sets the variable and runs the command."""
    import importlib
    import pathlib
    import subprocess
    import sys

    from kprof.runners import registry

    readme = (pathlib.Path(__file__).parent.parent.parent / "README.md").read_text()
    block = readme[readme.index("# mykern/softmax.py, then:"):]
    (tmp_path / "mykern").mkdir()
    (tmp_path / "mykern" / "__init__.py").write_text("")
    (tmp_path / "mykern" / "softmax.py").write_text(block[:block.index("```")])
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.entries()  # the catalog first: a registry that is not empty is taken as loaded
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KPROF_RUNNERS", "mykern.softmax, mykern")
    h.append(ledger_path, h.make_event(h.gemm(), "some GPU"))
    try:
        importlib.import_module("mykern.softmax")  # as KPROF_RUNNERS has it imported where the registry loads
        assert main(["count-missing", "my_softmax", "--backend", h.CPU, "--spec", '{"tokens": 8, "vocab": 64}',
                     "--db", ledger_path]) == 0
        command = capsys.readouterr().out.splitlines()[1].removeprefix("measure them: ")
    finally:
        for name in ("mykern.softmax", "mykern"):
            sys.modules.pop(name, None)
    echo = command.replace(" kprof run ", " printenv KPROF_RUNNERS # ", 1)  # what a shell runs it with
    said = subprocess.run(["sh", "-c", echo], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert said.returncode == 0 and said.stdout == "mykern.softmax, mykern\n", (command, said.stderr)
