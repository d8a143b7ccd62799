"""The LMDB store: atomic idempotent appends, refused batches, versions, opening, map
growth and resolving citations. How events change the views is test_reducer's."""

import errno
import gc
import os
import random
import re
import subprocess
import sys
import threading

import lmdb
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kprof.errors import IntegrityError, LedgerError, LedgerVersionError, UsageError
from kprof.ledger import Ledger
from kprof import synth
from kprof.ledger import _codec, store
from kprof.ledger.audit import audit
from kprof.ledger.build import failed, retraction


def test_append_is_idempotent(ledger):
    evs = list(synth.events(0, 50))
    first = ledger.append(evs)
    assert len(first.added) == 50 and first.last_seq == 50
    again = ledger.append(evs + evs)
    assert again.added == [] and len(again.existing) == 100 and again.last_seq == 50
    assert ledger.last_seq == 50


def test_batches_commit_in_order_and_a_refused_batch_stops_the_rest(ledger):
    bad = msgspec.structs.replace(synth.event(100), key=b"\0" * 32)
    batches = [list(synth.events(0, 10)), list(synth.events(10, 20)), [synth.event(30), bad], list(synth.events(40, 50))]
    with pytest.raises(IntegrityError, match="provenance hashes to another key"):
        ledger.append_batches(batches)
    assert ledger.last_seq == 20  # the two batches before the refused one, whole; nothing of it or after
    view = synth.view(ledger)
    assert view.missing([synth.spec(i) for i in (0, 19, 30, 40)]) == [synth.spec(30), synth.spec(40)]
    results = ledger.append_batches([list(synth.events(0, 20)), list(synth.events(20, 25))])
    assert [(len(r.added), len(r.existing), r.last_seq) for r in results] == [(0, 20, 20), (5, 0, 25)]
    assert ledger.append_batches([]) == []
    assert audit(ledger.path).ok


@pytest.mark.parametrize("call", ["append", "append_batches"])
def test_an_event_where_a_batch_goes_is_a_usage_error_not_a_bare_type_error(ledger, call):
    """append(event) or append_batches([event, event]) (events, not batches of them) raised a bare TypeError
    ("'Measured' object is not iterable") from inside the store; it is a UsageError naming the type and the fix, and
    nothing is written. The meta and event reads, under one damage check in _get, still answer."""
    ev, other = synth.event(0), synth.event(1)
    with pytest.raises(UsageError, match="a batch is an iterable of events, not 'Measured'; pass a list: \\[event\\]"):
        ledger.append(ev) if call == "append" else ledger.append_batches([ev, other])
    assert ledger.last_seq == 0 and ledger.event(_codec.event_id(_codec.encode(ev))) is None
    with pytest.raises(UsageError, match="not 'int'"):
        ledger.append(5)
    eid = ledger.append([ev]).added[0]
    assert ledger.last_seq == 1 and ledger.event(eid).key == ev.key and len(ledger.ledger_id) == 32


def test_a_failing_write_of_a_batch_is_what_the_caller_sees(ledger, monkeypatch):
    def boom(self, fn):
        raise OSError("disk gone")

    monkeypatch.setattr(Ledger, "write", boom)
    with pytest.raises(OSError, match="disk gone"):
        ledger.append_batches([list(synth.events(0, 3)), list(synth.events(3, 6))])
    assert ledger.last_seq == 0


def test_retraction_of_unknown_event_is_refused_whole(ledger):
    ev = synth.event(0)
    with pytest.raises(UsageError, match="append the target first"):
        ledger.append([synth.event(1), retraction(b"\0" * 32, ev.key, "x")])
    assert ledger.last_seq == 0


def test_retraction_of_another_keys_event_is_refused_whole(ledger):
    """A retraction names its own key: one naming a stored event of another key would retract nothing of its key
    (and hide the other row in audits), so it is refused as an unknown target is, and nothing is written."""
    other, mine = synth.event(0), synth.event(1)
    oid = ledger.append([other, mine]).added[0]
    with pytest.raises(UsageError, match=f"names event {oid.hex()[:16]}, which is not in this ledger under key"):
        ledger.append([synth.event(2), retraction(oid, mine.key, "x")])
    assert ledger.last_seq == 2


