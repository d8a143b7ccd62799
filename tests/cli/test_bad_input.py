"""Every bad path is refused before anything is written: exit 2, a message naming the value and the fix, and no
ledger, lock file, row or snapshot left behind. A damaged real ledger is still an integrity error (exit 3)."""

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys

import pytest

from kprof import api, synth
from kprof._limits import hit
from kprof.cli import VERBS, main
from kprof.errors import LedgerError, UsageError
from kprof.ledger import Ledger

SPEC = {"m": 32, "n": 32, "k": 32, "dtype": "fp32"}
READ_VERBS = ["query", "count-missing"]


def _files(path) -> dict:
    """Every file under path with its bytes: what a refused command must leave as it was."""
    out = {}
    for root, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def _verb(verb: str, h, db: str | None, *extra: str) -> list[str]:
    """argv of `verb` on one spec (show: on a citation), with --db when given."""
    args = ["show", "kprof.0123456789abcdef"] if verb == "show" else [verb, h.GEMM, "--backend", h.CPU,
                                                                          *h.spec_args(SPEC)]
    return [*args, *(["--db", db] if db is not None else []), *extra]


# ---- --db naming no file --------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", [*READ_VERBS, "show"])
def test_a_db_that_does_not_exist_is_a_usage_error_for_the_read_verbs(verb, tmp_path, capsys, h, refused):
    refused(_verb(verb, h, "profle.db", "--json"),
             "no ledger at profle.db; pass --db or set KPROF_DB, or `kprof run` to create one")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("read", [api.query, api.count_missing, api.scopes, api.show])
def test_the_python_api_raises_the_same_usage_error_naming_its_keyword(read, tmp_path):
    """A Python caller passes db=, not --db: the refusals said "pass --db" to it."""
    def call(db):
        args = {api.scopes: (), api.show: ("kprof.0123456789abcdef",)}.get(read, ("single_gemm", "torch-cpu", [SPEC]))
        return read(*args, db=db)

    with pytest.raises(LedgerError, match=r"^no ledger at .*profle.db; pass db=\.\.\. or set KPROF_DB, or "):
        call(str(tmp_path / "profle.db"))
    for db in ("", " "):
        with pytest.raises(UsageError, match=f"^db={db!r} is empty; pass the ledger file \\(e.g. db='profile.db'\\), "
                                             f"or omit db to use \\$KPROF_DB"):
            call(db)
    (tmp_path / "notes.txt").write_text("not a ledger")
    with pytest.raises(LedgerError, match=r"not an LMDB file\); check that db \(or \$KPROF_DB\) names the ledger file"):
        call(str(tmp_path / "notes.txt"))
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_run_fresh_still_needs_no_ledger(tmp_path, capsys, h):
    """--fresh measures and writes nothing: no ledger is not an error there."""
    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(SPEC), "--db", "none.db", "--fresh",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "ok"
    assert os.listdir(tmp_path) == []


# ---- --db "" ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", [*READ_VERBS, "show", "run", "audit", "calibrate"])
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_db_is_refused_everywhere(verb, empty, tmp_path, capsys, h, refused):
    h.append("profile.db")  # ./profile.db exists: an empty --db must not silently mean it
    before = _files(tmp_path)
    if verb in ("audit", "calibrate"):
        argv = [verb, "--db", empty]
    else:
        argv = _verb(verb, h, empty)
    refused(argv, f"--db {empty!r} is empty", "omit --db to use $KPROF_DB, else ./profile.db")
    assert _files(tmp_path) == before


# ---- --db naming a file that is not a ledger -------------------------------------------------------------------

def _text(path):
    path.write_text("not a ledger\n")


def _sqlite(path):
    con = sqlite3.connect(path)
    con.execute("create table t (x)")
    con.commit()
    con.close()


def _empty(path):
    path.touch()


def _noise(path):
    path.write_bytes(bytes(range(256)) * 64)


NOT_LEDGERS = {"text": (_text, "(not an LMDB file)"), "sqlite": (_sqlite, "(an SQLite database)"),
               "empty": (_empty, "(an empty file, 0 bytes)"), "noise": (_noise, "(not an LMDB file)")}


@pytest.mark.parametrize("verb", [*READ_VERBS, "show", "run", "audit"])
@pytest.mark.parametrize("kind", list(NOT_LEDGERS))
def test_a_file_that_is_not_a_ledger_is_refused_and_left_alone(verb, kind, tmp_path, capsys, h, refused):
    make, what = NOT_LEDGERS[kind]
    path = tmp_path / "some.db"
    make(path)
    before = _files(tmp_path)
    argv = ["audit", "--db", str(path)] if verb == "audit" else _verb(verb, h, str(path), "--json")
    refused(argv, f"{path} is not a kprof ledger {what}", "check that --db (or $KPROF_DB) names the ledger")
    assert _files(tmp_path) == before  # the file untouched, no some.db-lock beside it, no rows


@pytest.mark.parametrize("verb", [*READ_VERBS, "run"])
def test_a_device_or_a_directory_is_refused(verb, tmp_path, capsys, h, refused):
    refused(_verb(verb, h, os.devnull), f"{os.devnull} is not a kprof ledger (not a regular file")
    refused(_verb(verb, h, str(tmp_path)), f"ledger path {tmp_path} is a directory, not a kprof ledger")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("verb", [*READ_VERBS, "run"])
@pytest.mark.parametrize("db, file", [("x.db/", "x.db"), ("x.db/.", "x.db")])
def test_a_db_whose_form_names_a_directory_is_refused_and_nothing_is_created(verb, db, file, tmp_path, capsys, h,
                                                                             refused, monkeypatch):
    """`--db x.db/` (a shell's completion adds the slash): `run` stored its row in the file x.db, then read `x.db/`
    back, found nothing there and reported the row missing (exit 1); the read verbs called it no ledger."""
    refused(_verb(verb, h, db, "--json"), f"--db {db!r} names a directory", f"pass the file, e.g. --db {file}")
    monkeypatch.setenv("KPROF_DB", db)
    refused(_verb(verb, h, None, "--json"), f"KPROF_DB={db!r} names a directory", f"e.g. KPROF_DB={file}")
    with pytest.raises(LedgerError, match=f"^db={re.escape(repr(db))} names a directory .* e.g. db='x.db'$"):
        api.query(h.GEMM, h.CPU, [SPEC], db=db)
    monkeypatch.delenv("KPROF_DB")
    for argv in (["audit"], ["export", "-o", "s.kseg"], ["merge", "none.kseg"], ["scopes"]):  # every verb: one rule
        refused([*argv, "--db", db], f"--db {db!r} names a directory", f"pass the file, e.g. --db {file}")
    assert os.listdir(tmp_path) == []


def test_audit_names_a_device_or_a_directory_as_the_other_verbs_do(tmp_path, capsys, refused):
    refused(["audit", "--db", os.devnull], f"{os.devnull} is not a kprof ledger (not a regular file")
    refused(["audit", "--db", str(tmp_path)], f"ledger path {tmp_path} is a directory, not a kprof ledger")
    assert os.listdir(tmp_path) == []


def test_a_db_that_is_a_dangling_link_or_a_loop_is_refused_and_nothing_is_created(tmp_path, capsys, h, refused):
    os.symlink("loop2", "loop1")
    os.symlink("loop1", "loop2")
    os.symlink("gone", "dangling")
    for db in ("loop1", "dangling"):
        for verb in [*READ_VERBS, "show", "run"]:
            refused(_verb(verb, h, db, "--json"), f"ledger path {db} is a symbolic link to nothing", "fix the link")
    assert sorted(os.listdir(tmp_path)) == ["dangling", "loop1", "loop2"]  # no lock file, no ledger through the link


