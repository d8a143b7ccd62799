"""Segments (kprof.merge.segment) and merges (kprof.merge.merge): a round trip gives the same rows and view root;
every damaged, reordered or forged segment is rejected whole with nothing written; conflicts merge nothing and
leave a report; a fast-forward merges; re-merging is a no-op; disjoint ledgers merged both ways agree."""

import hashlib
import json
import os
import re
import subprocess
import sys

import msgspec
import pytest

from kprof.cli import main
from kprof.errors import MergeConflict, UsageError
from kprof.ledger import Ledger, _codec
from kprof import synth
from kprof.ledger.audit import audit
from kprof.ledger.build import retraction
from kprof.ledger.events import Retracted
from kprof.merge import segment
from kprof.merge.export import export
from kprof.merge.merge import merge
from kprof.merge.segment import SegmentError

SPECS = [synth.spec(i) for i in range(60)]


def _ledger(path, events) -> str:
    with Ledger.open(str(path)) as led:
        led.append(list(events))
    return str(path)


def _answers(path) -> tuple:
    with Ledger.open(path, readonly=True) as led:
        view = synth.view(led)
        rows = view.get_many(SPECS)
        return view.root, [(r.status, r.citation, r.metrics) for r in rows]


def _digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _eid(event) -> bytes:
    return _codec.event_id(_codec.encode(event))


@pytest.fixture
def source(tmp_path):
    """A ledger of 40 rows, a re-measurement with its parent, a failure and a retraction; its segment."""
    again = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(synth.event(3)))
    gone = synth.event(5, seed=4)
    path = _ledger(tmp_path / "src.db", [*synth.events(0, 40), again, gone])
    with Ledger.open(path) as led:
        led.append([retraction(_eid(gone), gone.key, "a bad clock", at=1.8e9)])
    seg = str(tmp_path / "src.kseg")
    export(path, seg)
    return path, seg


def test_export_then_merge_into_an_empty_ledger_reads_the_same(tmp_path, source):
    path, seg = source
    header = segment.header_of(seg)
    with Ledger.open(path, readonly=True) as led:
        assert header.events == led.last_seq and header.ledger_id == led.ledger_id
    target = str(tmp_path / "copy.db")
    result = merge([seg], target)
    assert (result.added, result.existing) == (header.events, 0)
    assert _answers(target) == _answers(path)
    assert audit(target).ok
    again = merge([seg], target)  # re-merging is a no-op
    assert (again.added, again.existing) == (0, header.events) and _answers(target) == _answers(path)
    with Ledger.open(target, readonly=True) as led:
        assert led.last_seq == header.events
    assert audit(target).ok


def test_events_given_twice_among_the_segments_are_not_counted_as_already_there(tmp_path, capsys):
    """Two exports of overlapping ranges (a directory of segments a team commits) merged into a new ledger said
    "merged 30 new event(s) (20 already there)": nothing was there; 20 were given twice. Merged again, 70 (the
    segments' events) were "already there" in a ledger of 30."""
    path = _ledger(tmp_path / "src.db", synth.events(0, 30))
    rows = tmp_path / "rows"
    rows.mkdir()
    export(path, str(rows / "all.kseg"))
    export(path, str(rows / "late.kseg"), since=10)
    target = str(tmp_path / "new.db")
    result = merge([str(rows)], target)
    assert (result.added, result.existing, result.repeated) == (30, 0, 20)
    again = merge([str(rows)], target)
    assert (again.added, again.existing, again.repeated) == (0, 30, 20) and audit(target).ok
    assert main(["merge", str(rows / "late.kseg"), str(rows / "all.kseg"), "--db", str(tmp_path / "cli.db")]) == 0
    assert "merged 30 new event(s) into " in (out := capsys.readouterr().out)
    assert "(0 already there, 20 repeated in the segments) from 2 segment(s)" in out, out


def test_export_filters_and_since(tmp_path, source):
    path, _ = source
    everything = export(path, str(tmp_path / "all.kseg")).events
    assert everything == 43 and export(path, str(tmp_path / "gpu.kseg"), gpu_name=synth.GPU).events == everything
    later = str(tmp_path / "later.kseg")
    assert export(path, later, since=40).events == 3  # the re-measurement, the failure... after seq 40
    with pytest.raises(UsageError, match="exists"):
        export(path, later)
    # rows of another GPU and another backend beside them: each filter exports its own rows only
    with Ledger.open(path) as led:
        led.append([synth.event(0, gpu="Other GPU"), synth.event(1, gpu="Other GPU"), synth.event(2, backend="other")])
    assert export(path, str(tmp_path / "gpu2.kseg"), gpu_name=synth.GPU).events == everything + 1  # backend other
    assert export(path, str(tmp_path / "other.kseg"), gpu_name="Other GPU").events == 2
    assert export(path, str(tmp_path / "backend.kseg"), backend="other").events == 1
    assert export(path, str(tmp_path / "both.kseg"), backend=synth.BACKEND, gpu_name=synth.GPU).events == everything


@pytest.mark.parametrize("kwargs, named", [({"since": 1.5}, "since=1.5 is not a whole number"),
                                           ({"since": True}, "since=True is not a whole number"),
                                           ({"since": "5"}, "since='5' is not a whole number"),
                                           ({"output": None}, "output=None is not a path"),
                                           ({"output": 5}, "output=5 is not a path")])
def test_export_refuses_python_arguments_of_the_wrong_type_and_writes_nothing(tmp_path, source, kwargs, named,
                                                                             monkeypatch):
    """From Python, since=1.5 exported from seq 2 and since=True from seq 2 (the verb's --since refuses both), and
    since='5' or output=None raised a raw TypeError/AttributeError: each is a UsageError naming the value."""
    path, _ = source
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(UsageError, match=re.escape(named)):
        export(path, **{"output": "out.kseg", **kwargs})
    assert sorted(os.listdir(tmp_path)) == before

    class Seq:  # a whole number of another type (np.int64) reads as the number it holds
        def __index__(self):
            return 40

    assert export(path, "seq.kseg", since=Seq()).events == 3


@pytest.mark.parametrize("flag", ["table", "backend", "gpu_name"])
def test_export_refuses_a_filter_no_scope_matches_and_writes_nothing(tmp_path, source, flag):
    """A mistyped filter would write an empty segment: refused, naming the value and the scopes the ledger holds."""
    path, _ = source
    with pytest.raises(UsageError, match=f"match --{flag.replace('_', '-')} 'nosuch'.*{synth.GPU}") as err:
        export(path, str(tmp_path / "out.kseg"), **{flag: "nosuch"})
    assert "kprof scopes" in str(err.value) and not os.path.lexists(tmp_path / "out.kseg")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out.kseg")]


def test_the_scopes_a_filter_no_scope_matches_names_list_the_ledger_exported(tmp_path, capsys):
    """`kprof export --db 'team ledgers/p.db' --table nosuch` said "(`kprof scopes` lists them)": pasted, that lists
    $KPROF_DB's or ./profile.db's scopes (here: no ledger, exit 2). Run as printed, it lists the exported ledger's."""
    import shlex

    (tmp_path / "team ledgers").mkdir()
    path = _ledger(tmp_path / "team ledgers" / "p.db", synth.events(0, 2))
    prog = (sys.executable, "-m", "kprof")
    assert main(["export", "--db", path, "--table", "nosuch", "-o", str(tmp_path / "out.kseg")], prog=prog) == 2
    err = " ".join(capsys.readouterr().err.split())
    command = err[err.index(f"`{shlex.join(prog)} scopes"):].split("`")[1]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    env.pop("KPROF_DB", None)
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and synth.GPU in done.stdout, (command, done.stdout, done.stderr)


@pytest.mark.parametrize("output, needle", [("", "is empty"), ("nodir/x.kseg", "does not exist"),
                                            ("a-file/x.kseg", "a-file is not a directory")])
def test_export_refuses_an_output_it_cannot_write_before_reading_the_ledger(tmp_path, source, capsys, output,
                                                                           needle, refused, monkeypatch):
    path, _ = source
    (tmp_path / "a-file").write_text("x")
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    refused(["export", "-o", output, "--db", path], needle, "give a new file path in a writable directory")
    assert sorted(os.listdir(tmp_path)) == before  # no `.part` file, no segment


