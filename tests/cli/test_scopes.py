"""`kprof scopes` and `kprof.api.scopes`: every (table, backend, GPU key) of a ledger with its row count."""

import json
import os

from kprof import api
from kprof.cli import main
from kprof.ledger import Ledger
from kprof.ledger._codec import encode, event_id
from kprof.ledger.build import retraction

H200 = "NVIDIA H200"


def _fill(h, db, gpu):
    """Four rows of single_gemm/torch-cpu here (2 ok, 1 failed, 1 of an older revision), one under another GPU key,
    one rms_norm row, and a memcpy row retracted (its scope stays, with no rows)."""
    copy = h.make_event({"bytes": 4096}, gpu, table="memcpy")
    h.append(db, h.make_event(h.gemm(), gpu), h.make_event(h.gemm(m=64), gpu),
             h.make_event(h.gemm(m=128), gpu, kind="failed"), h.make_event(h.gemm(m=8), gpu, revision=0),
             h.make_event(h.gemm(), H200), h.make_event({"tokens": 4, "hidden": 64, "dtype": "fp32"}, gpu,
                                                        table="rms_norm"), copy)
    h.append(db, retraction(event_id(encode(copy)), copy.key, "wrong bytes"))


def _expected(gpu):
    return sorted([["memcpy", "torch-cpu", gpu, 0], ["rms_norm", "torch-cpu", gpu, 1],
                   ["single_gemm", "torch-cpu", gpu, 4], ["single_gemm", "torch-cpu", H200, 1]])


def test_json_lists_every_scope_sorted_with_its_rows(ledger_path, capsys, h, local_gpu):
    _fill(h, ledger_path, local_gpu)
    assert main(["scopes", "--db", ledger_path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["db", "scopes"] and doc["db"] == ledger_path
    assert [list(s) for s in doc["scopes"]] == [["table", "backend", "gpu_name", "rows"]] * 4
    assert [list(s.values()) for s in doc["scopes"]] == _expected(local_gpu)


def test_python_call_gives_the_same_scopes(ledger_path, h, local_gpu):
    _fill(h, ledger_path, local_gpu)
    found = api.scopes(ledger_path)
    assert all(type(s) is api.Scope for s in found)
    assert [[s.table, s.backend, s.gpu_name, s.rows] for s in found] == _expected(local_gpu)


def test_human_output_is_a_table_and_a_total(ledger_path, capsys, h):
    h.append(ledger_path, h.make_event(h.gemm(), H200), h.make_event(h.gemm(m=64), H200),
             h.make_event(h.gemm(), "Some CPU"))
    assert main(["scopes", "--db", ledger_path]) == 0
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    rows = [[cell.strip() for cell in line.strip("│").split("│")] for line in lines if line.startswith("│")]
    assert rows == [["single_gemm", "torch-cpu", H200, "2"], ["single_gemm", "torch-cpu", "Some CPU", "1"]]
    assert lines[0].strip() == f"scopes of {ledger_path}"
    assert lines[-1] == ("2 scope(s), 3 row(s); read one with --gpu-name (query, count-missing) or gpu_key= "
                         "(kprof.perf_api)")


def test_an_empty_ledger_has_no_scopes(ledger_path, capsys):
    Ledger.open(ledger_path).close()
    assert main(["scopes", "--db", ledger_path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"db": ledger_path, "scopes": []}
    assert main(["scopes", "--db", ledger_path]) == 0
    assert capsys.readouterr().out == f"ledger {ledger_path} holds no rows; `kprof run` fills it\n"


def test_a_ledger_that_does_not_exist_is_a_usage_error_and_stays_absent(tmp_path, capsys):
    db = str(tmp_path / "absent.db")
    assert main(["scopes", "--db", db, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"no ledger at {db}" in captured.err
    assert not os.path.exists(db)


def test_a_ledger_that_does_not_exist_is_named_with_where_its_path_came_from(tmp_path, monkeypatch, capsys):
    """`KPROF_DB=/x/missing.db kprof scopes` said "pass --db or set KPROF_DB", KPROF_DB set: the message names the path
    and what named it ($KPROF_DB, or the default where it is unset), with the fix that fits; so does the Python API."""
    import pytest

    from kprof.errors import LedgerPathError

    missing = str(tmp_path / "x" / "missing.db")
    monkeypatch.setenv("KPROF_DB", missing)
    assert main(["scopes"]) == 2
    err = capsys.readouterr().err
    assert f"no ledger at {missing} (named by $KPROF_DB); set KPROF_DB to the ledger file (or unset it), or pass " \
           f"--db, or `kprof run` to create one" in err and "or set KPROF_DB" not in err
    monkeypatch.delenv("KPROF_DB")
    monkeypatch.chdir(tmp_path)
    for given in ([], ["--db", "profile.db"]):  # the default's path given: it said "no --db given", one given
        assert main(["scopes", *given]) == 2
        assert "no ledger at profile.db (the path read where no --db is given and KPROF_DB is unset); pass --db or " \
               "set KPROF_DB, or `kprof run` to create one" in capsys.readouterr().err
    with pytest.raises(LedgerPathError, match=r"^no ledger at profile\.db \(the path read where no db=\.\.\. is given "
                                              r"and KPROF_DB is unset\); pass db=\.\.\. or set KPROF_DB"):
        api.scopes()
    assert not os.listdir(tmp_path)  # nothing made



def test_a_missing_ledger_named_by_kprof_db_with_spaces_around_it_says_kprof_db_named_it(tmp_path, monkeypatch,
                                                                                          capsys):
    """KPROF_DB=' /x/missing.db ' (spaces around a setting do not matter: the path read is /x/missing.db) said "pass
    --db or set KPROF_DB", the variable set: the missing ledger is named as $KPROF_DB's, with the fix that fits."""
    missing = str(tmp_path / "missing.db")
    monkeypatch.setenv("KPROF_DB", f" {missing} ")
    assert main(["scopes"]) == 2
    err = capsys.readouterr().err
    assert f"no ledger at {missing} (named by $KPROF_DB); set KPROF_DB to the ledger file" in err, err
    assert not os.listdir(tmp_path)

def test_default_db_is_kprof_db_then_cwd(tmp_path, monkeypatch, capsys, h):
    h.append(str(tmp_path / "profile.db"), h.make_event(h.gemm(), H200))
    assert main(["scopes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scopes"][0]["gpu_name"] == H200
    other = tmp_path / "other.db"
    h.append(str(other), h.make_event(h.gemm(), "Other GPU"))
    monkeypatch.setenv("KPROF_DB", str(other))
    assert main(["scopes", "--json"]) == 0
    assert [s["gpu_name"] for s in json.loads(capsys.readouterr().out)["scopes"]] == ["Other GPU"]


def test_a_narrow_terminal_cuts_no_name(tmp_path, capsys, h, monkeypatch):
    """At 40 columns `kprof scopes` printed `single_…`, `torch-c…`: the names to pass back were cut."""
    import sys

    from rich.console import Console

    db = str(tmp_path / "p.db")
    h.append(db, h.make_event(h.gemm(), "NVIDIA H200 NVL"))
    monkeypatch.setattr("kprof.cli.scopes.console", lambda: Console(file=sys.stdout, width=40, soft_wrap=True))
    assert main(["scopes", "--db", db]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("│")[1:4]] for line in out.splitlines() if line.startswith("│")]
    assert "…" not in out and rows[0][:2] == ["single_gemm", "torch-cpu"]
    assert " ".join(r[2] for r in rows).split() == ["NVIDIA", "H200", "NVL"]