def test_the_library_refuses_before_lmdb_opens_the_file(tmp_path):
    path = tmp_path / "notes.txt"
    _text(path)
    for readonly in (True, False):
        with pytest.raises(LedgerError, match="is not a kprof ledger"):
            Ledger.open(str(path), readonly=readonly)
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_a_damaged_real_ledger_is_still_an_integrity_error(tmp_path, capsys, h, local_gpu):
    path = str(tmp_path / "p.db")
    h.append(path, *[h.make_event(h.gemm(m=8 * i), local_gpu) for i in range(1, 200)])
    with open(path, "r+b") as f:  # an LMDB file whose pages past the header are gone
        f.truncate(os.path.getsize(path) // 2)
    code = main(_verb("query", h, path))
    err = capsys.readouterr().err
    assert code == 3 and "truncated" in err, err


# ---- a ledger in a read-only directory -------------------------------------------------------------------------

_NO_OVERRIDE = "-dac_override,-dac_read_search,-fowner"


def _as_this_user(args: list[str], cwd) -> subprocess.CompletedProcess:
    """`python -m kprof ARGS` under file permissions: run as root, without the capabilities that let root write
    into a read-only directory (setpriv), so the test means the same for every user."""
    prefix = []
    if os.geteuid() == 0:
        prefix = ["setpriv", "--bounding-set", _NO_OVERRIDE, "--inh-caps", _NO_OVERRIDE, "--"]
        if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
            pytest.skip("running as root, and setpriv cannot drop the capability to write read-only directories")
    return subprocess.run([*prefix, sys.executable, "-m", "kprof", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def read_only_ledger(tmp_path, h, local_gpu):
    """A ledger of one row in a directory this user cannot write, with no lock file beside it (a copy)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    h.append(str(shared / "p.db"), h.make_event(SPEC, local_gpu))
    os.remove(shared / "p.db-lock")
    os.chmod(shared, 0o555)
    yield shared
    os.chmod(shared, 0o755)


@pytest.mark.parametrize("verb", READ_VERBS)
def test_a_ledger_in_a_read_only_directory_is_readable(verb, read_only_ledger, tmp_path, h):
    before = _files(read_only_ledger)
    proc = _as_this_user(_verb(verb, h, str(read_only_ledger / "p.db"), "--json"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["missing_count"] == 0 and doc["count"] == 1
    assert _files(read_only_ledger) == before  # no lock file could be made, and none was


def test_an_older_ledger_in_a_read_only_directory_is_read_through_an_upgraded_copy(tmp_path, monkeypatch):
    """Reading a ledger of an older format rebuilds its views first; where the file cannot be written, the reader
    reads an upgraded copy in the temporary directory, removed when it is done, and leaves the file's directory as
    it was."""
    shared, temp = tmp_path / "shared", tmp_path / "temp"
    shared.mkdir()
    temp.mkdir()
    shutil.copyfile(os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "ledgers", "synthetic-v3.db"),
                    shared / "old.db")
    monkeypatch.setenv("TMPDIR", str(temp))
    os.chmod(shared, 0o555)
    try:
        before = _files(shared)
        proc = _as_this_user(["scopes", "--db", str(shared / "old.db"), "--json"], tmp_path)
        assert _files(shared) == before
    finally:
        os.chmod(shared, 0o755)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["scopes"] == [{"table": "single_gemm", "backend": "synthetic",
                                                  "gpu_name": "Synthetic GPU", "rows": 47}]
    assert os.listdir(temp) == []


# ---- the stopping rule's settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [("KPROF_TIME_BUDGET_S", "-1"), ("KPROF_TIME_BUDGET_S", "0"),
                                         ("KPROF_TIME_BUDGET_S", "abc"), ("KPROF_TIME_BUDGET_S", "inf"),
                                         ("KPROF_TARGET_CI", "0"), ("KPROF_TARGET_CI", "2"), ("KPROF_TARGET_CI", "x")])
def test_a_bad_stopping_rule_setting_is_refused_before_any_work(name, value, tmp_path, capsys, h, refused,
                                                               monkeypatch):
    """A budget of 0 would store rows of 3 samples as ok; a text value was a traceback."""
    monkeypatch.setenv(name, value)
    refused(_run_into("snap", h, "p.db"), f"{name}={value!r} is not", "or unset it")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name, value", [("KPROF_ENERGY_S", "-1"), ("KPROF_CAPPED_SAMPLE_S", "abc"),
                                         ("KPROF_CAPPED_MAX_SAMPLE_S", "-1"), ("KPROF_SPEC_TIMEOUT_S", "0"),
                                         ("KPROF_WORKER_START_S", "soon"), ("KPROF_RANK_START_S", "inf"),
                                         ("KPROF_RANK_STEP_S", "-2"), ("KPROF_PROFILE_GPUS", "abc"),
                                         ("VIBESIM_PROFILE_GPUS", "-1"), ("KPROF_SKIP_ENV_CHECK", "yes")])
def test_every_run_setting_is_checked_on_the_cpu_too(name, value, tmp_path, capsys, h, refused, monkeypatch):
    """Settings of the GPU path or the pool, never used by this CPU run: a value wrong on every backend is named
    before anything is written, not when a later run first reads it."""
    monkeypatch.setenv(name, value)
    refused(_run_into("snap", h, "p.db"), f"{name}={value!r} is not")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name, value", [("KPROF_POOL", "maybe"), ("KPROF_CPU_WORKERS", "0"),
                                         ("KPROF_CPU_WORKERS", "two"), ("KPROF_TIMER", "bogus")])
def test_a_bad_setting_is_refused_even_when_every_row_is_stored(name, value, tmp_path, capsys, h, refused,
                                                                local_gpu, monkeypatch):
    """The pool's settings were read only when a spec was measured: a run whose rows were all stored exited 0 with
    KPROF_POOL=maybe, and the same command failed on the next spec that was missing."""
    h.append("p.db", h.make_event(SPEC, local_gpu))
    before = _files(tmp_path)
    monkeypatch.setenv(name, value)
    refused(_run_into("snap", h, "p.db"), f"{name}={value!r} is not")
    assert _files(tmp_path) == before


# ---- the Python API's arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("specs, needle", [(None, "got NoneType"), ("m=1", "got str"), (5, "got int"),
                                           (SPEC, "got one spec (dict); wrap it in a list"),
                                           ({"specs": [SPEC]}, 'got a {"specs": [...]} document (as a specs file '
                                                               'holds); pass its list, doc["specs"]')])
def test_the_python_api_refuses_specs_that_are_not_a_list_of_specs(specs, needle, tmp_path, h, local_gpu):
    db = str(tmp_path / "p.db")
    h.append(db, h.make_event(SPEC, local_gpu))
    with Ledger.open(db, readonly=True) as ledger:
        view = api.view(ledger, h.GEMM, h.CPU, local_gpu)
        for call in (view.get_many, view.missing, lambda s: api.query(h.GEMM, h.CPU, s, db=db),
                     lambda s: api.count_missing(h.GEMM, h.CPU, s, db=db),
                     lambda s: api.run(h.GEMM, h.CPU, s, db=db)):
            with pytest.raises(UsageError, match=f"specs: expected a list of specs.*{re.escape(needle)}"):
                call(specs)
        assert [r.status for r in view.get_many(iter([SPEC]))] == ["ok"]  # any other iterable is listed
    assert sorted(os.listdir(tmp_path)) == ["p.db", "p.db-lock"]


@pytest.mark.parametrize("full", ["50", True, -1, 2.0])
def test_the_python_api_names_a_full_that_is_no_row_count(full, tmp_path, h, local_gpu):
    """api.query's full= (how many rows are given as the contract's JSON): "50" was a TypeError traceback from a
    comparison inside, and True or -1 were taken as counts (one row, none); each is refused, naming the value."""
    db = str(tmp_path / "p.db")
    h.append(db, h.make_event(SPEC, local_gpu))
    with pytest.raises(UsageError, match=re.escape(f"full={full!r} is not a row count; pass an int >= 0")):
        api.query(h.GEMM, h.CPU, [SPEC], db=db, full=full)
    short = api.query(h.GEMM, h.CPU, [SPEC, SPEC], db=db, full=1).results
    assert "metrics" in short[0] and short[1] == {"spec": short[0]["spec"], "status": "ok", "error": None}


def test_the_python_api_names_a_db_that_is_not_a_path_and_a_view_of_no_ledger(tmp_path):
    with pytest.raises(UsageError, match="db=3 is not a path \\(int\\)"):
        api.query("single_gemm", "torch-cpu", [SPEC], db=3)
    with pytest.raises(UsageError, match="api.view takes an open Ledger, not str 'p.db'; open one first"):
        api.view("p.db", "single_gemm", "torch-cpu", "x")
    assert os.listdir(tmp_path) == []


def test_the_python_api_names_arguments_of_the_wrong_type(tmp_path, h, local_gpu):
    db = str(tmp_path / "p.db")
    h.append(db, h.make_event(SPEC, local_gpu))
    before = _files(tmp_path)
    for call in (api.query, api.count_missing, api.run):
        with pytest.raises(UsageError, match=r"^gpu_name=3 is not a GPU key \(int\); pass it as a str, e.g. "
                                             r"gpu_name='NVIDIA H200'"):
            call(h.GEMM, h.CPU, [SPEC], gpu_name=3, db=db)
    with pytest.raises(UsageError, match="None is not a citation, event id or key; pass `kprof.<hex>`"):
        api.show(None, db=db)
    for size in (-1, 0, "x", 1.5, 1 << 64):
        with pytest.raises(UsageError, match=f"map_size={re.escape(repr(size))} is not a size in bytes; pass a "
                                             f"positive int"):
            Ledger.open(db, readonly=True, map_size=size)
    with Ledger.open(db, readonly=True) as ledger:
        for key in (None, 3, "", " "):  # each would answer "missing" for the ok spec
            with pytest.raises(UsageError, match=f"GPU key {re.escape(repr(key))} is not a GPU key; pass one as a "
                                                 f"non-empty str, as `kprof scopes` lists them"):
                api.view(ledger, h.GEMM, h.CPU, key)
        assert api.view(ledger, h.GEMM, h.CPU, local_gpu).get_many([SPEC])[0].status == "ok"
    assert _files(tmp_path) == before


def test_a_blank_kprof_db_is_named_as_such(tmp_path, capsys, h, refused, monkeypatch):
    monkeypatch.setenv("KPROF_DB", "  ")
    for verb in [*READ_VERBS, "run"]:
        refused(_verb(verb, h, None), "KPROF_DB='  ' is blank", "or unset it")
    assert os.listdir(tmp_path) == []


def test_run_of_a_cuda_backend_without_a_gpu_says_to_run_on_one(tmp_path, capsys, h, refused, monkeypatch):
    """--gpu-name names rows: it cannot give a run a GPU, so the message must not suggest it (reads may use it)."""
    from kprof.measure import device_name

    monkeypatch.setattr(device_name, "local_gpu_name", lambda: None)
    spec = ["--spec", json.dumps({"m": 8, "n": 8, "k": 8, "dtype": "bf16"})]
    for extra in ([], ["--gpu-name", "NVIDIA H200"]):
        refused(["run", h.GEMM, "--backend", "torch", *spec, "--db", "p.db", *extra],
                "none is visible here; run on a machine with one (--gpu-name only names the rows)")
    refused(["calibrate", "--backend", "torch", "--db", "p.db"], "run on a machine with one")
    refused(["query", h.GEMM, "--backend", "torch", *spec, "--db", "p.db"], "pass --gpu-name")
    assert os.listdir(tmp_path) == []


# ---- --output-dir ----------------------------------------------------------------------------------------------

def _run_into(out_dir: str, h, db: str) -> list[str]:
    return ["run", h.GEMM, "--backend", h.CPU, *h.spec_args(SPEC), "--db", db, "--output-dir", out_dir, "--json"]


def test_an_empty_output_dir_is_refused_before_any_work(tmp_path, capsys, h, refused):
    refused(_run_into("", h, "p.db"), "--output-dir '' is empty", "omit --output-dir")
    assert os.listdir(tmp_path) == []


def test_an_output_dir_through_a_file_is_refused_before_any_work(tmp_path, capsys, h, refused):
    (tmp_path / "notes").write_text("x")
    refused(_run_into("notes/run1", h, "p.db"),
             f"--output-dir notes/run1 passes through {tmp_path / 'notes'}, which is not a directory",
             "pass a new directory")
    refused(_run_into("notes/a/b", h, "p.db"), "passes through")
    assert os.listdir(tmp_path) == ["notes"]


def test_an_output_dir_naming_a_file_with_a_trailing_slash_is_refused_before_any_work(tmp_path, capsys, h, refused):
    """`notes/` of a file `notes` passed the check (lexists and abspath do not see the file through the slash):
    the run measured and stored its rows, then failed to write the snapshot (exit 1)."""
    (tmp_path / "notes").write_text("x")
    for out_dir in ("notes/", "notes//"):
        refused(_run_into(out_dir, h, "p.db"), f"--output-dir {out_dir} is a file, not a directory")
    assert os.listdir(tmp_path) == ["notes"]  # no ledger: refused before any work


def test_an_output_dir_that_is_a_broken_link_is_refused(tmp_path, capsys, h, refused):
    os.symlink(tmp_path / "gone", tmp_path / "snap")
    refused(_run_into("snap", h, "p.db"), "--output-dir snap is a broken link, not a directory")
    assert os.listdir(tmp_path) == ["snap"]


def test_an_output_dir_holding_a_plot_of_a_snapshot_is_refused(tmp_path, capsys, h, refused):
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "curve.png").write_bytes(b"png")
    refused(_run_into("snap", h, "p.db"), "already holds a snapshot (curve.png)")
    assert sorted(os.listdir(tmp_path)) == ["snap"]


def test_an_output_dir_under_a_read_only_directory_is_refused_before_any_work(tmp_path, h):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        proc = _as_this_user(_run_into(str(locked / "run1"), h, "p.db"), tmp_path)
        existing = _as_this_user(_run_into(str(locked), h, "p.db"), tmp_path)
    finally:
        os.chmod(locked, 0o755)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--output-dir {locked / 'run1'} cannot be created: {locked} is not writable" in proc.stderr
    assert existing.returncode == 2 and f"--output-dir {locked} is not writable" in existing.stderr
    assert sorted(os.listdir(tmp_path)) == ["locked"] and os.listdir(locked) == []  # no ledger, no snapshot


@pytest.mark.parametrize("umask, mode", [(0o022, 0o444), (0o077, 0o400)])
def test_a_snapshot_is_read_only_for_those_the_umask_lets_read_it(tmp_path, capsys, h, umask, mode):
    """The snapshot's files were made r--r--r-- whatever the umask, so under umask 077 a run into an existing shared
    --output-dir left its results, command and host readable by every user; they are read-only as the umask allows."""
    os.mkdir("snap", 0o755)
    was = os.umask(umask)
    try:
        assert main(_run_into("snap", h, "p.db")) == 0
    finally:
        os.umask(was)
    capsys.readouterr()
    modes = {name: stat.S_IMODE(os.stat(os.path.join("snap", name)).st_mode) for name in os.listdir("snap")}
    assert "results.json" in modes and set(modes.values()) == {mode}, modes


def test_writing_outputs_never_sets_the_process_umask(tmp_path, capsys, h, monkeypatch):
    """A snapshot's, a segment's and a replaced report's modes were had by reading the umask, which means setting it
    (to 022) for a moment: another thread's file made meanwhile (a perf_api caller's, a pool's) took 022 where the
    process keeps 027. Their modes come from the umask as the kernel applies it; os.umask is never called."""
    from kprof import _outdir
    from kprof.merge import segment

    def umask(_mask):
        raise AssertionError("os.umask called while writing an output")

    real, was = os.umask, os.umask(0o027)
    monkeypatch.setattr(os, "umask", umask)
    try:
        os.mkdir("snap")
        assert main(_run_into("snap", h, "p.db")) == 0
        _outdir.replace_whole(str(tmp_path / "report.json"), b"{}")
        with Ledger.open("p.db", readonly=True) as led:
            data = [raw for _seq, _eid, raw in led.iter_log()]
            written = segment.write(str(tmp_path / "rows.kseg"), data, led.ledger_id, len(data))
    finally:
        real(was)
    capsys.readouterr()
    assert {stat.S_IMODE(os.stat(os.path.join("snap", n)).st_mode) for n in os.listdir("snap")} == {0o440}
    assert stat.S_IMODE(os.stat(tmp_path / "report.json").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(written).st_mode) & 0o777 in (0o640, 0o440)


def test_a_snapshot_that_cannot_be_written_after_the_run_says_so(tmp_path, capsys, h, monkeypatch):
    """Checked before the run, the directory can still fail after it (a full disk): a clear error, no traceback,
    and the way to the snapshot without measuring again."""
    from kprof import artifacts

    def full_disk(path, *_args):
        raise OSError(28, "No space left on device", os.path.join(path, "request.json"))

    monkeypatch.setattr(artifacts, "_write", full_disk)
    code = main(_run_into("snap", h, "p.db"))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "cannot write the snapshot in --output-dir snap: No space left on device (snap/request.json)" in err
    assert "run the command again with a new --output-dir" in err
    with Ledger.open("p.db", readonly=True) as ledger:
        assert ledger.last_seq == 1  # the run's row is stored


def test_a_fresh_run_whose_snapshot_cannot_be_written_is_not_said_to_have_stored_rows(tmp_path, capsys, h,
                                                                                      monkeypatch):
    """A --fresh run whose snapshot failed said its rows are in the ledger "(unless --fresh)" and to run again without
    --force, where stored rows are read: it stored none, and the same command measures every spec again."""
    from kprof import artifacts

    def full_disk(path, *_args):
        raise OSError(28, "No space left on device", os.path.join(path, "request.json"))

    monkeypatch.setattr(artifacts, "_write", full_disk)
    assert main([*_run_into("snap", h, "p.db"), "--fresh"]) == 1
    err = capsys.readouterr().err
    assert "the --fresh run finished and stored nothing: for the snapshot, run the command again with a new " \
           "--output-dir (it measures every spec again)" in err, err
    assert "in the ledger" not in err and "--force" not in err and not os.path.exists("p.db")


def test_a_snapshot_another_run_placed_while_this_one_measured_is_kept_and_the_stored_rows_are_said(
        tmp_path, capsys, h, monkeypatch):
    """Two runs into one --output-dir both pass the check before measuring; the one that finishes second was refused
    as a usage error (exit 2, "nothing written") though its rows were stored, and without the way to its snapshot."""
    measure = api.run

    def another_run_finishes_first(*args, **kwargs):
        res = measure(*args, **kwargs)
        os.makedirs("snap")
        (tmp_path / "snap" / "request.json").write_text("{}")  # the other run's snapshot
        return res

    monkeypatch.setattr(api, "run", another_run_finishes_first)
    code = main(_run_into("snap", h, "p.db"))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "cannot write the snapshot: --output-dir snap already holds a snapshot (request.json)" in err
    assert "its rows are in the ledger" in err and "run the command again with a new --output-dir" in err
    assert os.listdir("snap") == ["request.json"] and (tmp_path / "snap" / "request.json").read_text() == "{}"
    with Ledger.open("p.db", readonly=True) as ledger:
        assert ledger.last_seq == 1  # the run's row is stored


def test_a_snapshot_placed_while_this_one_was_staged_is_not_replaced(tmp_path, capsys, h, monkeypatch):
    """The files are renamed into place after the plot (a second): a rename replaces a file another run put there."""
    from kprof import artifacts

    def plot_while_another_run_finishes(curve, path):
        (tmp_path / "snap" / "results.json").write_text("{}")
        return False

    monkeypatch.setattr(artifacts, "_plot", plot_while_another_run_finishes)
    assert main(_run_into("snap", h, "p.db")) == 1
    assert "cannot write the snapshot: --output-dir snap already holds a snapshot (results.json)" in \
        capsys.readouterr().err
    assert os.listdir("snap") == ["results.json"] and (tmp_path / "snap" / "results.json").read_text() == "{}"


def test_a_write_past_the_file_size_limit_is_named_and_keeps_earlier_rows(tmp_path):
    """LMDB failing at commit (a full disk, `ulimit -f`: EFBIG) is not damage: exit 2 saying so, and the rows
    committed before stay, as audit confirms."""
    db = str(tmp_path / "p.db")
    spec = '{"m": 8, "n": 64, "k": 64, "dtype": "fp32"}'
    base = [sys.executable, "-m", "kprof"]
    assert subprocess.run(base + ["run", "single_gemm", "--backend", "torch-cpu", "--spec", spec, "--db", db],
                          capture_output=True).returncode == 0
    limit = os.path.getsize(db)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); "
            "from kprof.cli import main; sys.exit(main(sys.argv[2:]))")
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([{"m": m, "n": 512, "k": 512, "dtype": "fp32"} for m in range(1, 41)]))
    proc = subprocess.run([sys.executable, "-c", code, str(limit), "run", "single_gemm", "--backend", "torch-cpu",
                           "--specs", str(specs), "--db", db], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "writing the ledger failed" in proc.stderr and "ulimit -f" in proc.stderr and "Traceback" not in proc.stderr
    audit = subprocess.run(base + ["audit", "--db", db, "--json"], capture_output=True, text=True)
    assert audit.returncode == 0 and json.loads(audit.stdout)["events"] == 1


_LIMITED = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); "
            "from kprof.cli import main; sys.exit(main(sys.argv[2:]))")  # a file size limit: as a full disk fails


def test_a_full_disk_while_run_creates_the_ledger_is_named_not_called_damage(tmp_path):
    """The first commit, which makes a new file a ledger, refused by a full disk (here `ulimit -f`) read as damage:
    "ledger p.db is damaged ... restore from a copy", exit 3. It is the full disk's message now, exit 2."""
    import lmdb

    db = str(tmp_path / "p.db")
    lmdb.open(db, subdir=False, max_readers=510).close()  # its lock file at full size (past the limit below)
    os.remove(db)
    proc = subprocess.run([sys.executable, "-c", _LIMITED, "8192", "run", "single_gemm", "--backend", "torch-cpu",
                           "--spec", '{"m": 8, "n": 64, "k": 64, "dtype": "fp32"}', "--db", db],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "writing the ledger failed" in proc.stderr and "ulimit -f" in proc.stderr
    assert "damaged" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_audit_a_failed_write_names_runs_in_a_shell_on_that_ledger(h, local_gpu, tmp_path):
    """A run whose write a full disk refused (here `ulimit -f`) said "`kprof audit` confirms it" without the --db it
    was given: pasted, that audits $KPROF_DB or ./profile.db, another file, and may call it clean. It names the
    ledger, quoted for a shell, and run as printed audits it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    db = str(tmp_path / "team ledgers" / "p.db")
    os.mkdir(os.path.dirname(db))
    h.append(db, h.make_event(h.gemm(m=32), local_gpu))
    prog = (sys.executable, "-m", "kprof")
    limited = _LIMITED.replace("main(sys.argv[2:])", f"main(sys.argv[2:], prog={prog!r})")
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("KPROF_DB", None)
    proc = subprocess.run([sys.executable, "-c", limited, str(os.path.getsize(db)), "run", h.GEMM, "--backend",
                           h.CPU, *h.spec_args(*[h.gemm(m=8, k=k) for k in (16, 32, 48)]), "--db", db],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "writing the ledger failed" in proc.stderr, proc.stderr
    err = " ".join(proc.stderr.split())
    command = err[err.index(f"`{shlex.join(prog)} audit"):].split("`")[1]
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"audit of {db}: clean" in done.stdout, (command, done.stdout, done.stderr)


@pytest.mark.parametrize("verb", ["scopes", "audit"])
def test_a_reader_of_an_older_format_whose_temporary_copy_cannot_be_written_says_where(tmp_path, verb):
    """A reader of an older format reads an upgraded copy it makes in the temporary directory; that copy refused
    (a full temporary directory, here `ulimit -f`) read as damage to the ledger ("restore from a copy", exit 3, and
    audit's finding). It names the temporary directory now, exit 2, and the ledger is unchanged."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    db = tmp_path / "v3.db"
    shutil.copy(os.path.join(root, "fixtures", "ledgers", "synthetic-v3.db"), db)
    before = db.read_bytes()
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    proc = subprocess.run([sys.executable, "-c", _LIMITED, str(os.path.getsize(db) // 2), verb, "--db", str(db)],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot read ledger {db} (an older format) from its upgraded copy: writing it in {tmp_path / 'tmp'} " \
           f"failed (" in proc.stderr
    assert "free space there, or set TMPDIR" in proc.stderr and "damaged" not in proc.stderr
    assert db.read_bytes() == before and os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("verb, exc, code, note", [
    ("run", KeyboardInterrupt(), 130, "interrupted (Ctrl-C): every row stored before it stays in the ledger"),
    ("run", SystemExit(143), 143, "interrupted (SIGTERM): every row stored before it stays in the ledger"),
    ("merge", KeyboardInterrupt(), 130, "a merge is all or nothing: the ledger holds none of its events"),
    ("query", KeyboardInterrupt(), 130, "interrupted (Ctrl-C): nothing was left half-written"),
])
def test_an_interrupt_is_one_line_saying_what_it_left(verb, exc, code, note, capsys, monkeypatch):
    import kprof.cli as cli

    def interrupted(argv):
        raise exc

    monkeypatch.setattr(cli, "app", interrupted)
    assert main([verb, "--db", "p.db"]) == code
    captured = capsys.readouterr()
    assert captured.out == "" and note in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("again", ["SIGINT", "SIGTERM"])
def test_a_second_interrupt_while_the_first_is_reported_is_still_one_line(again, capsys, monkeypatch):
    """Ctrl-C pressed twice on a run (the first stops its workers, which takes a moment): the second, arriving while
    the interrupt's line was written, ended kprof in a traceback of both, killed by SIGINT."""
    import signal

    import kprof.cli as cli
    from kprof.cli import _render

    def interrupted(argv):
        raise KeyboardInterrupt

    said = _render.error

    def error(message):
        signal.raise_signal(getattr(signal, again))  # the second one, as the line is written
        said(message)

    monkeypatch.setattr(cli, "app", interrupted)
    monkeypatch.setattr(_render, "error", error)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        code = main(["run", "--db", "p.db"])
    except (KeyboardInterrupt, SystemExit) as exc:
        code = exc
    assert code == 130
    assert "interrupted (Ctrl-C): every row stored" in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # as they were


@pytest.mark.parametrize("argv, note", [
    (["run", "--fresh"], "a --fresh run writes nothing: the ledger is as it was; the same command again measures every "
                         "spec"),
    (["run", "--force"], "the same command again measures every spec anew (--force; without it, only what is "
                         "missing)"),
    (["calibrate", "--force"], "the same command again measures every ceiling anew (--force"),
    (["run", "--remote", "x", "--fresh"], "a --fresh run writes nothing: the ledger is as it was, and the engine's "
                                          "unfinished jobs were cancelled; the same command with a new --output-dir "
                                          "measures every spec"),  # the same command is refused: remote-run.json
    (["run", "--remote=x", "--force"], "the same command with a new --output-dir sends every spec anew (--force"),
    (["run", "--fresh=false"], "every row stored before it stays in the ledger, and nothing half-written does; the "
                               "same command again measures only what is missing"),
])
def test_an_interrupted_fresh_or_force_run_says_what_the_same_command_does_again(argv, note, capsys, monkeypatch):
    """A Ctrl-C of `run --fresh` said every row stored before it stays and the same command measures only what is
    missing (it stores nothing and measures every spec); of `run --force`, that it measures only what is missing."""
    import kprof.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "app", interrupted)
    assert main([*argv, "--db", "p.db"]) == 130
    err = capsys.readouterr().err
    assert note in err, err
    assert "--fresh" not in argv or "only what is missing" not in err, err  # `--fresh=false` is no --fresh


@pytest.mark.parametrize("module", ["cyclopts", "msgspec", "ctypes"])
@pytest.mark.parametrize("sig, code, said", [("SIGINT", 130, "Ctrl-C"), ("SIGTERM", 143, "SIGTERM")])
def test_an_interrupt_while_kprof_starts_is_one_line_saying_what_it_left(module, sig, code, said, tmp_path):
    """The `kprof` script imports kprof.cli before it calls main, and that import loaded cyclopts (a fifth of a
    second, more on a busy host), then main loaded msgspec (for --json) and ctypes (the SIGBUS handler) before it
    handled signals: a Ctrl-C then was a traceback, a SIGTERM a silent death by the signal. The signal here arrives
    as the module is first imported, in a process started as the script starts."""
    code_ = ("import os, signal, sys\n"
             "class Stop:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             f"        if name == {module!r}:\n"
             "            sys.meta_path.remove(self)\n"
             f"            os.kill(os.getpid(), signal.{sig})\n"
             "sys.meta_path.insert(0, Stop())\n"
             "from kprof.cli import main\n"
             "sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code_, "run", "single_gemm", "--db", str(tmp_path / "p.db")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 128 - code, proc.stderr  # ended by the signal after its line: a shell reads `code`
    assert proc.stderr.startswith(f"error: interrupted ({said}): every row stored before it stays in the ledger")
    assert "Traceback" not in proc.stderr and os.listdir(tmp_path) == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ctrl_c_of_kprof_in_a_shell_loop_stops_the_loop(tmp_path):
    """Ctrl-C reaches the terminal's foreground process group: kprof and the shell running its loop. kprof exited 130,
    which bash takes for an interrupt the program handled, and went on to the loop's next command (Ctrl-C of `for t in
    ...; do kprof run ...; done` stopped one run of many); kprof ends by SIGINT after its line, and the loop stops. The
    group's SIGINT is sent here as kprof starts, in a session of its own."""
    code_ = ("import os, signal, sys\n"
             "class Stop:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'msgspec':\n"
             "            sys.meta_path.remove(self)\n"
             "            os.killpg(0, signal.SIGINT)\n"
             "sys.meta_path.insert(0, Stop())\n"
             "from kprof.cli import main\n"
             "sys.exit(main())")
    kprof = " ".join(map(shlex.quote, [sys.executable, "-c", code_, "run", "single_gemm", "--db", "p.db"]))
    proc = subprocess.run(["bash", "-c", f'for i in 1 2; do {kprof}; echo "after $i: $?"; done; echo loop done'],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, start_new_session=True)
    assert proc.stdout == "" and proc.returncode == -signal.SIGINT, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error: interrupted (Ctrl-C): every row stored before it stays in the ledger")
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_while_torch_loads_lets_its_import_finish_then_is_the_one_line(tmp_path):
    """torch's import runs C++ that calls back into Python, and a KeyboardInterrupt raised inside such a call ended
    the run in `terminate called after throwing an instance of 'pybind11::error_already_set'` (SIGABRT), not the one
    line: Ctrl-C and SIGTERM are held while torch loads, then handled. The signal here arrives as torch is first
    imported, and Python code runs on inside the import, where the interrupt was raised."""
    code_ = ("import os, signal, sys, time\n"
             "class Stop:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'torch':\n"
             "            sys.meta_path.remove(self)\n"
             "            os.kill(os.getpid(), signal.SIGINT)\n"
             "            time.sleep(0.1)\n"
             "sys.meta_path.insert(0, Stop())\n"
             "from kprof.cli import main\n"
             "code = main()\n"
             "print(hasattr(sys.modules.get('torch'), 'Tensor'))\n"
             "sys.exit(code)")
    spec = json.dumps({"m": 8, "n": 8, "k": 8, "dtype": "fp32"})
    proc = subprocess.run([sys.executable, "-c", code_, "run", "single_gemm", "--backend", "torch-cpu", "--spec", spec,
                           "--db", str(tmp_path / "p.db")], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == -2, proc.stderr  # ended by SIGINT at exit (a shell reads 130)
    assert proc.stdout.strip() == "True"  # the import finished before the interrupt was handled
    assert proc.stderr.startswith("error: interrupted (Ctrl-C): every row stored before it stays in the ledger")
    assert "Traceback" not in proc.stderr and os.listdir(tmp_path) == []


def test_a_verb_s_own_exit_is_not_taken_for_an_interrupt(monkeypatch):
    import kprof.cli as cli

    def exits(argv):
        raise SystemExit(5)

    monkeypatch.setattr(cli, "app", exits)
    with pytest.raises(SystemExit):
        main(["list"])


def test_an_output_dir_the_system_will_not_create_is_refused_before_any_work(tmp_path, capsys, h, refused):
    """/proc accepts no directory, whatever its permission bits say (root passes os.access there)."""
    refused(_run_into("/proc/kprof-snapshot", h, "p.db"), "--output-dir /proc/kprof-snapshot cannot be created in "
            "/proc")
    assert os.listdir(tmp_path) == []


def test_an_output_dir_name_too_long_for_the_file_system_is_refused_before_any_work(tmp_path, capsys, h, refused):
    """The probe made a short directory name, so a 300-byte one passed: the run measured and stored its rows, then
    failed to write the snapshot (exit 1)."""
    long = "y" * 300
    refused(_run_into(f"runs/{long}/a", h, "p.db"), f"the name {'y' * 40}... is 300 bytes, longer than the 255",
            "pass a new directory")
    deep = "/".join(["d" * 250] * 17)  # each name fits; the path, past 4096 bytes, does not
    refused(_run_into(deep, h, "p.db"), "cannot be created: its path is", "pass a new directory")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_sigterm_during_export_leaves_no_partial_file(sig, code, tmp_path):
    """SIGTERM ends a verb as Ctrl-C does (128 + 15), after its temporary files are removed. So does SIGHUP (a dropped
    ssh session, a closed terminal), which ended the process at once by its default action: an export left its
    `.kseg-*.part` file, no run of it again removed, and a run its claim file, with no line of what it left."""
    db = str(tmp_path / "p.db")
    out = tmp_path / "out"
    out.mkdir()
    with Ledger.open(db) as led:
        from kprof import synth

        led.append(list(synth.events(0, 20)))
    code = ("import os, signal, sys; from kprof.merge import segment; stream = segment._stream\n"
            "def killed(f, events, header):\n"
            "    f.write(b'partial'); f.flush(); os.kill(os.getpid(), signal.%s); return stream(f, events, header)\n"
            "segment._stream = killed\n"
            "from kprof.cli import main; sys.exit(main())") % sig
    proc = subprocess.run([sys.executable, "-c", code, "export", "--db", db, "-o", str(out / "x.kseg")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -getattr(signal, sig), proc.stderr  # ended by it, after its line: a shell reads `code`
    assert proc.stderr.startswith(f"error: interrupted ({sig}): nothing was left half-written"), proc.stderr
    assert os.listdir(out) == []


def test_sighup_ignored_under_nohup_stays_ignored(tmp_path):
    """`nohup kprof ...` ignores SIGHUP, so the command outlives the session: kprof handles SIGHUP as an interrupt only
    where it is not ignored."""
    db = str(tmp_path / "p.db")
    with Ledger.open(db) as led:
        from kprof import synth

        led.append(list(synth.events(0, 20)))
    code = ("import os, signal, sys\n"
            "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "from kprof.merge import segment; stream = segment._stream\n"
            "def hung_up(f, events, header):\n"
            "    os.kill(os.getpid(), signal.SIGHUP); return stream(f, events, header)\n"
            "segment._stream = hung_up\n"
            "from kprof.cli import main; sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code, "export", "--db", db, "-o", str(tmp_path / "x.kseg")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("wrote 20 event(s)"), proc.stderr



def test_sigterm_after_a_sighup_nohup_ignores_still_ends_a_held_block(tmp_path):
    """Under nohup a dropped session's SIGHUP, reaching a block that holds signals (torch's import), was recorded, and
    being the first recorded the one handled at its end: ignored, and `timeout`'s SIGTERM after it with it. The run
    measured on and stored its row (exit 0); the SIGTERM ends it, the SIGHUP stays ignored."""
    code = ("import os, signal, sys\n"
            "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "from kprof.runners import environments; require = environments.require\n"
            "def hung_up(entry):\n"
            "    os.kill(os.getpid(), signal.SIGHUP); os.kill(os.getpid(), signal.SIGTERM); return require(entry)\n"
            "environments.require = hung_up\n"
            "from kprof.cli import main; sys.exit(main())")
    db = str(tmp_path / "p.db")
    proc = subprocess.run([sys.executable, "-c", code, "run", "single_gemm", "--backend", "torch-cpu", "--spec",
                           json.dumps({"m": 8, "n": 8, "k": 8, "dtype": "fp32"}), "--db", db],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stderr.startswith("error: interrupted (SIGTERM)"), proc.stderr


# ---- integer flags, list flags, --specs - -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, shown, fix", [
    (["export", "-o", "d/", "--since", "1.5"], "--since '1.5'", "e.g. --since 1 or --since 2"),
    (["export", "-o", "d/", "--since=2.0"], "--since '2.0'", "e.g. --since 2"),
    (["audit", "--remeasure", "1.7"], "--remeasure '1.7'", "e.g. --remeasure 1 or --remeasure 2"),
    (["audit", "--jobs", "1.5"], "--jobs '1.5'", "e.g. --jobs 1 or --jobs 2"),
    (["audit", "--jobs", "1e2"], "--jobs '1e2'", "e.g. --jobs 100"),
    (["audit", "--jobs", "two"], "--jobs 'two'", "pass an integer"),
])
def test_an_integer_flag_refuses_a_float_instead_of_rounding_it(argv, shown, fix, tmp_path, h, refused, local_gpu):
    """cyclopts rounded them: `--since 1.5` exported as --since 2, `--remeasure 1.7` checked 2 rows."""
    h.append("p.db", h.make_event(SPEC, local_gpu))
    before = _files(tmp_path)
    refused([*argv, "--db", "p.db"], f"{shown} is not a whole number; pass an integer", fix)
    assert _files(tmp_path) == before


def test_every_integer_flag_of_every_verb_is_strict():
    import importlib
    import typing

    from cyclopts import Parameter

    from kprof.cli import VERBS
    from kprof.cli._options import whole

    found = []
    for verb, target, _help in VERBS:
        module, name = target.split(":")
        for param, hint in typing.get_type_hints(getattr(importlib.import_module(module), name),
                                                 include_extras=True).items():
            if param == "return":
                continue
            args = typing.get_args(hint)
            base = args[0] if typing.get_origin(hint) is typing.Annotated else hint
            if int in (base, *typing.get_args(base)):
                assert any(isinstance(a, Parameter) and a.converter is whole for a in args[1:]), (verb, param)
                found.append((verb, param))
    assert sorted(found) == [("audit", "jobs"), ("audit", "remeasure"), ("audit", "seed"), ("export", "since")]


@pytest.mark.parametrize("argv, shown, fix", [
    (["measure", "single_gemm", "--backend", "torch", "--spec", "{}", "--duration-s", "ten"], "--duration-s 'ten'",
     "e.g. --duration-s 10"),
    (["measure", "single_gemm", "--backend", "torch", "--spec", "{}", "--telemetry-hz", "1_0"],
     "--telemetry-hz '1_0'", "e.g. --telemetry-hz 20"),
    (["audit", "--remeasure", "1", "--tolerance", "5%"], "--tolerance '5%'", "e.g. --tolerance 0.05"),
])
def test_a_float_flag_refuses_text_naming_the_flag_and_the_value(argv, shown, fix, tmp_path, refused):
    """cyclopts said `Invalid value for --duration-s: unable to convert "ten" into float`: no fix, unlike every
    other bad value."""
    refused(argv, f"{shown} is not a number; pass a decimal number", fix)
    assert os.listdir(tmp_path) == []


def test_every_float_flag_of_every_verb_is_strict():
    import importlib
    import typing

    from cyclopts import Parameter

    found = []
    for verb, target, _help in VERBS:
        module, name = target.split(":")
        for param, hint in typing.get_type_hints(getattr(importlib.import_module(module), name),
                                                 include_extras=True).items():
            args = typing.get_args(hint)
            base = args[0] if typing.get_origin(hint) is typing.Annotated else hint
            if float in (base, *typing.get_args(base)):
                assert any(isinstance(a, Parameter) and getattr(a.converter, "__qualname__", "").startswith(
                    "number.") for a in args[1:]), (verb, param)
                found.append((verb, param))
    assert sorted(found) == [("audit", "tolerance"), ("measure", "duration_s"), ("measure", "telemetry_hz")]


@pytest.mark.parametrize("verb", [verb for verb, _t, _h in VERBS])
def test_no_verb_has_negative_list_flags(verb, capsys):
    assert main([verb, "--help"]) == 0
    assert "--empty-" not in capsys.readouterr().out


@pytest.mark.parametrize("verb", [verb for verb, _t, _h in VERBS])
def test_no_verb_shows_a_repeatable_flag_as_taking_several_values(verb, capsys):
    """`kprof show --help` listed `--dir STR...`, a flag taking several values at once; it takes one a use
    (`--dir a b` is refused: "--dir takes one value"), repeated as `--dir a --dir b`. It reads `--dir DIR` now."""
    assert main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert "STR..." not in out and not re.search(r"--\S+ [A-Z_=]+\.\.\.", out), out


def test_a_negative_list_flag_is_not_parsed(tmp_path, capsys, h):
    (tmp_path / "specs.json").write_text(json.dumps([SPEC]))
    assert main(["query", h.GEMM, "--backend", h.CPU, "--empty-spec", "--specs", "specs.json"]) == 2
    assert "--empty-spec" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["specs.json"]


def test_export_and_measure_have_help_of_their_own(capsys):
    assert main(["export", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Default: every GPU key" in out and "local device" not in out
    assert main(["measure", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "The one spec to measure" in out and "repeatable" not in out
    assert "--spec JSON The one spec" in out and "STR..." not in out  # one JSON object, not several strings
    # its --backend example is one it takes (the shared help named torch-cpu, which it refuses), its --gpu-name the
    # GPU it runs on, not a filter
    said = " ".join(out.replace("│", " ").split())
    assert "e.g. torch (see kprof list); a CPU backend or a collective is refused" in said and "torch-cpu" not in said
    assert "it must be the name of the GPU measured on" in said and "filter" not in said
    for verb in ("run", "query", "count-missing"):
        assert main([verb, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "--spec JSON One spec" in out and "--specs FILE" in out and "STR..." not in out, verb


def test_measure_help_shows_its_one_spec_as_required(capsys, tmp_path):
    """measure refuses a call without --spec, but its help's usage line left --spec out (`Usage: kprof measure
    --backend STR [OPTIONS] TABLE`) and listed it as optional."""
    assert main(["measure", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: kprof measure --backend STR --spec JSON [OPTIONS] TABLE" in out, out
    said = " ".join(out.replace("│", " ").split())
    assert "* --spec JSON The one spec to measure, as a JSON object of the table's KernelArgs. [required]" in said
    assert main(["measure", "single_gemm", "--backend", "torch"]) == 2
    assert capsys.readouterr().err.startswith("error: --spec is missing: the one spec to measure")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, said", [
    (["run", "single_gemm", "--backend", "torch-cpu", "--spec", "{}", "--force", "--fresh"],
     "error: --force and --fresh cannot be combined: --force re-measures every spec and stores the new rows, "
     "--fresh measures every spec and writes nothing; pass one of them"),
    (["query", "single_gemm", "--backend", "torch-cpu", "--bogus"], "error: Unknown option: --bogus; see `kprof query --help`"),
    (["audit", "--jobs"], "error: --jobs needs a value: shard processes the audit runs"),
    (["nosuch"], 'error: Unknown command "nosuch"'),
    (["list", "--json=3"], 'error: Invalid value for --json: unable to convert "3" into bool; see `kprof list --help`')])
def test_a_parse_error_is_one_line_as_every_usage_error(argv, said, tmp_path, capsys):
    """cyclopts printed its parse errors as a multi-line panel with no fix; they are now one `error:` line, as the
    other usage errors are, pointing at the verb's help."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(said) and err.count("\n") == 1 and "╭" not in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, said", [
    (["query", "single_gemm", "rms_norm", "--backend", "torch-cpu", "--spec", "{}"],
     "error: unexpected argument 'rms_norm': a command takes one table and one --backend; run one command per "
     "table/backend pair; see `kprof query --help`"),
    (["run", "single_gemm", "--backend", "torch-cpu", "--backend", "torch", "--spec", "{}"],
     "error: --backend is given more than once: a command takes one backend; run one command per table/backend "
     "pair; see `kprof run --help`"),
    (["scopes", "a", "b"], "error: unexpected arguments 'a', 'b': `kprof scopes` takes no such argument; see "
     "`kprof scopes --help`"),
    (["query", "single_gemm", "--backend", "torch-cpu", "--spec", "{}", "{}"],
     "error: unexpected argument '{}': --spec takes one JSON object; give each spec its own --spec, or put them in a "
     "--specs file; see `kprof query --help`"),
    (["run", "single_gemm", "--backend", "torch-cpu", "--specs=a.json", "b.json"],
     "error: unexpected argument 'b.json': --specs takes one file; put every spec in it (a JSON list, or JSONL); see "
     "`kprof run --help`"),
    (["query", "single_gemm", "--backend", "torch-cpu", "--spec", "{}", "--db", "a.db", "b.db"],
     "error: unexpected argument 'b.db': --db takes one value; see `kprof query --help`"),
])
def test_a_second_table_or_backend_is_refused_by_the_one_pair_rule(argv, said, tmp_path, capsys):
    """The seed's rule (one table/backend pair per command) was cyclopts' "Unused Tokens: ['rms_norm']" and
    "Parameter --backend specified multiple times": the value, but not the rule or the fix."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == said + "\n", err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, said", [
    (["query"], "error: TABLE is missing: the table, e.g. single_gemm (see `kprof list`); see `kprof query --help`"),
    (["measure"], "error: TABLE is missing: the table, e.g. single_gemm"),
    (["query", "single_gemm"], "error: --backend is missing: the backend, e.g. torch-cpu (see `kprof list`)"),
    (["count-missing", "single_gemm", "--backend"], "error: --backend needs a value: the backend, e.g. torch-cpu"),
    (["show"], "error: REF is missing: a citation (`kprof.<hex>`), an event id or a key"),
    (["merge"], "error: SEGMENTS is missing: segment files to merge"),
    (["export"], "error: -o/--output is missing: the new segment file"),
    (["export", "-o"], "error: -o needs a value: the new segment file"),
    (["query", "single_gemm", "--backend", "torch-cpu", "--gpu-name"], "error: --gpu-name needs a value: GPU key of "
                                                                          "the rows")])
def test_a_required_argument_left_out_is_named_as_the_usage_line_names_it(argv, said, tmp_path, capsys):
    """cyclopts said `Command "query" parameter --table requires an argument` for a query with no table: a
    positional TABLE read as a flag to add, and nothing said what it takes."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(said) and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, said", [
    (["query", "single_gemm", "--backend", "torch-cpu", "--spec", "{}", "--db", "-old.db"],
     "error: --db needs a value: ledger file. Default: $KPROF_DB, else ./profile.db; '-old.db' after it reads as an "
     "option: to pass it as the value, write --db=-old.db; see `kprof query --help`"),
    (["export", "-o", "-rows.kseg"], "; '-rows.kseg' after it reads as an option: to pass it as the value, write "
                                     "-o=-rows.kseg; see `kprof export --help`"),
    (["query", "single_gemm", "--backend", "torch-cpu", "--db", "--spec", "{}"],
     "error: --db needs a value: ledger file. Default: $KPROF_DB, else ./profile.db; see `kprof query --help`"),
    (["query", "single_gemm", "--backend", "torch-cpu", "--spec", "{}", "--db", "-old ledger.db"],
     ": to pass it as the value, write '--db=-old ledger.db'; see `kprof query --help`")])
def test_a_value_starting_with_a_dash_is_said_to_read_as_an_option(argv, said, tmp_path, capsys):
    """A ledger or segment whose name starts with '-' (`--db -old.db`) was refused as "--db needs a value", where one
    was given, with no way to pass it; the line says the value read as an option and how to pass it (`--db=-old.db`),
    and a flag's name after the flag (`--db --spec`) is still only a missing value."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith(said + "\n") and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


def test_a_segment_named_with_a_leading_dash_is_said_to_read_as_an_option(tmp_path, capsys):
    """`kprof merge -rows.kseg` (a file of that name here) was "Unknown option: -rows.kseg. -r is not a recognized
    option": the file is named, with the way to pass it (./-rows.kseg); an unknown option that names no file is
    cyclopts' line still."""
    (tmp_path / "-rows.kseg").write_bytes(b"")
    assert main(["merge", "-rows.kseg", "--db", "p.db"]) == 2
    assert capsys.readouterr().err == ("error: '-rows.kseg' reads as an option, and names a file here: to pass the "
                                       "file, write ./-rows.kseg; see `kprof merge --help`\n")
    assert main(["merge", "-none.kseg", "--db", "p.db"]) == 2
    assert capsys.readouterr().err.startswith("error: Unknown option: -none.kseg")
    assert sorted(os.listdir(tmp_path)) == ["-rows.kseg"]


@pytest.mark.parametrize("argv, said", [
    (["export", "-o", "-", "--db", "p.db"], "error: -o -: a segment is a file, not stdout"),
    (["export", "--output", "-"], "error: -o -: a segment is a file, not stdout"),
    (["export", "-o=-", "--db", "p.db"], "error: -o -: a segment is a file, not stdout"),
    (["merge", "-", "--db", "p.db"], "error: a segment -: a segment is a file, not stdin"),
    (["merge", "--db", "p.db", "a.kseg", "-"], "error: a segment -: a segment is a file, not stdin")])
def test_a_segment_piped_through_stdout_or_stdin_is_refused_as_such(argv, said, tmp_path, capsys):
    """`kprof export -o - | ssh host kprof merge -`, to ship rows between machines: `-o -` said "-o needs a value"
    (it had one), `-o=-` wrote a file named "-", and `merge -` said "Unknown option: -". Each says a segment is a
    file, and the fix, and nothing is written."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(said) and "give a" in err and "file path" in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


def test_help_says_what_the_verbs_do(capsys):
    """run's --output-dir help left out the curve.png it writes; audit's said --remeasure exits 1 on a drift only,
    where a row that fails to measure exits 1 too."""
    assert main(["run", "--help"]) == 0
    assert "curve.png" in capsys.readouterr().out
    assert main(["audit", "--help"]) == 0
    assert "fails to measure" in capsys.readouterr().out


@pytest.mark.parametrize("form", [["--specs", "-"], ["--specs=-"]])
def test_specs_from_stdin_is_refused_as_such(form, tmp_path, capsys, h, refused):
    refused(["query", h.GEMM, "--backend", h.CPU, *form, "--db", "p.db"],
            "--specs -: reading specs from stdin is not supported; write them to a file and pass its path")
    refused(["query", h.GEMM, "--backend", h.CPU, "--specs", "--json"], "--json looks like a flag")
    assert os.listdir(tmp_path) == []


# ---- settings that contradict each other ------------------------------------------------------------------------

@pytest.mark.parametrize("env, needle", [
    ({"KPROF_CAPPED_SAMPLE_S": "5", "KPROF_CAPPED_MAX_SAMPLE_S": "1"},
     "KPROF_CAPPED_SAMPLE_S='5' is above KPROF_CAPPED_MAX_SAMPLE_S='1'"),
    ({"KPROF_PROFILE_GPUS": "0", "VIBESIM_PROFILE_GPUS": "1"},
     "KPROF_PROFILE_GPUS='0' and VIBESIM_PROFILE_GPUS='1' are the same setting and differ"),
])
def test_settings_that_contradict_each_other_are_refused_on_the_cpu_too(env, needle, tmp_path, capsys, h, refused,
                                                                        monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refused(_run_into("snap", h, "p.db"), needle)
    assert os.listdir(tmp_path) == []


def test_a_collective_without_a_gpu_names_its_own_cpu_backend(tmp_path, capsys, h, refused, monkeypatch):
    """all_reduce's CPU twin is gloo: torch-cpu has no all_reduce."""
    from kprof.measure import device_name

    monkeypatch.setattr(device_name, "local_gpu_name", lambda: None)
    spec = json.dumps({"message_size_bytes": 16777216, "dtype": "bf16", "world_size": 2})
    err = refused(["run", "all_reduce", "--backend", "nccl", "--spec", spec, "--db", "p.db"],
                  "backend nccl measures on a CUDA GPU", "or use backend gloo")
    assert "torch-cpu" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("make", ["file", "lock_dir"])
def test_a_claims_directory_a_run_cannot_use_is_refused_before_a_ledger_is_made(tmp_path, h, refused, make):
    """`<db>-claims` a file, or its lock a directory: one line naming it, exit 2, and no ledger created (the ledger
    used to be created first, then the run refused; a lock that was a directory was a traceback)."""
    if make == "file":
        (tmp_path / "p.db-claims").write_text("")
        needle = "cannot use p.db-claims, where concurrent runs on the ledger record the keys they measure: p.db-claims is not a directory"
    else:
        (tmp_path / "p.db-claims" / "lock").mkdir(parents=True)
        needle = "p.db-claims/lock is a directory; fix or remove p.db-claims/lock"
    refused(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(SPEC), "--db", "p.db"], needle)
    assert not os.path.exists(tmp_path / "p.db") and not os.path.exists(tmp_path / "p.db-lock")


@pytest.mark.parametrize("extra, said", [({"backend": "torch-cpu"}, '"backend"; pass --backend instead'),
                                         ({"table": "single_gemm"}, '"table"; remove it; the specs are the list')])
@pytest.mark.parametrize("verb", ["run", "query"])
def test_a_specs_document_with_keys_beside_specs_names_them(verb, extra, said, tmp_path, capsys, h):
    """{"specs": [...], "backend": ...} was read as one spec and refused for its field "specs", the one key that
    is right."""
    (tmp_path / "specs.json").write_text(json.dumps({"specs": [SPEC], **extra}))
    assert main([verb, h.GEMM, "--backend", h.CPU, "--specs", "specs.json", "--db", "p.db"]) == 2
    err = capsys.readouterr().err
    assert f'--specs specs.json: a {{"specs": [...]}} document holds only "specs", and it also has {said}' in err
    assert os.listdir(tmp_path) == ["specs.json"]


def test_every_help_is_laid_out_whole_on_a_terminal_that_is_not_utf8(monkeypatch):
    """Under a C locale (PYTHONIOENCODING=ascii) `kprof measure --help` printed `100 \\xb5s` for `100 µs`, escaped by
    the stream after the panel was laid out: that line's border stood three columns right of the others."""
    import io

    from kprof.cli import VERBS

    for verb in ["", *(name for name, _target, _help in VERBS)]:
        raw = io.BytesIO()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii", errors="backslashreplace"))
        assert main([verb, "--help"] if verb else ["--help"]) == 0
        sys.stdout.flush()
        panel = [line for line in raw.getvalue().decode("ascii").splitlines() if line.startswith(("+", "|"))]
        assert panel and len({len(line) for line in panel}) == 1, (verb, [line for line in panel if "\\" in line])


def test_no_help_text_loses_a_placeholder(capsys):
    """The help texts are markdown: `kprof.<hex>` outside backticks read as an HTML tag and vanished (`kprof show
    --help` said "A citation (kprof.)"). Every <placeholder> in a verb's parameter help is printed."""
    import inspect
    import re
    import typing

    from kprof.cli import VERBS, app

    for verb, _target, _help in VERBS:
        helps = [meta.help for p in inspect.signature(app[verb].default_command).parameters.values()
                 for meta in getattr(typing.get_type_hints(app[verb].default_command, include_extras=True)
                                     .get(p.name), "__metadata__", ()) if getattr(meta, "help", None)]
        assert main([verb, "--help"]) == 0
        out = "".join(capsys.readouterr().out.split())
        for placeholder in {p for text in helps for p in re.findall(r"<[a-z]+>", text)}:
            assert placeholder in out, (verb, placeholder)
    assert main(["show", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "A citation (kprof.<hex>)" in out and "(kmeasure.<hex>)" in out and "a kmeasure.<hex> citation" in out


@pytest.mark.parametrize("flag", ["--spec", "--gpu-name", "--db", "--output-dir", "KPROF_DB"])
def test_a_value_that_is_not_utf8_is_refused_naming_its_bytes(flag, tmp_path, h, refused, monkeypatch):
    """A byte that is not UTF-8 in an argument or $KPROF_DB (a file name in another encoding, a C locale's text) is
    refused before anything is written: it was a traceback (a spec's JSON, the GPU key's hash, LMDB's path, and a
    snapshot's record of the command after the rows were stored)."""
    bad = os.fsdecode(b"x\xffy")
    value = json.dumps({**SPEC, "dtype": "fp32"}).replace("fp32", bad) if flag == "--spec" else bad
    argv = ["run", h.GEMM, "--backend", h.CPU, *(["--spec", value] if flag == "--spec" else h.spec_args(SPEC))]
    if flag == "KPROF_DB":
        monkeypatch.setenv("KPROF_DB", bad)
    elif flag != "--spec":
        argv += [flag, value]
    err = refused(argv, "is not UTF-8 text (byte ", " is 0xff); ", "x\\xffy")
    assert err.count("\n") == 1 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["--gpu-name", "KPROF_DB"])
def test_a_utf8_value_under_a_c_locale_without_utf8_mode_names_the_locale(where, tmp_path):
    """Under LC_ALL=C with PYTHONUTF8=0, Python reads a UTF-8 argument's bytes as ascii escapes: the value was called
    not UTF-8 at its first byte (`byte 0 is 0xc3`, which starts a valid `Ü`), with the fix to pass it in UTF-8, as it
    was. The message says Python's encoding is the cause and how to change it; nothing is written."""
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "PYTHONIOENCODING": "utf-8"}
    argv = [sys.executable, "-m", "kprof", "run", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps(SPEC)]
    if where == "KPROF_DB":
        env["KPROF_DB"] = "ledgé.db"
    else:
        argv += ["--gpu-name", "Ünïcødé", "--db", "x.db"]
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    value = "KPROF_DB='ledgé.db'" if where == "KPROF_DB" else "argument 'Ünïcødé'"
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert f"error: {value} is UTF-8, but Python reads arguments and variables here as ascii" in p.stderr, p.stderr
    assert "set PYTHONUTF8=1, or a UTF-8 locale (LC_ALL=C.UTF-8)" in p.stderr and "byte 0" not in p.stderr
    assert os.listdir(tmp_path) == []


_FEW_DESCRIPTORS = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); held = []\n"
                    "while len(held) < 70:\n    try:\n        held.append(os.open(os.devnull, os.O_RDONLY))\n"
                    "    except OSError:\n        break\n"
                    "[os.close(fd) for fd in held[:int(sys.argv[1])]]\n"
                    "from kprof.cli import main; sys.exit(main(sys.argv[2:]))")  # `ulimit -n`, all but N taken


@pytest.mark.parametrize("exc, said", [
    (OSError(24, "Too many open files"), "too many open files ([Errno 24] Too many open files): this process may have"),
    (Exception("p.db: Too many open files in system"), "the system's table of open files is full (p.db: Too many open "
                                                        "files in system); close files elsewhere"),
    (MemoryError(), "out of "), (ValueError("no limit"), None)])
def test_a_limit_is_told_from_the_error_that_met_it(exc, said):
    """What a descriptor, file-table or memory error met, told by its errno or (LMDB's) its text: the system's full
    file table (ENFILE) is not this process's ulimit -n."""
    assert hit(exc) is None if said is None else hit(exc).startswith(said), hit(exc)


@pytest.mark.parametrize("free, verb", [(6, ["audit", "--jobs", "2"]), (8, ["audit", "--jobs", "2"]),
                                        (5, ["run", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps(SPEC)])])
def test_too_few_file_descriptors_is_one_line_naming_ulimit_n(tmp_path, free, verb):
    """A process out of file descriptors (`ulimit -n`) where audit makes its shard processes' pipes was an OSError
    traceback (exit 1), and a run refused its claims directory said to fix or remove it; either is one line naming
    the limit and its fix now, exit 2, and the ledger is as it was. Only a verb that writes says that every row stored
    before stays (an audit's line said so too, of rows it never stores)."""
    db = str(tmp_path / "p.db")
    with Ledger.open(db) as led:
        led.append(list(synth.events(1, 3)))
    before = (tmp_path / "p.db").read_bytes()
    proc = subprocess.run([sys.executable, "-c", _FEW_DESCRIPTORS, str(free), *verb, "--db", db],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "too many open files" in proc.stderr and "ulimit -n 64" in proc.stderr and "Traceback" not in proc.stderr
    said = [line for line in proc.stderr.strip().splitlines() if not line.startswith("measuring ")]  # (run's opening)
    assert len(said) == 1 and (tmp_path / "p.db").read_bytes() == before
    assert ("every row stored before stays" in said[0]) == (verb[0] == "run"), said


_ADDRESS_SPACE = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]),) * 2); "
                  "from kprof.cli import main; sys.exit(main(sys.argv[2:]))")  # `ulimit -v`


def test_a_ledger_opens_under_an_address_space_limit_below_its_16_gib_map(tmp_path):
    """Every ledger was opened with a 16 GiB memory map, so under any `ulimit -v` below that (a batch queue's) every
    verb failed to open it ("Cannot allocate memory; check the path and its permissions", exit 2): the map is kept
    within a quarter of the limit (LMDB maps the pages in use, and grows the map as a write needs), and a 4 GiB
    limit reads, exports and merges rows."""
    db, seg, merged = (str(tmp_path / n) for n in ("p.db", "p.kseg", "m.db"))
    with Ledger.open(db) as led:
        led.append(list(synth.events(1, 3)))

    def limited(*args):
        return subprocess.run([sys.executable, "-c", _ADDRESS_SPACE, str(4 << 30), *args], capture_output=True,
                              text=True, cwd=tmp_path)

    for args in (["scopes", "--db", db], ["audit", "--db", db], ["export", "-o", seg, "--db", db],
                 ["merge", seg, "--db", merged]):
        proc = limited(*args)
        assert proc.returncode == 0, (args, proc.stderr)
    with Ledger.open(merged, readonly=True) as led, Ledger.open(db, readonly=True) as source:
        assert led.last_seq == source.last_seq == 2


def test_a_run_whose_torch_cannot_be_mapped_under_ulimit_v_is_one_line(tmp_path):
    """Under an address space limit too small for torch's libraries, a run ended with an ImportError traceback ("failed
    to map segment from shared object", exit 1, read as rows left missing); it is one line naming the limit and its
    fix, exit 2, and no ledger is made."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")  # numpy's OpenBLAS sizes its buffers by thread: not that limit
    proc = subprocess.run([sys.executable, "-c", _ADDRESS_SPACE, str(150 << 20), "run", "single_gemm", "--backend",
                           "torch-cpu", "--spec", json.dumps(SPEC), "--db", "p.db"],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "out of address space" in proc.stderr and "ulimit -v allows this process 153600 KiB" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "p.db")


def test_a_current_directory_removed_since_is_named_not_a_traceback(tmp_path):
    """Run from a directory removed since (a batch job's scratch cleaned up), audit's shard processes failed to spawn
    (a FileNotFoundError traceback, exit 1) and a run's torch died in MKL ("Cannot load libtorch_cpu.so"); the
    directory is named, with the fix, exit 2."""
    db = str(tmp_path / "p.db")
    with Ledger.open(db) as led:
        led.append(list(synth.events(1, 3)))
    code = ("import os, sys; os.mkdir(sys.argv[1]); os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]); "
            "from kprof.cli import main; sys.exit(main(sys.argv[2:]))")
    gone = str(tmp_path / "gone")
    proc = subprocess.run([sys.executable, "-c", code, gone, "audit", "--db", db], capture_output=True, text=True,
                          env=dict(os.environ, PWD=gone))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: the current directory ({gone}) was removed; cd to a directory that exists and run " \
                          f"the command again\n"
    # a reader of a ledger named by its whole path, or --version, needs no directory: each answered there, and was
    # refused by the check as well
    from kprof import __version__

    for argv, said in ((["scopes", "--db", db], "scopes of "), (["--version"], __version__)):
        proc = subprocess.run([sys.executable, "-c", code, gone, *argv], capture_output=True, text=True,
                              env=dict(os.environ, PWD=gone))
        assert proc.returncode == 0 and said in proc.stdout, proc.stderr
    proc = subprocess.run([sys.executable, "-c", code, gone, "scopes", "--db", "p.db"], capture_output=True, text=True,
                          env=dict(os.environ, PWD=gone))
    assert proc.returncode == 2 and "the current directory" in proc.stderr, proc.stderr  # a relative path: refused


def test_a_relative_specs_file_in_a_removed_directory_is_refused_as_the_directory_not_as_missing(tmp_path):
    """A query of a ledger named by its whole path answers in a removed directory; its --specs named relative to that
    directory was let through and said "--specs specs.json: no such file", not why (the directory is gone). The
    directory is named, as for any relative path; a --specs named whole is read."""
    db, specs = str(tmp_path / "p.db"), tmp_path / "specs.json"
    with Ledger.open(db) as led:
        led.append(list(synth.events(1, 3)))
    specs.write_text(json.dumps(SPEC))
    code = ("import os, sys; os.mkdir(sys.argv[1]); os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]); "
            "from kprof.cli import main; sys.exit(main(sys.argv[2:]))")
    gone = str(tmp_path / "gone")
    for given in (["--specs", "specs.json"], ["--specs=specs.json"], ["--specs", str(specs)]):
        proc = subprocess.run([sys.executable, "-c", code, gone, "query", "single_gemm", "--backend", "torch-cpu",
                               *given, "--db", db], capture_output=True, text=True, env=dict(os.environ, PWD=gone))
        if given[-1] == str(specs):
            assert proc.returncode == 0 and "1 missing" in proc.stdout, proc.stderr
        else:
            assert proc.returncode == 2 and proc.stderr.startswith(f"error: the current directory ({gone}) was "
                                                                   f"removed"), proc.stderr


def test_pool_workers_whose_torch_cannot_be_mapped_under_ulimit_v_name_the_limit(tmp_path):
    """CPU workers (KPROF_CPU_WORKERS) that could not import torch under `ulimit -v` ended the run with "no worker
    could prepare its device (cpu0: ImportError: ... failed to map segment ...)"; the limit and its fix are named."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", KPROF_CPU_WORKERS="2")
    specs = [json.dumps({**SPEC, "m": m}) for m in (8, 16)]
    proc = subprocess.run([sys.executable, "-c", _ADDRESS_SPACE, str(150 << 20), "run", "single_gemm", "--backend",
                           "torch-cpu", "--spec", specs[0], "--spec", specs[1], "--db", "p.db"],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: out of address space (") and \
        "ulimit -v allows this process 153600 KiB; raise the limit" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "p.db")
