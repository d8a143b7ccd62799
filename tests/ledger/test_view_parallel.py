"""The two-process lookup (a helper process answers the tail of the specs) answers exactly as one process
does, from the same snapshot, and the helper lives and dies with the ledger that started it."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from unittest import mock

import msgspec
import pytest

from kprof.errors import SpecError
from kprof.ledger import _parallel, synth
from kprof.ledger.build import failed


class ElsewhereArgs(msgspec.Struct, frozen=True):
    """A KernelArgs type of this test module, which the helper process cannot import."""

    m: int
    n: int
    k: int
    dtype: str


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
def helper(view, monkeypatch):
    """Splits every lookup of ≥ 2 specs; the ledger's helper, started and ready."""
    monkeypatch.setattr(_parallel, "worth_it", lambda n: n >= 2)
    helper = _parallel.helper_for(view.ledger.path, wait=60)
    assert helper is not None, "the lookup helper did not start"
    return helper


def serial(fn):
    with mock.patch.object(_parallel, "worth_it", lambda n: False):
        return fn()


def fields(rows, specs):
    """Everything a row holds, and whether its spec is the very dict given."""
    return [(r.spec is s, r.spec, r.status, r.key, r.event_id, r.summary, r.base, r.to_json())
            for r, s in zip(rows, specs)]


def test_split_lookups_equal_one_process(view, specs, helper):
    rows = view.get_many(specs)
    assert {r.status for r in rows} == {"ok", "stale", "failed", "missing"}
    assert fields(rows, specs) == fields(serial(lambda: view.get_many(specs)), specs)
    assert all(r.spec is s for r, s in zip(rows, specs))  # canonical dicts are returned as given
    assert view.missing(specs) == serial(lambda: view.missing(specs))
    root, queried = view.query(specs)
    assert root.hex() == view.root and fields(queried, specs) == fields(rows, specs)
    assert helper.served == 3


def test_the_first_large_lookup_starts_the_helper_and_answers_alone(view, specs, monkeypatch):
    monkeypatch.setattr(_parallel, "worth_it", lambda n: n >= 2)
    assert view.missing(specs) == serial(lambda: view.missing(specs))  # no helper yet: answered here
    helper = _parallel.helper_for(view.ledger.path, wait=60)
    assert helper is not None and helper.served == 0
    view.missing(specs)
    assert helper.served == 1


def test_non_canonical_specs(view, specs, helper):
    specs = [dict(s, k=4096.0) if i % 5 == 0 else s for i, s in enumerate(specs)]  # an int given as a float
    rows = view.get_many(specs)  # rows carry the canonical specs, which only this process builds
    assert fields(rows, specs) == fields(serial(lambda: view.get_many(specs)), specs)
    assert all(type(r.spec["k"]) is int for r in rows) and helper.served == 0
    assert view.missing(specs) == serial(lambda: view.missing(specs))  # the helper normalizes them
    assert helper.served == 1


def test_a_dead_helper_is_answered_here_and_replaced(view, specs, helper):
    want_rows, want_missing = fields(serial(lambda: view.get_many(specs)), specs), serial(lambda: view.missing(specs))
    helper.proc.send_signal(signal.SIGKILL)
    helper.proc.wait()
    assert fields(view.get_many(specs), specs) == want_rows
    assert view.missing(specs) == want_missing
    fresh = _parallel.helper_for(view.ledger.path, wait=60)
    assert fresh is not None and fresh is not helper
    assert view.missing(specs) == want_missing and fresh.served == 1


@pytest.mark.parametrize("at", [3, 70])  # in this process's half, in the helper's
def test_an_invalid_spec_is_named_by_its_index(view, specs, helper, at):
    specs = specs[:at] + [dict(specs[at], dtype=5)] + specs[at + 1:]
    for lookup in (view.get_many, view.missing):
        with pytest.raises(SpecError) as split:
            lookup(specs)
        with pytest.raises(SpecError) as one:
            serial(lambda: lookup(specs))
        assert split.value.index == one.value.index == at and str(split.value) == str(one.value)
    assert view.missing(specs[:at]) == serial(lambda: view.missing(specs[:at]))  # the pipe is still in step


def test_a_snapshot_the_helper_cannot_see_is_answered_here(view, specs, helper):
    """The helper answers only from the requester's snapshot: a commit in between makes this process
    answer the tail itself, from its own (older) snapshot."""
    ledger = view.ledger
    with ledger.read() as txn:
        want = fields(serial(lambda: view._rows(txn, specs)), specs)
        ledger.append([synth.event(i, seed=7) for i in range(80)])  # every spec's row changes
        assert fields(view._rows(txn, specs), specs) == want
    assert helper.served == 0
    assert fields(view.get_many(specs), specs) != want and helper.served == 1


def test_a_busy_helper_is_not_waited_for(view, specs, helper):
    with helper.lock:  # another thread's lookup holds it
        assert view.missing(specs) == serial(lambda: view.missing(specs))
    assert helper.served == 0


