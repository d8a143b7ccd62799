"""The write path's contracts: appends store events as they decode (schema checked,
ints in float fields canonical), a retraction of a retraction is refused, a closed ledger says so, a forked
child never ends its parent's read transactions, a map changes size only once this process's other reads
end, a second open for writing adopts a map another process grew, and an open waits briefly for a writer
that is creating the file.

The fork scenarios fork this very process: a child leaves by os._exit in a `finally`, so that it never runs
on into pytest. Where a child must end the way a program does (sys.exit, the interpreter's finalization),
the fork happens in a separate Python process instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lmdb
import msgspec
import pytest

from kprof.errors import IntegrityError, LedgerError, UsageError
from kprof.ledger import Ledger
from kprof import synth
from kprof.ledger import _codec, store
from kprof.ledger.build import failed, retraction
from kprof.ledger._reducer import CurrentRow, opened
from kprof.ledger.store import VIEW_DBS

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """The environment of a helper process: it imports the kprof of this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("KPROF_DB", None)
    return env


def _python(code: str, cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a separate Python process; fails the test with its output if it fails."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _eid(event) -> bytes:
    return _codec.event_id(_codec.encode(event))


def _live_readers(ledger) -> set[tuple[int, str]]:
    """(pid, txnid) of every reader slot of the lock file that holds a snapshot (an ended one shows txnid '-')."""
    out = set()
    for line in ledger.env.readers().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 3 and fields[2] != "-":
            out.add((int(fields[0]), fields[2]))
    return out


def _dump(ledger) -> dict:
    out = {}
    with ledger.read() as txn:
        for name in VIEW_DBS + ("log", "events"):
            out[name] = dict(txn.cursor(ledger.dbs[name]))
        out["last_seq"] = txn.get(b"last_seq", db=ledger.dbs["meta"])
    return out


# ---- 1. appends refuse what is not an event of the schema ------------------------------------------------


def _shape_holding_a_list():
    base = synth.event(0)
    prov = msgspec.structs.replace(base.provenance, shape={"m": [1, 2], "n": 1, "k": 1, "dtype": "bf16"})
    return msgspec.structs.replace(base, provenance=prov, key=_codec.provenance_key(prov))


def _unknown_error_kind():
    return failed(synth.event(1).provenance, "segfault", "not one of the error kinds", measured_at=1.8e9)


@pytest.mark.parametrize("make_bad", [_shape_holding_a_list, _unknown_error_kind, object, lambda: None,
                                      lambda: {"key": b"x"}],
                         ids=["shape-value-is-a-list", "error-kind-segfault", "object", "None", "dict"])
def test_append_refuses_what_does_not_fit_the_schema_naming_its_index_and_writes_nothing(ledger, make_bad):
    ledger.append([synth.event(0)])
    batch = [synth.event(5), synth.event(6), make_bad()]
    with pytest.raises(UsageError, match=r"\bevent 2 of the batch\b"):
        ledger.append(batch)
    with pytest.raises(UsageError, match=r"\bevent 2 of the batch\b"):
        ledger.append_batches([[synth.event(7)], batch])
    assert ledger.last_seq == 2  # the first append_batches batch committed; nothing of the refused ones
    assert ledger.event(_eid(synth.event(5))) is None and ledger.event(_eid(synth.event(6))) is None
    assert [seq for seq, _eid_, _data in ledger.iter_log()] == [1, 2]


# ---- 2. canonical bytes: an event is stored as it decodes -------------------------------------------------


def _int_metric(ev):
    return msgspec.structs.replace(ev, metrics={**ev.metrics, "energy_j": 2})  # the schema says float | None


def _int_measured_at(ev):
    return msgspec.structs.replace(ev, measured_at=1_700_000_000)  # the schema says float


def _int_stats(ev):
    return msgspec.structs.replace(ev, stats=msgspec.structs.replace(ev.stats, cv=0, min=1))


@pytest.mark.parametrize("with_ints", [_int_metric, _int_measured_at, _int_stats],
                         ids=["metric", "measured_at", "stats"])
def test_an_int_in_a_float_field_is_stored_as_it_decodes_and_reappending_it_is_a_noop(ledger, with_ints):
    ev = with_ints(synth.event(0))
    first = ledger.append([ev])
    assert len(first.added) == 1 and first.last_seq == 1
    eid = first.added[0]
    back = ledger.event(eid)
    # the stored bytes are the ones the event read back encodes to, and its id is theirs
    assert _codec.event_id(_codec.encode(back)) == eid
    with ledger.read() as txn:
        stored = txn.get(eid, db=ledger.dbs["events"])
    assert stored == _codec.encode(back) and _codec.event_id(stored) == eid
    # appending the event read back, or the one given, again is a no-op
    again = ledger.append([back])
    assert (again.added, again.existing, again.last_seq) == ([], [eid], 1)
    again = ledger.append([ev, back])
    assert (again.added, again.existing, again.last_seq) == ([], [eid, eid], 1)
    with ledger.read() as txn:
        assert [e for _seq, e in ledger.history_of(txn, ev.key)] == [eid]
    assert ledger.last_seq == 1


# ---- 3. a retraction of a retraction -----------------------------------------------------------------------


def test_retracting_a_retraction_is_refused_and_writes_nothing(ledger):
    m = synth.event(0)
    mid = ledger.append([m]).added[0]
    r1 = retraction(mid, m.key, "bad run", at=1.0)
    r1id = ledger.append([r1]).added[0]
    before = _dump(ledger)
    r2 = retraction(r1id, m.key, "undo the retraction", at=2.0)
    with pytest.raises(UsageError, match="retraction"):
        ledger.append([r2])
    with pytest.raises(UsageError, match="retraction"):
        ledger.append([synth.event(1), r2])  # with a new event in the batch: none of it is written
    assert ledger.last_seq == 2
    assert ledger.event(_eid(r2)) is None and ledger.event(_eid(synth.event(1))) is None
    assert _dump(ledger) == before


# ---- 4. a closed ledger ------------------------------------------------------------------------------------


def test_a_batch_that_retracts_a_keys_only_row_then_measures_it_again_makes_the_new_row_current(ledger):
    """Within one batch, a key's row deleted by a retraction reads as no row to the next event of that key."""
    first, again = synth.event(0, seed=1), synth.event(0, seed=2)
    ledger.append([first, retraction(_codec.event_id(_codec.encode(first)), first.key, "bad clocks"), again])
    assert synth.view(ledger).get(**synth.spec(0)).event_id == _codec.event_id(_codec.encode(again))


@pytest.mark.parametrize("count", [_codec.encode("x"), _codec.encode(-4), b"\xc1"])
def test_rebuilding_views_over_a_damaged_rebuild_count_repairs_and_counts_anew(ledger, count):
    """The repair is not blocked by the damage of the count it keeps: a count that is not a positive int is 0."""
    from kprof.ledger._reducer import REBUILT

    ledger.append([synth.event(0)])
    ledger.write(lambda txn: txn.put(REBUILT, count, db=ledger.dbs["meta"]))
    assert ledger.rebuild_views() == 1
    with ledger.read() as txn:
        assert txn.get(REBUILT, db=ledger.dbs["meta"]) == _codec.encode(1)


def test_append_after_close_raises_ledger_error(ledger_path):
    led = Ledger.open(ledger_path)
    led.append([synth.event(0)])
    led.close()
    with pytest.raises(LedgerError, match="closed"):
        led.append([synth.event(1)])
    with pytest.raises(LedgerError, match="closed"):
        led.last_seq
    with Ledger.open(ledger_path, readonly=True) as again:
        assert again.last_seq == 1


CLOSED_DURING = "was closed during this read .*; close a ledger after its reads"


def test_a_read_under_way_when_its_ledger_closes_says_so_not_damage(ledger_path, monkeypatch):
    """Rows still iterated after close (here or in another thread), or a read another thread's close overtakes once
    begun, met LMDB's "closed object" error and read as a damaged ledger (exit 3); a view of a closed ledger was
    made. Each now says the ledger was closed, and how to use it."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 3)))
    led = Ledger.open(ledger_path, readonly=True)
    view, rows = synth.view(led), synth.view(led).rows()
    assert next(rows).status == "ok"
    led.close()
    with pytest.raises(LedgerError, match=CLOSED_DURING):
        next(rows)
    with pytest.raises(LedgerError, match=f"ledger {ledger_path} is closed; open it again with Ledger.open"):
        synth.view(led)
    led = Ledger.open(ledger_path, readonly=True)
    view, check = synth.view(led), store._check_file
    monkeypatch.setattr(store, "_check_file", lambda *args: (led.close(), check(*args)))  # a close, once begun
    with pytest.raises(LedgerError, match=CLOSED_DURING):
        view.get_many([synth.spec(0)])
    assert os.path.realpath(ledger_path) not in store._envs
    assert all(env is not led.env for env, *_ in store._reads.values())


def test_a_close_in_another_thread_waits_for_the_write_under_way(ledger_path, monkeypatch):
    """Another thread's close during an append closed LMDB's environment under the write transaction: the append
    failed with LMDB's raw "closed object" error (read by the CLI as a damaged ledger), and at times the close hung
    for good. The close now waits for the write to commit; the next write is told the ledger is closed."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 3)))
    led, append, release, releasing = Ledger.open(ledger_path), store.append_events, store._release, threading.Event()
    closer = threading.Thread(target=led.close)

    def closed_meanwhile(*args):  # the events are written in the transaction; another thread closes the ledger
        done = append(*args)
        closer.start()
        releasing.wait(1)  # the close would release the environment now, under this write: it waits instead
        return done

    monkeypatch.setattr(store, "append_events", closed_meanwhile)
    monkeypatch.setattr(store, "_release", lambda *args: (releasing.set(), release(*args)))
    assert led.append(list(synth.events(3, 6))).last_seq == 6
    closer.join(10)
    assert not closer.is_alive() and releasing.is_set() and os.path.realpath(ledger_path) not in store._envs
    with pytest.raises(LedgerError, match="is closed"):
        led.append(list(synth.events(6, 9)))
    with Ledger.open(ledger_path, readonly=True) as again:
        assert again.last_seq == 6


def test_a_ledger_opened_while_another_thread_writes_it_opens_at_once(tmp_path, ledger_path):
    """Each Ledger opened its sub-databases through py-lmdb's own write transaction, which waits for the file's writer
    holding the GIL: opened in one thread while another wrote the file (through the environment they share), it
    deadlocked the process (here, in a helper process: the writer inside its transaction waits for the GIL, and the
    opener, holding it, for the writer). The handles are now opened once per environment."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 3)))
    proc = _python(f"""
        import threading
        from kprof import synth
        from kprof.ledger import Ledger, store

        led, append, seen = Ledger.open({ledger_path!r}), store.append_events, []

        def open_meanwhile(*args):  # inside the write transaction: another thread opens the ledger and reads it
            reader = threading.Thread(target=lambda: seen.append(Ledger.open({ledger_path!r}, readonly=True).last_seq))
            reader.start()
            reader.join()
            return append(*args)

        store.append_events = open_meanwhile
        print(led.append(list(synth.events(3, 6))).last_seq, seen)
    """, tmp_path, timeout=120)
    assert proc.stdout.split() == ["6", "[3]"]  # the reader's snapshot: before the write it ran inside


def test_two_threads_closing_one_ledger_release_its_environment_once(ledger_path, monkeypatch):
    """Both closes released the shared environment, the second another ledger's use of it: closed under that one."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 3)))
    shared, other = Ledger.open(ledger_path, readonly=True), Ledger.open(ledger_path, readonly=True)
    release, second = store._release, threading.Event()

    def release_slowly(*args):  # the first release waits (a while) for the other thread's to begin
        second.set() if second.is_set() or threading.current_thread().name == "b" else second.wait(2)
        return release(*args)

    monkeypatch.setattr(store, "_release", release_slowly)
    threads = [threading.Thread(target=shared.close, name=name) for name in "ab"]
    threads[0].start()
    threads[1].start()
    [thread.join() for thread in threads]
    assert synth.view(other).count_missing([synth.spec(i) for i in range(5)]) == 2
    other.close()
    assert os.path.realpath(ledger_path) not in store._envs


# ---- 5. fork safety: a child never ends its parent's read transactions ---------------------------------------


def test_a_child_forked_inside_a_read_block_leaves_the_parents_snapshot_intact(tmp_path, ledger_path):
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 200)))
    meta, current = led.dbs["meta"], led.dbs["current"]
    pid = -1
    try:
        with led.read() as txn:
            mine = (os.getpid(), str(txn.id()))
            assert mine in _live_readers(led)
            before = txn.get(b"last_seq", db=meta)
            pid = os.fork()
            if pid == 0:
                pass  # the child leaves the block as the parent's code would (read()'s finally runs)
            else:
                _pid, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0
                assert mine in _live_readers(led), led.env.readers()
                # Another process rewrites the views and appends: had the child freed this snapshot's reader
                # slot, LMDB could reuse the pages it reads.
                _python(f"""
                    from kprof.ledger import Ledger
                    from kprof import synth
                    led = Ledger.open({ledger_path!r})
                    for seed in range(1, 4):
                        led.rebuild_views()
                        led.append(list(synth.events(0, 200, seed=seed)))
                    assert led.last_seq == 800, led.last_seq
                """, cwd=tmp_path)
                assert txn.get(b"last_seq", db=meta) == before
                rows = list(txn.cursor(current))
                assert len(rows) == 200
                assert all(opened("current", k, v, CurrentRow).kind in ("m", "f") for k, v in rows)
                assert sorted(k for k, _v in rows) == sorted(synth.event(i).key for i in range(200))
                assert [s for s, _e, _d in led.iter_log(txn)] == list(range(1, 201))
    finally:
        if pid == 0:
            os._exit(0)
    assert led.last_seq == 800
    led.close()