def test_export_into_a_new_directory_and_with_nothing_after_since(tmp_path, source, capsys, monkeypatch):
    """`-o rows/` makes the directory; --since at the last event writes no empty segment (exit 0, said so); past it,
    a usage error naming the last seq."""
    path, _ = source
    monkeypatch.chdir(tmp_path)
    assert main(["export", "-o", "rows/", "--db", path, "--since", "40"]) == 0
    assert "wrote 3 event(s)" in capsys.readouterr().out and len(os.listdir(tmp_path / "rows")) == 1
    with Ledger.open(path, readonly=True) as led:
        last = led.last_seq
    assert main(["export", "-o", "more/", "--db", path, "--since", str(last), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["segment"] is None and doc["events"] == 0 and not os.path.exists(tmp_path / "more")
    assert main(["export", "-o", "rows/", "--db", path, "--since", str(last)]) == 0
    assert f"no event of {path} to export after seq {last}: no segment written" in capsys.readouterr().out
    assert len(os.listdir(tmp_path / "rows")) == 1
    assert main(["export", "-o", "rows/", "--db", path, "--since", str(last + 1)]) == 2
    assert f"the ledger's last event is seq {last}" in capsys.readouterr().err


def test_export_makes_a_new_directory_with_its_parents(tmp_path, source, capsys, monkeypatch, refused):
    """`-o rows/h200/` (a directory by its trailing /) is made as `rows/` is, parents too: it was refused, "rows does
    not exist; ... or a directory (ending in /)", the very form it had been given. A file on the way is refused."""
    path, _ = source
    monkeypatch.chdir(tmp_path)
    assert main(["export", "-o", "rows/h200/", "--db", path]) == 0
    assert "wrote" in capsys.readouterr().out and len(os.listdir(tmp_path / "rows" / "h200")) == 1
    (tmp_path / "a-file").write_text("x")
    refused(["export", "-o", "a-file/h200/", "--db", path], "a-file is not a directory")


def test_a_damaged_segment_names_its_file_among_several(tmp_path, source):
    _path, seg = source
    bad = _write(tmp_path / "bad.kseg", _read(seg)[:1000])
    with pytest.raises(SegmentError, match=f"^segment {bad}: truncated"):
        merge([seg, bad], str(tmp_path / "t.db"))
    flipped = bytearray(_read(seg))
    flipped[-40] ^= 1
    bad2 = _write(tmp_path / "bad2.kseg", bytes(flipped))
    with pytest.raises(SegmentError, match=f"^segment {bad2}: "):
        merge([seg, bad2], str(tmp_path / "t.db"))


def test_a_refused_merge_into_a_new_ledger_leaves_no_ledger_behind(tmp_path, source):
    """A segment damaged anywhere (its structure, or an event that does not decode) is found before the new ledger
    file is created: no empty ledger or lock file is left behind."""
    _path, seg = source
    for name, data in _damaged_copies(seg, tmp_path):
        bad = _write(tmp_path / f"{name}.kseg", data)
        with pytest.raises(UsageError):
            merge([seg, bad], str(tmp_path / "new.db"))
        assert not [n for n in os.listdir(tmp_path) if n.startswith("new.db")], name


def test_a_segment_that_is_a_pipe_or_a_device_is_refused_before_it_is_read(tmp_path, source):
    """A pipe with no writer blocked the merge for good at its open (in a directory of segments too), one with a writer
    (`kprof merge <(cat x.kseg)`) was read empty the second time and called "not a kprof segment", and /dev/null was
    called that too: each is refused as not a regular file, and no ledger is made."""
    import subprocess
    import sys

    _path, seg = source
    os.mkfifo(tmp_path / "piped.kseg")
    p = subprocess.run([sys.executable, "-m", "kprof", "merge", "piped.kseg", "--db", "new.db"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)  # a subprocess: where the pipe is opened, it waits
    assert p.returncode == 2 and "segment piped.kseg is not a regular file (a pipe, device or socket)" in p.stderr, \
        p.stderr
    for bad in (os.devnull, str(tmp_path / "piped.kseg")):
        with pytest.raises(UsageError, match=f"^segment {bad} is not a regular file .*save it to a file"):
            merge([seg, bad], str(tmp_path / "new.db"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("new.db")]


def test_merge_refuses_an_output_dir_it_could_not_write_before_merging(tmp_path, source, refused):
    _path, seg = source
    target = _ledger(tmp_path / "t.db", synth.events(100, 105))
    before = _answers(target)
    (tmp_path / "a-file").write_text("x")
    # an existing directory takes the report too (it is replaced): the fix said "pass a new directory", a run's
    err = refused(["merge", seg, "--db", target, "--output-dir", str(tmp_path / "a-file")],
                  "is a file, not a directory; pass a directory (it is created if absent)")
    assert "new directory" not in err
    refused(["merge", seg, "--db", target, "--output-dir", ""], "is empty; pass a directory (it is created if absent)")
    assert _answers(target) == before


def test_a_conflict_whose_report_cannot_be_written_is_still_refused(tmp_path, monkeypatch):
    """The default report directory (the working directory) unwritable: the conflict still merges nothing and
    says where its report could not go."""
    target = _ledger(tmp_path / "t.db", synth.events(0, 5))
    seg = str(tmp_path / "c.kseg")
    export(_ledger(tmp_path / "c.db", [synth.event(3, seed=1)]), seg)
    real = os.makedirs

    def unwritable(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "makedirs", unwritable)
    with pytest.raises(MergeConflict, match="could not be written to .*merge-report.json \\(Permission denied\\)"):
        merge([seg], target)
    monkeypatch.setattr(os, "makedirs", real)
    assert not (tmp_path / "merge-report.json").exists()


def test_a_conflict_whose_report_a_full_disk_refuses_says_to_free_space(tmp_path):
    """A report the disk refused (here `ulimit -f`: File too large) in the --output-dir given said to "give
    --output-dir", the flag given; it says to free space or raise the file size limit, or give another directory."""
    target = _ledger(tmp_path / "t.db", synth.events(0, 5))
    seg = str(tmp_path / "c.kseg")
    export(_ledger(tmp_path / "c.db", [synth.event(3, seed=1)]), seg)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); from kprof.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "merge", seg, "--db", target, "--output-dir",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    assert "merge-report.json (File too large); free space there or raise the file size limit (ulimit -f), or give " \
           "--output-dir another directory" in proc.stderr, proc.stderr
    assert os.listdir(tmp_path / "out") == []


def test_a_conflict_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Two merges refused at once in one directory wrote into one file: each opened merge-report.json (emptying it)
    and wrote from its start, so the shorter report ran on into the longer one's tail (no JSON); one interrupted
    left an empty or part file where the earlier report was. A report is written under a name of its own, then
    named."""
    target = _ledger(tmp_path / "t.db", synth.events(0, 5))
    segs = [str(tmp_path / f"c{i}.kseg") for i in range(2)]
    for i, seg in enumerate(segs):
        export(_ledger(tmp_path / f"c{i}.db", [synth.event(3, seed=1 + i)]), seg)
    out = tmp_path / "out"
    with pytest.raises(MergeConflict):
        merge([segs[0]], target, output_dir=str(out))
    earlier = (out / "merge-report.json").read_bytes()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(msgspec.json, "format", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge([segs[1]], target, output_dir=str(out))
    assert os.listdir(out) == ["merge-report.json"] and (out / "merge-report.json").read_bytes() == earlier
    monkeypatch.undo()
    with pytest.raises(MergeConflict):
        merge([segs[1]], target, output_dir=str(out))
    report = json.loads((out / "merge-report.json").read_text())
    assert report["keys"][0]["incoming"]["event"] == _eid(synth.event(3, seed=2)).hex()
    assert os.stat(out / "merge-report.json").st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _damaged_copies(seg: str, tmp_path):
    data = _read(seg)
    step = max(1, len(data) // 150)
    for at in list(range(0, len(data), step)) + [len(data) - 1]:
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        yield f"flip@{at}", bytes(flipped)
    for cut in (len(data) - 1, len(data) - 33, len(data) // 2, 12, 0):
        yield f"cut@{cut}", data[:cut]
    yield "trailing", data + b"\0"


def test_every_damaged_segment_is_rejected_whole_and_nothing_is_written(tmp_path, source):
    """Each refusal names the file and the fix: a truncated or altered copy said what failed and where, but not what
    to do ("truncated at byte 1000: ...", "the footer's digest does not match ...")."""
    _path, seg = source
    target = _ledger(tmp_path / "t.db", synth.events(100, 110))
    before = _digest(target)
    fixes = ("copy the file again from where it was written, or export it again from its ledger",
             "give a .kseg file `kprof export` wrote", "export it again from its ledger")
    for name, data in _damaged_copies(seg, tmp_path):
        bad = _write(tmp_path / f"{name}.kseg", data)
        with pytest.raises(SegmentError) as err:
            merge([bad], target)
        assert str(err.value).startswith(f"segment {bad}: ") or str(err.value).startswith(f"{bad}: "), name
        assert any(fix in str(err.value) for fix in fixes), (name, str(err.value))
        assert "truncated at byte" in str(err.value) or not name.startswith("cut@") or name == "cut@0", str(err.value)
        assert _digest(target) == before, name



@pytest.mark.parametrize("version", range(1, _codec.FORMAT_VERSION))
def test_a_refused_merge_leaves_a_ledger_of_an_older_format_as_it_was(tmp_path, source, version):
    """A writer's open rebuilds an older file's views; a merge opened the file so before it read the segments, so a
    damaged segment (exit 2) or a conflict (exit 3) rewrote a ledger kept in git though nothing was merged. The
    segments are checked first; the file stays as it was, and a merge that passes upgrades it and merges."""
    import shutil

    fixtures = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "ledgers")
    target = str(tmp_path / "old.db")
    shutil.copyfile(os.path.join(fixtures, f"synthetic-v{version}.db"), target)
    before = _digest(target)
    _path, seg = source
    bad = _write(tmp_path / "bad.kseg", _read(seg)[:-1])
    with pytest.raises(SegmentError):
        merge([bad], target)
    other = export(_ledger(tmp_path / "o.db", [synth.event(0, seed=3)]), str(tmp_path / "o.kseg")).path
    with pytest.raises(MergeConflict):
        merge([other], target, output_dir=str(tmp_path))
    assert _digest(target) == before
    fine = export(_ledger(tmp_path / "n.db", [synth.event(100)]), str(tmp_path / "n.kseg")).path
    assert merge([fine], target).added == 1 and _digest(target) != before and audit(target).ok



@pytest.mark.parametrize("version", range(1, _codec.FORMAT_VERSION))
def test_a_merge_into_an_older_format_that_another_writer_upgrades_meanwhile_merges(tmp_path, monkeypatch, version):
    """Two merges (or a merge and a run) at once on a ledger of an older format: the one whose check of the reader's
    upgraded copy the other's write overtook failed, exit 2, with "ledger ... changed since this reader copied it;
    open it again", though nothing was wrong with it. It checks the file again as it now is, and merges."""
    import shutil

    from kprof.merge import merge as merge_module

    fixtures = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "ledgers")
    target = str(tmp_path / "old.db")
    shutil.copyfile(os.path.join(fixtures, f"synthetic-v{version}.db"), target)
    mine = export(_ledger(tmp_path / "n.db", [synth.event(100), synth.event(101)]), str(tmp_path / "n.kseg")).path
    check, overtaken = merge_module._check, []

    def another_writer_first(ledger, paths, txn=None):
        if ledger is not None and ledger.real_path != os.path.realpath(target) and not overtaken:
            overtaken.append(True)  # the other merge upgrades the file and writes, after this one copied it
            with Ledger.open(target) as writer:
                writer.append([synth.event(200)])
        return check(ledger, paths, txn)

    monkeypatch.setattr(merge_module, "_check", another_writer_first)
    result = merge([mine], target)
    assert overtaken and (result.added, result.existing) == (2, 0) and audit(target).ok
    with Ledger.open(target, readonly=True) as led:
        assert synth.view(led).get_many([synth.spec(i) for i in (100, 101, 200)])[2].status == "ok"


def test_a_merge_into_a_ledger_whose_creation_never_committed_makes_it_one(tmp_path, source):
    """A writer's open makes an LMDB file holding nothing (a run killed while creating it) a ledger, and a merge did;
    the check before an older format's upgrade opened it as a reader first, which refuses such a file (exit 2)."""
    import lmdb

    path, seg = source
    target = str(tmp_path / "uncreated.db")
    lmdb.open(target, subdir=False).close()
    assert merge([seg], target).added == segment.header_of(seg).events
    assert _answers(target) == _answers(path) and audit(target).ok


@pytest.mark.parametrize("version", range(1, _codec.FORMAT_VERSION + 1))
def test_merging_what_a_ledger_holds_already_leaves_its_file_byte_for_byte(tmp_path, version):
    """`kprof merge rows/` again is a no-op, yet it committed a write transaction (and upgraded a ledger of an older
    format), so a ledger kept in git read as changed after every merge of a shared directory. It writes nothing now."""
    import shutil

    fixtures = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "ledgers")
    target = str(tmp_path / "old.db")
    shutil.copyfile(os.path.join(fixtures, f"synthetic-v{version}.db"), target)
    seg = export(target, str(tmp_path / "all.kseg")).path
    before = _digest(target)
    result = merge([seg], target)
    assert (result.added, result.existing) == (0, segment.header_of(seg).events) and _digest(target) == before


def test_merging_an_event_of_a_key_whose_rows_were_all_retracted_leaves_the_file_byte_for_byte(tmp_path):
    """A key with no current row still has a history: its events the ledger holds are found there, not written."""
    first = synth.event(3)
    seg = str(tmp_path / "a.kseg")
    export(_ledger(tmp_path / "a.db", [first]), seg)
    target = _ledger(tmp_path / "b.db", [first, retraction(_eid(first), first.key, "a bad clock", at=1.8e9)])
    before = _digest(target)
    result = merge([seg], target)
    assert (result.added, result.existing) == (0, 1) and _digest(target) == before


@pytest.mark.parametrize("block", [1, 7, 1000])
def test_a_segment_read_a_few_bytes_at_a_time_reads_the_same_and_rejects_the_same(tmp_path, source, monkeypatch,
                                                                                  block):
    """Events and lengths that straddle the reader's blocks: the same events, runs and digests as one block."""
    _path, seg = source
    events, runs = list(segment.read(seg)), list(segment.runs(seg, 4))
    monkeypatch.setattr(segment, "BLOCK", block)
    digests = []
    small = list(segment.runs(seg, 4, digests))
    assert [e for run in small for e in run.events] == events and small == runs
    assert [len(run.events) for run in small[:-1]] == [4] * (len(small) - 1)
    assert digests == [_read(seg)[-32:]]
    for name, data in _damaged_copies(seg, tmp_path):
        with pytest.raises(SegmentError):
            list(segment.read(_write(tmp_path / f"{name}.kseg", data)))


def test_reordered_and_forged_segments_are_rejected(tmp_path, source):
    _path, seg = source
    events = list(segment.read(seg))
    target = _ledger(tmp_path / "t.db", synth.events(100, 101))
    before = _digest(target)
    # two events swapped, the footer kept: its digest no longer matches
    data = _read(seg)
    a, b = events[0], events[1]
    swapped = data.replace(len(a).to_bytes(4, "big") + a + len(b).to_bytes(4, "big") + b,
                           len(b).to_bytes(4, "big") + b + len(a).to_bytes(4, "big") + a)
    assert swapped != data
    bad = _write(tmp_path / "swapped.kseg", swapped)
    with pytest.raises(SegmentError, match="digest"):
        merge([bad], target)
    # a well-formed segment whose event carries another key than its provenance hashes to
    forged = msgspec.structs.replace(synth.event(7), key=synth.event(8).key)
    fake = str(tmp_path / "forged.kseg")
    segment.write(fake, [_codec.encode(synth.event(6)), _codec.encode(forged)])
    with pytest.raises(SegmentError, match="forged"):
        merge([fake], target)
    assert _digest(target) == before


def test_a_parent_after_its_re_measurement_in_one_segment_is_refused(tmp_path):
    """A segment holding a re-measurement before the row it re-measured (or its parent's parent) merged both and
    left the older row current, superseding its own re-measurement (across segments, the same order is a conflict):
    refused whole, naming both events, and nothing is written; in log order, it merges."""
    first = synth.event(3)
    again = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(first))
    third = msgspec.structs.replace(synth.event(3, seed=11), parent=_eid(again))
    target = _ledger(tmp_path / "t.db", synth.events(100, 101))
    before = _digest(target)
    for name, order in (("child-first", [again, first]), ("grandparent-last", [again, third, first])):
        seg = str(tmp_path / f"{name}.kseg")
        segment.write(seg, [_codec.encode(e) for e in [synth.event(0), *order]])
        with pytest.raises(SegmentError, match=f"event {len(order)} \\({_eid(first).hex()[:16]}\\) is the parent of "
                                               f"event 1 before it"):
            merge([seg], target)
        assert _digest(target) == before
        with pytest.raises(SegmentError, match="is the parent of"):
            merge([seg], str(tmp_path / "new.db"))
        assert not os.path.exists(tmp_path / "new.db")
    ordered = str(tmp_path / "ordered.kseg")
    segment.write(ordered, [_codec.encode(e) for e in (first, again, third)])
    assert merge([ordered], target).added == 3
    with Ledger.open(target, readonly=True) as led:
        assert synth.view(led).get_many([synth.spec(3)])[0].event_id == _eid(third)


