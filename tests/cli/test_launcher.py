"""The seed's command form `python -m launcher kernel-profile <verb> ...` is `kprof <verb> ...`, as real processes."""

import json
import os
import shlex
import shutil
import subprocess
import sys

GEMM = {"m": 32, "n": 32, "k": 32, "dtype": "fp32"}


def _kprof() -> str:
    path = shutil.which("kprof", path=os.path.dirname(sys.executable))
    assert path, "the kprof console script is not installed next to this interpreter"
    return path


def _proc(cmd, cwd, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


def _both(tmp_path, *argv):
    launcher = _proc([sys.executable, "-m", "launcher", "kernel-profile", *argv], tmp_path)
    kprof = _proc([_kprof(), *argv], tmp_path)
    return launcher, kprof


def test_list_json_is_identical(tmp_path):
    launcher, kprof = _both(tmp_path, "list", "--json")
    assert launcher.returncode == kprof.returncode == 0, (launcher.stderr, kprof.stderr)
    assert launcher.stdout == kprof.stdout
    assert json.loads(kprof.stdout)["count"] >= 5


def test_query_json_is_identical(tmp_path, h, local_gpu):
    db = str(tmp_path / "profile.db")
    h.append(db, h.make_event(GEMM, local_gpu), h.make_event({**GEMM, "m": 64}, local_gpu, kind="failed"))
    argv = ["query", "single_gemm", "--backend", "torch-cpu", *h.spec_args(GEMM, {**GEMM, "m": 64}, {**GEMM, "k": 8}),
            "--db", db, "--json"]
    launcher, kprof = _both(tmp_path, *argv)
    assert launcher.returncode == kprof.returncode == 0, (launcher.stderr, kprof.stderr)
    assert launcher.stdout == kprof.stdout
    doc = json.loads(kprof.stdout)
    assert [r["status"] for r in doc["results"]] == ["ok", "failed", "missing"]


def test_usage_errors_are_identical(tmp_path):
    argv = ["query", "no_such_table", "--backend", "torch-cpu", "--spec", json.dumps(GEMM), "--json"]
    launcher, kprof = _both(tmp_path, *argv)
    assert launcher.returncode == kprof.returncode == 2
    assert launcher.stdout == kprof.stdout == ""
    assert "unknown table" in launcher.stderr and "unknown table" in kprof.stderr
    assert os.listdir(tmp_path) == []


def test_launcher_without_kernel_profile_is_a_usage_error(tmp_path):
    p = _proc([sys.executable, "-m", "launcher", "list"], tmp_path)
    assert p.returncode == 2 and "kernel-profile" in p.stderr


def test_kprof_console_script_runs(tmp_path, local_gpu):
    db = str(tmp_path / "profile.db")
    p = _proc([_kprof(), "run", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps(GEMM),
               "--spec", json.dumps({**GEMM, "dtype": "bf16"}), "--db", db, "--json"], tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)  # one JSON document on stdout, nothing else
    assert doc["table"] == "single_gemm" and doc["backend"] == "torch-cpu" and doc["mode"] == "jit"
    assert doc["gpu_name"] == local_gpu and doc["db"] == db
    assert doc["count"] == 2 and doc["missing_count"] == 0
    for r in doc["results"]:
        assert r["status"] == "ok" and r["metrics"]["time_ms"] > 0 and r["citation"].startswith("kprof.")
    assert os.path.exists(db)
    # the rows persisted: a second process reads them
    q = _proc([_kprof(), "count-missing", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps(GEMM),
               "--db", db, "--json"], tmp_path)
    assert q.returncode == 0 and json.loads(q.stdout)["missing_count"] == 0


def test_the_records_name_the_command_as_typed(tmp_path, h, local_gpu):
    """job.meta.json and the event's origin said `kprof run ...` of a run started as `python -m launcher
    kernel-profile run ...`: the command recorded could not be typed again as it was."""
    argv = ["run", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps(GEMM), "--output-dir", "snap"]
    p = _proc([sys.executable, "-m", "launcher", "kernel-profile", *argv], tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    with open(tmp_path / "snap" / "job.meta.json") as f, open(tmp_path / "snap" / "results.json") as g:
        command, citation = json.load(f)["command"], json.load(g)["results"][0]["citation"]
    assert command == shlex.join([os.path.basename(sys.executable), "-m", "launcher", "kernel-profile", *argv])
    shown = _proc([_kprof(), "show", citation, "--json"], tmp_path)
    assert json.loads(shown.stdout)["event"]["origin"]["command"] == command


def test_the_launcher_s_help_and_usage_errors_name_the_command_as_typed(tmp_path):
    """`python -m launcher kernel-profile query --help` said `Usage: kprof query ...`, and a usage error pointed at
    `kprof query --help`: a command the launcher's user may not have on PATH. Both name the launcher form."""
    form = f"{os.path.basename(sys.executable)} -m launcher kernel-profile"
    top = _proc([sys.executable, "-m", "launcher", "kernel-profile", "--help"], tmp_path)
    verb = _proc([sys.executable, "-m", "launcher", "kernel-profile", "query", "--help"], tmp_path)
    bad = _proc([sys.executable, "-m", "launcher", "kernel-profile", "query"], tmp_path)
    assert top.returncode == verb.returncode == 0 and bad.returncode == 2
    assert f"Usage: {form} COMMAND" in top.stdout, top.stdout
    assert f"Usage: {form} query " in verb.stdout, verb.stdout
    assert f"see `{form} query --help`" in bad.stderr, bad.stderr
    kprof = _proc([_kprof(), "query", "--help"], tmp_path)
    assert "Usage: kprof query " in kprof.stdout  # the console script's own name


def test_messages_name_the_command_as_typed(tmp_path, capsys, h, local_gpu):
    """Through the launcher, messages other than the usage line named `kprof run`, `kprof query` and count-missing's
    `measure them: kprof run ...`, a command its user may not have: they name the form typed; kprof's say `kprof`."""
    from kprof.cli import main

    launcher = ("python", "-m", "launcher", "kernel-profile")
    absent = str(tmp_path / "absent.db")
    assert main(["scopes", "--db", absent], prog=launcher) == 2
    err = capsys.readouterr().err
    assert "`python -m launcher kernel-profile run` to create one" in err and "kprof run" not in err, err
    db = str(tmp_path / "profile.db")
    h.append(db, h.make_event(GEMM, local_gpu))
    argv = ["count-missing", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps({**GEMM, "m": 8}),
            "--db", db]
    assert main(argv, prog=launcher) == 0
    out = capsys.readouterr().out
    assert f"measure them: python -m launcher kernel-profile run single_gemm --backend torch-cpu --db {db} " in out
    assert main(argv) == 0 and "measure them: kprof run single_gemm" in capsys.readouterr().out
    assert main(["scopes", "--db", absent]) == 2 and "`kprof run` to create one" in capsys.readouterr().err


def test_launcher_help_is_an_answer_not_a_usage_error(tmp_path):
    """`python -m launcher --help` printed its usage on stderr and exited 2, as a mistyped command does: a script that
    checks the help exits 0 failed. Asked for, the usage goes to stdout, exit 0, and names where the verbs are listed."""
    for flag in ("--help", "-h"):
        p = _proc([sys.executable, "-m", "launcher", flag], tmp_path)
        assert (p.returncode, p.stderr) == (0, ""), p.stderr
        assert "python -m launcher kernel-profile <verb>" in p.stdout and "kernel-profile --help" in p.stdout
    p = _proc([sys.executable, "-m", "launcher", "kernel-profile", "--help"], tmp_path)
    assert p.returncode == 0 and "count-missing" in p.stdout


def test_a_suggested_command_that_sets_variables_first_is_named_as_typed(monkeypatch):
    """A library message's command that begins with the variables it sets (`OMP_NUM_THREADS=1 kprof run ...`: an
    unknown GPU key's run, a row's ceiling `why`) kept `kprof` under the launcher: the rewrite matched "`kprof " only.
    The variables stay first and the command is the form typed; `kprof` outside backticks is left alone."""
    from kprof.cli import _render

    monkeypatch.setattr(_render, "typed_as", ["python", "-m", "launcher", "kernel-profile"])
    said = _render.as_typed("measure with `KPROF_RUNNERS='a, b' OMP_NUM_THREADS=1 kprof run t --db p.db`; kprof run")
    assert said == ("measure with `KPROF_RUNNERS='a, b' OMP_NUM_THREADS=1 python -m launcher kernel-profile run t "
                    "--db p.db`; kprof run")
