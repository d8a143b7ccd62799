"""kprof.perf_api: a GPU key the ledger has never held rows of raises, naming the ones it holds; counts still count;
the views it caches read the rows of the timing method asked for, of the file now at the path."""

import os
import subprocess
import sys
import threading

import lmdb
import msgspec

import pytest

from kprof import perf_api
from kprof import api
from kprof.errors import IntegrityError, LedgerError, LedgerPathError, SpecError, UnknownGpuKeyError, UsageError
from kprof.ledger import KeyMaker, Ledger, ShapeCodec
from kprof.ledger.build import measured
from kprof.ledger.events import Method, Stats
from kprof.method import effective_entry
from kprof.runners.registry import lookup

SPEC = {"m": 32, "n": 32, "k": 32, "dtype": "fp32"}


def _write(path: str, time_ms: float = 0.1, backend: str = "torch-cpu", gpu_key: str = "Known CPU", **method) -> str:
    """A ledger at path holding one row of SPEC, timed `time_ms`, under the timing method `method`."""
    entry = effective_entry(lookup("single_gemm", backend), **method)
    keys = KeyMaker(entry.table, entry.backend, gpu_key, entry.contract, ShapeCodec(entry.args))
    stats = Stats(n=3, median=time_ms, p10=time_ms, p90=time_ms, mean=time_ms, stdev=0.0, cv=0.0, min=time_ms,
                  max=time_ms)
    metrics = {"time_ms": time_ms, "tflops": 1.0, "memory_bandwidth_gbps": 1.0, "energy_j": None}
    with Ledger.open(path) as led:
        led.append([measured(keys.provenance(SPEC), metrics, stats, Method(timer="cpu"))])
    return path


@pytest.fixture
def db(tmp_path):
    yield _write(str(tmp_path / "profile.db"))
    perf_api.close_all()


def test_get_under_an_unknown_gpu_key_names_the_known_ones(db):
    with pytest.raises(UnknownGpuKeyError, match="no single_gemm/torch-cpu rows for GPU key 'AMD EPYC': it holds "
                                                 r"single_gemm/torch-cpu rows for GPU key 'Known CPU' \(1 row\)"):
        perf_api.get_single_gemm(backend="torch-cpu", gpu_key="AMD EPYC", db=db, **SPEC)


def test_a_gpu_key_or_spec_value_with_a_lone_surrogate_is_a_usage_error(db):
    """A str holding a lone surrogate (how Python reads a byte that is not UTF-8, e.g. os.fsdecode of a file name) as
    the GPU key or in a spec was a UnicodeEncodeError from hashing the key or from msgspec: a usage error naming it."""
    bad = "Known CPU\udcff"
    with pytest.raises(UsageError, match=r"GPU key 'Known CPU\\udcff' is not UTF-8 text"):
        perf_api.get_single_gemm(backend="torch-cpu", gpu_key=bad, db=db, **SPEC)
    with pytest.raises(UsageError, match=r"GPU key 'Known CPU\\udcff' is not UTF-8 text"):
        perf_api.count_single_gemm([SPEC], backend="torch-cpu", gpu_key=bad, db=db)
    with pytest.raises(UsageError, match=r"gpu_name='Known CPU\\udcff' is not UTF-8 text"):
        api.query("single_gemm", "torch-cpu", [SPEC], gpu_name=bad, db=db)
    with pytest.raises(SpecError, match=r"^spec 1: field 'dtype' = 'fp32\\udcff' is not UTF-8 text"):
        api.query("single_gemm", "torch-cpu", [SPEC, {**SPEC, "dtype": "fp32\udcff"}], gpu_name="Known CPU", db=db)


def test_get_under_a_known_gpu_key_is_the_row_or_none(db):
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC).metrics["time_ms"] == 0.1
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **{**SPEC, "m": 64}) is None