def test_a_view_the_helper_cannot_rebuild_is_answered_here(ledger, specs, helper):
    ledger.append(list(synth.events(0, 60)))
    view = ledger.view(synth.TABLE, synth.BACKEND, synth.GPU, contract=synth.CONTRACT, args_type=ElsewhereArgs)
    assert view.missing(specs) == serial(lambda: view.missing(specs))  # refused there: no such module
    rows = view.get_many(specs)
    assert fields(rows, specs) == fields(serial(lambda: view.get_many(specs)), specs)
    assert helper.served == 0 and helper.proc.poll() is None


def test_the_helper_holds_no_snapshot_between_lookups(view, specs, helper):
    view.get_many(specs)
    readers = view.ledger.env.readers().splitlines()[1:]
    slots = [line.split() for line in readers if line.strip()]
    assert [s for s in slots if int(s[0]) == helper.proc.pid and s[2] != "-"] == []


def test_the_helper_stops_with_the_ledger(ledger_path, specs, monkeypatch):
    from kprof.ledger import Ledger

    monkeypatch.setattr(_parallel, "worth_it", lambda n: n >= 2)
    ledger = Ledger.open(ledger_path)
    ledger.append(list(synth.events(0, 10)))
    helper = _parallel.helper_for(ledger_path, wait=60)
    assert helper is not None and helper.proc.poll() is None
    ledger.close()
    assert helper.proc.poll() is not None
    assert os.path.realpath(ledger_path) not in _parallel._helpers


def test_the_helper_exits_when_its_requester_dies(ledger_path):
    from kprof.ledger import Ledger

    with Ledger.open(ledger_path) as ledger:
        ledger.append(list(synth.events(0, 10)))
    script = textwrap.dedent(f"""
        import os, time
        from kprof.ledger import Ledger, _parallel
        ledger = Ledger.open({ledger_path!r}, readonly=True)
        helper = _parallel.helper_for({ledger_path!r}, wait=60)
        print(helper.proc.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        helper_pid = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(helper_pid):
            time.sleep(0.05)
        assert not _alive(helper_pid)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie awaiting its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # 3.12+
def test_a_forked_child_does_not_use_its_parents_helper(view, specs, helper):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _parallel._helpers == {} else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert view.missing(specs) == serial(lambda: view.missing(specs)) and helper.served == 1


def test_summaries_survive_the_pipe(view, helper):
    specs = [synth.spec(i) for i in range(60)]
    rows = view.get_many(specs)
    assert helper.served == 1
    for i, row in enumerate(rows):
        if row.status == "ok":
            assert msgspec.to_builtins(row.summary.metrics) == synth.event(i).metrics


def test_a_helper_that_never_gets_ready_is_not_started_again(view, specs, monkeypatch):
    monkeypatch.setattr(_parallel, "worth_it", lambda n: n >= 2)
    monkeypatch.setattr(_parallel, "_never", set())
    started = []

    class Failing(_parallel.Helper):
        def __init__(self, path):
            started.append(path)
            super().__init__(path)
            self.proc.kill()  # dies before its ready byte, as a helper that cannot import kprof would

    monkeypatch.setattr(_parallel, "Helper", Failing)
    for _ in range(3):
        assert view.missing(specs) == serial(lambda: view.missing(specs))
        _parallel.helper_for(view.ledger.path, wait=5)
    assert len(started) == 1


def test_a_verb_of_the_cli_starts_no_helper(view, specs, tmp_path, monkeypatch):
    import json

    from kprof.cli import main

    monkeypatch.setattr(_parallel, "worth_it", lambda n: n >= 2)
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(specs))
    args = ["count-missing", synth.TABLE, "--backend", "torch-cpu", "--specs", str(path), "--db", view.ledger.path,
            "--gpu-name", synth.GPU, "--json"]
    with mock.patch.object(_parallel, "Helper", side_effect=AssertionError("a helper was started")):
        assert main(args) == 0
    from kprof import _process

    assert not _process.one_shot  # restored when the verb returns


def test_the_helper_answers_only_the_very_snapshot_it_was_asked_about(view, specs, helper):
    """A request names its snapshot by ledger id, transaction id and last sequence number: a file put in the
    ledger's place could repeat the transaction id, never the ledger id."""
    ledger = view.ledger
    with ledger.read() as txn:
        meta = ledger.dbs["meta"]
        snapshot = [txn.get(b"ledger_id", db=meta), txn.id(), txn.get(b"last_seq", db=meta)]
    config = [view.table, view.backend, view.gpu_key, msgspec.msgpack.encode(view.contract),
              synth.SynthArgs.__module__, synth.SynthArgs.__qualname__, False, specs]
    with ledger.read() as txn:
        want = view._ok_flags(txn, specs)
    for other in ([msgspec.msgpack.encode("another ledger"), *snapshot[1:]], [snapshot[0], snapshot[1] + 1, snapshot[2]],
                  [*snapshot[:2], msgspec.msgpack.encode(10**6)]):
        assert helper.ask(["flags", other, *config]) and helper.answer() is None
    assert helper.ask(["flags", snapshot, *config]) and bytes(helper.answer()) == want
    assert helper.served == 1