NEWER = "a newer kprof wrote it; upgrade kprof to merge it (nothing was merged)"


def _as_a_newer_kprof_writes(event, at: tuple = (), **fields) -> bytes:
    """The event's bytes with fields this kprof does not know added (in the record at path `at`), as a newer kprof
    appends them; the key rehashed where they went into the provenance."""
    doc = msgspec.msgpack.decode(_codec.encode(event))
    record = doc
    for name in at:
        record = record[name]
    record.update(fields)
    doc["key"] = _codec.key_of(msgspec.msgpack.encode(doc["provenance"]))
    return msgspec.msgpack.encode(doc)


@pytest.mark.parametrize(("at", "fields", "named"), [
    ((), {"thermal_state": "hot"}, "thermal_state"),
    (("provenance",), {"power": "loaded"}, "provenance.power"),
    (("method",), {"sweeps": 3, "clock": "max"}, "method.sweeps, method.clock"),
])
def test_a_segment_of_a_newer_kprof_is_refused_naming_its_unknown_fields(tmp_path, at, fields, named):
    """An event with fields this kprof's schema lacks was refused as "not in canonical form (not written by
    kprof)", which reads as a forgery; it names the fields and the fix (a newer kprof wrote it), nothing merged."""
    target = _ledger(tmp_path / "t.db", synth.events(100, 101))
    before = _digest(target)
    seg = str(tmp_path / "newer.kseg")
    segment.write(seg, [_codec.encode(synth.event(6)), _as_a_newer_kprof_writes(synth.event(7), at, **fields)])
    said = f"{seg}: event 1 holds fields this kprof does not know ({named}): {NEWER}"
    with pytest.raises(SegmentError, match=f"^{re.escape(said)}$"):
        merge([seg], target)
    assert _digest(target) == before



