"""The local pool, end to end on the CPU: `kprof run` with two spawned workers (KPROF_CPU_WORKERS=2) measuring the
pool tests' runner (faulty_runner.py beside this file): a worker killed mid-spec, a hung one, concurrent runs
on one ledger, and a spec that needs more GPUs than are usable."""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kprof.ledger import Ledger

HERE = os.path.dirname(os.path.abspath(__file__))


def _env(tmp_path, **extra):
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([HERE, env.get("PYTHONPATH", "")]), KPROF_RUNNERS="faulty_runner",
               KPROF_CPU_WORKERS="2", KPROF_TIME_BUDGET_S="0.02", KPROF_DB=str(tmp_path / "p.db"))
    env.update(extra)
    return env


def _specs(*acts, start=1000):
    return json.dumps([{"n": start + i, "act": a} for i, a in enumerate(acts)])


def _run(tmp_path, specs, *args, wait=True, start_new_session=False, **env):
    path = tmp_path / f"specs-{len(list(tmp_path.glob('specs-*')))}.json"
    path.write_text(specs)
    cmd = [sys.executable, "-m", "kprof", "run", "faulty", "--backend", "cpu", "--specs", str(path), "--json", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path, **env),
                         cwd=tmp_path, start_new_session=start_new_session)
    return _finish(p) if wait else p


def _finish(p):
    out, err = p.communicate(timeout=180)
    return p.returncode, (json.loads(out) if out.strip() else None), err


def _events(tmp_path) -> list:
    with Ledger.open(str(tmp_path / "p.db"), readonly=True) as led, led.read() as txn:
        return [eid for _seq, eid, _data in led.iter_log(txn)]


def _by_n(doc):
    return {r["spec"]["n"]: r for r in doc["results"]}


@pytest.mark.slow
def test_two_workers_measure_every_spec_and_say_where(tmp_path):
    code, doc, err = _run(tmp_path, _specs(*["ok"] * 6))
    assert code == 0, err
    assert doc["missing_count"] == 0 and len(_events(tmp_path)) == 6
    assert "devices: cpu0, cpu1" in err
    code, doc, err = _run(tmp_path, _specs(*["ok"] * 6))  # all there: nothing measured, no worker started
    assert code == 0 and len(_events(tmp_path)) == 6 and "devices" not in err


@pytest.mark.slow
def test_a_worker_killed_mid_spec_fails_only_that_spec(tmp_path):
    code, doc, err = _run(tmp_path, _specs("ok", "ok", "die", "ok", "ok", "ok", "ok"))
    assert code == 1, err
    rows = _by_n(doc)
    assert rows[1002]["status"] == "error" and rows[1002]["error"]["kind"] == "crash"
    assert "died (exit code -9)" in rows[1002]["error"]["message"]
    assert all(rows[n]["status"] == "ok" for n in rows if n != 1002)  # the rest went to a fresh worker
    assert len(_events(tmp_path)) == 7  # six measured, one failed: nothing finished was lost
    code, doc, _ = _run(tmp_path, _specs("ok", "ok", "ok", "ok", "ok", "ok", "ok"))
    assert code == 0 and _by_n(doc)[1002]["status"] == "ok"  # the failed row is measured again, and kept


@pytest.mark.slow
def test_a_hung_worker_is_killed_and_its_spec_fails_as_timeout(tmp_path):
    started = time.monotonic()
    code, doc, err = _run(tmp_path, _specs("hang", "ok", "ok", "ok"), KPROF_SPEC_TIMEOUT_S="4")
    assert code == 1, err
    rows = _by_n(doc)
    assert rows[1000]["error"]["kind"] == "timeout" and "KPROF_SPEC_TIMEOUT_S" in rows[1000]["error"]["message"]
    assert all(rows[n]["status"] == "ok" for n in (1001, 1002, 1003))
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_worker_that_hangs_after_delivering_its_row_is_replaced_and_the_row_kept(tmp_path):
    """A worker whose row came, then hung before it said it was idle (a runner's teardown), still counted as
    measuring past KPROF_SPEC_TIMEOUT_S: the run ended in a TypeError traceback. The row is kept, and the worker,
    bounded from its row on, is killed and replaced for the rest."""
    code, doc, err = _run(tmp_path, _specs("linger", "ok"), KPROF_CPU_WORKERS="1", KPROF_POOL="on",
                          KPROF_SPEC_TIMEOUT_S="6")
    assert code == 0 and "Traceback" not in err, err
    assert all(r["status"] == "ok" for r in doc["results"]) and len(_events(tmp_path)) == 2


@pytest.mark.slow
def test_ctrl_c_of_a_run_with_workers_is_one_line_and_keeps_every_row(tmp_path):
    """Ctrl-C reaches the whole process group: the parent says what the interrupt left; the workers, which the
    parent stops, print nothing (a traceback per worker before)."""
    import signal

    p = _run(tmp_path, _specs(*["slow"] * 12), wait=False, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not os.path.exists(tmp_path / "p.db") or len(_events(tmp_path)) < 2):
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGINT and out == "", err  # ended by SIGINT, as a shell tool: a shell reads 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted (Ctrl-C): every row stored before it stays in the ledger" in err
    kept = len(_events(tmp_path))
    assert 2 <= kept < 12
    code, doc, _ = _run(tmp_path, _specs(*["slow"] * 12))  # the rest, and only the rest, is measured
    assert code == 0 and len(_events(tmp_path)) == 12


@pytest.mark.slow
def test_a_worker_that_always_dies_is_given_up_and_the_rest_fail_without_loss(tmp_path):
    code, doc, err = _run(tmp_path, _specs("die", "die", "die", "die", "ok", "ok"), KPROF_CPU_WORKERS="1",
                          KPROF_POOL="on")
    assert code == 1
    rows = _by_n(doc)
    assert all(r["status"] == "error" and r["error"]["kind"] == "crash" for r in rows.values())
    assert "given up" in err and len(_events(tmp_path)) == 6
    assert "went to a fresh worker" in rows[1002]["error"]["message"]
    last = rows[1003]["error"]["message"]  # the fourth death: no fresh worker took the rest
    assert "went to a fresh worker" not in last and "cpu0 was given up (its worker died" in last, last