def test_a_child_forked_during_a_half_read_iter_log_that_exits_leaves_the_parents_reader_slot(tmp_path, ledger_path):
    """The child ends like a program (sys.exit: the interpreter's finalization closes the inherited generator
    and frees the inherited transaction and environment), so this fork happens in a separate process."""
    led = Ledger.open(ledger_path)
    led.append(list(synth.events(0, 50)))
    led.close()
    out = _python(f"""
        import json, os, sys
        from kprof.ledger import Ledger

        def live(led):
            return sorted(tuple(line.split()) for line in led.env.readers().splitlines()[1:]
                          if len(line.split()) == 3 and line.split()[2] != "-")

        led = Ledger.open({ledger_path!r}, readonly=True)
        it = led.iter_log()
        next(it)
        before = live(led)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _pid, status = os.waitpid(pid, 0)
        after = live(led)
        rest = [seq for seq, _eid, _data in it]
        print(json.dumps({{"pid": os.getpid(), "child_exit": os.waitstatus_to_exitcode(status),
                           "before": before, "after": after, "rest": rest}}))
    """, cwd=tmp_path).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["child_exit"] == 0
    assert [r[0] for r in seen["before"]] == [str(seen["pid"])]
    assert seen["after"] == seen["before"], seen
    assert seen["rest"] == list(range(2, 51))


