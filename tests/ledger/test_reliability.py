"""Reliability of the LMDB ledger under real processes: SIGKILL mid-batch, concurrent writers, readers
during writes, damaged files and fork(). Every scenario runs separate Python processes; nothing is mocked.
The helper processes live in tests/ledger/_writer.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kprof.errors import LedgerError
from kprof.ledger import Ledger, _codec
from kprof import synth
from kprof.ledger.audit import audit

ROOT = Path(__file__).resolve().parents[2]
HELPER = str(Path(__file__).with_name("_writer.py"))
PY = [sys.executable, "-W", "error"]
DAMAGE = re.compile(r"truncat|damag|empty|corrupt|not an lmdb file|not a kprof ledger", re.IGNORECASE)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("KPROF_DB", None)
    return env


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_stray_processes():
    """A failed assertion must not leave a writer running: kill (by its own pid) whatever a test started."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _popen(argv, cwd) -> subprocess.Popen:
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _started.append(proc)
    return proc


def _helper(*args, cwd) -> subprocess.Popen:
    return _popen([*PY, HELPER, *map(str, args)], cwd)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"helper {proc.args} did not finish in {timeout} s; stderr:\n{err}")
    return out, err


def _run_helper(*args, cwd, timeout: float = 60) -> dict:
    proc = _helper(*args, cwd=cwd)
    out, err = _finish(proc, timeout)
    assert proc.returncode == 0, f"helper {args} exited {proc.returncode}:\n{out}\n{err}"
    assert "Traceback" not in err, err
    return json.loads(out.strip().splitlines()[-1])


def _kprof(*args, cwd) -> subprocess.Popen:
    return _popen([*PY, "-m", "kprof", *map(str, args)], cwd)


def _audit_cli(path, cwd) -> tuple[int, str]:
    proc = _kprof("audit", "--db", path, cwd=cwd)
    out, err = _finish(proc, 120)
    return proc.returncode, out + err