@pytest.mark.slow
def test_a_fresh_worker_that_does_not_start_is_given_up_within_the_start_limit(tmp_path):
    """The worker that takes over from one that died hung in its start: the run waited for it forever (the start
    limit was kept only for the workers a pool starts with); it is given up, and what is left fails saying why. The
    limit is the least (10 s) or, where a worker starts slower on this host (a loaded one), three whole runs of one
    worker timed here: the first worker must start within it."""
    timed = time.monotonic()
    code, _doc, err = _run(tmp_path, _specs("ok"), KPROF_CPU_WORKERS="1", KPROF_POOL="on",
                           KPROF_DB=str(tmp_path / "timed.db"))
    assert code == 0, err
    limit = max(10, math.ceil(3 * (time.monotonic() - timed)))
    p = _run(tmp_path, _specs("die", "ok"), wait=False, start_new_session=True, KPROF_CPU_WORKERS="1",
             KPROF_POOL="on", KPROF_WORKER_START_S=str(limit), FAULTY_HANG_START=str(tmp_path / "hang"))
    try:
        code, doc, err = _finish(p)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert code == 1, err
    rows = _by_n(doc)
    assert rows[1000]["error"]["kind"] == "crash" and "died" in rows[1000]["error"]["message"]
    assert rows[1001]["error"]["kind"] == "crash"
    assert f"did not start within {limit} s (KPROF_WORKER_START_S)" in rows[1001]["error"]["message"]
    assert f"cpu0 given up: did not start within {limit} s" in err and len(_events(tmp_path)) == 2


@pytest.mark.slow
def test_a_run_waiting_for_a_key_whose_worker_crashed_in_the_other_run_reads_its_failure(tmp_path):
    """Run B waited for the keys run A held; A's worker died on one (a failed row), and B measured that key again:
    a second crash and a second failed event of one key. B reads A's failure, as it reads A's ok rows. (A gate, not
    a head start in seconds, keeps A's keys held while B claims: on a loaded host B's worker started after A ended.)"""
    gate = tmp_path / "gate"  # A's first spec waits for it: B takes its claims while A holds every key, however slow
    env = dict(KPROF_CPU_WORKERS="1", KPROF_POOL="on", FAULTY_GATE=str(gate))

    def claimed(but=()):  # a run's claim file that holds keys: it has taken them
        found = [f for f in tmp_path.glob("p.db-claims/*.claim") if f.name not in but and f.stat().st_size]
        return found[0].name if found else None

    def until(what):
        deadline = time.monotonic() + 120
        while (found := what()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    first = _run(tmp_path, _specs("gate", "die"), wait=False, **env)
    a = until(claimed)  # A holds both keys
    second = _run(tmp_path, _specs("gate", "die", "ok"), wait=False, **env)
    assert until(lambda: claimed(but=(a,))), "B took no key"  # B claimed its own key: it found A's two held
    gate.touch()
    code_a, _doc_a, err_a = _finish(first)
    code_b, doc_b, err_b = _finish(second)
    assert code_a == 1 and code_b == 1, err_a + err_b
    assert "2 spec(s) another run was measuring were waited for" in err_b, err_b
    assert _by_n(doc_b)[1001]["status"] == "failed"  # A's failure, read
    assert len(_events(tmp_path)) == 3  # A's ok row and failure, B's own row: each key measured once


@pytest.mark.slow
def test_a_run_waiting_for_keys_another_run_measures_says_so(tmp_path):
    """A run whose specs another run holds waits for them, and said nothing while it did: a second `kprof run` of a
    long fill's specs sat silent (no progress: it measured nothing) for as long as the first took, as if hung."""
    gate = tmp_path / "gate"
    env = dict(KPROF_CPU_WORKERS="1", KPROF_POOL="on", FAULTY_GATE=str(gate))
    first = _run(tmp_path, _specs("gate"), wait=False, **env)
    deadline = time.monotonic() + 120
    while not any(f.stat().st_size for f in tmp_path.glob("p.db-claims/*.claim")) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _run(tmp_path, _specs("gate", "ok"), wait=False, **env)
    deadline = time.monotonic() + 120  # its own spec measured, it waits for the other's: then the gate opens
    while len(_events(tmp_path) if (tmp_path / "p.db").exists() else []) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    gate.touch()
    (code_a, _doc_a, err_a), (code_b, doc_b, err_b) = _finish(first), _finish(second)
    assert (code_a, code_b) == (0, 0), err_a + err_b
    assert f"waiting: another run on {tmp_path / 'p.db'} is measuring 1 of these spec(s); each is read once that " \
           f"run stores it" in err_b, err_b
    assert "waiting" not in err_a and len(_events(tmp_path)) == 2


@pytest.mark.slow
def test_concurrent_runs_on_one_ledger_measure_each_key_once(tmp_path):
    specs = _specs(*["slow"] * 8)
    first = _run(tmp_path, specs, wait=False)
    time.sleep(0.3)
    second = _run(tmp_path, specs, wait=False)
    (c1, d1, e1), (c2, d2, e2) = _finish(first), _finish(second)
    assert (c1, c2) == (0, 0), (e1, e2)
    assert len(_events(tmp_path)) == 8  # 8 keys, 8 events: no key measured twice
    assert d1["view_root"] == d2["view_root"]
    assert d1["missing_count"] == d2["missing_count"] == 0


def test_a_dead_runs_claims_expire(tmp_path):
    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    code = ("import sys, os, signal; from kprof.runners.claims import Claims; c = Claims(sys.argv[1], 'dead').__enter__();"
            "c.take([b'k1', b'k2']); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", code, db], check=False)
    assert os.path.exists(f"{db}-claims/dead.claim")
    with Claims(db, "live") as live:
        mine, held = live.take([b"k1", b"k3"])
        assert (mine, held) == ([b"k1", b"k3"], {})  # the killed holder's claim expired with it
        assert not os.path.exists(f"{db}-claims/dead.claim")
        with Claims(db, "other") as other:
            assert other.take([b"k1", b"k4"]) == ([b"k4"], {b"k1": "live"})
    with Claims(db, "after") as after:
        assert after.take([b"k1"]) == ([b"k1"], {})  # released when its run ended