# ---- 6. map growth with this thread's own read open -------------------------------------------------------------


def test_map_growth_with_a_read_open_raises_ledger_error_and_the_snapshot_keeps_reading(ledger_path, monkeypatch):
    led = Ledger.open(ledger_path, map_size=64 * 1024)
    led.append(list(synth.events(0, 20)))
    map_before = led.env.info()["map_size"]
    it = led.iter_log()
    assert next(it)[0] == 1

    def no_wait(_s):
        raise AssertionError("waited for a read this very thread holds open")

    # refused at once: waiting could not end this thread's own read
    monkeypatch.setattr(store, "time", SimpleNamespace(monotonic=time.monotonic, time=time.time, sleep=no_wait))
    with pytest.raises(LedgerError, match="read"):
        led.append(list(synth.events(20, 400)))  # needs more than the map: would end the open snapshot
    monkeypatch.undo()
    assert led.env.info()["map_size"] == map_before
    rest = list(it)  # the snapshot keeps reading
    assert [seq for seq, _e, _d in rest] == list(range(2, 21))
    decode = _codec.event_decoder.decode
    assert [decode(data).key for _s, _e, data in rest] == [synth.event(i).key for i in range(1, 20)]
    assert led.last_seq == 20

    # with no read open the map grows, on append's path and append_batches', losing nothing
    assert len(led.append(list(synth.events(20, 300))).added) == 280
    r = led.append(list(synth.events(0, 300, seed=1)) + list(synth.events(0, 10)))  # re-measurements, repeats
    assert (len(r.added), len(r.existing), r.last_seq) == (300, 10, 600)
    res = led.append_batches([list(synth.events(300 + 100 * j, 400 + 100 * j)) for j in range(5)])
    assert [x.last_seq for x in res] == [700, 800, 900, 1000, 1100]
    assert led.env.info()["map_size"] > map_before
    assert [seq for seq, _e, _d in led.iter_log()] == list(range(1, 1101))
    views = _dump(led)
    led.rebuild_views()
    assert _dump(led) == views
    led.close()