@pytest.mark.parametrize(("version", "said"), [
    (segment.FORMAT + 1, f"segment format {segment.FORMAT + 1}; this kprof reads format {segment.FORMAT}: a newer "
                         f"kprof wrote it; upgrade kprof to merge it"),
    (0, f"segment format 0; this kprof reads format {segment.FORMAT}: no kprof writes an older one (the header is "
        f"damaged); export the segment again")])
def test_a_segment_format_this_kprof_does_not_read_is_refused_with_the_right_fix(tmp_path, version, said):
    """A segment format newer than this kprof's says to upgrade kprof; one older than the first (no kprof wrote it:
    a damaged header) said so too, which no upgrade mends."""
    import time

    seg = str(tmp_path / "x.kseg")
    with open(seg, "wb") as f:
        segment._stream(f, [_codec.encode(synth.event(1))], segment.SegmentHeader(version, "", time.time(), 1))
    with pytest.raises(SegmentError, match=f"^{re.escape(f'segment {seg}: {said}')}$"):
        merge([seg], str(tmp_path / "t.db"))
    assert not os.path.exists(tmp_path / "t.db")


def test_a_segment_holding_an_event_kind_this_kprof_does_not_know_says_so(tmp_path):
    doc = msgspec.msgpack.decode(_codec.encode(synth.event(7)))
    doc["type"] = "annotated"
    seg = str(tmp_path / "newer.kseg")
    segment.write(seg, [msgspec.msgpack.encode(doc)])
    said = f"{seg}: event 0 is of a kind this kprof does not know ('annotated'): {NEWER}"
    with pytest.raises(SegmentError, match=f"^{re.escape(said)}$"):
        merge([seg], str(tmp_path / "t.db"))
    assert not os.path.exists(tmp_path / "t.db")


def test_a_conflict_merges_nothing_and_reports_both_events(tmp_path):
    ours = _ledger(tmp_path / "ours.db", synth.events(0, 10))
    theirs_db = _ledger(tmp_path / "theirs.db", [*synth.events(20, 25), synth.event(4, seed=3)])  # key 4 again
    seg = str(tmp_path / "theirs.kseg")
    export(theirs_db, seg)
    before = _digest(ours)
    out = tmp_path / "out"
    with pytest.raises(MergeConflict) as err:
        merge([seg], ours, output_dir=str(out))
    assert _digest(ours) == before  # nothing merged, not even the five new keys
    report = json.loads((out / "merge-report.json").read_text())
    assert report == err.value.report and report["conflicts"] == 1
    (row,) = report["keys"]
    assert row["key"] == synth.event(4).key.hex()
    assert row["current"]["event"] == _eid(synth.event(4)).hex()
    assert row["incoming"]["event"] == _eid(synth.event(4, seed=3)).hex()
    mine, their = synth.event(4).metrics["time_ms"], synth.event(4, seed=3).metrics["time_ms"]
    assert row["time_ms_relative_difference"] == pytest.approx(their / mine - 1)
    # every provenance field, defaults included: a revision-1 row's profiler_revision was left out of the report
    assert row["provenance"] == msgspec.structs.asdict(synth.event(4).provenance)
    assert row["provenance"]["profiler_revision"] == 1


def test_a_conflict_says_which_segments_to_leave_out(tmp_path, capsys):
    """A refused merge named the conflicting segments but not what to do: it now says which segments to leave out
    (each one at odds with the ledger's rows, which stay; one of two at odds with each other), and merging without
    them merges the rest."""
    ours = _ledger(tmp_path / "ours.db", synth.events(0, 10))
    theirs = str(tmp_path / "theirs.kseg")
    export(_ledger(tmp_path / "theirs.db", [synth.event(4, seed=3)]), theirs)  # key 4 again, not from ours
    one, two = str(tmp_path / "one.kseg"), str(tmp_path / "two.kseg")
    export(_ledger(tmp_path / "one.db", [synth.event(40)]), one)
    export(_ledger(tmp_path / "two.db", [synth.event(40, seed=3)]), two)
    fine = str(tmp_path / "fine.kseg")
    export(_ledger(tmp_path / "fine.db", [synth.event(50)]), fine)
    argv = ["--db", ours, "--output-dir", str(tmp_path / "out")]
    assert main(["merge", theirs, one, two, fine, *argv]) == 3
    err = capsys.readouterr().err
    assert (f"nothing was merged; the fix: leave out {theirs} (the ledger keeps its rows) and leave out one "
            f"of {one} or {two}; the conflicts are in") in err, err
    assert main(["merge", one, fine, *argv]) == 0
    with Ledger.open(ours, readonly=True) as led:
        assert led.last_seq == 12


@pytest.mark.parametrize("between", ["another row", "the same segment"])
def test_a_row_another_writer_stores_between_the_check_and_the_write_is_held_against(tmp_path, monkeypatch,
                                                                                      between):
    """The check read the ledger in one transaction and the merge wrote in another: a row another writer (a run, a
    merge) stored for one of its keys in between was superseded by the incoming event, no conflict said, and the
    run that stored it read a row that was no longer current. The write now checks again where the ledger moved: a
    conflict merges nothing; the same events stored meanwhile (the same segment merged at once) are no conflict."""
    ours = _ledger(tmp_path / "ours.db", synth.events(0, 10))
    theirs_db = _ledger(tmp_path / "theirs.db", [*synth.events(20, 25), synth.event(30)])
    seg = str(tmp_path / "theirs.kseg")
    export(theirs_db, seg)
    append, interfered = Ledger.append_checked, []

    def stored_between(self, prepared, **kwargs):  # the merge's first write: another writer commits just before it
        if not interfered:
            interfered.append(between)
            if between == "another row":
                self.append([synth.event(30, seed=3)])
            else:
                merge([seg], ours)
        return append(self, prepared, **kwargs)

    monkeypatch.setattr(Ledger, "append_checked", stored_between)
    out = tmp_path / "out"
    if between == "another row":
        with pytest.raises(MergeConflict, match="1 incoming event"):
            merge([seg], ours, output_dir=str(out))
        report = json.loads((out / "merge-report.json").read_text())
        assert report["keys"][0]["current"]["event"] == _eid(synth.event(30, seed=3)).hex()
        assert report["keys"][0]["incoming"]["event"] == _eid(synth.event(30)).hex()
        with Ledger.open(ours, readonly=True) as led:
            assert led.last_seq == 11  # the other writer's row stands; nothing of the segment was merged
            assert synth.view(led).get(**synth.spec(30)).event_id == _eid(synth.event(30, seed=3))
    else:
        assert (merge([seg], ours).existing, _answers(ours)) == (6, _answers(_ledger(tmp_path / "both.db", [
            *synth.events(0, 10), *synth.events(20, 25), synth.event(30)])))
    assert audit(ours).ok