def test_a_run_ending_while_another_reads_its_claims_is_read_past(tmp_path, monkeypatch):
    """A run ends its claims by removing its file and closing it, outside the directory lock: another run that had
    opened the file found it unlocked, took its holder for dead and removed it too, which failed (the file was
    gone), and that run stopped with "cannot use <ledger>-claims: ...: No such file or directory" (exit 2)."""
    import fcntl

    from kprof.runners import claims as claims_module
    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    ending = Claims(db, "ending").__enter__()
    ending.take([b"k1"])
    real = fcntl.flock

    def flock(f, op):  # the run ends between another run's open of its file and its look at the file's lock
        if op == fcntl.LOCK_SH | fcntl.LOCK_NB and ending._own is not None:
            ending.release()
        return real(f, op)

    monkeypatch.setattr(claims_module.fcntl, "flock", flock)
    with Claims(db, "reader") as reader:
        assert reader.take([b"k1", b"k2"]) == ([b"k1", b"k2"], {})
    assert os.listdir(f"{db}-claims") == ["lock"]


def test_claim_rounds_wait_for_held_keys_and_drop_what_is_no_longer_wanted(tmp_path, monkeypatch):
    """A round yields the specs this run claimed and still wants; a key another run holds comes back in a later
    round once it is let go; a claimed key no longer wanted (stored by another run meanwhile) has its claim ended."""
    from kprof.runners import claims as claims_module
    from kprof.runners.claims import Claims

    monkeypatch.setattr(claims_module, "WAIT_S", 0.0)
    db = str(tmp_path / "p.db")
    keys = [b"k0", b"k1", b"k2"]
    rows = [SimpleNamespace(status="failed", event_id=b"e%d" % i) for i in range(3)]
    with Claims(db, "other") as other, Claims(db, "this") as this:
        other.take([b"k0"])
        rounds = this.rounds([0, 1, 2], keys, lambda: rows, lambda i, row: i != 2)
        assert next(rounds) == ([1], rows, {b"k0": "other"})
        assert this.claimed == {b"k1"}  # k2 was claimed, not wanted, and let go
        other.drop([b"k0"])
        assert next(rounds) == ([0], rows, {})  # its holder stored nothing: measured here
        assert next(rounds, None) is None


def test_a_failure_another_run_stored_since_this_run_began_is_its_answer_held_or_not(tmp_path):
    """Two runs of a spec that fails (an oom row), the second taking its key after the first had stored the failure
    and ended: the second measured it again, a second failed event of one key (where it had waited for the key, the
    failure was its answer). A row of the key's own stored since the run began is its answer either way; a failure
    there when the run began is measured again, as jit asks."""
    from kprof.runners.claims import Claims, rounds

    db = str(tmp_path / "p.db")
    before = [None, SimpleNamespace(status="failed", event_id=b"f1"), SimpleNamespace(status="stale", event_id=b"s")]
    now = [SimpleNamespace(status="failed", event_id=b"f0"), before[1], before[2]]
    with Claims(db, "this") as this:
        assert list(rounds(this, [0, 1, 2], [b"k0", b"k1", b"k2"], lambda: now, "jit", before)) == [([1, 2], now, {})]


def test_a_forced_key_another_run_measured_since_this_run_began_is_not_measured_again(tmp_path):
    """Two `run --force` of specs without rows, the second started as the first ended (its rows stored before the
    second took a key): the second measured every key again, two events a key, where a key that had a row when it
    began was left to the other run's new row (the refresh asked for). A row of the key's own stored since the run
    began, where it had none or only a stale one, is the refresh asked for too; one there when it began is not."""
    from kprof.runners.claims import Claims, rounds

    db = str(tmp_path / "p.db")
    before = [None, SimpleNamespace(status="stale", event_id=b"old"), SimpleNamespace(status="ok", event_id=b"e2")]
    now = [SimpleNamespace(status="ok", event_id=b"n0"), SimpleNamespace(status="failed", event_id=b"n1"),
           SimpleNamespace(status="ok", event_id=b"e2")]
    with Claims(db, "this") as this:
        assert list(rounds(this, [0, 1, 2], [b"k0", b"k1", b"k2"], lambda: now, "force", before)) == [([2], now, {})]
        assert this.claimed == {b"k2"}  # the others' claims ended at once


def test_a_held_key_whose_holder_stored_a_failure_is_not_measured_again(tmp_path, monkeypatch):
    """Two runs of one spec whose worker crashes: the second waited for the first, then measured the key again
    (another crash, a second failed event), though concurrent runs never measure a key twice. The row the holder
    stored since this run began, a failure too, is its answer."""
    from kprof.runners import claims as claims_module
    from kprof.runners.claims import Claims, rounds

    monkeypatch.setattr(claims_module, "WAIT_S", 0.0)
    db = str(tmp_path / "p.db")
    before = [None, SimpleNamespace(status="stale", event_id=b"old")]
    now = [SimpleNamespace(status="failed", event_id=b"new"), SimpleNamespace(status="failed", event_id=b"new1")]
    with Claims(db, "other") as other, Claims(db, "this") as this:
        other.take([b"k0", b"k1"])
        rounds = rounds(this, [0, 1], [b"k0", b"k1"], lambda: before if other.claimed else now, "jit", before)
        assert next(rounds) == ([], before, {b"k0": "other", b"k1": "other"})
        other.drop([b"k0", b"k1"])
        assert next(rounds) == ([], now, {})  # both read, neither measured
        assert this.claimed == set() and next(rounds, None) is None