@pytest.mark.parametrize("reads", [False, True])
def test_a_map_change_waits_for_another_threads_write(ledger_path, monkeypatch, reads):
    """A write that fills the map grows it once this process's other transactions end; another thread's write that
    began meanwhile (two Ledgers of one file share its environment) was not waited for: the change failed that write,
    or itself, with a raw LMDB error, a batch lost. It waits for that write, and both batches are stored.
    `reads`: that write opens a read inside it (as run's check before each store does), which waited for the change
    while the change waited for the write: both stood still until the change gave up (GROW_WAIT_S) and failed its
    batch. The thread's own write already holds the change off, so its read goes on."""
    from kprof.ledger import _env

    monkeypatch.setattr(_env, "GROW_WAIT_S", 2.0)
    first, second = Ledger.open(ledger_path, map_size=64 * 1024), Ledger.open(ledger_path, map_size=64 * 1024)
    inside, real_change, errors = threading.Event(), _env._change_map, []

    def hold(txn):  # runs in the other thread's write transaction, once the change waits for it
        inside.set()
        time.sleep(0.3)
        if reads:
            second.last_seq

    def write_meanwhile():
        try:
            second.append([synth.event(5000)], before=hold)
        except Exception as exc:  # the finding
            errors.append(exc)

    other = threading.Thread(target=write_meanwhile)

    def change_meanwhile(*args):
        if other.ident is None:
            other.start()
            assert inside.wait(30)
        return real_change(*args)

    monkeypatch.setattr(_env, "_change_map", change_meanwhile)
    started = time.monotonic()
    try:
        result = first.append(list(synth.events(0, 400)))  # past the map: grows it
        other.join()
    finally:
        first.close()
        second.close()
    assert errors == [] and result.last_seq in (400, 401) and (not reads or time.monotonic() - started < 1.5)
    with Ledger.open(ledger_path, readonly=True) as led:
        assert led.last_seq == 401 and led.env.info()["map_size"] > 64 * 1024