def test_count_under_an_unknown_gpu_key_counts_every_spec_missing(db):
    specs = [SPEC, {**SPEC, "m": 64}]
    assert perf_api.count_single_gemm(specs, backend="torch-cpu", gpu_key="AMD EPYC", db=db) == 2
    assert perf_api.count_single_gemm(specs, backend="torch-cpu", gpu_key="Known CPU", db=db) == 1


def test_each_timing_method_reads_its_own_rows(db, monkeypatch):
    """A simulator reads decode (sustained) and prefill (loaded) rows in one process; KPROF_TIMER changing between
    two calls changes the rows read too."""
    for power, time_ms in (("sustained", 1.0), ("loaded", 2.0)):
        _write(db, time_ms, "torch", "Known GPU", power=power, timer="events")
    _write(db, 3.0, "torch", "Known GPU", power="loaded")  # timer cupti
    get = perf_api.get_single_gemm
    assert get(backend="torch", gpu_key="Known GPU", db=db, timer="events", **SPEC).metrics["time_ms"] == 1.0
    assert get(backend="torch", gpu_key="Known GPU", db=db, timer="events", power="loaded",
               **SPEC).metrics["time_ms"] == 2.0
    monkeypatch.setenv("KPROF_TIMER", "events")
    assert get(backend="torch", gpu_key="Known GPU", db=db, **SPEC).metrics["time_ms"] == 1.0
    monkeypatch.setenv("KPROF_POWER", "loaded")
    assert get(backend="torch", gpu_key="Known GPU", db=db, **SPEC).metrics["time_ms"] == 2.0
    monkeypatch.delenv("KPROF_TIMER")
    assert get(backend="torch", gpu_key="Known GPU", db=db, **SPEC).metrics["time_ms"] == 3.0
    assert perf_api.count_single_gemm([SPEC], backend="torch", gpu_key="Known GPU", db=db, l2="warm") == 1
    assert perf_api.view_for("single_gemm", "torch", "Known GPU", db, cuda_graph=False).contract.timing == (
        "cupti;l2=cold;eager;power=loaded")


def test_a_ledger_replaced_in_place_is_read_anew(db, tmp_path):
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC).metrics["time_ms"] == 0.1
    os.replace(_write(str(tmp_path / "new.db"), 0.5), db)
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC).metrics["time_ms"] == 0.5
    assert perf_api.count_single_gemm([SPEC], backend="torch-cpu", gpu_key="Known CPU", db=db) == 0


def test_a_cached_ledger_its_caller_closed_is_opened_again(db):
    """A notebook's `with perf_api.view_for(...).ledger:` (or view.ledger.close()) closed the ledger perf_api caches:
    every later get_/count_ of that db raised "ledger ... is closed; open it again with Ledger.open", which no call of
    the caller's could do (only close_all()). perf_api opens it again, and a view held from before says it is closed."""
    view = perf_api.view_for("single_gemm", "torch-cpu", "Known CPU", db)
    with view.ledger:
        assert view.get(**SPEC).metrics["time_ms"] == 0.1
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC).metrics["time_ms"] == 0.1
    assert perf_api.count_single_gemm([SPEC], backend="torch-cpu", gpu_key="Known CPU", db=db) == 0
    assert perf_api.view_for("single_gemm", "torch-cpu", "Known CPU", db) is not view
    with pytest.raises(LedgerError, match="is closed"):
        view.get(**SPEC)


def test_a_replacement_met_while_another_thread_reads_the_earlier_file_leaves_that_read_whole(db, tmp_path):
    """Reopening a replaced file must not close the earlier one under another thread's read (its rows would read as
    a damaged ledger): the call that finds it replaced waits for that read to end (it was refused: a simulator's
    reader threads saw every such call fail), then reads the new file."""
    view = perf_api.view_for("single_gemm", "torch-cpu", "Known CPU", db)
    rows, read, replaced, got = view.rows(), threading.Event(), threading.Event(), []

    def reader():
        got.append(next(rows))
        read.set()
        replaced.wait()
        got.extend(rows)

    thread = threading.Thread(target=reader)
    thread.start()
    read.wait()
    os.replace(_write(str(tmp_path / "new.db"), 0.5), db)
    ends = threading.Timer(0.3, replaced.set)  # the earlier read ends meanwhile
    ends.start()
    try:
        assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC).metrics[
            "time_ms"] == 0.5
        assert replaced.is_set()
    finally:
        replaced.set()
        thread.join()
        ends.cancel()
    assert [row.metrics["time_ms"] for row in got] == [0.1]