def test_a_claim_file_is_made_and_locked_under_the_directory_lock(tmp_path):
    """Another run cleaning up dead runs' files holds the directory lock: a claim file made outside it, and not yet
    locked, would be taken for a dead run's and removed, and its run's keys measured twice."""
    import fcntl
    import threading

    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    os.makedirs(f"{db}-claims")
    entered = threading.Event()
    claims = Claims(db, "new")
    with open(f"{db}-claims/lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent run in _held_by_others
        thread = threading.Thread(target=lambda: (claims.__enter__(), entered.set()))
        thread.start()
        assert not entered.wait(0.5)  # waits for the directory lock
        assert not os.path.exists(f"{db}-claims/new.claim")
    thread.join(10)
    assert entered.is_set() and os.path.exists(f"{db}-claims/new.claim")
    claims.release()


def test_a_claims_directory_that_cannot_be_made_is_a_usage_error(tmp_path):
    from kprof.errors import UsageError
    from kprof.runners.claims import Claims

    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match="cannot make .*-claims"):
        Claims(str(tmp_path / "f" / "p.db"), "r").__enter__()


def test_a_spec_needing_more_gpus_than_usable_fails_and_nothing_else_is_lost(tmp_path, monkeypatch):
    import kprof.runners.fill as fill
    from kprof import api
    from kprof.runners.devices import Device, Devices

    sys.path.insert(0, HERE)
    monkeypatch.setenv("KPROF_RUNNERS", "faulty_runner")
    monkeypatch.setattr("kprof.runners.registry.REGISTRY", {})
    monkeypatch.setattr(fill, "usable_devices", lambda entry, key: Devices(
        [Device("gpu0", "GPU-x")], None, [{"gpu": "gpu1", "uuid": "GPU-y", "name": "", "why": "1 compute process(es)"}],
        True))
    monkeypatch.setattr("kprof.api.resolve_gpu_key", lambda entry, name, measures=False: "NVIDIA H200")
    try:
        res = api.run("faulty_gpu", "cuda2", [{"n": 5, "act": "ok"}, {"n": 6, "act": "ok"}], db=str(tmp_path / "p.db"))
    finally:
        sys.path.remove(HERE)
    assert res.exit_code == 1 and res.measured == 0
    assert [r["error"] for r in res.results] == [{"kind": "unavailable", "message": "need 2 idle GPU(s), found 1 "
                                                  "(gpu1: 1 compute process(es))"}] * 2
    assert not os.path.exists(tmp_path / "p.db")  # nothing measured, nothing written


def test_forced_gpus_bypass_the_guard_and_bad_values_are_named(monkeypatch):
    from kprof.errors import UsageError
    from kprof.measure import nvml
    from kprof.runners import devices
    from kprof.runners.registry import lookup

    entry = lookup("single_gemm", "torch")
    busy = nvml.GpuState(0, "GPU-a", "NVIDIA H200", 2, 9000.0, 99.0, "2 compute process(es)")
    idle = nvml.GpuState(1, "GPU-b", "NVIDIA H200", 0, 500.0, 0.0)
    other = nvml.GpuState(2, "GPU-c", "NVIDIA A100", 0, 500.0, 0.0)
    monkeypatch.setattr(nvml, "gpu_inventory", lambda *a, **k: [busy, idle, other])
    monkeypatch.delenv("KPROF_PROFILE_GPUS", raising=False)
    monkeypatch.delenv("VIBESIM_PROFILE_GPUS", raising=False)
    d = devices.usable_devices(entry, "NVIDIA H200")
    assert d.devices == [devices.Device("gpu1", "GPU-b")] and d.guarded and d.forced is None
    assert [s["gpu"] for s in d.skipped] == ["gpu0", "gpu2"] and "compute process" in d.skipped[0]["why"]
    assert "not a NVIDIA H200" in d.skipped[1]["why"]
    monkeypatch.setenv("VIBESIM_PROFILE_GPUS", "0,1")
    d = devices.usable_devices(entry, "NVIDIA H200")
    assert d.devices == [devices.Device("gpu0", "GPU-a"), devices.Device("gpu1", "GPU-b")]
    assert d.forced == "VIBESIM_PROFILE_GPUS" and not d.guarded
    for bad in ("x", "0,0", "-1", "7"):
        monkeypatch.setenv("KPROF_PROFILE_GPUS", bad)
        with pytest.raises(UsageError, match="KPROF_PROFILE_GPUS"):
            devices.usable_devices(entry, "NVIDIA H200")


def test_a_spec_needing_n_gpus_runs_on_a_group_of_n():
    from kprof.runners.devices import Device, groups, need_of
    from kprof.runners.registry import lookup

    gpus = [Device(f"gpu{i}", f"GPU-{i}") for i in range(5)]
    assert groups(gpus, 1) == gpus
    assert groups(gpus, 2) == [Device("gpu0+gpu1", "GPU-0,GPU-1"), Device("gpu2+gpu3", "GPU-2,GPU-3")]
    assert groups(gpus, 8) == []
    entry = lookup("single_gemm", "torch")
    assert need_of(entry, {"m": 1}) == 1
    import msgspec

    comm = msgspec.structs.replace(entry, gpus_arg="world_size")
    assert need_of(comm, {"world_size": 4}) == 4
    assert need_of(msgspec.structs.replace(comm, device="cpu"), {"world_size": 4}) == 1  # CPU slots are not counted


def test_one_usable_device_of_this_process_is_measured_in_process():
    """auto mode spawns no worker for a run whose only usable device is this process's own (CUDA device 0, or one
    CPU slot) and whose specs need one device; a pool for any other device, for more devices, and for collectives
    on GPUs."""
    import msgspec

    from kprof.runners.devices import Device, Devices
    from kprof.runners.fill import _own_device
    from kprof.runners.registry import lookup

    gpu = lookup("single_gemm", "torch")
    cpu = lookup("single_gemm", "torch-cpu")
    specs = [{"m": 1}, {"m": 2}]
    one = Devices([Device("gpu0", "GPU-a")], None, [], True)
    assert _own_device(gpu, one, [0, 1], specs)
    assert not _own_device(gpu, Devices([Device("gpu1", "GPU-b")], None, [], True), [0, 1], specs)
    assert not _own_device(gpu, Devices([Device("gpu0", "GPU-a"), Device("gpu1", "GPU-b")], None, [], True), [0],
                           specs)
    assert _own_device(cpu, Devices([Device("cpu0", None)], None, []), [0, 1], specs)
    assert not _own_device(cpu, Devices([Device("cpu0", None), Device("cpu1", None)], None, []), [0, 1], specs)
    comm = msgspec.structs.replace(gpu, gpus_arg="world_size")  # an nccl collective: its ranks go to the pool
    assert not _own_device(comm, one, [0], [{"world_size": 1}])
    assert not _own_device(comm, one, [0], [{"world_size": 2}])