# ---- 7. a second open for writing after another process grew the map ----------------------------------------------


def test_opening_for_writing_where_the_file_is_open_read_only_adopts_a_map_another_process_grew(tmp_path, ledger_path):
    Ledger.open(ledger_path).close()
    reader = Ledger.open(ledger_path, readonly=True, map_size=1 << 20)  # a 1 MiB map in this process
    assert reader.env.info()["map_size"] == 1 << 20
    _python(f"""
        import os
        from kprof.ledger import Ledger
        from kprof import synth
        led = Ledger.open({ledger_path!r}, map_size=1 << 20)
        led.append(list(synth.events(0, 1500)))
        assert os.path.getsize({ledger_path!r}) > 1 << 20 and led.env.info()["map_size"] > 1 << 20
    """, cwd=tmp_path)
    writer = Ledger.open(ledger_path)  # shares the reader's environment, whose map is now too small
    assert writer.last_seq == 1500 and reader.last_seq == 1500
    assert writer.append([synth.event(1500)]).last_seq == 1501
    assert reader.last_seq == 1501
    writer.close()
    reader.close()


# ---- 8. a read-only open while a writer creates the file ------------------------------------------------------


def _create_in_child(path: str, stage: str | None) -> int:
    """Forks a child that creates the ledger at `path` and exits; returns its pid. A `stage` pauses the
    creation where a reader can catch it: "empty", the file made but empty (LMDB has not written its header
    yet), then also the next; "no-dbs", the header written but kprof's sub-databases not committed (the
    writer's first transaction not done)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if stage == "empty":
                open(path, "wb").close()
                time.sleep(0.1)
            if stage is not None:
                lmdb.open(path, subdir=False, lock=True).close()  # writes the header: an LMDB file, no sub-dbs
                time.sleep(0.1)
            Ledger.open(path).close()
            code = 0
        finally:
            os._exit(code)
    return pid


def test_a_read_only_open_while_a_writer_creates_the_file_is_never_an_integrity_error(tmp_path):
    """Staged creations first (a reader polling the file catches each pause), then unstaged races; a
    file that is empty and stays so is still refused (not a ledger), after the short wait."""
    outcomes, want = [], []
    for trial, stage in enumerate(["empty", "no-dbs"] * 2 + [None] * 10):
        path = str(tmp_path / f"race{trial}.db")
        pid = _create_in_child(path, stage)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with Ledger.open(path, readonly=True) as led:
                        outcomes.append(led.last_seq)
                    break
                except LedgerError as exc:  # before the writer has created the file
                    assert "no ledger at" in str(exc)
                    assert time.monotonic() < deadline
                except IntegrityError as exc:
                    outcomes.append(f"trial {trial} (stage {stage}): {exc}")
                    break
        finally:
            _pid, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        want.append(0)
        assert outcomes == want

    empty = tmp_path / "empty.db"
    empty.touch()
    for readonly in (True, False):  # empty for good: nothing of a ledger in it (a usage error, exit 2)
        with pytest.raises(LedgerError, match="is not a kprof ledger \\(an empty file"):
            Ledger.open(str(empty), readonly=readonly)
    assert empty.stat().st_size == 0
