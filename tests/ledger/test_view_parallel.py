"""The two-process lookup (a forked child answers the tail of the specs) answers exactly as one process does."""

import os
import random
import signal
import threading
from unittest import mock

import msgspec
import pytest

from kprof.errors import SpecError
from kprof.ledger import _parallel, synth
from kprof.ledger.build import failed
from kprof.ledger.view import View

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # 3.12+


@pytest.fixture
def view(ledger):
    """ok, stale, failed and missing rows, queried by a shuffled spec list with repeats."""
    ledger.append([synth.event(i, revision=0 if i % 4 == 2 else 1) for i in range(60)])
    ledger.append([failed(synth.event(i).provenance, "oom", "CUDA out of memory") for i in range(3, 60, 8)])
    return synth.view(ledger)


@pytest.fixture
def specs():
    specs = [synth.spec(i) for i in range(80)] + [synth.spec(i) for i in range(0, 80, 7)]
    random.Random(5).shuffle(specs)
    return specs


@pytest.fixture
def forks(monkeypatch):
    """Splits every lookup of ≥ 2 specs, on any machine and even where earlier tests left a library's idle
    thread pool (torch's) behind, which the child never touches; lists the children forked."""
    monkeypatch.setattr(_parallel, "worth_it", lambda n: n >= 2)
    pids = []
    real = os.fork

    def fork():
        pid = real()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    return pids


def reaped(pids) -> bool:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
            return False
        except ChildProcessError:
            pass
    return True


def serial(fn):
    with mock.patch.object(_parallel, "worth_it", lambda n: False):
        return fn()


def fields(rows, specs):
    """Everything a row holds, and whether its spec is the very dict given."""
    return [(r.spec is s, r.spec, r.status, r.key, r.event_id, r.summary, r.base, r.to_json())
            for r, s in zip(rows, specs)]


def test_split_lookups_equal_one_process(view, specs, forks):
    rows = view.get_many(specs)
    assert {r.status for r in rows} == {"ok", "stale", "failed", "missing"}
    assert fields(rows, specs) == fields(serial(lambda: view.get_many(specs)), specs)
    assert all(r.spec is s for r, s in zip(rows, specs))  # canonical dicts are returned as given
    assert view.missing(specs) == serial(lambda: view.missing(specs))
    root, queried = view.query(specs)
    assert root.hex() == view.root and fields(queried, specs) == fields(rows, specs)
    assert len(forks) == 3 and reaped(forks)


def test_non_canonical_specs_fall_back_to_one_process(view, specs, forks):
    specs = [dict(s, k=4096.0) if i % 5 == 0 else s for i, s in enumerate(specs)]  # an int given as a float
    rows = view.get_many(specs)
    assert fields(rows, specs) == fields(serial(lambda: view.get_many(specs)), specs)
    assert all(type(r.spec["k"]) is int for r in rows)  # rows carry the canonical specs
    assert view.missing(specs) == serial(lambda: view.missing(specs))


@pytest.mark.parametrize("how", ["raise", "crash"])
def test_a_failing_child_falls_back_to_one_process(view, specs, forks, monkeypatch, how):
    parent = os.getpid()

    def failing(real):
        def wrapped(self, txn, part):
            if os.getpid() != parent:
                if how == "crash":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("child failed")
            return real(self, txn, part)
        return wrapped

    want_rows, want_missing = serial(lambda: fields(view.get_many(specs), specs)), serial(lambda: view.missing(specs))
    monkeypatch.setattr(View, "_values", failing(View._values))
    monkeypatch.setattr(View, "_ok_flags", failing(View._ok_flags))
    assert fields(view.get_many(specs), specs) == want_rows
    assert view.missing(specs) == want_missing
    assert len(forks) == 2 and reaped(forks)


def test_no_fork_to_spare_answers_in_one_process(view, specs, forks, monkeypatch):
    def refuse():
        raise BlockingIOError("fork: Resource temporarily unavailable")

    want_rows, want_missing = serial(lambda: fields(view.get_many(specs), specs)), serial(lambda: view.missing(specs))
    monkeypatch.setattr(os, "fork", refuse)
    assert fields(view.get_many(specs), specs) == want_rows
    assert view.missing(specs) == want_missing


@pytest.mark.parametrize("at", [3, 70])  # in the parent's half, in the child's
def test_an_invalid_spec_is_named_by_its_index(view, specs, forks, at):
    specs = specs[:at] + [dict(specs[at], dtype=5)] + specs[at + 1:]
    for lookup in (view.get_many, view.missing):
        with pytest.raises(SpecError) as split:
            lookup(specs)
        with pytest.raises(SpecError) as one:
            serial(lambda: lookup(specs))
        assert split.value.index == one.value.index == at and str(split.value) == str(one.value)
    assert len(forks) == 2 and reaped(forks)  # a child whose parent failed first was killed, then reaped


def test_the_child_leaves_the_parents_reader_slot_alone(view, specs, forks):
    view.get_many(specs)
    with view.ledger.read():
        readers = view.ledger.env.readers()
    pids = {int(line.split()[0]) for line in readers.splitlines()[1:] if line.strip()}
    assert pids == {os.getpid()}


def test_no_split_in_a_threaded_process():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert not _parallel.worth_it(1 << 30)
    finally:
        stop.set()
        worker.join()


def test_summaries_survive_the_pipe(view, forks):
    specs = [synth.spec(i) for i in range(60)]
    rows = view.get_many(specs)
    for i, row in enumerate(rows):
        if row.status == "ok":
            assert msgspec.to_builtins(row.summary.metrics) == synth.event(i).metrics