def test_a_conflict_found_at_a_later_batch_says_what_the_earlier_batches_merged(tmp_path, monkeypatch):
    """A merge of several batches whose later batch meets a row another writer stored after the check said "nothing
    was merged" while its earlier batches were in the ledger: it now says how many, and how many of them are new
    (it called events the ledger held already merged: "the first 8 event(s) were merged" where 6 were)."""
    import kprof.merge.merge as m

    monkeypatch.setattr(m, "BATCH", 4)
    ours = _ledger(tmp_path / "ours.db", synth.events(0, 3))
    theirs_db = _ledger(tmp_path / "theirs.db", [*synth.events(20, 22), *synth.events(0, 2), *synth.events(22, 27),
                                                 synth.event(30)])  # two events of the first batches held already
    seg = str(tmp_path / "theirs.kseg")
    export(theirs_db, seg)
    append, calls = Ledger.append_checked, []

    def stored_before_the_last_batch(self, prepared, **kwargs):
        calls.append(len(prepared))
        if len(calls) == 3:  # two batches (8 events) merged; another writer re-measures the last batch's key
            self.append([synth.event(30, seed=3)])
        return append(self, prepared, **kwargs)

    monkeypatch.setattr(Ledger, "append_checked", stored_before_the_last_batch)
    with pytest.raises(MergeConflict, match=r"the first 8 event\(s\) of the segments were merged \(6 of them new to "
                                            r"the ledger; whole batches, each checked"):
        merge([seg], ours, output_dir=str(tmp_path / "out"))
    with Ledger.open(ours, readonly=True) as led:
        assert led.last_seq == 3 + 6 + 1
    assert audit(ours).ok


def test_a_full_disk_at_a_later_batch_says_what_the_earlier_batches_merged(tmp_path, monkeypatch, capsys):
    """A merge of several batches whose later batch the disk refused (full, or `ulimit -f`) said only that "nothing of
    the failed transaction was stored", where the merge is said to be all or nothing: it says how many events the
    earlier batches put in the ledger, and that the same merge again merges the rest, as an interrupt's line does."""
    import lmdb

    import kprof.merge.merge as m

    monkeypatch.setattr(m, "BATCH", 4)
    ours = _ledger(tmp_path / "ours.db", synth.events(0, 3))
    seg = str(tmp_path / "theirs.kseg")
    export(_ledger(tmp_path / "theirs.db", synth.events(20, 30)), seg)
    append, calls = Ledger.append_checked, []

    def full_at_the_second_batch(self, prepared, **kwargs):
        calls.append(len(prepared))
        if len(calls) == 2:
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")
        return append(self, prepared, **kwargs)

    monkeypatch.setattr(Ledger, "append_checked", full_at_the_second_batch)
    assert main(["merge", seg, "--db", ours]) == 2
    err = capsys.readouterr().err
    assert "writing the ledger failed" in err and "the first 4 of the merge's 10 event(s) are in the ledger" in err
    assert "the same merge again merges the rest" in err, err
    monkeypatch.setattr(Ledger, "append_checked", append)
    assert main(["merge", seg, "--db", ours]) == 0
    with Ledger.open(ours, readonly=True) as led:
        assert led.last_seq == 13


def test_segments_that_conflict_with_each_other_are_named_and_leave_no_new_ledger(tmp_path, capsys):
    """Two segments re-measuring one row, neither from the other, merged into a ledger not created yet: the
    conflict is named as one between the segments (both paths), the report carries both events' kinds, metrics and
    difference, and no ledger or lock file is made."""
    one, two = str(tmp_path / "one.kseg"), str(tmp_path / "two.kseg")
    export(_ledger(tmp_path / "one.db", synth.events(0, 5)), one)
    export(_ledger(tmp_path / "two.db", [synth.event(4, seed=3)]), two)
    out = tmp_path / "out"
    assert main(["merge", one, two, "--db", str(tmp_path / "new.db"), "--output-dir", str(out)]) == 3
    err = capsys.readouterr().err
    assert "1 event(s) of the segments conflict with each other (attempts at one key, neither re-measuring the " \
        "other)" in err and "ledger's current rows" not in err
    assert f"of {one}" in err and f"of {two}" in err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("new.db")]
    (row,) = json.loads((out / "merge-report.json").read_text())["keys"]
    assert row["current"]["segment"] == one and row["incoming"]["segment"] == two
    assert row["current"]["kind"] == row["incoming"]["kind"] == "measured"
    mine, their = synth.event(4).metrics, synth.event(4, seed=3).metrics
    assert (row["current"]["metrics"], row["incoming"]["metrics"]) == (mine, their)
    assert row["time_ms_relative_difference"] == pytest.approx(their["time_ms"] / mine["time_ms"] - 1)


def test_a_re_measurement_merges_after_its_parent_whatever_order_its_segments_come_in(tmp_path, capsys):
    """A re-measurement's segment named (or, in a directory, written) before its parent's: the parent merges first,
    the re-measurement is the current row and the parent its history. A ledger that holds the re-measurement
    already refuses the parent, saying why."""
    parent_db = _ledger(tmp_path / "p.db", synth.events(0, 5))
    again = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(synth.event(3)))
    rows = tmp_path / "rows"
    rows.mkdir()
    child = export(_ledger(tmp_path / "c.db", [again]), str(rows)).path
    parent = export(parent_db, str(rows)).path  # written after the child: the later segment
    both = _ledger(tmp_path / "both.db", [*synth.events(0, 5), again])
    for name, given in (("named.db", [child, parent]), ("dir.db", [str(rows)])):
        target = str(tmp_path / name)
        assert main(["merge", *given, "--db", target]) == 0, capsys.readouterr().err
        assert _answers(target) == _answers(both) and audit(target).ok
        with Ledger.open(target, readonly=True) as led, led.read() as txn:
            assert [eid for _seq, eid in led.history_of(txn, again.key)] == [_eid(synth.event(3)), _eid(again)]
    late = str(tmp_path / "late.db")
    merge([child], late)
    with pytest.raises(MergeConflict, match="it is the parent of the row here"):
        merge([parent], late, output_dir=str(tmp_path / "out"))


@pytest.mark.parametrize("into", ["new", "empty"])
def test_a_keys_attempts_without_parents_in_one_segment_are_its_history_not_a_conflict(tmp_path, into):
    """A ledger measured a key twice without naming the first as parent (a second `run --fresh`): its segment holds
    both, and merged they follow each other as in that ledger, not as a conflict."""
    first, again = synth.event(0, seed=1), synth.event(0, seed=2)
    seg = str(tmp_path / "s.kseg")
    export(_ledger(tmp_path / "src.db", [first, again, synth.event(1)]), seg)
    db = str(tmp_path / "into.db") if into == "new" else _ledger(tmp_path / "into.db", [])
    assert merge([seg], db).added == 3
    assert _answers(db) == _answers(str(tmp_path / "src.db"))


def test_a_fast_forward_merges(tmp_path):
    ours = _ledger(tmp_path / "ours.db", synth.events(0, 10))
    newer = msgspec.structs.replace(synth.event(4, seed=3), parent=_eid(synth.event(4)))
    theirs_db = _ledger(tmp_path / "theirs.db", [*synth.events(0, 10), newer])
    seg = str(tmp_path / "theirs.kseg")
    export(theirs_db, seg)
    result = merge([seg], ours)
    assert (result.added, result.existing) == (1, 10)
    assert _answers(ours) == _answers(theirs_db) and audit(ours).ok


def test_disjoint_ledgers_merged_both_ways_agree(tmp_path):
    a = _ledger(tmp_path / "a.db", synth.events(0, 30))
    b = _ledger(tmp_path / "b.db", synth.events(30, 60))
    sa, sb = str(tmp_path / "a.kseg"), str(tmp_path / "b.kseg")
    export(a, sa)
    export(b, sb)
    merge([sb], a)
    merge([sa], b)
    assert _answers(a) == _answers(b) and audit(a).ok and audit(b).ok


def test_cli_export_and_merge(tmp_path, capsys):
    src = _ledger(tmp_path / "src.db", synth.events(0, 12))
    seg = str(tmp_path / "s.kseg")
    assert main(["export", "-o", seg, "--db", src, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == 12
    dst = str(tmp_path / "dst.db")
    assert main(["merge", seg, "--db", dst, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["added"] == 12 and doc["segments"][0]["events"] == 12
    conflicting = _ledger(tmp_path / "c.db", [synth.event(3, seed=1)])
    seg2 = str(tmp_path / "c.kseg")
    assert main(["export", "-o", seg2, "--db", conflicting]) == 0
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["merge", seg2, "--db", dst, "--output-dir", str(out), "--json"]) == 3
    assert (out / "merge-report.json").exists()
    assert "conflict" in capsys.readouterr().err
    bad = _write(tmp_path / "bad.kseg", _read(seg)[:-5])
    assert main(["merge", bad, "--db", dst]) == 2
    assert "truncated" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "none.kseg"), "--db", dst]) == 2


