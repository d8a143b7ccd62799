"""Sharing rows without LMDB files: each teammate exports to one directory (content-named segments, committed to
git), and anyone merges the directory into any ledger: oldest segment first, so a row's history (a re-measurement
and its parent, exported at different times) merges in order."""

import json
import re
import os
import time

import msgspec

from kprof.cli import main
from kprof.ledger import Ledger, _codec
from kprof import synth

SPECS = [synth.spec(i) for i in range(30)]


def _eid(event) -> bytes:
    return _codec.event_id(_codec.encode(event))


def _root(path) -> bytes:
    with Ledger.open(str(path), readonly=True) as led:
        return synth.view(led).root


def _export(db, rows, capsys, *since) -> str:
    assert main(["export", "--db", str(db), "-o", str(rows), "--json", *since]) == 0
    return json.loads(capsys.readouterr().out)["segment"]


def test_a_directory_of_segments_is_how_a_team_shares_rows(tmp_path, capsys):
    rows = tmp_path / "rows"
    rows.mkdir()
    alice, bob, carol = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "c.db"
    with Ledger.open(str(alice)) as led:
        led.append([synth.event(i) for i in range(15)])
    first = _export(alice, rows, capsys)
    time.sleep(0.01)
    with Ledger.open(str(bob)) as led:
        led.append([synth.event(i) for i in range(15, 30)])
    _export(bob, rows, capsys)
    time.sleep(0.01)
    again = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(synth.event(3)))  # alice re-measures row 3
    with Ledger.open(str(alice)) as led:
        led.append([again])
    later = _export(alice, rows, capsys, "--since", "15")
    assert os.path.basename(first) != os.path.basename(later)  # named by content: no file is ever overwritten
    assert sorted(os.listdir(rows)) == sorted(n for n in os.listdir(rows) if n.endswith(".kseg"))
    # Named by content, the newest segment may sort first by name: the directory merges oldest first anyway. Made
    # so here (a name is only where the file lies; merge reads what it holds): the re-measurement's segment sorts
    # first, its parent's last.
    renamed = {later: os.path.join(rows, "0" * 32 + ".kseg"), first: os.path.join(rows, "f" * 32 + ".kseg")}
    for old, new in renamed.items():
        os.replace(old, new)
    later, first = renamed[later], renamed[first]
    assert sorted(os.listdir(rows))[0] == os.path.basename(later)
    assert main(["merge", str(rows), "--db", str(carol)]) == 0
    with Ledger.open(str(carol), readonly=True) as led:
        view = synth.view(led)
        got = view.get_many(SPECS)
        assert all(r.status == "ok" for r in got) and got[3].event_id == _eid(again)
    root = _root(carol)
    assert main(["merge", str(rows), "--db", str(carol)]) == 0  # merging again changes nothing
    assert _root(carol) == root
    both = tmp_path / "ab.db"  # the same rows as both teammates' ledgers merged
    with Ledger.open(str(both)) as led:
        led.append([synth.event(i) for i in range(30)] + [again])
    assert _root(both) == root
    # Named in the other order (the re-measurement first), the segments still merge parent first: the same rows.
    assert main(["merge", later, first, "--db", str(tmp_path / "d.db"), "--output-dir", str(tmp_path)]) == 0
    assert _root(tmp_path / "d.db") == _root(alice) and not (tmp_path / "merge-report.json").exists()


def test_overlapping_exports_merge_whatever_order_they_are_named_in(tmp_path, capsys):
    """An export of the whole ledger and one `--since` a seq, named newest first: an event both hold (a row and its
    re-measurement, both in each) bound the whole export after the newer one, while the newer one's re-measurement of
    a row only the whole export holds bound it the other way; the cycle fell back to the given order and the merge
    was refused as a conflict (exit 3). A link the segment holds itself binds it to no other."""
    db = tmp_path / "p.db"
    again = msgspec.structs.replace(synth.event(0, seed=9), parent=_eid(synth.event(0)))
    second = msgspec.structs.replace(synth.event(1, seed=8), parent=_eid(synth.event(1)))
    third = msgspec.structs.replace(synth.event(1, seed=7), parent=_eid(second))
    with Ledger.open(str(db)) as led:
        for batch in ([synth.event(0), synth.event(1)], [again], [second], [third]):
            led.append(batch)
    # newer: again (its parent in whole only), second and third (both in whole too)
    newer = _export(db, tmp_path / "newer.kseg", capsys, "--since", "2")
    whole = _export(db, tmp_path / "whole.kseg", capsys)
    assert main(["merge", newer, whole, "--db", str(tmp_path / "r.db"), "--output-dir", str(tmp_path)]) == 0, \
        capsys.readouterr().err
    assert _root(tmp_path / "r.db") == _root(db) and not (tmp_path / "merge-report.json").exists()