def test_event_with_forged_key_is_refused(ledger):
    ev = msgspec.structs.replace(synth.event(0), key=b"\1" * 32)
    with pytest.raises(IntegrityError, match="provenance hashes to another key"):
        ledger.append([synth.event(1), ev])
    assert ledger.last_seq == 0


def test_appending_to_a_key_whose_history_entry_is_damaged_is_refused_naming_it(ledger):
    ev = synth.event(0, seed=1)
    ledger.append([ev])
    ledger.write(lambda txn: txn.put(ev.key, b"\xc1", db=ledger.dbs["history"]))  # 0xc1: never valid msgpack
    with pytest.raises(IntegrityError, match=f"history: entry {ev.key.hex()} is damaged: it cannot be decoded"):
        ledger.append([synth.event(0, seed=2)])
    assert ledger.last_seq == 1


def test_a_meta_value_of_another_type_is_damage_naming_meta_not_a_decoding_error(ledger):
    ledger.write(lambda txn: txn.put(b"ledger_id", _codec.encode(5), db=ledger.dbs["meta"]))
    with pytest.raises(IntegrityError, match="reading sub-database `meta` failed"):
        ledger.ledger_id


def test_a_writer_refuses_a_ledger_that_holds_events_but_lost_its_format_version_and_writes_nothing(ledger_path):
    """Opened as a new file, its last_seq would read 0 again: the next append would log over its first events."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 3)))
        led.write(lambda txn: txn.delete(b"format_version", db=led.dbs["meta"]))
    with open(ledger_path, "rb") as f:
        before = f.read()
    with pytest.raises(IntegrityError, match=f"ledger {ledger_path} holds events but no format version"):
        Ledger.open(ledger_path)
    with pytest.raises(IntegrityError, match=f"{ledger_path} is an LMDB file but not a kprof ledger"):
        Ledger.open(ledger_path, readonly=True)
    with open(ledger_path, "rb") as f:
        assert f.read() == before


def test_map_full_grows_and_retries(tmp_path):
    led = Ledger.open(str(tmp_path / "small.db"), map_size=256 * 1024)
    for b in range(0, 3000, 500):
        led.append(list(synth.events(b, b + 500)))
    assert led.last_seq == 3000 and led.env.info()["map_size"] > 256 * 1024
    led.close()
    assert audit(str(tmp_path / "small.db")).ok


@pytest.mark.parametrize("newer", [_codec.FORMAT_VERSION + 1, 99])
def test_newer_format_is_refused_naming_both_versions(ledger_path, newer):
    led = Ledger.open(ledger_path)
    led.write(lambda txn: txn.put(b"format_version", _codec.encode(newer), db=led.dbs["meta"]))
    led.close()
    with open(ledger_path, "rb") as f:
        before = f.read()
    expect = rf"format version {newer}, but this kprof reads versions up to {_codec.FORMAT_VERSION}"
    for readonly in (True, False):  # a writer that cannot read it does not touch it either
        with pytest.raises(LedgerVersionError, match=expect):
            Ledger.open(ledger_path, readonly=readonly)
    with open(ledger_path, "rb") as f:
        assert f.read() == before


def test_readonly_open_of_missing_file_and_directory(tmp_path):
    with pytest.raises(LedgerError, match="no ledger at"):
        Ledger.open(str(tmp_path / "nope.db"), readonly=True)
    with pytest.raises(LedgerError, match="is a directory"):
        Ledger.open(str(tmp_path))
    assert not os.path.exists(tmp_path / "nope.db")


def test_a_path_whose_name_is_not_utf8_opens_as_the_os_names_it(tmp_path):
    """A file name in another encoding reaches Python as surrogate escapes (os.fsdecode); LMDB took it as UTF-8 text
    and raised UnicodeEncodeError. The ledger is the file of that very name."""
    p = os.path.join(str(tmp_path), os.fsdecode(b"r\xe9sultats.db"))
    with Ledger.open(p) as ledger:
        ledger.append([synth.event(0)])
    assert os.path.exists(os.fsencode(p))
    with Ledger.open(p, readonly=True) as ledger:
        assert synth.view(ledger).get_many([synth.spec(0)])[0].ok


def test_a_new_ledger_in_a_directory_that_is_not_there_names_the_directory(tmp_path):
    """LMDB's "No such file or directory" on a new ledger's path did not say that its directory is what is missing."""
    with pytest.raises(LedgerError, match=f"there is no directory {re.escape(str(tmp_path / 'nodir'))}; check the"):
        Ledger.open(str(tmp_path / "nodir" / "x.db"))
    assert os.listdir(tmp_path) == []


def test_readonly_ledger_refuses_writes(ledger_path):
    Ledger.open(ledger_path).close()
    ro = Ledger.open(ledger_path, readonly=True)
    with pytest.raises(LedgerError, match="read-only"):
        ro.append([synth.event(0)])
    ro.close()


def test_lmdb_file_that_is_not_a_ledger(tmp_path):
    p = str(tmp_path / "other.db")
    env = lmdb.open(p, subdir=False)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"b")
    env.close()
    with pytest.raises((IntegrityError, LedgerError)):
        Ledger.open(p, readonly=True)


def test_resolve_by_citation_key_and_prefix(ledger):
    ledger.append(list(synth.events(0, 20)))
    row = synth.view(ledger).get(**synth.spec(5))
    by_cite = ledger.resolve(row.citation)
    assert by_cite.kind == "event" and by_cite.event_id == row.event_id and len(by_cite.history) == 1
    by_key = ledger.resolve(row.key.hex()[:12])
    assert by_key.kind == "key" and by_key.current == row.event_id
    with pytest.raises(UsageError, match="not a citation"):
        ledger.resolve("xyz")
    with pytest.raises(UsageError, match="nothing in"):
        ledger.resolve("kprof.00000000000000000000")




_APPEND = "import sys; from kprof import synth; from kprof.ledger import Ledger; " \
          "Ledger.open(sys.argv[1]).append(list(synth.events(int(sys.argv[2]), int(sys.argv[2]) + 2)))"


def test_a_writer_whose_lock_file_was_removed_refuses_to_commit_over_another_writer(tmp_path):
    """`<ledger>-lock` removed while a writer has the ledger open (a `git clean -X`, a clean-up script): the next
    process makes a new one, and LMDB's write lock no longer excludes the two. The first writer's commit landed on
    the other's, whose rows were lost (two writers through the two locks lost every row and left the file damaged);
    now a commit checks the lock file is still the one opened, and the first writer refuses, writing nothing."""
    path = str(tmp_path / "l.db")
    with Ledger.open(path) as held:
        held.append(list(synth.events(0, 2)))
        os.remove(path + "-lock")

        def during(txn):  # another process appends through a lock file of its own, while this write is open
            subprocess.run([sys.executable, "-c", _APPEND, path, "10"], check=True, timeout=120)
            txn.put(b"last_seq", _codec.encode(99), db=held.dbs["meta"])

        with pytest.raises(LedgerError, match=f"the lock file {re.escape(path)}-lock of ledger {re.escape(path)} was "
                                              f"replaced or removed since this process opened it; open it again"):
            held.write(during)
        with pytest.raises(LedgerError, match="lock file .* was replaced or removed"):
            synth.view(held).count_missing([synth.spec(0)])
    with Ledger.open(path, readonly=True) as fresh:
        assert fresh.last_seq == 4 and synth.view(fresh).count_missing([synth.spec(i) for i in (0, 1, 10, 11)]) == 0
    assert audit(path).ok


def test_a_writer_of_a_ledger_replaced_in_place_refuses_to_append(tmp_path, ledger_path):
    """A writer went on committing into the file it opened after another was moved to its path: every row it then
    reported stored was in a file no name reached any more (lost). Its appends refuse now, as its reads did."""
    with Ledger.open(ledger_path) as held:
        held.append(list(synth.events(0, 2)))
        with Ledger.open(str(tmp_path / "new.db")) as other:
            other.append(list(synth.events(5, 6)))
        os.replace(tmp_path / "new.db", ledger_path)
        with pytest.raises(LedgerError, match="was replaced or removed since this process opened it"):
            held.append(list(synth.events(2, 4)))
    with Ledger.open(ledger_path, readonly=True) as fresh:
        assert fresh.last_seq == 1


@pytest.mark.parametrize("readonly", [True, False])
def test_a_lock_file_that_is_a_directory_is_named(tmp_path, readonly):
    """`<ledger>-lock` a directory: LMDB's error named the ledger file ("p.db: Is a directory"), which is a file."""
    path = str(tmp_path / "p.db")
    with Ledger.open(path) as led:
        led.append(list(synth.events(0, 1)))
    os.remove(path + "-lock")
    os.mkdir(path + "-lock")
    with pytest.raises(LedgerError, match=f"cannot open ledger {re.escape(path)}: its lock file {re.escape(path)}-lock "
                                          f"is a directory: remove it"):
        Ledger.open(path, readonly=readonly)
    os.rmdir(path + "-lock")
    with Ledger.open(path, readonly=True) as led:
        assert led.last_seq == 1


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="no posix_fallocate (macOS)")
@pytest.mark.parametrize("readonly", [True, False])
def test_a_lock_file_has_its_disk_blocks_before_lmdb_maps_it(tmp_path, readonly):
    """LMDB sizes `<ledger>-lock` (a hole) and writes its reader table through a map of it: on a full disk the first
    write to a page no block backed faulted (SIGBUS), and every verb, `kprof audit` too, said the ledger was damaged
    (exit 3). Its blocks are taken before LMDB opens it, where a full disk refuses them (the next test); a lock file
    a killed open left as a hole gets them too."""
    path = str(tmp_path / "p.db")
    with Ledger.open(path) as led:
        led.append(list(synth.events(0, 1)))
    for left in ("none", "a hole"):
        os.remove(path + "-lock")
        if left == "a hole":
            with open(path + "-lock", "wb") as f:
                f.truncate(32768)
        with Ledger.open(path, readonly=readonly) as led:
            assert led.last_seq == 1
        st = os.stat(path + "-lock")
        assert st.st_size == 32768 and st.st_blocks * 512 >= st.st_size, (left, st)


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="no posix_fallocate (macOS)")
@pytest.mark.parametrize("readonly", [True, False])
def test_a_full_disk_refusing_the_lock_file_is_named_not_read_as_damage(tmp_path, monkeypatch, readonly):
    path = str(tmp_path / "p.db")
    with Ledger.open(path) as led:
        led.append(list(synth.events(0, 1)))
    os.remove(path + "-lock")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(LedgerError, match=f"cannot open ledger {re.escape(path)}: its lock file {re.escape(path)}-lock "
                                          f"cannot take its 32 KiB \\(No space left on device\\): the disk is full or "
                                          f"past a file size limit \\(ulimit -f\\); free space and run again"):
        Ledger.open(path, readonly=readonly)
    monkeypatch.undo()
    with Ledger.open(path, readonly=True) as led:  # once there is space, as it was
        assert led.last_seq == 1