def test_a_call_whose_ledger_another_thread_reopened_meanwhile_reads_the_new_file(db, tmp_path, monkeypatch):
    """A call holding the view of a file that another thread (here: the call's own lookup, once) found replaced, and
    closed, was refused ("is closed", or "was replaced ... open it again"; where the close came mid-read, a damaged
    ledger): it reads the new file."""
    assert perf_api.count_single_gemm([SPEC], backend="torch-cpu", gpu_key="Known CPU", db=db) == 0
    new, real = _write(str(tmp_path / "new.db"), 0.5), perf_api.view_for

    def another_thread_meanwhile(*args, **kwargs):
        view = real(*args, **kwargs)
        if os.path.exists(new):
            os.replace(new, db)
            real(*args, **kwargs)  # finds the file replaced: opens the new one, closes the earlier
        return view

    monkeypatch.setattr(perf_api, "view_for", another_thread_meanwhile)
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC).metrics["time_ms"] == 0.5
    _write(new, 0.1)
    assert perf_api.count_single_gemm([SPEC, {**SPEC, "m": 64}], backend="torch-cpu", gpu_key="Known CPU", db=db) == 1


def test_a_count_of_a_generator_retried_on_the_new_file_counts_every_spec(db, tmp_path, monkeypatch):
    """count_<table> takes any iterable of specs; a read retried on a file found replaced (as above) counted the
    generator the first read had used up: 0 missing, whatever the new file held. The specs are listed once."""
    new, real = _write(str(tmp_path / "new.db"), 0.5), perf_api.view_for

    def replaced_meanwhile(*args, **kwargs):
        view = real(*args, **kwargs)
        if os.path.exists(new):
            os.replace(new, db)  # after the lookup found the file standing, before its read
        return view

    monkeypatch.setattr(perf_api, "view_for", replaced_meanwhile)
    specs = (spec for spec in [SPEC, {**SPEC, "m": 64}, {**SPEC, "m": 128}])
    assert perf_api.count_single_gemm(specs, backend="torch-cpu", gpu_key="Known CPU", db=db) == 2
    assert not os.path.exists(new)  # the retry was met


def test_an_older_format_ledger_written_since_it_was_read_is_read_anew(db):
    """A reader of an older-format file reads an upgraded copy, the file as it was: once a writer has upgraded the
    file and added rows, the next call reads them (a simulator's process outlives many runs)."""
    env = lmdb.open(db, subdir=False, max_dbs=16)
    with env.begin(write=True) as txn:  # the file now says it is of the previous format (its views rebuild alike)
        txn.put(b"format_version", msgspec.msgpack.encode(3), db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    others = [{**SPEC, "m": m} for m in range(64, 264)]
    assert perf_api.count_single_gemm([SPEC, *others], backend="torch-cpu", gpu_key="Known CPU", db=db) == 200
    entry = effective_entry(lookup("single_gemm", "torch-cpu"))
    keys = KeyMaker(entry.table, entry.backend, "Known CPU", entry.contract, ShapeCodec(entry.args))
    stats = Stats(n=3, median=0.2, p10=0.2, p90=0.2, mean=0.2, stdev=0.0, cv=0.0, min=0.2, max=0.2)
    with Ledger.open(db) as led:  # a writer: upgrades the file in place, then appends
        led.append([measured(keys.provenance(s), {"time_ms": 0.2}, stats, Method(timer="cpu")) for s in others])
    assert perf_api.count_single_gemm([SPEC, *others], backend="torch-cpu", gpu_key="Known CPU", db=db) == 0
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **others[0]).metrics == {
        "time_ms": 0.2}