def test_cpu_workers_are_bounded_by_the_cores_and_by_the_specs(tmp_path, monkeypatch):
    """KPROF_CPU_WORKERS past the machine's cores is refused before anything is written (a huge value built a
    list of that many slots and hung); a run starts no more workers than it has specs."""
    from kprof import api
    from kprof.errors import UsageError
    from kprof.runners import devices, fill
    from kprof.runners.registry import lookup

    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    entry = lookup("single_gemm", "torch-cpu")
    for bad in ("3", "999999999999", "0", "two"):
        monkeypatch.setenv("KPROF_CPU_WORKERS", bad)
        with pytest.raises(UsageError, match=f"KPROF_CPU_WORKERS='{bad}' is not a whole number from 1 to this "
                                             f"machine's 2 core"):
            devices.usable_devices(entry, "cpu")
    monkeypatch.setenv("KPROF_CPU_WORKERS", "2")
    assert len(devices.usable_devices(entry, "cpu").devices) == 2
    started = []

    class Recording(fill.Pool):
        def __init__(self, entry, gpu_key, devices):
            started.append(list(devices))
            super().__init__(entry, gpu_key, devices)

    monkeypatch.setattr(fill, "Pool", Recording)
    monkeypatch.setenv("KPROF_POOL", "on")
    spec = {"m": 4, "n": 4, "k": 4, "dtype": "fp32"}
    res = api.run("single_gemm", "torch-cpu", [spec], db=str(tmp_path / "p.db"))
    assert res.exit_code == 0 and [len(d) for d in started] == [1]
    assert res.pool["devices"] == ["cpu0"]  # as the run says and job.meta.json records it: cpu1 was not used


def test_a_spec_time_limit_sends_the_specs_to_workers_and_is_kept(tmp_path, capsys, monkeypatch):
    """A CPU run is measured in the calling process, where no spec can be stopped: with KPROF_SPEC_TIMEOUT_S set
    it goes to a worker, which is killed past the limit (the spec fails as `timeout`); with KPROF_POOL=off as well
    it is refused before anything is written. (A hung spec: a limit under 1 s is refused.)"""
    from kprof.cli import main

    monkeypatch.syspath_prepend(HERE)  # the spawned worker gets this sys.path and imports KPROF_RUNNERS
    monkeypatch.setenv("KPROF_RUNNERS", "faulty_runner")
    monkeypatch.setattr("kprof.runners.registry.REGISTRY", {})
    monkeypatch.delitem(sys.modules, "faulty_runner", raising=False)
    db = str(tmp_path / "p.db")
    spec = '{"n": 1000, "act": "hang"}'
    monkeypatch.setenv("KPROF_SPEC_TIMEOUT_S", "1")
    monkeypatch.setenv("KPROF_POOL", "off")
    try:
        assert main(["run", "faulty", "--backend", "cpu", "--spec", spec, "--db", db]) == 2
        assert "KPROF_POOL=off" in capsys.readouterr().err and not os.path.exists(db)
        monkeypatch.delenv("KPROF_POOL")
        assert main(["run", "faulty", "--backend", "cpu", "--spec", spec, "--db", db, "--json"]) == 1
    finally:  # not left imported: a later KPROF_RUNNERS import into an empty registry must register it again
        sys.modules.pop("faulty_runner", None)
    out, err = capsys.readouterr()
    row = json.loads(out)["results"][0]
    assert row["error"]["kind"] == "timeout", row
    assert "in this process" not in err


def test_a_dropped_claim_is_read_per_run(tmp_path):
    """A run ends a claim by a line of its own file; a key another run claimed after it stays that run's."""
    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    with Claims(db, "first") as first, Claims(db, "second") as second, Claims(db, "third") as third:
        assert first.take([b"k1", b"k2"]) == ([b"k1", b"k2"], {})
        first.drop([b"k1"])
        assert second.take([b"k1", b"k2"]) == ([b"k1"], {b"k2": "first"})
        assert third.take([b"k1", b"k2"]) == ([], {b"k1": "second", b"k2": "first"})
        second.drop([b"k1"])
        first.take([b"k1"])  # claimed again after its own drop
        assert third.take([b"k1"]) == ([], {b"k1": "first"})


def test_two_names_of_one_ledger_share_its_claims(tmp_path, monkeypatch):
    """A run through a link to the ledger, or through a relative path, claims in the same place as a run through
    the file's own path: otherwise both would measure the same key."""
    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    os.symlink(db, tmp_path / "link.db")
    monkeypatch.chdir(tmp_path)
    with Claims(db, "first") as first, Claims("link.db", "second") as second:
        assert first.take([b"k1"]) == ([b"k1"], {})
        assert second.take([b"k1"]) == ([], {b"k1": "first"})
    assert not os.path.exists(tmp_path / "link.db-claims")


def test_a_live_claim_file_of_garbage_and_a_directory_named_as_a_claim_are_read_past(tmp_path):
    """A live run's claim file holding bytes that are not text, and a directory named `*.claim`, were an uncaught
    UnicodeDecodeError and IsADirectoryError in every other run's take (a traceback, exit 1): the garbage lines
    are skipped, the file's keys stay its run's, and the directory (no run's claims) is left alone."""
    import fcntl

    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    os.makedirs(f"{db}-claims/odd.claim")
    with open(f"{db}-claims/live.claim", "wb") as live:
        live.write(b"\xf9\xfe\x00garbage\n" + b"k1".hex().encode() + b"\n\xff\n")
        live.flush()
        fcntl.flock(live, fcntl.LOCK_EX)  # its run is alive
        with Claims(db, "mine") as mine:
            assert mine.take([b"k1", b"k2"]) == ([b"k2"], {b"k1": "live"})
    assert os.path.isdir(f"{db}-claims/odd.claim")