def test_a_writer_refuses_a_ledger_of_several_hard_links_and_a_reader_reads_it(tmp_path):
    """Two hard links to one ledger are two names, each with a lock file of its own (`<name>-lock`): two writers, one
    through each, did not exclude each other, and their commits overwrote each other's (every row lost, the file left
    damaged). A writer through any name of such a file refuses now, naming the fix; a reader reads it."""
    path = str(tmp_path / "a.db")
    with Ledger.open(path) as led:
        led.append(list(synth.events(0, 2)))
    os.link(path, tmp_path / "b.db")
    for name in (path, str(tmp_path / "b.db")):
        with pytest.raises(LedgerError, match=f"ledger {re.escape(name)} has 2 hard links, each name with a lock file "
                                              f"of its own: .*; keep one name"):
            Ledger.open(name)
        with Ledger.open(name, readonly=True) as reader:
            assert reader.last_seq == 2
    os.remove(tmp_path / "b.db")
    with Ledger.open(path) as led:
        assert led.append(list(synth.events(2, 3))).last_seq == 3


@pytest.mark.parametrize("how", ["os.replace", "rm and create"])
def test_a_ledger_replaced_in_place_is_read_anew_and_the_earlier_reader_refuses(tmp_path, ledger_path, how):
    """A file replaced at the path is another file: a new open reads it, not the environment this process holds on
    the earlier one, and a reader of the earlier one says so instead of answering from it."""
    specs = [synth.spec(i) for i in range(5)]
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 2)))
    held = Ledger.open(ledger_path, readonly=True)
    view = synth.view(held)
    assert view.count_missing(specs) == 3
    if how == "os.replace":
        with Ledger.open(str(tmp_path / "new.db")) as led:
            led.append(list(synth.events(0, 5)))
        os.replace(tmp_path / "new.db", ledger_path)
    else:
        os.remove(ledger_path)
        with Ledger.open(ledger_path) as led:
            led.append(list(synth.events(0, 5)))
    with Ledger.open(ledger_path, readonly=True) as fresh:
        assert synth.view(fresh).count_missing(specs) == 0
    with pytest.raises(LedgerError, match=f"ledger {ledger_path} was replaced or removed since this process opened "
                                          f"it; open it again"):
        view.count_missing(specs)
    held.close()