def test_a_lookup_reads_no_directory_and_a_link_pointed_elsewhere_is_read_anew(db, tmp_path, monkeypatch):
    """A lookup resolved the ledger's path (realpath: a system call per directory on the way) on every call, about a
    tenth of its time: only opening a ledger resolves it. A link to the ledger pointed at another file still reads
    that file, and a relative path the directory it names now."""
    link = tmp_path / "link.db"
    link.symlink_to(db)
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=str(link), **SPEC).metrics == {
        "time_ms": 0.1, "tflops": 1.0, "memory_bandwidth_gbps": 1.0, "energy_j": None}
    resolved = []
    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda *a, **k: resolved.append(a) or real(*a, **k))
    for _ in range(3):
        assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=str(link), **SPEC) is not None
    assert resolved == []
    link.unlink()
    link.symlink_to(_write(str(tmp_path / "other.db"), 0.5))
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=str(link),
                                    **SPEC).metrics["time_ms"] == 0.5
    (tmp_path / "sub").mkdir()
    _write(str(tmp_path / "sub" / "link.db"), 0.7)
    monkeypatch.chdir(tmp_path / "sub")
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db="link.db",
                                    **SPEC).metrics["time_ms"] == 0.7
    monkeypatch.chdir(tmp_path)
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db="link.db",
                                    **SPEC).metrics["time_ms"] == 0.5
    (tmp_path / "gone").mkdir()
    monkeypatch.chdir(tmp_path / "gone")
    (tmp_path / "gone").rmdir()  # a working directory removed: an absolute path is read as ever
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC) is not None


def test_the_gpu_key_of_this_machine_is_resolved_once_per_view(db, monkeypatch):
    calls = []
    monkeypatch.setattr(perf_api, "resolve_gpu_key", lambda entry, name, **_: calls.append(name) or "Known CPU")
    for _ in range(3):
        assert perf_api.get_single_gemm(backend="torch-cpu", db=db, **SPEC) is not None
    assert calls == [None]


def test_a_dangling_link_a_gpu_key_not_a_str_and_arguments_inside_a_spec_are_named(db, tmp_path):
    with pytest.raises(UsageError, match="GPU key 3 is not a GPU key; pass one as a non-empty str"):
        perf_api.get_single_gemm(backend="torch-cpu", gpu_key=3, db=db, **SPEC)
    os.symlink(tmp_path / "nothing.db", tmp_path / "link.db")
    with pytest.raises(LedgerError, match="is a symbolic link to nothing"):
        perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=str(tmp_path / "link.db"), **SPEC)
    with pytest.raises(SpecError, match='spec 0: field "backend" is not a KernelArgs field of single_gemm; pass '
                                        'backend= to count_single_gemm once, not in the specs'):
        perf_api.count_single_gemm([{**SPEC, "backend": "torch-cpu"}], backend="torch-cpu", db=db)


def test_every_db_that_names_no_ledger_is_a_ledger_path_error(db, tmp_path):
    """As the README says: nothing there, not a ledger (a directory among them) or db='' raise LedgerPathError, the
    one error a caller catches for a db that names no ledger (a directory and a dangling link were other LedgerErrors)."""
    os.symlink(tmp_path / "nothing.db", tmp_path / "link.db")
    (tmp_path / "notes.txt").write_text("not a ledger")
    for path in (str(tmp_path / "none.db"), str(tmp_path / "link.db"), str(tmp_path), str(tmp_path / "notes.txt"), ""):
        with pytest.raises(LedgerPathError):
            perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=path, **SPEC)
        with pytest.raises(LedgerPathError):
            api.scopes(path)