def test_a_segment_replaced_between_the_two_passes_merges_nothing(tmp_path, monkeypatch):
    """The write pass holds each batch to the digest the check pass took of it: another (valid) file in the
    segment's place stops the merge before its first batch is written."""
    import kprof.merge.merge as m

    target = _ledger(tmp_path / "t.db", synth.events(100, 105))
    seg_a, seg_b = str(tmp_path / "a.kseg"), str(tmp_path / "b.kseg")
    export(_ledger(tmp_path / "a.db", synth.events(0, 5)), seg_a)
    export(_ledger(tmp_path / "b.db", synth.events(0, 6)), seg_b)
    real, calls = segment.runs, []

    def swapped(path, size, digests=None):
        calls.append(path)
        return real(seg_b if len(calls) > 1 else path, size, digests)  # the second pass reads another file

    monkeypatch.setattr(m.segment, "runs", swapped)
    before = _answers(target)
    with pytest.raises(SegmentError, match="changed while it was merged"):
        merge([seg_a], target)
    assert len(calls) == 2 and _answers(target) == before


def _ten_events_in_batches_of_four(tmp_path, monkeypatch) -> tuple[str, str, str]:
    """(a ledger of 10 events, its segment, a target path not created yet), merges writing batches of 4 events."""
    import kprof.merge.merge as m

    monkeypatch.setattr(m, "BATCH", 4)
    src = _ledger(tmp_path / "src.db", synth.events(0, 10))
    seg = str(tmp_path / "s.kseg")
    export(src, seg)
    return src, seg, str(tmp_path / "t.db")


def test_a_merge_stopped_half_way_leaves_a_verified_prefix_and_merging_again_completes_it(tmp_path, monkeypatch):
    src, seg, target = _ten_events_in_batches_of_four(tmp_path, monkeypatch)
    real, calls = Ledger.append_checked, []

    def dies_on_the_second_batch(self, prepared, **kwargs):
        calls.append(len(prepared))
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill, as far as the merge can tell
        return real(self, prepared, **kwargs)

    monkeypatch.setattr(Ledger, "append_checked", dies_on_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        merge([seg], target)
    with Ledger.open(target, readonly=True) as led:
        assert led.last_seq == 4  # the first batch, whole
    assert audit(target).ok
    monkeypatch.setattr(Ledger, "append_checked", real)
    result = merge([seg], target)
    assert (result.added, result.existing) == (6, 4) and _answers(target) == _answers(src)


@pytest.mark.parametrize("commit", ["before", "after"])
def test_an_interrupted_merge_of_several_batches_says_which_it_merged(tmp_path, monkeypatch, capsys, commit):
    """Ctrl-C (or SIGTERM) of a merge of more than one batch said "a merge is all or nothing: the ledger holds none
    of its events" while it held every batch committed before; it now says how many, read from the ledger (the
    interrupt can come between a batch's commit and the merge's count of it)."""
    src, seg, target = _ten_events_in_batches_of_four(tmp_path, monkeypatch)
    real, calls = Ledger.append_checked, []

    def interrupted_at_the_second_batch(self, prepared, **kwargs):
        calls.append(len(prepared))
        if len(calls) == 2 and commit == "before":
            raise KeyboardInterrupt
        done = real(self, prepared, **kwargs)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(Ledger, "append_checked", interrupted_at_the_second_batch)
    assert main(["merge", seg, "--db", target]) == 130
    held = 4 if commit == "before" else 8
    assert f"interrupted (Ctrl-C): the first {held} of the merge's 10 event(s) are in the ledger" in \
           capsys.readouterr().err
    with Ledger.open(target, readonly=True) as led:
        assert led.last_seq == held
    monkeypatch.setattr(Ledger, "append_checked", real)
    assert main(["merge", seg, "--db", target, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["added"] == 10 - held and _answers(target) == _answers(src)


def test_a_directory_of_content_named_segments_is_shared_by_merging_all_of_it(tmp_path):
    """Export into a directory names each segment by its digest; merging every segment of the directory into any
    ledger gives the rows of all the ledgers that exported there (the way a team shares rows through git)."""
    shared = tmp_path / "rows"
    shared.mkdir()
    a = _ledger(tmp_path / "a.db", synth.events(0, 20))
    b = _ledger(tmp_path / "b.db", synth.events(20, 40))
    first, second = export(a, str(shared)), export(b, str(shared))
    names = sorted(p.name for p in shared.iterdir())
    assert names == sorted(os.path.basename(x.path) for x in (first, second)) and len(names) == 2
    for x in (first, second):
        assert os.path.basename(x.path) == _read(x.path)[-32:].hex()[:32] + ".kseg"
    team = str(tmp_path / "team.db")
    result = merge(sorted(str(p) for p in shared.iterdir()), team)
    assert result.added == 40 and audit(team).ok
    both = _ledger(tmp_path / "both.db", synth.events(0, 40))
    assert _answers(team)[0] == _answers(both)[0]  # the same view root


def test_a_retraction_whose_target_is_nowhere_merges_nothing(tmp_path, source):
    """A segment exported --since after a retracted event's own seq carries the retraction without its target:
    merged into a ledger that never held the target, it is refused before anything is written."""
    path, _ = source
    tail = str(tmp_path / "tail.kseg")
    with Ledger.open(path, readonly=True) as led:
        last = led.last_seq
    export(path, tail, since=last - 1)  # the retraction alone
    target = _ledger(tmp_path / "t.db", synth.events(100, 103))
    before = _answers(target)
    with pytest.raises(UsageError, match="retracts event"):
        merge([tail], target)
    assert _answers(target) == before



def test_a_retraction_of_an_older_event_leaves_the_rows_after_it_checked(tmp_path):
    """A retracts its first measurement of a key and measures it again (no parent: the key had no row left); B, which
    held that measurement and re-measured it since, merges A's segment. The retraction withdraws a row B no longer
    shows, so B's own re-measurement stays current, and A's new row is a conflict with it (it had merged silently over
    B's row: a retraction left its key unchecked). A retraction of the row B shows still merges what follows it."""
    first = synth.event(3)
    ours = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(first))
    gone = retraction(_eid(first), first.key, "a bad clock", at=1.8e9)
    theirs = synth.event(3, seed=5)
    src = _ledger(tmp_path / "a.db", [first, gone, theirs])
    seg = str(tmp_path / "a.kseg")
    export(src, seg)
    target = _ledger(tmp_path / "b.db", [first, ours])
    before = _digest(target)
    with pytest.raises(MergeConflict):
        merge([seg], target, output_dir=str(tmp_path / "out"))
    assert _digest(target) == before
    report = json.loads((tmp_path / "out" / "merge-report.json").read_text())
    assert [(k["current"]["event"], k["incoming"]["event"]) for k in report["keys"]] == [(_eid(ours).hex(),
                                                                                          _eid(theirs).hex())]
    plain = _ledger(tmp_path / "c.db", [first])  # the retracted row is the one shown here: what follows it merges
    assert merge([seg], plain).added == 2 and _answers(plain) == _answers(src)



def test_a_retraction_of_the_current_row_checks_what_follows_against_the_row_it_brings_back(tmp_path):
    """B measured a key and re-measured it, and gave A only the re-measurement; A retracted it and measured the key
    again (no parent: A had no row left). Merged into B, the retraction brings B's first row back, and A's new row is
    a conflict with it (the key was left unchecked after a retraction of its current row: it merged silently over
    B's row). Where the row brought back is the new row's parent, or there is none, it merges."""
    first = synth.event(3)
    again = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(first))
    gone = retraction(_eid(again), again.key, "a bad clock", at=1.8e9)
    theirs = synth.event(3, seed=5)
    seg = str(tmp_path / "a.kseg")
    export(_ledger(tmp_path / "a.db", [again, gone, theirs]), seg)
    target = _ledger(tmp_path / "b.db", [first, again])
    before = _digest(target)
    with pytest.raises(MergeConflict):
        merge([seg], target, output_dir=str(tmp_path / "out"))
    assert _digest(target) == before
    report = json.loads((tmp_path / "out" / "merge-report.json").read_text())
    assert [(k["current"]["event"], k["incoming"]["event"]) for k in report["keys"]] == [(_eid(first).hex(),
                                                                                          _eid(theirs).hex())]
    plain = _ledger(tmp_path / "c.db", [again])  # nothing to bring back: A's new row merges
    assert merge([seg], plain).added == 2
    child = msgspec.structs.replace(theirs, parent=_eid(first))  # A held the first row too: its row's parent
    seg2 = str(tmp_path / "a2.kseg")
    export(_ledger(tmp_path / "a2.db", [first, again, gone, child]), seg2)
    assert merge([seg2], target).added == 2 and _answers(target) == _answers(str(tmp_path / "a2.db"))


def _events_bytes(n):
    return [_codec.encode(synth.event(i)) for i in range(n)]

def test_a_retraction_of_the_current_row_brings_back_no_row_the_ledger_retracted(tmp_path):
    """B measured a key, re-measured it, retracted that, and measured it again from its first row; A, given that
    last row, retracted it and measured again from the first row. Merged into B, the retraction brings back B's
    first row (its retracted re-measurement stays retracted), of which A's new row is a child: it merges."""
    first = synth.event(3)
    mid, again, theirs = (msgspec.structs.replace(synth.event(3, seed=s), parent=_eid(first)) for s in (7, 9, 5))
    target = _ledger(tmp_path / "b.db", [first, mid, retraction(_eid(mid), mid.key, "a bad clock", at=1.8e9), again])
    seg = str(tmp_path / "a.kseg")
    export(_ledger(tmp_path / "a.db", [again, retraction(_eid(again), again.key, "a bad clock", at=1.9e9), theirs]),
           seg)
    assert merge([seg], target).added == 2
    with Ledger.open(target, readonly=True) as led:
        assert synth.view(led).get(**synth.spec(3)).event_id == _eid(theirs)


def test_a_retraction_of_the_current_row_brings_back_no_row_the_segments_retracted(tmp_path):
    """A held B's two rows of a key, retracted both (the older first) and measured the key again (no parent: no row
    was left). Merged into B, the second retraction brings back no row, not the one the first withdrew: it merges."""
    first = synth.event(3)
    again = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(first))
    theirs = synth.event(3, seed=5)
    target = _ledger(tmp_path / "b.db", [first, again])
    seg = str(tmp_path / "a.kseg")
    export(_ledger(tmp_path / "a.db", [first, again, *(retraction(_eid(e), e.key, "a bad clock", at=1.8e9 + i)
                                                      for i, e in enumerate((first, again))), theirs]), seg)
    assert merge([seg], target).added == 3
    with Ledger.open(target, readonly=True) as led:
        assert synth.view(led).get(**synth.spec(3)).event_id == _eid(theirs)