def test_a_file_truncated_under_a_live_reader_is_an_integrity_error_not_a_crash(tmp_path, ledger_path):
    """A reader whose environment is open (a second open shares it, as perf_api's cached views do) checks the file's
    length before each read: reading past its end would kill the process (SIGBUS). In a child, so that a crash
    fails the test instead of ending it."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 50)))
    script = ("import os, sys\nfrom kprof import synth\nfrom kprof.errors import IntegrityError\n"
              "from kprof.ledger import Ledger\n"
              "held = Ledger.open(sys.argv[1], readonly=True)\nview = synth.view(held)\n"
              "assert view.count_missing([synth.spec(0)]) == 0\nos.truncate(sys.argv[1], 8192)\n"
              "for call in (lambda: view.count_missing([synth.spec(1)]), lambda: Ledger.open(sys.argv[1], "
              "readonly=True)):\n"
              "    try:\n        call()\n    except IntegrityError as exc:\n        print(exc)\n")
    done = subprocess.run([sys.executable, "-c", script, ledger_path], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(re.fullmatch(f"ledger {re.escape(ledger_path)} is truncated: 8192 bytes on disk, "
                                                f"its header says [0-9]+; run `kprof audit` for the full report, and "
                                                f"restore the file from a copy", line) for line in lines), lines


def test_a_lock_file_this_user_cannot_write_is_named(ledger_path, monkeypatch):
    Ledger.open(ledger_path).close()
    os.chmod(ledger_path + "-lock", 0o444)
    real_access = os.access

    def as_another_user(path, *args, **kw):  # what LMDB says where the lock file is another user's, read-only
        raise lmdb.Error(f"{path}: Permission denied")

    monkeypatch.setattr(lmdb, "open", as_another_user)
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == ledger_path + "-lock" else real_access(p, mode))
    with pytest.raises(LedgerError, match=f"cannot open ledger {ledger_path}: this user cannot write its lock file "
                                          f"{ledger_path}-lock, where LMDB registers every reader; have its owner "
                                          f"make it writable"):
        Ledger.open(ledger_path, readonly=True)


# ---- threads: one environment per file, opened and released under one lock -------------------------------------


def test_two_threads_opening_one_file_at_once_share_one_environment(ledger_path, monkeypatch):
    """LMDB allows one environment per file in a process: a thread opening the file while another one's open is under
    way must wait for it and share its environment, not open a second (lmdb refuses it: one open failed)."""
    Ledger.open(ledger_path).close()
    real_open, second = lmdb.open, threading.Event()
    calls: list[str] = []

    def open_slowly(*args, **kwargs):  # the first open waits (a while) for a second thread's open to reach LMDB
        calls.append(threading.current_thread().name)
        second.set() if len(calls) > 1 else second.wait(2)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(lmdb, "open", open_slowly)
    opened, errors = {}, []

    def reader(name):
        try:
            opened[name] = Ledger.open(ledger_path, readonly=True)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(name,), name=name) for name in "ab"]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    try:
        assert errors == [] and calls == calls[:1] and opened["a"].env is opened["b"].env
    finally:
        [led.close() for led in opened.values()]


def test_a_thread_closing_the_last_user_of_a_file_never_closes_it_under_another_threads_open(ledger_path, monkeypatch):
    """A close that released the file's environment while another thread's open had found it shared (and not yet
    counted itself) closed it under that open, which read as a damaged ledger (exit 3)."""
    with Ledger.open(ledger_path) as led:
        led.append(list(synth.events(0, 3)))
    first = Ledger.open(ledger_path, readonly=True)
    real_check, closer = store._check_file, threading.Thread(target=first.close)

    def close_meanwhile(*args):  # the second open, its environment found: the first ledger closes now (or waits)
        if not closer.is_alive() and closer.ident is None:
            closer.start()
            closer.join(2)
        return real_check(*args)

    monkeypatch.setattr(store, "_check_file", close_meanwhile)
    with Ledger.open(ledger_path, readonly=True) as second:
        closer.join()
        assert synth.view(second).count_missing([synth.spec(i) for i in range(5)]) == 2
    assert os.path.realpath(ledger_path) not in store._envs


def test_the_environment_of_a_ledger_collected_unclosed_is_closed_when_another_file_is_opened(tmp_path):
    """A Ledger dropped without close kept its LMDB environment (the file's and its lock file's descriptors, its
    mapping) until the process ended: a simulator opening the ledgers of many files that way ran out of descriptors."""
    paths = [str(tmp_path / f"{i}.db") for i in range(3)]
    for path in paths:
        with Ledger.open(path) as led:
            led.append(list(synth.events(0, 2)))
    dropped, kept = Ledger.open(paths[0], readonly=True), Ledger.open(paths[1], readonly=True)
    env, specs = dropped.env, [synth.spec(0), synth.spec(1)]
    assert synth.view(dropped).count_missing(specs) == 0
    del dropped
    gc.collect()
    with Ledger.open(paths[2], readonly=True) as third:
        assert synth.view(third).count_missing(specs) == 0
    with pytest.raises(lmdb.Error, match="closed"):
        env.stat()
    assert os.path.realpath(paths[0]) not in store._envs
    assert synth.view(kept).count_missing(specs) == 0  # a Ledger alive keeps its own
    kept.close()
    with Ledger.open(paths[0], readonly=True) as again:
        assert synth.view(again).count_missing(specs) == 0


def test_no_transaction_of_another_thread_begins_while_a_thread_changes_the_map(ledger_path, monkeypatch):
    """A map change (here adopting the size another process grew the map to) ends every transaction of the process:
    another thread's read that began meanwhile, or a second change, failed inside LMDB and read as a damaged ledger
    (IntegrityError, exit 3). A read arriving during a change waits for it. (The other process writes past the map.)"""
    import time

    from kprof.ledger import _env

    with Ledger.open(ledger_path, map_size=1 << 20) as led:
        led.append(list(synth.events(0, 3)))
    reader = Ledger.open(ledger_path, readonly=True, map_size=1 << 20)
    grow = ("import sys\nfrom kprof import synth\nfrom kprof.ledger import Ledger\n"
            "with Ledger.open(sys.argv[1], map_size=1 << 24) as led:\n    led.append(list(synth.events(3, 2000)))\n")
    subprocess.run([sys.executable, "-c", grow, ledger_path], check=True, timeout=120)
    began, waiting, real_begin, real_change = threading.Event(), threading.Event(), store._begin, _env._change_map

    class Watched:  # the exclusion, noting when a thread waits for it
        def __init__(self, lock):
            self.lock = lock

        def acquire(self, blocking=True):
            return self.lock.acquire(blocking)

        def release(self):
            self.lock.release()

        def __enter__(self):
            if not self.lock.acquire(blocking=False):
                waiting.set()
                self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    answers, seen = {}, []

    def read(name):
        answers[name] = [row.status for row in synth.view(reader).get_many([synth.spec(i) for i in range(5)])]

    other = threading.Thread(target=read, args=("other",))

    def change_meanwhile(*args):  # the first change: another thread reads now, and begins (or waits)
        if other.ident is None:
            other.start()
            deadline = time.monotonic() + 60
            while not (began.is_set() or waiting.is_set()) and time.monotonic() < deadline:
                time.sleep(0.001)
            seen.append(began.is_set())
        return real_change(*args)

    watched = Watched(getattr(_env, "_mapping", threading.RLock()))
    monkeypatch.setattr(_env, "_mapping", watched, raising=False)
    monkeypatch.setattr(store, "_mapping", watched, raising=False)
    monkeypatch.setattr(store, "_begin", lambda *args: (other.ident == threading.get_ident() and began.set())
                        or real_begin(*args))
    monkeypatch.setattr(_env, "_change_map", change_meanwhile)
    try:
        read("first")
        other.join()
    finally:
        reader.close()
    assert seen == [False]
    assert answers == {"first": ["ok"] * 5, "other": ["ok"] * 5}


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_the_ledger_and_its_lock_file_are_made_as_the_umask_allows(tmp_path, umask, mode):
    """The ledger and its lock file were made rw-r--r-- whatever the umask, so under umask 002 in a group's directory
    a teammate could not even read the ledger (LMDB's readers write the lock file's reader table); both are made as
    the umask allows now, as the claims and segments are."""
    code = "import sys; from kprof.ledger import Ledger; Ledger.open(sys.argv[1]).close()"
    db = tmp_path / "p.db"
    subprocess.run([sys.executable, "-c", code, str(db)], check=True, preexec_fn=lambda: os.umask(umask))
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()} == \
        {"p.db": oct(mode), "p.db-lock": oct(mode)}


def test_a_ledger_opened_out_of_file_descriptors_names_ulimit_n_not_its_permissions(tmp_path):
    """Opening a ledger with no descriptor left (`ulimit -n`) said "Too many open files; check the path and its
    permissions" to a Python caller (a simulator's perf_api lookups in a batch job): it names the limit and its fix."""
    db = str(tmp_path / "p.db")
    Ledger.open(db).close()
    code = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
            "from kprof.ledger import Ledger\nheld = []\n"
            "while len(held) < 70:\n    try:\n        held.append(os.open(os.devnull, os.O_RDONLY))\n"
            "    except OSError:\n        break\n"
            "os.close(held.pop())\n"
            "try:\n    Ledger.open(sys.argv[1], readonly=True)\nexcept Exception as exc:\n    print(exc)\n")
    said = subprocess.run([sys.executable, "-c", code, db], capture_output=True, text=True, check=True).stdout
    assert said.startswith(f"cannot open ledger {db}: too many open files (") and "ulimit -n 64" in said, said
    assert "permissions" not in said


def test_close_if_idle_closes_only_a_ledger_no_read_of_this_process_is_in(ledger_path):
    """perf_api closed its least recently read ledgers by taking the ledger package's private locks and reading its
    registry of open reads; the ledger says it itself: close_if_idle leaves a ledger with a read in it (this thread's,
    or another's) open and says so, and closes one without, which then refuses reads."""
    with Ledger.open(ledger_path) as writer:
        writer.append(list(synth.events(0, 3)))
    ledger = Ledger.open(ledger_path, readonly=True)
    with ledger.read():
        assert ledger.close_if_idle() is False and not ledger.closed
    started, finish = threading.Event(), threading.Event()

    def read():
        with ledger.read():
            started.set()
            finish.wait(10)

    thread = threading.Thread(target=read)
    thread.start()
    started.wait(10)
    try:
        assert ledger.close_if_idle() is False and not ledger.closed
    finally:
        finish.set()
        thread.join()
    assert ledger.close_if_idle() is True and ledger.closed
    with pytest.raises(LedgerError, match="is closed"):
        ledger.last_seq
    assert ledger.close_if_idle() is True  # closed already