def test_a_pipe_in_the_claims_directory_is_read_past_or_refused(tmp_path):
    """A pipe named `*.claim` in the claims directory hung every run's take for good (its open waits for a writer):
    it is no run's claims, and is left alone. A pipe named `lock` hung every run's start: it is refused, named."""
    db = str(tmp_path / "p.db")
    os.makedirs(f"{db}-claims")
    os.mkfifo(f"{db}-claims/odd.claim")
    code = ("from kprof.runners.claims import Claims\nfrom kprof.errors import UsageError\ntry:\n"
            f"    with Claims({db!r}, 'mine') as c: print(c.take([b'k1']))\nexcept UsageError as e: print(e)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)  # where it waits
    assert p.returncode == 0 and p.stdout.strip() == "([b'k1'], {})", p.stderr
    assert os.path.exists(f"{db}-claims/odd.claim")
    os.unlink(f"{db}-claims/lock")
    os.mkfifo(f"{db}-claims/lock")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith(f"cannot use {db}-claims, where concurrent runs"), p.stderr
    assert f"fix or remove {db}-claims/lock" in p.stdout


def test_a_claims_directory_that_goes_mid_run_is_one_usage_error(tmp_path):
    """`<db>-claims` replaced by a file (or made unreadable) while a run holds claims: take and drop raised an
    uncaught OSError (a traceback); now one UsageError naming it, and the run's end does not raise again."""
    import shutil

    from kprof.errors import UsageError
    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    claims = Claims(db, "r").__enter__()
    claims.take([b"k1"])
    shutil.rmtree(f"{db}-claims")
    (tmp_path / "p.db-claims").write_text("")
    for call in (lambda: claims.take([b"k2"]), lambda: claims.drop([b"k1"])):
        with pytest.raises(UsageError, match=r"cannot use .*p\.db-claims, where concurrent runs .*: .*p\.db-claims"
                                             r"/lock: Not a directory; fix or remove"):
            call()
    claims.release()


@pytest.mark.slow
def test_a_run_waiting_for_a_key_holds_none_it_has_stored(tmp_path):
    """Run X stores its key, then waits for a key run Y holds while Y waits for X's: X's stored key is no longer
    claimed (it used to stay claimed until X ended, so the two runs waited for each other for ever)."""
    from kprof.ledger import KeyMaker, ShapeCodec
    from kprof.measure.env import cpu_model
    from kprof.method import effective_entry
    from kprof.runners.claims import Claims
    from kprof.runners.registry import lookup

    db = str(tmp_path / "p.db")
    entry = effective_entry(lookup("single_gemm", "torch-cpu"))
    keys = KeyMaker(entry.table, entry.backend, cpu_model(), entry.contract, ShapeCodec(entry.args))
    specs = [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}, {"m": 16, "n": 8, "k": 8, "dtype": "fp32"}]
    k1, k2 = (keys.key(entry.args(**s)) for s in specs)
    env = dict(os.environ, KPROF_TIME_BUDGET_S="0.02", KPROF_DB=db)
    with Claims(db, "y") as y:
        assert y.take([k2]) == ([k2], {})
        x = subprocess.Popen([sys.executable, "-m", "kprof", "run", "single_gemm", "--backend", "torch-cpu",
                              "--spec", json.dumps(specs[0]), "--spec", json.dumps(specs[1]), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and x.poll() is None and not (os.path.exists(db) and _events(tmp_path)):
            time.sleep(0.1)
        while time.monotonic() < deadline and x.poll() is None and y.take([k1])[1]:  # taken only once k1 is stored
            time.sleep(0.1)
        assert x.poll() is None  # x waits for k2 ...
        assert len(_events(tmp_path)) == 1 and y.take([k1])[1] == {}  # ... holding no claim on the k1 it stored
        y.drop([k1])
    out, err = x.communicate(timeout=120)  # y ended without measuring k2: x measures it
    assert x.returncode == 0, err
    assert json.loads(out)["missing_count"] == 0 and len(_events(tmp_path)) == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_claim_a_full_disk_refuses_is_a_usage_error_and_other_runs_read_past_it(tmp_path):
    """A full disk used to be an OSError traceback from the claim file's flush (and again from its close); a run
    reading a claim file a full disk cut short mid-line skips that line."""
    from kprof.errors import UsageError
    from kprof.runners.claims import Claims

    db = str(tmp_path / "p.db")
    with Claims(db, "other") as other, Claims(db, "full") as full:
        other.take([b"k1"])
        other._own.write("-k")  # a line cut short
        other._own.flush()
        full._own.close()
        full._own = open("/dev/full", "a")  # every write: No space left on device
        with pytest.raises(UsageError, match=r"cannot record this run's claims in .*full\.claim \(No space left"):
            full.take([b"k2"])
        assert full.claimed == set()
    assert not os.path.exists(f"{db}-claims/full.claim")


@pytest.mark.slow
def test_a_pool_run_leaves_no_temporary_directory(tmp_path):
    """Each worker's segment was merged with a new empty temporary directory for a conflict report, never removed:
    one left in the temporary directory per spec measured."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code, doc, err = _run(tmp_path, _specs(*["ok"] * 4), TMPDIR=str(tmp))
    assert code == 0 and doc["missing_count"] == 0, err
    assert [n for n in os.listdir(tmp) if n.startswith("kprof-")] == []


@pytest.mark.slow
def test_workers_of_a_killed_run_end_quietly_and_leave_no_segment(tmp_path):
    """SIGKILL of the run: its workers, finding no parent to send their next event to, printed a BrokenPipeError
    traceback each on the run's stderr and left the spool of segments in the temporary directory."""
    import signal

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = _run(tmp_path, _specs(*["slow"] * 12), wait=False, TMPDIR=str(tmp))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not os.path.exists(tmp_path / "p.db") or len(_events(tmp_path)) < 2):
        time.sleep(0.2)
    p.kill()
    _out, err = p.communicate(timeout=60)  # the workers hold its stderr until they end
    assert p.returncode == -signal.SIGKILL
    assert "Traceback" not in err, err
    assert os.listdir(tmp) == []


@pytest.mark.slow
def test_a_worker_inside_a_hung_spec_ends_when_its_run_is_killed(tmp_path):
    """SIGKILL of the run (the OOM killer, a job's kill) while a worker was inside a spec that hangs: the worker only
    looked for its parent when it next used the pipe, so it lived on, orphaned, holding its device for as long as the
    spec took (an hour here). It now watches its parent and ends within a second of it, leaving no spool."""
    import signal

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = _run(tmp_path, _specs("ok", "ok", "hang", "hang"), wait=False, TMPDIR=str(tmp))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not os.path.exists(tmp_path / "p.db") or len(_events(tmp_path)) < 2):
        time.sleep(0.2)
    time.sleep(1.0)  # each worker is inside its `hang` spec
    p.kill()
    _out, err = p.communicate(timeout=30)  # the workers hold its stderr until they end: an hour before
    assert p.returncode == -signal.SIGKILL
    assert "Traceback" not in err, err
    assert os.listdir(tmp) == []