def test_a_retraction_of_a_row_an_earlier_segment_made_current_leaves_what_follows_to_merge(tmp_path):
    """One segment holds a key's row; a later one, of a ledger that held it, retracts it and measures the key again
    without a parent. Merged together into a new ledger, the later row follows the retraction: it merges."""
    first, theirs = synth.event(3), synth.event(3, seed=5)
    one, two = str(tmp_path / "1.kseg"), str(tmp_path / "2.kseg")
    export(_ledger(tmp_path / "a.db", [first]), one)
    export(_ledger(tmp_path / "b.db", [first, retraction(_eid(first), first.key, "a bad clock", at=1.8e9), theirs]),
           two)
    db = str(tmp_path / "into.db")
    assert merge([one, two], db).added == 3
    with Ledger.open(db, readonly=True) as led:
        assert synth.view(led).get(**synth.spec(3)).event_id == _eid(theirs)



def test_a_segment_written_meanwhile_at_the_same_path_is_kept_and_this_write_refused(tmp_path):
    """Two writers of one path: each streams to a temporary file of its own; the second to finish is refused,
    and the first's segment is whole."""
    target = str(tmp_path / "same.kseg")

    def events():
        yield from _events_bytes(3)
        segment.write(target, _events_bytes(5), count=5)  # the other writer finishes first

    with pytest.raises(UsageError, match="exists"):
        segment.write(target, events(), count=3)
    assert len(list(segment.read(target))) == 5
    assert os.listdir(tmp_path) == ["same.kseg"]


@pytest.mark.parametrize("into_dir", [False, True])
def test_a_segment_the_disk_refuses_is_a_usage_error_and_leaves_nothing(tmp_path, into_dir):
    """A full disk or a file size limit (here EFBIG, as `ulimit -f` gives) is named, exit 2, and no partial file
    stays: neither the target nor a temporary file."""
    import resource
    import subprocess
    import sys

    out = tmp_path / "segs"
    out.mkdir()
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            "from kprof.merge import segment; from kprof.ledger import _codec; from kprof import synth; "
            "segment.write(sys.argv[1], [_codec.encode(synth.event(i)) for i in range(50)])")
    target = str(out) if into_dir else str(out / "x.kseg")
    proc = subprocess.run([sys.executable, "-c", code, target], capture_output=True, text=True)
    assert proc.returncode == 1 and "UsageError: cannot write segment" in proc.stderr, proc.stderr
    assert "File too large" in proc.stderr
    assert os.listdir(out) == []


def test_a_segment_is_readable_as_a_file_open_makes_it(tmp_path):
    target = segment.write(str(tmp_path / "x.kseg"), _events_bytes(1), count=1)
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~umask


def test_a_segment_in_a_directory_that_does_not_exist_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot write segment .*No such file or directory"):
        segment.write(str(tmp_path / "no" / "x.kseg"), _events_bytes(1), count=1)


def test_a_ledger_given_to_merge_is_refused_with_the_fix(tmp_path, source, refused):
    """`kprof merge other.db` said only `not a kprof segment: it does not begin with KPROFSEG`."""
    path, _seg = source
    target = _ledger(tmp_path / "t.db", synth.events(100, 105))
    before = _digest(target)
    refused(["merge", path, "--db", target], f"segment {path}: not a kprof segment",
            "give a .kseg file `kprof export` wrote (a ledger is merged by exporting it first)")
    assert _digest(target) == before


def test_a_segment_of_no_event_merged_into_a_new_ledger_makes_no_file(tmp_path, capsys):
    """A segment holding no event (a worker's, or one written by hand) merged into a ledger not created yet made an
    empty ledger file, so a mistyped --db became a ledger that `query` read as holding nothing. It merges nothing and
    makes no file; into an existing ledger it changes nothing."""
    empty = segment.write(str(tmp_path / "empty.kseg"), [], "x")
    assert main(["merge", empty, "--db", str(tmp_path / "new.db")]) == 0
    assert "merged 0 new event(s)" in capsys.readouterr().out
    assert not [n for n in os.listdir(tmp_path) if n.startswith("new.db")]
    target = _ledger(tmp_path / "t.db", synth.events(0, 3))
    before = _digest(target)
    assert (merge([empty], target).added, _digest(target)) == (0, before)


@pytest.mark.parametrize("nested", ["event", "unknown field"])
def test_an_event_nested_past_the_decoders_depth_is_refused_as_forged(tmp_path, nested):
    """Arrays nested a million deep (the whole event, or a field no schema declares, which the typed decode skips)
    were a RecursionError traceback (exit 1) where the merge decoded it: refused as forged, nothing written."""
    deep = b"\x91" * 1_000_000 + b"\xc0"
    data = _codec.encode(synth.event(7))
    data = deep if nested == "event" else bytes([data[0] + 1]) + data[1:] + b"\xa1z" + deep  # one more map entry
    seg, good = str(tmp_path / "deep.kseg"), str(tmp_path / "good.kseg")
    segment.write(seg, [data])
    segment.write(good, [_codec.encode(synth.event(8))])
    for segments in ([seg], [good, seg]):  # with another segment, the merge orders them first (reading each link)
        with pytest.raises(SegmentError, match=f"^{re.escape(seg)}: event 0 .*export it again from its ledger"):
            merge(segments, str(tmp_path / "t.db"))
    assert not os.path.exists(tmp_path / "t.db")


@pytest.mark.parametrize("field, value, said", [
    ("measured_at", float("nan"), "measured_at nan, which is not a time"),
    ("measured_at", 1e12, "measured_at 1000000000000.0, which is not a time"),
    ("measured_at", -1e300, "measured_at -1e+300, which is not a time"),
    ("metrics", {"time_ms": float("nan")}, "metric 'time_ms' = nan, which no measurement gives"),
    ("metrics", {"energy_j": None, "tflops": float("-inf")}, "metric 'tflops' = -inf, which no measurement gives"),
])
def test_an_event_of_a_value_no_measurement_has_is_refused(tmp_path, field, value, said):
    """A forged event whose id and key hash right but whose time is no date (nan, or past year 9999) merged, and
    then every `query` and `show` of its row was an OverflowError or ValueError traceback; a nan or inf metric
    merged as a row whose time JSON reads as null. Refused, naming the event and value, nothing written."""
    forged = msgspec.structs.replace(synth.event(7), **{field: value})
    seg = str(tmp_path / "odd.kseg")
    segment.write(seg, [_codec.encode(synth.event(6)), _codec.encode(forged)])
    with pytest.raises(SegmentError, match=f"^{re.escape(seg)}: event 1 holds {re.escape(said)}"):
        merge([seg], str(tmp_path / "t.db"))
    assert not os.path.exists(tmp_path / "t.db")
    fine = msgspec.structs.replace(synth.event(7), measured_at=-1.5e9)  # before 1970 is a time
    segment.write(str(tmp_path / "fine.kseg"), [_codec.encode(fine)])
    assert merge([str(tmp_path / "fine.kseg")], str(tmp_path / "t.db")).added == 1