def test_gpu_name_as_kprof_api_spells_it_is_named_as_gpu_key(db):
    """get_<table> took gpu_name= (kprof.api's keyword) as a spec field and said only "use only {m, n, k, dtype}": the
    caller, dropping it, read this machine's GPU key instead of the one meant."""
    with pytest.raises(SpecError, match='field "gpu_name" is not a KernelArgs field of single_gemm; pass gpu_key= to '
                                        'get_single_gemm$'):
        perf_api.get_single_gemm(backend="torch-cpu", gpu_name="Known CPU", db=db, **SPEC)
    with pytest.raises(SpecError, match='field "gpu_name" is not a KernelArgs field of single_gemm; pass gpu_key= to '
                                        'count_single_gemm once, not in the specs'):
        perf_api.count_single_gemm([{**SPEC, "gpu_name": "Known CPU"}], backend="torch-cpu", db=db)


def test_the_cached_ledgers_are_closed_at_exit(db):
    """(An exit handler registered before perf_api's runs after it: it sees what perf_api left open.)"""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print(len(sys.modules['kprof.perf_api']._ledgers), 'held at exit'))\n"
              "from kprof import perf_api\n"
              "print(perf_api.count_single_gemm([dict(m=32, n=32, k=32, dtype='fp32')], backend='torch-cpu', "
              "gpu_key='Known CPU', db=sys.argv[1]))\n")
    done = subprocess.run([sys.executable, "-c", script, db], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "0\n0 held at exit\n"), done.stderr


@pytest.mark.parametrize("call, said", [
    (dict(backend="torch-cpu", timer="x"), "timer='x' is not one of cupti, events on any backend; "),
    (dict(backend="torch-cpu", timer="events"), "timer='events' applies to CUDA backends; "),
    (dict(backend="torch-cpu", power="loaded"), "omit power, or pass a CUDA backend"),
    (dict(backend="torch", gpu_key="NVIDIA H200", timer="bogus"), "timer='bogus' is not one of cupti, events; e.g. "
                                                                  "timer='cupti', or omit it"),
    (dict(backend="torch", gpu_key="NVIDIA H200", cuda_graph="yes"), "cuda_graph='yes' is not a bool; pass "
                                                                     "cuda_graph=True or cuda_graph=False"),
])
def test_a_bad_method_argument_is_named_as_the_python_keyword(db, call, said):
    """The method checks are shared with the verbs, whose messages name flags; a Python caller reads the keyword
    arguments it passed instead (no `--timer` in a message to code that has no command line)."""
    with pytest.raises(UsageError) as caught:
        perf_api.get_single_gemm(db=db, **call, **SPEC)
    assert said in str(caught.value) and "--" not in str(caught.value).split("`")[0]


def test_a_bad_spec_names_the_table_not_the_runners_struct(db):
    with pytest.raises(SpecError, match=r'field "dtype" is missing; a single_gemm spec needs \{m, n, k, dtype\}'):
        perf_api.count_single_gemm([{"m": 1, "n": 1, "k": 1}], backend="torch-cpu", db=db)
    with pytest.raises(SpecError, match='field "z" is not a KernelArgs field of single_gemm; use only'):
        perf_api.get_single_gemm(backend="torch-cpu", db=db, **SPEC, z=3)


def test_a_table_no_runner_registers_is_named_with_the_tables_there_are(db):
    """(perf_api.get_<typo> was Python's bare AttributeError, naming nothing that exists.)"""
    with pytest.raises(AttributeError, match=r"kprof.perf_api has no get_single_gem: no runner registers table "
                                             r"'single_gem'; its tables: all_gather, .*single_gemm \(see `kprof list`"):
        perf_api.get_single_gem
    with pytest.raises(AttributeError, match="no runner registers table 'gemm'"):
        perf_api.count_gemm
    assert not hasattr(perf_api, "no_such_name") and not hasattr(perf_api, "get_")