def test_a_worker_whose_spool_another_worker_removed_writes_no_segment_beside_it(tmp_path, monkeypatch):
    """The run killed, one worker ended first and removed the (empty) spool; another, about to write its next event,
    found no directory there and wrote its segment beside it in TMPDIR, as a file named like the spool (or left its
    temporary `.kseg-*.part` there, ended mid-write). A segment is named inside the spool: the write fails, the
    worker ends quietly and nothing is left."""
    import multiprocessing

    import msgspec

    from kprof.measure.env import cpu_model
    from kprof.runners import pool
    from kprof.runners.chunk import Chunk
    from kprof.runners.registry import lookup

    entry = lookup("rms_norm", "torch-cpu")
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the worker ignores Ctrl-C; this process must not
    monkeypatch.setattr(pool, "watch_parent", lambda **k: None)
    parent, child = multiprocessing.Pipe()
    parent.send(Chunk.of(entry, cpu_model(), [{"tokens": 1, "hidden": 64, "dtype": "fp32"}]).encode())
    parent.send(None)
    spool = tmp_path / "spool"  # removed (never made, here) before the worker writes
    pool._worker_main(child, None, entry.table, entry.backend, msgspec.msgpack.encode(entry.contract), cpu_model(),
                      str(spool))
    got = []
    while parent.poll():
        got.append(parent.recv())
    assert [m[0] for m in got] == ["ready"] and os.listdir(tmp_path) == []


def test_an_interrupt_while_a_segment_merges_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) while a worker's segment was merged left the temporary directory made for a conflict's
    report behind: one `kprof-*` directory per interrupted run."""
    import tempfile

    from kprof import api
    from kprof.merge import merge as merge_module

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("KPROF_POOL", "on")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(merge_module, "merge_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        api.run("single_gemm", "torch-cpu", [{"m": 4, "n": 4, "k": 4, "dtype": "fp32"}], db=str(tmp_path / "p.db"))
    assert os.listdir(tmp) == []


def test_an_interrupt_while_the_workers_start_stops_them_at_once(monkeypatch):
    """Ctrl-C while the workers prepared their devices: each was asked to stop and waited for (up to 10 s) until it
    had finished starting; a worker that measured nothing is killed."""
    import signal

    from kprof.runners import pool as pool_module
    from kprof.runners.devices import Device
    from kprof.runners.registry import lookup

    made = []

    class Recorded(pool_module._Worker):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    def interrupted(self, timeout, on_event):
        raise KeyboardInterrupt

    monkeypatch.setattr(pool_module, "_Worker", Recorded)
    monkeypatch.setattr(pool_module.Pool, "_poll", interrupted)
    pool = pool_module.Pool(lookup("single_gemm", "torch-cpu"), "cpu", [Device("cpu0", None), Device("cpu1", None)])
    with pytest.raises(KeyboardInterrupt):
        pool.__enter__()
    assert [w.process.exitcode for w in made] == [-signal.SIGKILL] * 2


def test_workers_refusing_a_gpu_of_another_model_say_it_in_the_words_of_the_verbs():
    """KPROF_PROFILE_GPUS naming A100s on a host whose device 0 (the key's) is an H200: every worker refuses with
    the device's SettingError, and the run said "no worker could prepare its device (gpu1: SettingError: ... or omit
    gpu_name=)", the Python wording, to `kprof run`. The refusal all workers gave is raised as it was, both ways."""
    from kprof.errors import SettingError
    from kprof.runners import pool as pool_module
    from kprof.runners.devices import Device
    from kprof.runners.registry import lookup

    class Refused:
        def __init__(self, label):
            self.device, self.state, self.refusal = Device(label, None), "starting", None

        def stop(self, kill=False):
            pass

    error = SettingError("GPU key 'NVIDIA H200' differs from CUDA device 0 ('NVIDIA A100'); ... or omit gpu_name=",
                         "GPU key 'NVIDIA H200' differs from CUDA device 0 ('NVIDIA A100'); ... or omit --gpu-name")
    pool = pool_module.Pool(lookup("single_gemm", "torch-cpu"), "cpu", [])
    try:
        pool.workers = [Refused("gpu1"), Refused("gpu2")]
        for w in pool.workers:  # as each worker's message reads (kprof.runners.pool._worker_main)
            pool._message(w, ("refused", type(error).__name__, str(error), error.cli), None)
        raised = pool._refused()
        assert type(raised) is SettingError and (str(raised), raised.cli) == (str(error), error.cli)
        assert [d["device"] for d in pool.dropped] == ["gpu1", "gpu2"]
    finally:
        pool.workers = []
        pool.close()


def test_an_interrupt_while_the_workers_are_stopped_leaves_no_spool(monkeypatch):
    """SIGTERM (or Ctrl-C) while the run waited for its workers to stop, once every row was stored, left the spool of
    segments, an empty `kprof-pool-*` directory, in the temporary directory for good."""
    from kprof.runners import pool as pool_module
    from kprof.runners.devices import Device
    from kprof.runners.registry import lookup

    def interrupted(self, kill=False):
        raise SystemExit(143)

    pool = pool_module.Pool(lookup("single_gemm", "torch-cpu"), "cpu", [Device("cpu0", None)]).__enter__()
    workers = list(pool.workers)
    monkeypatch.setattr(pool_module._Worker, "stop", interrupted)
    with pytest.raises(SystemExit):
        pool.close()
    monkeypatch.undo()
    assert not os.path.exists(pool._spool) and pool.workers == []
    for w in workers:  # a daemon: the run's end would take it
        w.stop(kill=True)