def test_a_directory_without_segments_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["merge", str(tmp_path / "empty"), "--db", str(tmp_path / "x.db")]) == 2
    assert "no .kseg segment" in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists()
    (tmp_path / "run" / "segments").mkdir(parents=True)  # a remote run's --output-dir: the segments are below
    assert main(["merge", str(tmp_path / "run"), "--db", str(tmp_path / "x.db")]) == 2
    assert f"keeps its segments in segments/: pass {tmp_path / 'run' / 'segments'}" in capsys.readouterr().err


def test_a_directory_s_files_not_named_kseg_are_named_not_skipped_silently(tmp_path, capsys):
    """A segment renamed (gemm.seg) in a directory was passed over without a word: `merged 0 new event(s) ... from 1
    segment(s)`, or 'no .kseg segment' for a directory of it alone. The merge names each file it leaves out."""
    rows, db = tmp_path / "rows", tmp_path / "a.db"
    rows.mkdir()
    with Ledger.open(str(db)) as led:
        led.append([synth.event(i) for i in range(3)])
    os.replace(_export(db, rows, capsys), rows / "gemm.seg")
    (rows / ".gitkeep").touch()  # hidden: not named
    assert main(["merge", str(rows), "--db", str(tmp_path / "b.db")]) == 2
    err = capsys.readouterr().err
    assert f"it holds {rows / 'gemm.seg'}, not named *.kseg: rename a segment to end in .kseg" in err, err
    assert not (tmp_path / "b.db").exists()
    with Ledger.open(str(db)) as led:
        led.append([synth.event(3)])
    _export(db, rows, capsys, "--since", "3")
    assert main(["merge", str(rows), "--db", str(tmp_path / "b.db")]) == 0
    out, err = capsys.readouterr()
    assert "merged 1 new event(s)" in out
    assert f"note: not merged: {rows / 'gemm.seg'} (not named *.kseg" in err and ".gitkeep" not in err, err