def test_a_conflict_report_replaces_a_link_in_its_place_and_never_writes_through_it(tmp_path):
    """merge-report.json was opened for writing where it lay: a link of that name (planted in a shared working
    directory, the default) had the file it named overwritten with the report. The link itself is replaced."""
    ours = _ledger(tmp_path / "ours.db", synth.events(0, 10))
    theirs = _ledger(tmp_path / "theirs.db", [synth.event(4, seed=3)])
    seg = str(tmp_path / "theirs.kseg")
    export(theirs, seg)
    victim, out = tmp_path / "victim.txt", tmp_path / "out"
    victim.write_text("keep me\n")
    out.mkdir()
    (out / "merge-report.json").symlink_to(victim)
    with pytest.raises(MergeConflict, match="the conflicts are in"):
        merge([seg], ours, output_dir=str(out))
    assert victim.read_text() == "keep me\n"
    assert not (out / "merge-report.json").is_symlink()
    assert json.loads((out / "merge-report.json").read_text())["conflicts"] == 1
    assert sorted(os.listdir(out)) == ["merge-report.json"]


def test_runs_and_batches_of_large_events_end_at_their_byte_bounds_and_merge_the_same(tmp_path, monkeypatch):
    """Runs and batches were counts of events (10,000 and 50,000) whatever their size: a segment of events near the
    64 MiB an event may have was held whole, terabytes at once. Each ends once its events pass its byte bound; both
    passes of a merge cut the file alike, and it merges as before."""
    import kprof.merge.merge as m

    events = [_codec.encode(e) for e in synth.events(0, 30)]
    seg = str(tmp_path / "s.kseg")
    segment.write(seg, events)
    monkeypatch.setattr(segment, "RUN_BYTES", 5 * len(events[0]))
    monkeypatch.setattr(m, "BATCH_BYTES", 10 * len(events[0]))
    sizes = [len(run.events) for run in segment.runs(seg, 10_000)]
    assert sum(sizes) == 30 and len(sizes) > 1 and max(sizes) <= 6
    batches = [sum(len(part.run.events) for part in batch) for batch in m._batches([seg])]
    assert sum(batches) == 30 and len(batches) > 1 and max(batches) <= 12
    assert merge([seg], str(tmp_path / "t.db")).added == 30
    assert _answers(str(tmp_path / "t.db"))[1][:30] == _answers(_ledger(tmp_path / "src.db", synth.events(0, 30)))[1][:30]


@pytest.mark.parametrize("target_in", ["ledger", "segment"])
def test_a_retraction_of_another_keys_event_is_refused_as_forged_before_any_batch_is_written(tmp_path, monkeypatch,
                                                                                           target_in):
    """A retraction whose key is not its target's passed the check and was refused only by the ledger's append, as
    its batch was written: the batches before it were merged already (a forged segment merged in part), and the
    error said to "append the target first". Refused by the check, nothing written."""
    import kprof.merge.merge as m

    monkeypatch.setattr(m, "BATCH", 2)
    target = synth.event(0) if target_in == "ledger" else synth.event(1)
    ours = _ledger(tmp_path / "ours.db", [synth.event(0)])
    before = _digest(ours)
    forged = Retracted(key=synth.event(3).key, target=_eid(target), reason="forged", measured_at=1.8e9)
    seg = str(tmp_path / "forged.kseg")
    segment.write(seg, [*map(_codec.encode, synth.events(1, 6)), _codec.encode(forged)])
    with pytest.raises(SegmentError, match=f"^{re.escape(seg)}: event 5 retracts event {_eid(target).hex()[:16]}, of "
                                           f"another key than its own \\(forged\\); export it again"):
        merge([seg], ours)
    assert _digest(ours) == before


def test_a_segment_write_killed_before_its_end_is_removed_by_the_next_write_there(tmp_path):
    """A write killed before its end (SIGKILL: `timeout -k`, the OOM killer; Ctrl-\\) left its `.kseg-*.part` file,
    as large as the segment it was writing, which no later write removed (each writes a file of its own name). The
    next write into the directory removes the part files no live writer holds (a writer holds its file locked from
    before its first byte till it is placed); an empty one, maybe a writer's not yet locked, is let be."""
    import fcntl

    segs = tmp_path / "segs"
    segs.mkdir()
    code = ("import os, signal, sys; from kprof.merge import segment; from kprof import synth; from kprof.ledger "
            "import _codec\n"
            "def killed(f, events, header):\n"
            "    f.write(b'partial' * 1000); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
            "segment._stream = killed\n"
            "segment.write(sys.argv[1], [_codec.encode(e) for e in synth.events(0, 5)])")
    proc = subprocess.run([sys.executable, "-c", code, str(segs)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    (dead,) = os.listdir(segs)
    assert dead.startswith(".kseg-") and dead.endswith(".part")
    (segs / ".kseg-empty.part").write_bytes(b"")
    (segs / ".kseg-live.part").write_bytes(b"partial")
    with open(segs / ".kseg-live.part", "rb") as live:
        fcntl.flock(live, fcntl.LOCK_EX)  # another writer's, still writing (a second open stands for its process)
        written = segment.write(str(segs), [_codec.encode(e) for e in synth.events(0, 5)])
    assert sorted(os.listdir(segs)) == sorted([".kseg-empty.part", ".kseg-live.part", os.path.basename(written)])
    assert sum(1 for _ in segment.read(written)) == 5


def test_a_write_whose_placed_part_file_another_write_removed_meanwhile_ends_as_written(tmp_path, monkeypatch):
    """Once its file is placed and closed, a writer's part file is unlocked till the writer removes it: another write
    into the directory (its clean-up of killed writes' part files) removed it between the writer's check that it was
    there and its removal, which raised FileNotFoundError, a traceback of an export whose segment was written."""
    segs = tmp_path / "segs"
    segs.mkdir()
    exists = os.path.exists

    def another_write_between(path):
        there = exists(path)
        if str(path).endswith(".part"):
            segment._drop_killed(str(segs))  # the other write's clean-up, now
        return there

    monkeypatch.setattr(os.path, "exists", another_write_between)
    written = segment.write(str(segs), [_codec.encode(e) for e in synth.events(0, 5)])
    monkeypatch.undo()
    assert os.listdir(segs) == [os.path.basename(written)] and sum(1 for _ in segment.read(written)) == 5


@pytest.mark.parametrize("when", ["commit", "print"])
def test_an_interrupt_after_a_merge_s_last_commit_does_not_say_it_merged_none(tmp_path, monkeypatch, capsys, when):
    """A merge of one batch (up to 50,000 events) that a Ctrl-C or SIGTERM reached as its commit returned, or as its
    result was printed, said "a merge is all or nothing: the ledger holds none of its events" while the ledger held
    every one of them. It says they are in the ledger."""
    src = _ledger(str(tmp_path / "src.db"), synth.events(0, 5))
    seg, target = str(tmp_path / "a.kseg"), str(tmp_path / "t.db")
    export(src, seg)
    real = Ledger.append_checked

    def interrupted(self, prepared, **kwargs):
        real(self, prepared, **kwargs)
        raise KeyboardInterrupt

    if when == "commit":
        monkeypatch.setattr(Ledger, "append_checked", interrupted)
    else:
        import kprof.cli.merge as cli_merge

        monkeypatch.setattr(cli_merge, "console", lambda **kw: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert main(["merge", seg, "--db", target]) == 130
    err = capsys.readouterr().err
    assert "holds none" not in err and ("the first 5 of the merge's 5 event(s) are in the ledger" in err if
                                        when == "commit" else "its 5 new event(s) are in the ledger" in err), err
    with Ledger.open(target, readonly=True) as led:
        assert led.last_seq == 5


def test_an_interrupt_before_a_merge_s_commit_does_not_count_a_batch_whose_last_event_was_held_before(
        tmp_path, monkeypatch, capsys):
    """A batch's commit was read from its last event alone: where the ledger held that one already (an incremental
    export of the same ledger merged first), an interrupt before the commit said "the first 5 of the merge's 5
    event(s) are in the ledger" of a ledger holding 1 of them. The batch is looked for by an event it adds."""
    src = _ledger(str(tmp_path / "src.db"), synth.events(0, 5))
    seg, tail, target = str(tmp_path / "a.kseg"), str(tmp_path / "tail.kseg"), str(tmp_path / "t.db")
    export(src, seg)
    export(src, tail, since=4)
    assert main(["merge", tail, "--db", target]) == 0

    def interrupted(self, prepared, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Ledger, "append_checked", interrupted)
    capsys.readouterr()
    assert main(["merge", seg, "--db", target]) == 130
    err = capsys.readouterr().err
    assert "are in the ledger" not in err and "holds none" in err, err
    with Ledger.open(target, readonly=True) as led:
        assert led.last_seq == 1