def _wait_for_file(path: Path, procs, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"helper {proc.args} exited {proc.returncode} before {path.name}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.005)


def _commits(out: str) -> list[dict]:
    """The JSON lines a writer printed; a last line cut short by SIGKILL is dropped (it was never reported)."""
    lines = out.split("\n")
    complete = lines[:-1]  # the last piece is empty, or a line cut short
    return [doc for doc in map(json.loads, complete) if "last_seq" in doc]


def _log_is_contiguous(ledger: Ledger) -> tuple[int, set[bytes]]:
    """(entries, event ids) of the log, asserting it is exactly 1..n from one snapshot."""
    with ledger.read() as txn:
        seqs, eids = [], set()
        for seq, eid, data in ledger.iter_log(txn):
            assert data is not None, f"seq {seq}: event {eid.hex()} is logged but not stored"
            seqs.append(seq)
            eids.add(eid)
        stored = txn.stat(ledger.dbs["events"])["entries"]
    assert seqs == list(range(1, len(seqs) + 1)), "log has gaps or is out of order"
    assert len(eids) == len(seqs), "an event is logged twice"
    assert stored == len(seqs), f"{stored} events stored but {len(seqs)} logged"
    return len(seqs), eids


def _ok_indices(ledger: Ledger, indices) -> set[int]:
    indices = list(indices)
    rows = synth.view(ledger).get_many([synth.spec(i) for i in indices])
    return {i for i, row in zip(indices, rows) if row.ok}


def _new_ledger(path: Path, n: int = 0) -> Path:
    with Ledger.open(path) as ledger:
        if n:
            ledger.append(list(synth.events(0, n)))
    return path


# ---- 1. SIGKILL mid-batch -------------------------------------------------------------------------------

KILL_ROUNDS = 20
KILL_BATCH = 200
ROUND_SPAN = 1_000_000  # each round appends from its own index range, far beyond what it can reach


@pytest.mark.slow
def test_sigkill_mid_batch_twenty_times_leaves_a_clean_ledger(tmp_path):
    path = tmp_path / "kill.db"
    rng = random.Random(20240611)
    reported: list[list[dict]] = []
    last_reported_seq = 0
    for rnd in range(KILL_ROUNDS):
        ready = tmp_path / f"ready-{rnd}"
        proc = _helper("write", path, "--start", rnd * ROUND_SPAN, "--count", ROUND_SPAN,
                       "--batch-min", KILL_BATCH, "--batch-max", KILL_BATCH, "--ready-file", ready, cwd=tmp_path)
        _wait_for_file(ready, [proc])
        time.sleep(rng.uniform(0.0, 0.35))  # the ledger is open: now kill it somewhere in its append loop
        proc.send_signal(signal.SIGKILL)
        out, err = _finish(proc)
        assert proc.returncode == -signal.SIGKILL, f"round {rnd}: writer ended on its own ({proc.returncode}):\n{err}"
        assert "Traceback" not in err, err
        commits = _commits(out)
        for k, c in enumerate(commits):
            assert c["start"] == rnd * ROUND_SPAN + k * KILL_BATCH and c["added"] == KILL_BATCH, c
            assert c["last_seq"] > last_reported_seq, "a reported last_seq went backwards"
            last_reported_seq = c["last_seq"]
        reported.append(commits)
    assert sum(map(len, reported)) >= 5, "the kills came too early to exercise any committed batch"

    report = audit(str(path))
    assert report.ok, report.findings
    with Ledger.open(path, readonly=True) as ledger:
        last_seq = ledger.last_seq
        n_logged, _ = _log_is_contiguous(ledger)
        assert n_logged == last_seq == report.events == report.last_seq
        assert last_seq >= last_reported_seq
        total = 0
        for rnd, commits in enumerate(reported):
            base = rnd * ROUND_SPAN
            # every reported batch, plus at most the one batch that committed before its line was printed
            n_batches = len(commits) + 1
            present = _ok_indices(ledger, range(base, base + (n_batches + 1) * KILL_BATCH))
            reported_range = set(range(base, base + len(commits) * KILL_BATCH))
            assert reported_range <= present, f"round {rnd}: a reported batch is missing"
            extra = present - reported_range
            unreported = set(range(base + len(commits) * KILL_BATCH, base + n_batches * KILL_BATCH))
            assert extra in (set(), unreported), (f"round {rnd}: {len(extra)} events of an unreported batch "
                                                  f"are present: a batch was committed partially or out of order")
            total += len(present)
        assert total == last_seq, f"{total} events found in the rounds' ranges, last_seq is {last_seq}"


# ---- 2. Two concurrent writers --------------------------------------------------------------------------

PER_WRITER = 10_000


@pytest.mark.slow
@pytest.mark.parametrize("names", ["one", "link"])
def test_two_concurrent_writers_lose_nothing(tmp_path, names):
    """Two writers, through the file's path, or one through a link to it: LMDB's lock file (where its write lock
    lives) is beside the real file either way, so the two names share it (beside the link, the two writers' commits
    overwrote each other: lost rows, keys measured twice, a damaged ledger)."""
    path = _new_ledger(tmp_path / "two.db")
    if names == "link":
        os.symlink(path, tmp_path / "link.db")
    start = tmp_path / "start"
    procs = []
    for w in range(2):
        name = tmp_path / "link.db" if names == "link" and w == 1 else path
        procs.append(_helper("write", name, "--start", w * PER_WRITER, "--count", PER_WRITER,
                             "--batch-min", 100, "--batch-max", 500, "--seed", 7 + w,
                             "--ready-file", tmp_path / f"ready-{w}", "--start-file", start, cwd=tmp_path))
    for w in range(2):
        _wait_for_file(tmp_path / f"ready-{w}", procs)
    start.touch()
    spans = []
    for w, proc in enumerate(procs):
        out, err = _finish(proc, 120)
        assert proc.returncode == 0, f"writer {w} exited {proc.returncode}:\n{err}"
        assert "Traceback" not in err, err
        commits = _commits(out)
        assert out.strip().splitlines()[-1] == json.dumps({"done": True})
        assert sum(c["added"] for c in commits) == PER_WRITER and all(c["existing"] == 0 for c in commits)
        spans.append([(c["last_seq"] - c["added"] + 1, c["last_seq"]) for c in commits])
    # the two writers' batches interleave in the log: they really ran at the same time
    a, b = spans
    assert a[0][0] < b[-1][1] and b[0][0] < a[-1][1], "the writers did not overlap"
    seqs = sorted(s for span in spans for s in span)
    assert seqs[0][0] == 1 and seqs[-1][1] == 2 * PER_WRITER
    assert all(x[1] + 1 == y[0] for x, y in zip(seqs, seqs[1:])), "reported batches overlap or leave gaps"

    with Ledger.open(path, readonly=True) as ledger:
        assert ledger.last_seq == 2 * PER_WRITER
        assert _log_is_contiguous(ledger)[0] == 2 * PER_WRITER
        specs = [synth.spec(i) for i in range(2 * PER_WRITER)]
        view = synth.view(ledger)
        rows = view.get_many(specs)
        assert all(row.ok for row in rows), f"{sum(not r.ok for r in rows)} specs are not ok"
        assert view.missing(specs) == []
        for i in random.Random(3).sample(range(2 * PER_WRITER), 50):
            assert ledger.event(rows[i].event_id) == synth.event(i)
    report = audit(str(path))
    assert report.ok, report.findings
    assert not os.path.exists(tmp_path / "link.db-lock")  # one lock file, beside the real one
    assert report.events == report.last_seq == 2 * PER_WRITER


def test_two_writers_opening_a_format_1_file_at_once_upgrade_it_once_and_lose_nothing(tmp_path):
    """Both writers open a copy of the committed format-1 ledger at the same moment: one of them upgrades it
    (LMDB serializes the two write transactions; the second finds format 2 and leaves it), and then both
    append. Every event is there, and the file audits clean."""
    path = tmp_path / "v1.db"
    shutil.copyfile(ROOT / "fixtures" / "ledgers" / "synthetic-v1.db", path)
    start, per = tmp_path / "start", 600
    procs = [_helper("write", path, "--start", 1000 + w * per, "--count", per, "--batch-min", 50, "--batch-max", 200,
                     "--seed", w, "--ready-file", tmp_path / f"ready-{w}", "--start-file", start, "--open-after-start",
                     cwd=tmp_path) for w in range(2)]
    for w in range(2):
        _wait_for_file(tmp_path / f"ready-{w}", procs)
    start.touch()
    for w, proc in enumerate(procs):
        out, err = _finish(proc, 120)
        assert proc.returncode == 0 and "Traceback" not in err, f"writer {w} exited {proc.returncode}:\n{err}"
        assert sum(c["added"] for c in _commits(out)) == per
    with Ledger.open(str(path), readonly=True) as ledger:
        assert ledger.format_version == _codec.FORMAT_VERSION and ledger.last_seq == 49 + 2 * per
        view = synth.view(ledger)
        specs = [synth.spec(i) for i in range(1000, 1000 + 2 * per)]
        assert view.missing(specs) == [] and all(row.ok for row in view.get_many(specs))
    report = audit(str(path))
    assert report.ok, report.findings


# ---- 3. A reader during appends -------------------------------------------------------------------------


@pytest.mark.slow
def test_reader_sees_whole_batches_in_order_while_a_writer_appends(tmp_path):
    count, batch = 3000, 50
    path = _new_ledger(tmp_path / "rw.db")
    start, reader_ready = tmp_path / "start", tmp_path / "reader-ready"
    reader = _helper("read", path, "--count", count, "--batch", batch, "--ready-file", reader_ready,
                     "--deadline", 30, cwd=tmp_path)
    writer = _helper("write", path, "--start", 0, "--count", count, "--batch-min", batch, "--batch-max", batch,
                     "--start-file", start, "--pause", 0.02, cwd=tmp_path)
    _wait_for_file(reader_ready, [reader, writer])
    start.touch()
    w_out, w_err = _finish(writer)
    r_out, r_err = _finish(reader)
    assert writer.returncode == 0 and "Traceback" not in w_err, w_err
    assert reader.returncode == 0 and "Traceback" not in r_err, r_err
    assert len(_commits(w_out)) == count // batch
    result = json.loads(r_out.strip().splitlines()[-1])
    assert result["violations"] == []
    assert result["states"][-1] == count
    assert len(result["states"]) >= 5, f"the reader saw only {result['states']}: it did not overlap the writer"


# ---- 4. Damaged files -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A ledger of 300 events written in one transaction, so each event's bytes occur once in the file."""
    path = _new_ledger(tmp_path_factory.mktemp("pristine") / "pristine.db", 300)
    assert audit(str(path)).ok
    return path


def _copy(pristine: Path, dest: Path) -> Path:
    shutil.copyfile(pristine, dest)
    return dest


def test_flipped_byte_in_an_event_is_reported_by_kprof_audit(pristine, tmp_path):
    path = _copy(pristine, tmp_path / "flip.db")
    with Ledger.open(pristine, readonly=True) as ledger:
        _seq, eid, data = list(ledger.iter_log())[123]
    raw = bytearray(path.read_bytes())
    at, hits = raw.find(data), 0
    while at != -1:  # every copy, so the flip cannot land in a stale copy only
        raw[at + len(data) // 2] ^= 0x01
        hits += 1
        at = raw.find(data, at + 1)
    assert hits >= 1, "the event's bytes are not in the file"
    path.write_bytes(bytes(raw))

    code, text = _audit_cli(path, tmp_path)
    assert code == 3, text
    assert "Traceback" not in text, text
    assert eid.hex()[:16] in text, f"no finding names event {eid.hex()[:16]}:\n{text}"

    proc = _kprof("audit", "--db", path, "--json", cwd=tmp_path)
    out, err = _finish(proc, 120)
    assert proc.returncode == 3 and "Traceback" not in err, err
    doc = json.loads(out)
    assert doc["ok"] is False and any(eid.hex()[:16] in f for f in doc["findings"]), doc


@pytest.mark.parametrize("size", ["half", 4096, 0])
def test_truncated_file_gives_a_clear_error(pristine, tmp_path, size):
    path = _copy(pristine, tmp_path / "trunc.db")
    keep = path.stat().st_size // 2 if size == "half" else size
    with open(path, "r+b") as f:
        f.truncate(keep)
    code, text = _audit_cli(path, tmp_path)
    assert "Traceback" not in text, text
    assert code in (2, 3), text
    assert DAMAGE.search(text), f"kprof audit does not say the file is truncated or damaged:\n{text}"

    opened = _run_helper("open", path, cwd=tmp_path)
    assert opened.get("error") in ("IntegrityError", "LedgerError", "LedgerPathError"), opened
    assert opened["exit_code"] in (2, 3)
    assert DAMAGE.search(opened["message"]), opened


@pytest.mark.slow
def test_flipped_bytes_anywhere_never_crash_audit(pristine, tmp_path):
    size = pristine.stat().st_size
    rng = random.Random(99)
    offsets = [rng.randrange(k * size // 10, (k + 1) * size // 10) for k in range(10)]  # spread over the file
    paths = []
    for off in offsets:
        path = _copy(pristine, tmp_path / f"flip-{off}.db")
        raw = bytearray(path.read_bytes())
        raw[off] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        paths.append(path)
    results = _audit_many(paths, tmp_path)
    for off, (code, text) in zip(offsets, results):
        assert "Traceback" not in text, f"flip at {off} (page {off // 4096}):\n{text}"
        assert code in (0, 3), f"flip at {off} (page {off // 4096}) exited {code}:\n{text}"
        if code == 0:
            assert "clean" in text, text  # the flip landed in free space or in bytes nothing checks
        else:
            assert "finding" in text or DAMAGE.search(text), f"exit 3 without saying what is wrong:\n{text}"


def _audit_many(paths, cwd, parallel: int = 3) -> list[tuple[int, str]]:
    """`kprof audit` on each path, a few at a time; (exit code, stdout + stderr) in order."""
    results: list = [None] * len(paths)
    running: list = []
    for i, path in enumerate(paths):
        running.append((i, _kprof("audit", "--db", path, cwd=cwd)))
        while len(running) >= parallel or (i == len(paths) - 1 and running):
            j, proc = running.pop(0)
            out, err = _finish(proc, 120)
            results[j] = (proc.returncode, out + err)
    return results


def test_a_file_that_is_not_lmdb_gives_a_clear_error(tmp_path):
    path = tmp_path / "noise.db"
    path.write_bytes(random.Random(5).randbytes(64 * 1024))
    code, text = _audit_cli(path, tmp_path)
    assert "Traceback" not in text, text
    assert code in (2, 3), text
    assert DAMAGE.search(text), text
    opened = _run_helper("open", path, cwd=tmp_path)
    assert opened.get("error") in ("IntegrityError", "LedgerError", "LedgerPathError"), opened
    assert DAMAGE.search(opened["message"]), opened


# ---- 5. fork() ------------------------------------------------------------------------------------------


def test_a_ledger_used_after_fork_raises_ledger_error_in_the_child(tmp_path):
    path = _new_ledger(tmp_path / "fork.db", 10)
    result = _run_helper("fork", path, cwd=tmp_path)
    assert result["child_exit"] == 0, result
    child = result["child"]
    for op in ("last_seq", "get_many", "append", "read"):
        seen = child[op]
        assert seen["raised"] == "LedgerError" and seen["is_ledger_error"], (op, seen)
        assert "fork" in seen["message"], (op, seen)
    # the child's refused append left nothing behind, and the parent's ledger still reads and writes
    assert result["parent"] == {"last_seq_before": 10, "last_seq_after": 10, "append_after": 11}
    with Ledger.open(path, readonly=True) as ledger:
        assert ledger.last_seq == 11
    assert audit(str(path)).ok


def test_a_forked_child_exiting_normally_leaves_the_parents_snapshot_protected(tmp_path):
    """The child frees its copies of the environment and the read transaction as it exits (no os._exit):
    the parent's reader slot, which keeps writers off the pages its snapshot reads, is still there."""
    path = _new_ledger(tmp_path / "fork.db", 10)
    result = _run_helper("fork-exit", path, cwd=tmp_path)
    assert result["child_exit"] == 0, result
    assert result["before"] and result["after"] == result["before"], result
    assert result["last_seq"] == 10


def test_a_forked_child_is_told_to_use_a_spawned_process(tmp_path):
    """Reopening in a forked child would need closing the inherited environment, which frees the
    parent's reader slots: it is refused with the fix, and the parent keeps working."""
    path = _new_ledger(tmp_path / "fork.db", 10)
    result = _run_helper("fork", path, cwd=tmp_path)
    reopened = result["child"]["reopened"]
    assert reopened["raised"] == "LedgerError", reopened
    assert "forked child" in reopened["message"] and "spawn" in reopened["message"]


def test_a_forked_child_is_told_it_may_open_a_ledger_its_parent_closed_before_the_fork(tmp_path):
    """The fix named only a spawned process, though a child forked while the parent held the ledger closed opens it
    (for perf_api's cached ledgers: kprof.perf_api.close_all() before the fork), as a fork-based pool needs."""
    path = _new_ledger(tmp_path / "fork.db", 10)
    result = _run_helper("fork", path, cwd=tmp_path)
    for seen in (result["child"]["reopened"], result["child"]["get_many"]):
        assert "forked while the parent had it closed (kprof.perf_api.close_all() closes perf_api's)" in \
            seen["message"], seen


# ---- 6. reader slots ------------------------------------------------------------------------------------


def test_reader_slots_of_processes_killed_reading_are_freed_and_a_full_table_is_named(tmp_path):
    """Each read open, in any process, holds a slot of the lock file's reader table. A process killed while reading
    leaves its slots behind while the file stays open elsewhere: a read that finds none left frees those first. Where
    the reads are alive, the read is refused as a usage error, never taken for a damaged ledger."""
    path = _new_ledger(tmp_path / "slots.db", 10)
    with Ledger.open(path, readonly=True) as ledger:  # keeps the lock file's table as it is, for the processes after
        slots = ledger.env.max_readers()
        hog = ("import lmdb, os, signal, sys\n"
               "env = lmdb.open(sys.argv[1], subdir=False, readonly=True, max_dbs=16, max_readers=int(sys.argv[2]))\n"
               "held = [env.begin() for _ in range(int(sys.argv[2]))]\n"
               "os.kill(os.getpid(), signal.SIGKILL)\n")
        done = subprocess.run([*PY, "-c", hog, str(path), str(slots)], env=_env(), capture_output=True, timeout=120)
        assert done.returncode == -signal.SIGKILL, done.stderr
        view = synth.view(ledger)
        assert [row.status for row in view.get_many([synth.spec(0), synth.spec(99)])] == ["ok", "missing"]
        held = [ledger.env.begin() for _ in range(slots)]
        with pytest.raises(LedgerError, match=f"has {slots} reads open at once, over every process, LMDB's most; "
                                              r"end some \(read from fewer threads or processes\)"):
            view.get_many([synth.spec(1)])
        for txn in held:
            txn.abort()
        del held, txn  # (py-lmdb frees an ended read's slot with the object)
        assert view.get(**synth.spec(1)).ok