def test_a_worker_whose_last_spec_came_back_is_stopped_not_killed(monkeypatch):
    """The run closes its pool once the last spec's event arrives, before that worker's `idle`: the worker, still
    `busy` though done, was killed (SIGKILL), so a gloo run's ranks were left to find it gone and their directory
    (`kprof-ranks-*`) stayed in the temporary directory. It is asked to stop; one inside a spec is still killed."""
    from kprof.runners import pool as pool_module
    from kprof.runners.devices import Device
    from kprof.runners.registry import lookup

    pool = pool_module.Pool(lookup("single_gemm", "torch-cpu"), "cpu", [Device("cpu0", None), Device("cpu1", None)])
    pool.__enter__()
    workers, stops = list(pool.workers), []
    stop = pool_module._Worker.stop
    monkeypatch.setattr(pool_module._Worker, "stop", lambda self, kill=False: (stops.append(kill), stop(self, kill)))
    for w, item in zip(workers, [None, (0, {}, None)]):  # done (its event came), and inside a spec
        w.state, w.item = "busy", item
    pool.close()
    assert stops == [False, True]
    assert workers[0].process.exitcode == 0


def test_an_interrupt_kills_the_workers_and_one_while_they_are_stopped_leaves_none_running(monkeypatch):
    """Ctrl-C pressed twice: the first waited for each idle worker to end (up to 10 s each), and the second, arriving
    then, left the workers not yet stopped running until the interpreter's exit waited for them, where a third ended
    kprof in a traceback. On an interrupt every worker is killed, and one while they are stopped kills the rest."""
    from kprof.runners import pool as pool_module
    from kprof.runners.devices import Device
    from kprof.runners.registry import lookup

    pool = pool_module.Pool(lookup("single_gemm", "torch-cpu"), "cpu", [Device("cpu0", None), Device("cpu1", None)])
    pool.__enter__()
    workers = list(pool.workers)
    asked = []
    monkeypatch.setattr(pool_module._Worker, "stop", lambda self, kill=False: asked.append(kill))
    pool.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert asked == [True, True]  # killed, not waited for
    monkeypatch.undo()

    pool = pool_module.Pool(lookup("single_gemm", "torch-cpu"), "cpu", [Device("cpu0", None), Device("cpu1", None)])
    pool.__enter__()
    workers += pool.workers

    def interrupted(self, kill=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(pool_module._Worker, "stop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    monkeypatch.undo()
    for w in workers[2:]:
        w.process.join(10)
        assert not w.process.is_alive()
    for w in workers:
        w.stop(kill=True)


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_json_stdout_holds_the_document_alone_whatever_the_runners_print(tmp_path, workers):
    """--json's stdout is one JSON document: what a runner or a library writes to stdout, in this process (one CPU
    slot) or in a worker, went there before it and the document did not parse; it goes to stderr."""
    path = tmp_path / "specs.json"
    path.write_text(_specs("chatty", "chatty", "ok"))
    cmd = [sys.executable, "-m", "kprof", "run", "faulty", "--backend", "cpu", "--specs", str(path), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path, KPROF_CPU_WORKERS=workers),
                       cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["missing_count"] == 0
    assert "a runner's own print, spec n=1000" in p.stderr and "a library's own write to fd 1" in p.stderr


def test_a_spool_left_by_a_killed_run_is_removed_by_the_next_pool(tmp_path, monkeypatch):
    """SIGKILL of a run's whole process group left its spool (an empty `kprof-pool-*` directory, or one holding a
    segment nothing will merge) in the temporary directory for good. The next pool removes a spool no live process
    holds; a live one (held by its run) stays."""
    import fcntl
    import tempfile

    from kprof import _scratch
    from kprof.runners import pool as pool_module
    from kprof.runners.devices import Device
    from kprof.runners.registry import lookup

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = tmp_path / "kprof-pool-killed"
    left.mkdir()
    (left / "segment.kseg").write_bytes(b"never merged")
    old = time.time() - 2 * _scratch.SETTLE_S
    os.utime(left, (old, old))
    live = tmp_path / "kprof-pool-live"  # another run's, held (as _scratch holds it) while it lives
    live.mkdir()
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    os.utime(live, (old, old))
    pool = pool_module.Pool(lookup("single_gemm", "torch-cpu"), "cpu", [Device("cpu0", None)])
    try:
        assert not left.exists() and os.path.isdir(live) and os.path.isdir(pool._spool)
    finally:
        pool.close()
        os.close(held)
    assert os.listdir(tmp_path) == ["kprof-pool-live"]


def test_a_claims_directory_or_segment_refused_a_descriptor_names_ulimit_n(tmp_path):
    """A run's claims, or a segment, refused a file descriptor (`ulimit -n`) told a Python caller (api.run, export) to
    "fix or remove" the claims directory, or to give a path in a writable directory; each names the limit now."""
    import subprocess
    import sys

    code = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
            "from kprof.runners.claims import Claims\nfrom kprof.merge import segment\nheld = []\n"
            "while len(held) < 70:\n    try:\n        held.append(os.open(os.devnull, os.O_RDONLY))\n"
            "    except OSError:\n        break\n"
            "for fn in (lambda: Claims(sys.argv[1] + '/p.db', 'r').__enter__(),\n"
            "           lambda: segment.write(sys.argv[1] + '/s.kseg', [])):\n"
            "    try:\n        fn()\n    except Exception as exc:\n        print(exc)\n")
    said = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    assert len(said) == 2 and said[0].startswith("cannot use ") and said[1].startswith("cannot write segment "), said
    assert all("too many open files" in s and "ulimit -n 64" in s for s in said), said
    assert "fix or remove" not in said[0] and "writable directory" not in said[1]