def test_a_table_registered_after_the_import_has_its_functions(db, monkeypatch):
    """(A runner module imported after kprof.perf_api registered its table, and perf_api.get_<table> of it was an
    AttributeError: the functions were made only at import.)"""
    from kprof.runners import registry

    entry = msgspec.structs.replace(lookup("single_gemm", "torch-cpu"), table="late_gemm")
    monkeypatch.setitem(registry.REGISTRY, ("late_gemm", "torch-cpu"), entry)
    try:
        assert perf_api.count_late_gemm([SPEC], backend="torch-cpu", gpu_key="Known CPU", db=db) == 1
        with pytest.raises(UnknownGpuKeyError, match="no late_gemm/torch-cpu rows for GPU key 'Known CPU'"):
            perf_api.get_late_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC)
    finally:  # the functions leave with the table
        vars(perf_api).pop("get_late_gemm", None), vars(perf_api).pop("count_late_gemm", None)


def test_the_run_an_unknown_gpu_key_names_measures_the_spec_looked_up(tmp_path, monkeypatch):
    """`get_memcpy(..., bytes=4096, db='team ledgers/p.db')` of a scope the ledger never held said to measure it "with
    `kprof run memcpy --backend torch-cpu --db 'team ledgers/p.db'`": no spec, a usage error as written ("no specs
    given"). The run names the spec looked up; pasted into a shell it measures it, and the lookup finds the row."""
    from kprof.measure.env import cpu_model

    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("KPROF_DB", raising=False)
    (tmp_path / "team ledgers").mkdir()
    path = _write(str(tmp_path / "team ledgers" / "p.db"), gpu_key=cpu_model())
    with pytest.raises(UnknownGpuKeyError) as err:
        perf_api.get_memcpy(backend="torch-cpu", gpu_key=cpu_model(), bytes=4096, db=path)
    command = str(err.value).split("measure them with `")[1].split("`")[0]
    bin_dir = tmp_path / "bin"  # `kprof` as the script runs it: this interpreter, this checkout
    bin_dir.mkdir()
    (bin_dir / "kprof").write_text(f"#!/bin/sh\nexec {sys.executable} -m kprof \"$@\"\n")
    (bin_dir / "kprof").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    assert perf_api.get_memcpy(backend="torch-cpu", gpu_key=cpu_model(), bytes=4096, db=path) is not None


def test_the_run_an_unknown_gpu_key_names_measures_under_the_thread_count_looked_up(tmp_path, monkeypatch):
    """A lookup under OMP_NUM_THREADS=3 set in the process (os.environ, as a simulator's script sets it) named `kprof
    run ... --spec S` without the variable: pasted in a shell without it, the run measured under the physical cores'
    count, and the lookup, under 3 threads, still found no row. The run names the thread count as the variable."""
    from kprof.measure.env import cpu_model

    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("KPROF_DB", raising=False)
    path = _write(str(tmp_path / "p.db"), gpu_key=cpu_model())
    with pytest.raises(UnknownGpuKeyError) as err:
        perf_api.get_memcpy(backend="torch-cpu", gpu_key=cpu_model(), bytes=4096, db=path)
    command = str(err.value).split("measure them with `")[1].split("`")[0]
    assert command.startswith("OMP_NUM_THREADS=3 kprof run memcpy"), command
    bin_dir = tmp_path / "bin"  # `kprof` as the script runs it: this interpreter, this checkout
    bin_dir.mkdir()
    (bin_dir / "kprof").write_text(f"#!/bin/sh\nexec {sys.executable} -m kprof \"$@\"\n")
    (bin_dir / "kprof").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # a shell without the variable
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    assert perf_api.get_memcpy(backend="torch-cpu", gpu_key=cpu_model(), bytes=4096, db=path) is not None


def test_ledgers_past_the_limit_are_closed_least_recently_read_first(tmp_path, monkeypatch):
    """A harness reading a ledger in each of its temporary directories: perf_api held every ledger it had read open
    (3 descriptors and a mapping each), removed or not, till the process ran out of descriptors. At most OPEN_LEDGERS
    stay open, the least recently read closed first; one closed so is opened again when next read."""
    monkeypatch.setattr(perf_api, "OPEN_LEDGERS", 2, raising=False)
    paths = [_write(str(tmp_path / f"{i}.db"), 0.1 * (i + 1)) for i in range(4)]
    get = perf_api.get_single_gemm
    try:
        for path in [paths[0], paths[1], paths[0], paths[2]]:
            assert get(backend="torch-cpu", gpu_key="Known CPU", db=path, **SPEC) is not None
        assert sorted(perf_api._ledgers) == [paths[0], paths[2]]  # paths[1], read longer ago than paths[0], closed
        assert get(backend="torch-cpu", gpu_key="Known CPU", db=paths[3], **SPEC) is not None
        assert sorted(perf_api._ledgers) == paths[2:]
        assert get(backend="torch-cpu", gpu_key="Known CPU", db=paths[0], **SPEC).metrics["time_ms"] == 0.1
        assert len(perf_api._ledgers) == 2
    finally:
        perf_api.close_all()