def test_a_segment_named_in_another_encoding_than_utf8_is_refused_before_anything_is_merged(tmp_path, capsys):
    """A segment named with byte 0xff in a directory merged, then `merge --json` failed on its path in the report:
    a traceback, exit 1, the events merged and no document. It is refused first, named, exit 2."""
    rows, db = tmp_path / "rows", tmp_path / "a.db"
    rows.mkdir()
    with Ledger.open(str(db)) as led:
        led.append([synth.event(i) for i in range(3)])
    os.replace(_export(db, rows, capsys), os.path.join(os.fsencode(rows), b"\xff.kseg"))
    assert main(["merge", str(rows), "--db", str(tmp_path / "b.db"), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"error: segment {rows}/\\xff.kseg: it is named in another encoding than UTF-8" in err, err
    assert not (tmp_path / "b.db").exists()


def test_a_utf8_segment_name_under_a_c_locale_without_utf8_mode_is_refused_naming_the_locale(tmp_path, capsys):
    """Under LC_ALL=C with PYTHONUTF8=0 Python reads a directory's UTF-8 name (dé.kseg) as ascii escapes: the merge
    is refused, saying so and how to read it as UTF-8, not that the file is named in another encoding."""
    import subprocess
    import sys

    rows, db = tmp_path / "rows", tmp_path / "a.db"
    rows.mkdir()
    with Ledger.open(str(db)) as led:
        led.append([synth.event(i) for i in range(3)])
    os.replace(_export(db, rows, capsys), rows / "dé.kseg")
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run([sys.executable, "-m", "kprof", "merge", "rows", "--db", "b.db", "--json"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert "error: segment rows/d\\xc3\\xa9.kseg: its name is UTF-8, read here as ascii: set PYTHONUTF8=1" in p.stderr
    assert not (tmp_path / "b.db").exists()


def test_an_export_beside_its_events_in_a_segment_named_in_another_encoding_writes_its_own(tmp_path, capsys):
    """`export -o DIR --json` where DIR held the same events under a name with byte 0xff reported that file as the
    export: a traceback on its path (exit 1, no document). That file is passed over: a segment is written and named."""
    rows, db = tmp_path / "rows", tmp_path / "a.db"
    rows.mkdir()
    with Ledger.open(str(db)) as led:
        led.append([synth.event(i) for i in range(3)])
    os.replace(_export(db, rows, capsys), os.path.join(os.fsencode(rows), b"\xff.kseg"))
    assert main(["export", "--db", str(db), "-o", str(rows), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["written"] and doc["events"] == 3 and os.path.isfile(doc["segment"])


def test_the_python_merge_takes_a_directory_as_the_verb_does(tmp_path, capsys):
    """kprof.merge.merge.merge(["rows/"]) merges the directory's segments, oldest first, as `kprof merge rows/`
    does (it said 'cannot read segment rows: Is a directory')."""
    from kprof.merge.merge import merge

    rows = tmp_path / "rows"
    rows.mkdir()
    alice = tmp_path / "a.db"
    with Ledger.open(str(alice)) as led:
        led.append([synth.event(i) for i in range(15)])
    _export(alice, rows, capsys)
    time.sleep(0.01)
    again = msgspec.structs.replace(synth.event(3, seed=9), parent=_eid(synth.event(3)))
    with Ledger.open(str(alice)) as led:
        led.append([again])
    later = _export(alice, rows, capsys, "--since", "15")
    os.replace(later, os.path.join(rows, "0" * 32 + ".kseg"))  # sorts first by name: merged last, by its time
    result = merge([str(rows)], str(tmp_path / "c.db"))
    assert (result.added, len(result.segments)) == (16, 2)
    assert _root(tmp_path / "c.db") == _root(alice)
    assert merge([rows], str(tmp_path / "c.db")).added == 0  # a PathLike too; again: a no-op


def test_the_python_merge_refuses_paths_that_are_not_a_list_of_paths(tmp_path, capsys):
    """One path given as a str was read a character at a time ('cannot read segment r'), and a None in the list
    raised a raw TypeError: each is a UsageError naming the value and the fix, and no ledger is made."""
    import pytest

    from kprof.errors import UsageError
    from kprof.merge.merge import merge

    db = str(tmp_path / "x.db")
    for paths, named in ((str(tmp_path / "rows.kseg"), "wrap it in a list"), ([None], "segments[0] = None"),
                         (["a.kseg", 3], "segments[1] = 3"), ([""], "segments[0] = ''"), (7, "got int")):
        with pytest.raises(UsageError, match=re.escape(named)):
            merge(paths, db)
    assert not os.path.exists(db)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .kseg segment"):
        merge([str(tmp_path / "empty")], db)
    assert not os.path.exists(db)


def test_a_directory_path_naming_a_file_or_a_broken_link_is_refused(tmp_path, capsys):
    """`-o x/` where x is a file, a dangling link or a link loop: refused naming it (it was a FileExistsError
    traceback from making the directory), and nothing is written."""
    db = tmp_path / "a.db"
    with Ledger.open(str(db)) as led:
        led.append([synth.event(0)])
    (tmp_path / "file").write_text("notes")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.symlink(tmp_path / "loop2", tmp_path / "loop1")
    os.symlink(tmp_path / "loop1", tmp_path / "loop2")
    before = sorted(os.listdir(tmp_path))
    for name in ("file", "dangling", "loop1"):
        assert main(["export", "--db", str(db), "-o", str(tmp_path / name) + "/"]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name} is not a directory; give a new file path" in err, err
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "file").read_text() == "notes"


def test_exporting_the_same_events_into_a_directory_again_writes_no_second_segment(tmp_path, capsys):
    """`kprof export -o rows/` made twice wrote two segments of the same events, whose bytes differed only by their
    header's time (so their names differed too): a directory committed to git gained a copy at every export, and
    nothing said so. The second export names the segment that holds them and writes nothing."""
    rows = tmp_path / "rows"
    db = tmp_path / "a.db"
    with Ledger.open(str(db)) as led:
        led.append([synth.event(i) for i in range(5)])
    first = _export(db, str(rows) + "/", capsys)
    time.sleep(0.01)
    assert main(["export", "--db", str(db), "-o", str(rows), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["segment"], doc["events"], doc["written"]) == (first, 5, False)
    assert main(["export", "--db", str(db), "-o", str(rows)]) == 0
    assert f"the 5 event(s) of {db} are in {first} already" in capsys.readouterr().out
    assert os.listdir(rows) == [os.path.basename(first)]
    later = _export(db, rows, capsys, "--since", "2")  # other events: a segment of their own
    assert later != first and sorted(os.listdir(rows)) == sorted(os.path.basename(p) for p in (first, later))