def test_a_ledger_read_meanwhile_is_not_closed_past_the_limit(tmp_path, monkeypatch):
    """A ledger whose rows a caller is still iterating stays open while others are opened past the limit."""
    monkeypatch.setattr(perf_api, "OPEN_LEDGERS", 1, raising=False)
    first, second = _write(str(tmp_path / "a.db")), _write(str(tmp_path / "b.db"), 0.5)
    try:
        rows = perf_api.view_for("single_gemm", "torch-cpu", "Known CPU", first).rows()
        next(rows, None)  # a read begun, not finished
        assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=second, **SPEC).metrics[
            "time_ms"] == 0.5
        assert list(rows) == [] and first in perf_api._ledgers  # it ends as it began
    finally:
        perf_api.close_all()


def test_a_ledger_whose_file_is_gone_is_closed_before_one_read_longer_ago(tmp_path, monkeypatch):
    """Past the limit, the ledger of a removed file (whose views answer for no file at the path) is closed first; a
    live one read longer ago, whose views a caller may hold, stays open."""
    monkeypatch.setattr(perf_api, "OPEN_LEDGERS", 2, raising=False)
    paths = [_write(str(tmp_path / f"{i}.db")) for i in range(3)]
    try:
        for path in paths[:2]:
            perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=path, **SPEC)
        os.remove(paths[1])
        perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=paths[2], **SPEC)
        assert sorted(perf_api._ledgers) == [paths[0], paths[2]]
    finally:
        perf_api.close_all()


def test_a_damaged_ledger_s_error_names_that_ledger_in_its_kprof_audit(tmp_path, monkeypatch):
    """kprof.api and perf_api raised "run `kprof audit` for the full report" for a damaged ledger given as db=: run as
    said, that audits $KPROF_DB or ./profile.db, another file (the verbs add the --db typed; the Python API did not).
    It names the ledger given, quoted for a shell; the ledger `kprof audit` alone reads is left as it was."""
    os.mkdir(tmp_path / "team ledgers")
    db = _write(str(tmp_path / "team ledgers" / "p.db"))
    with Ledger.open(db) as ledger, ledger.read() as txn:
        key, value = next(iter(txn.cursor(ledger.dbs["current"])))
    with Ledger.open(db) as ledger:
        ledger.write(lambda txn: txn.put(key, value[:-1] + bytes([value[-1] ^ 1]), db=ledger.dbs["current"]))
    monkeypatch.delenv("KPROF_DB", raising=False)
    calls = [lambda: api.query("single_gemm", "torch-cpu", [SPEC], gpu_name="Known CPU", db=db),
             lambda: api.count_missing("single_gemm", "torch-cpu", [SPEC], gpu_name="Known CPU", db=db),
             lambda: perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC),
             lambda: perf_api.count_single_gemm([SPEC], backend="torch-cpu", gpu_key="Known CPU", db=db)]
    try:
        for call in calls:
            with pytest.raises(IntegrityError) as raised:
                call()
            assert f"run `kprof audit --db '{db}'` for the full report" in str(raised.value)
        monkeypatch.setenv("KPROF_DB", db)
        with pytest.raises(IntegrityError, match="; run `kprof audit` for the full report"):
            api.query("single_gemm", "torch-cpu", [SPEC], gpu_name="Known CPU")
    finally:
        perf_api.close_all()
