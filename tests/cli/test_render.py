"""Tables of query/run results: a large result prints its first rows and a line counting the rest, fast."""

import json
import os

import pytest

from kprof.api import QueryResult
from kprof.cli import main
from kprof.cli._render import TABLE_ROWS, results_table


def _result(statuses: list[str], errors: int = 0) -> QueryResult:
    rows = [{"spec": {"m": i + 1, "n": 8, "k": 8, "dtype": "fp32"}, "status": s,
             "metrics": {"time_ms": 0.5, "tflops": 1.0} if s == "ok" else None,
             "citation": "kprof.0123456789abcdef" if s == "ok" else None} for i, s in enumerate(statuses)]
    for r in rows[:errors]:
        r["status"], r["error"] = "error", {"kind": "oom", "message": "out of memory"}
    missing = sum(r["status"] != "ok" for r in rows)
    return QueryResult("single_gemm", "torch-cpu", "Some CPU", "p.db", "query", len(rows), missing, "ab" * 32, rows)


def _table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("│")]


def test_a_20000_spec_query_prints_the_first_rows_and_counts_the_rest(ledger_path, tmp_path, capsys, h, local_gpu):
    specs = [h.gemm(m=i + 1) for i in range(20000)]
    h.append(ledger_path, h.make_event(specs[0], local_gpu), h.make_event(specs[-1], local_gpu),
             h.make_event(specs[60], local_gpu, kind="failed"))
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    assert main(["query", "single_gemm", "--backend", "torch-cpu", "--specs", str(tmp_path / "specs.json"),
                 "--db", ledger_path]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert TABLE_ROWS == 50 and len(rows) == 50
    assert rows[0].split("│")[1].strip() == "1" and rows[-1].split("│")[1].strip() == "50"
    tail = out.splitlines()[-3:]
    assert tail[0] == "... and 19950 more rows (1 ok, 19948 missing, 1 failed); use --json for all"
    assert tail[1].startswith(f"2 of 20000 ok, 19998 missing (19997 missing, 1 failed); db {ledger_path}; view root ")
    assert tail[2] == 'failed spec {"m": 61, "n": 32, "k": 32, "dtype": "fp32"} (crash): segfault in the kernel'


def test_a_table_of_the_limit_is_whole_and_one_more_row_is_counted(capsys):
    results_table(_result(["ok"] * 50))
    whole = capsys.readouterr().out
    assert len(_table_rows(whole)) == 50 and "more row" not in whole
    results_table(_result(["ok"] * 50 + ["missing"]))
    out = capsys.readouterr().out
    assert len(_table_rows(out)) == 50
    assert "\n... and 1 more row (1 missing); use --json for all\n50 of 51 ok, 1 missing; db p.db" in out


def test_the_columns_and_limit_follow_the_rows_shown(capsys):
    results_table(_result(["missing"] * 3 + ["ok"] * 2), limit=3)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "status" in line)
    assert "time_ms" not in header  # the ok rows' metrics are not among the rows shown
    assert len(_table_rows(out)) == 3 and "... and 2 more rows (2 ok); use --json for all" in out


def test_error_lines_are_capped_too(capsys):
    results_table(_result(["missing"] * 80, errors=60))
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith('error spec {"m": ') for line in lines) == 50
    assert lines[-1] == "... and 10 more errors; use --json for all"
    assert "... and 30 more rows (20 missing, 10 error); use --json for all" in lines


def test_a_failure_line_says_the_rows_status_and_names_its_spec_as_json(capsys):
    """A query's failed row printed `error for {'m': 1, ...}`: "error", where its status reads failed, and the spec as a
    Python dict, not as --spec takes it. The line now starts with the row's status and names the spec as JSON."""
    res = _result(["missing", "missing"], errors=2)
    res.results[0]["status"] = "failed"
    results_table(res)
    lines = [line for line in capsys.readouterr().out.splitlines() if " spec {" in line]
    assert lines == ['failed spec {"m": 1, "n": 8, "k": 8, "dtype": "fp32"} (oom): out of memory',
                     'error spec {"m": 2, "n": 8, "k": 8, "dtype": "fp32"} (oom): out of memory']
    assert json.loads(lines[0].split(" spec ", 1)[1].split(" (oom)")[0]) == res.results[0]["spec"]


def test_a_terminal_that_is_not_utf8_gets_escapes_not_a_traceback(tmp_path, h, local_gpu):
    """A GPU key (or path) outside the terminal's encoding is printed escaped in a table, as JSON has it."""
    import os
    import subprocess
    import sys

    h.append(str(tmp_path / "p.db"), h.make_event(h.gemm(), local_gpu))
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    p = subprocess.run([sys.executable, "-m", "kprof", "query", "single_gemm", "--backend", "torch-cpu", "--spec",
                        json.dumps(h.gemm()), "--gpu-name", "Ünï 日本", "--db", "p.db"],
                       cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert b"Traceback" not in p.stderr, p.stderr
    assert p.returncode == 0 and b"on \\xdcn\\xef \\u65e5\\u672c (query)" in p.stdout, p.stdout


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_suggested_command_on_a_terminal_that_is_not_utf8_names_the_same_file_pasted(tmp_path, h, local_gpu,
                                                                                      encoding):
    """Under PYTHONIOENCODING=ascii, count-missing's `kprof run` named `--db 'd\\xe9 \\u4e2d.db'`, which a shell
    passes as those backslashes (run then made a new ledger by that name); it is $'...' of the name's UTF-8 bytes,
    as is a value an error quotes."""
    import os
    import shlex
    import subprocess
    import sys

    h.append(str(tmp_path / "dé 中.db"), h.make_event(h.gemm(), local_gpu))
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    argv = [sys.executable, "-m", "kprof", "count-missing", "single_gemm", "--backend", "torch-cpu", "--db", "dé 中.db"]
    p = subprocess.run([*argv, "--spec", json.dumps(h.gemm(m=8))], cwd=tmp_path, env=env, capture_output=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    word = p.stdout.decode(encoding).split("--db ")[1].split(" --spec")[0]
    assert word == "$'d\\xc3\\xa9 \\xe4\\xb8\\xad.db'", word
    said = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True).stdout
    assert said == "dé 中.db".encode()
    p = subprocess.run([*argv, "--spec", json.dumps(h.gemm(dtype="fp32中"))], cwd=tmp_path, env=env,
                       capture_output=True, timeout=120)
    assert p.returncode == 2 and "= $'fp32\\xe4\\xb8\\xad': " in p.stderr.decode(encoding), p.stderr


def test_a_suggested_command_naming_a_path_with_a_control_character_names_the_same_file_pasted(tmp_path, h,
                                                                                             local_gpu):
    """On any terminal, count-missing's `kprof run` for a ledger named with a tab said `--db 'd\\tx.db'`, which a shell
    passes as a backslash and a t (run then made a new ledger by that name); it is $'...' of the name's bytes."""
    import os
    import subprocess
    import sys

    h.append(str(tmp_path / "d\tx.db"), h.make_event(h.gemm(), local_gpu))
    argv = [sys.executable, "-m", "kprof", "count-missing", "single_gemm", "--backend", "torch-cpu", "--db", "d\tx.db"]
    p = subprocess.run([*argv, "--spec", json.dumps(h.gemm(m=8))], cwd=tmp_path, capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert p.returncode == 0, p.stderr
    word = p.stdout.decode().split("--db ")[1].split(" --spec")[0]
    assert word == "$'d\\x09x.db'", word
    assert subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True).stdout == b"d\tx.db"


def test_the_summary_line_says_which_statuses_the_missing_rows_have(capsys):
    results_table(_result(["ok", "missing", "failed", "failed"], errors=0))
    assert "1 of 4 ok, 3 missing (1 missing, 2 failed); db p.db" in capsys.readouterr().out
    results_table(_result(["missing", "ok"]))
    assert "1 of 2 ok, 1 missing; db p.db" in capsys.readouterr().out  # only missing rows: nothing to split
    results_table(_result(["ok", "ok"], errors=1))
    assert "1 of 2 ok, 1 missing (1 error); db p.db" in capsys.readouterr().out


def test_messages_and_tables_print_brackets_as_they_are(tmp_path, capsys, h, local_gpu):
    """Rich markup is off: a path, spec or exception text holding [...] prints whole (`rows[bold]/x[abc].kseg` lost
    its brackets as markup, and so would `pip install ray[client]`)."""
    from kprof.cli._render import error

    seg = tmp_path / "rows[bold]" / "x[abc].kseg"
    assert main(["merge", str(seg), "--db", str(tmp_path / "zz.db")]) == 2
    assert f"error: cannot read segment {seg}: " in capsys.readouterr().err
    error("Ray is not installed; pip install ray[client]")
    assert capsys.readouterr().err == "error: Ray is not installed; pip install ray[client]\n"
    db = str(tmp_path / "p[red].db")
    h.append(db, h.make_event(h.gemm(m=3), local_gpu))
    assert main(["scopes", "--db", db]) == 0
    assert f"scopes of {db}" in capsys.readouterr().out
    assert main(["audit", "--db", db]) == 0
    assert capsys.readouterr().out.startswith(f"audit of {db}: clean — 1 events")


def _wide_result(table="single_gemm", backend="torch-cpu") -> QueryResult:
    rows = [{"spec": {"m": m, "n": 1024, "k": 256, "dtype": "fp32"}, "status": "ok",
             "metrics": {"time_ms": 0.0255812 * m, "tflops": 0.0253911 * m, "memory_bandwidth_gbps": 51.0213,
                         "energy_j": None},
             "citation": f"kprof.{m:02d}44fe280f378904"} for m in (1, 16, 64)]
    return QueryResult(table, backend, "AMD EPYC", "p.db", "query", 3, 0, "ab" * 32, rows)


def _render(res, width: int) -> str:
    import io

    from rich.console import Console

    buf = io.StringIO()
    results_table(res, out=Console(file=buf, width=width, highlight=False, soft_wrap=True))
    return buf.getvalue()


def test_an_80_column_table_shows_every_number_and_citation_whole():
    """An 80-column terminal showed `0.02…` and `kpro…`: now the optional metrics give way, named below."""
    res = _wide_result()
    out = _render(res, 80)
    assert "…" not in out and max(len(line) for line in out.splitlines() if line[:1] in "┏┃┡│└") <= 80
    for r in res.results:
        assert r["citation"] in out
        for metric in ("time_ms", "tflops"):
            assert f" {r['metrics'][metric]:.4g} " in out
    assert "(not shown at 80 columns: memory_bandwidth_gbps, energy_j; widen the terminal, or use --json)" in out
    wide = _render(res, 200)
    assert "memory_bandwidth_gbps" in wide and "51.02" in wide and "not shown" not in wide


@pytest.mark.parametrize("width", [20, 24, 27])
def test_a_table_too_wide_for_any_fit_still_shows_every_value(width):
    """Below ~28 columns (a narrow pane, or COLUMNS=24 with the output to a log) rich gave the spec and status columns
    no room at all: the rows printed as empty cells beside their citations. Each column keeps a character at least,
    its values folded, never cut (the table is wider than the terminal, as it was already)."""
    res = _wide_result()
    body = [line for line in _render(res, width).splitlines() if line.startswith("│")]
    columns = list(zip(*(line.split("│")[1:-1] for line in body)))
    assert len(columns) == 7 and all(any(cell.strip() for cell in column) for column in columns), body
    assert ["".join(cell.strip() for cell in column) for column in columns[:5]] == [
        "11664", "102410241024", "256256256", "fp32fp32fp32", "okokok"]


def test_headers_fold_onto_two_lines_at_most_from_80_to_120_columns():
    """At 95 to 100 columns `memory_bandwidth_gbps` folded onto five lines over its numbers and `energy_j` onto eight
    over its dashes: an optional metric now gives way (named below) before a header takes more than two lines, and
    every number and citation stays whole."""
    res = _wide_result()
    for width in range(80, 121):
        lines = _render(res, width).splitlines()
        top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
        rule = next(i for i, line in enumerate(lines) if line.startswith("┡"))
        assert rule - top - 1 <= 2, (width, "\n".join(lines[top:rule + 1]))
        assert max(len(line) for line in lines if line[:1] in "┏┃┡│└") <= width
        for r in res.results:
            assert r["citation"] in "\n".join(lines) and f" {r['metrics']['time_ms']:.4g} " in "\n".join(lines)
    assert " 51.02 " in _render(res, 100)  # a metric whose header fits on two lines is kept


def test_a_collective_table_shows_the_message_size_once():
    rows = [{"spec": {"message_size_bytes": 1048576, "dtype": "fp32", "world_size": 2}, "status": "ok",
             "metrics": {"time_ms": 0.5, "algbw_gbps": 2.1, "busbw_gbps": 2.1, "message_size_bytes": 1048576.0,
                         "energy_j": None}, "citation": "kprof.0123456789abcdef"}]
    out = _render(QueryResult("all_reduce", "gloo", "AMD EPYC", "p.db", "query", 1, 0, "ab" * 32, rows), 200)
    header = next(line for line in out.splitlines() if "status" in line)
    assert header.count("message_size_bytes") == 1 and "1048576" in out and "1.049e+06" not in out


def test_a_float_spec_value_is_shown_whole(capsys):
    """A plugin's float spec field read with 4 significant digits like a metric: temperatures 0.123456 and 0.123457
    both showed 0.1235, two rows of one spec to the eye. A spec value is shown as given (1.0 as 1.0, not 1)."""
    res = _result(["missing"] * 3)
    for row, scale in zip(res.results, (0.123456, 0.123457, 1.0)):
        row["spec"] = {**row["spec"], "scale": scale}
    results_table(res)
    cells = [line.split("│")[5].strip() for line in _table_rows(capsys.readouterr().out)]
    assert cells == ["0.123456", "0.123457", "1.0"]


@pytest.mark.parametrize("argv", [
    ["query", "single_gemm", "--backend", "torch-cpu", "--specs", "a\nb\x1b[31m.json"],
    ["merge", "a\nb\x1b[31m.kseg", "--db", "p.db"],
    ["scopes", "--json=a\nb\x1b[31m"],
])
def test_an_error_naming_a_value_with_control_characters_is_one_line_of_escapes(argv, tmp_path, capsys, monkeypatch):
    """A newline or terminal escape in a path or value an error names is shown escaped: the error stays one line and
    cannot restyle the terminal (a path with a newline printed as two lines, its escape turned the rest red)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err, err
    assert "a\\nb\\x1b[31m" in err, err


def test_an_error_naming_a_path_with_an_undecodable_byte_shows_the_byte(tmp_path, capsys, monkeypatch, h):
    """Run in a directory named with byte 0xff, a ledger whose directory is missing was named `.../\\udcff/nodir`,
    Python's surrogate for the byte, which no shell or file manager shows; it is `\\xff`, as a refused argument's is."""
    here = os.path.join(os.fsencode(tmp_path), b"x\xff")
    os.mkdir(here)
    monkeypatch.chdir(here)
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *h.spec_args(h.gemm()), "--db", "nodir/p.db"]) == 2
    err = capsys.readouterr().err
    assert f"there is no directory {tmp_path}/x\\xff/nodir; " in err and "udc" not in err, err


def test_a_setting_with_an_undecodable_byte_is_named_with_the_byte(capsys, monkeypatch, h):
    """KPROF_TIME_BUDGET_S=$'\\xff' was refused as `KPROF_TIME_BUDGET_S='\\udcff'`, the repr of Python's surrogate;
    the byte is named. A backslash the value holds stays one (repr doubles it)."""
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", os.fsdecode(b"1\xff"))
    argv = ["run", "single_gemm", "--backend", "torch-cpu", *h.spec_args(h.gemm()), "--db", "p.db"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: KPROF_TIME_BUDGET_S='1\\xff' is not a number of seconds" in err and "udc" not in err, err
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "1\\udcff")  # a backslash, then text
    assert main(argv) == 2
    assert "error: KPROF_TIME_BUDGET_S='1\\\\udcff' is not" in capsys.readouterr().err
    assert not os.path.exists("p.db")


def test_a_results_table_prints_control_characters_of_stored_values_as_escapes(capsys):
    """A metric name of a merged row holding an escape sequence reached the terminal in the table's header."""
    res = _result(["ok"])
    res.results[0]["metrics"] = {"time_ms\x1b]0;owned\x07": 0.5}
    results_table(res)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "time_ms\\x1b]0;own" in out


@pytest.mark.parametrize("spec, start, end", [
    ({"m": 1, "n": 1, "k": 1, "dtype": "x" * 3_000_000}, 'spec 0: field "dtype" = \'xxx',
     "; use one of bf16, fp16, fp32"),
    ({"m": 1, "n": 1, "k": 1, "dtype": "fp32", "y" * 3_000_000: 1}, 'spec 0: field "yyy',
     "is not a KernelArgs field of single_gemm; use only {m, n, k, dtype}"),
])
def test_an_error_naming_a_value_of_megabytes_is_cut_and_keeps_the_fix(spec, start, end, tmp_path, capsys, monkeypatch):
    """A spec's 3 MB string was printed whole in its error, twice: 6 MB on stderr for one bad field."""
    monkeypatch.chdir(tmp_path)
    assert main(["count-missing", "single_gemm", "--backend", "torch-cpu", "--gpu-name", "x", "--spec",
                 json.dumps(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 2_100, len(err)
    assert err.startswith("error: " + start) and err.rstrip("\n").endswith(end)


def test_an_error_line_of_megabytes_from_any_verb_is_cut_in_its_middle(tmp_path, capsys, monkeypatch):
    """Where no message of its own shortens a value (a setting's, here), the error line is cut in its middle at
    ERROR_CHARS, keeping what is wrong and the fix: a 1 MB KPROF_POOL was written whole."""
    from kprof.cli._render import ERROR_CHARS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KPROF_POOL", "x" * 1_000_000)
    assert main(["run", "single_gemm", "--backend", "torch-cpu", "--spec",
                 json.dumps({"m": 1, "n": 8, "k": 8, "dtype": "fp32"}), "--db", "p.db"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) <= ERROR_CHARS + 100 and "characters left out" in err, len(err)
    assert err.startswith("error: KPROF_POOL='xxx") and err.rstrip("\n").endswith("or unset it")
    assert not os.path.exists("p.db")


def test_a_row_of_thousands_of_metrics_shows_the_first_and_counts_the_rest(capsys):
    """A merged row of 100,000 metric names made a query's table a column each, gathered through a list (quadratic):
    the query ran for hours. The table shows METRIC_COLUMNS of them and counts the rest (--json has them all)."""
    from kprof.cli._render import METRIC_COLUMNS

    res = _result(["ok", "ok"])
    res.results[1]["metrics"] = {**res.results[1]["metrics"], **{f"m{i:05d}": 1.0 for i in range(3_000)}}
    results_table(res)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "status" in line)
    assert "time_ms" in header and "tflops" in header and header.count("┃") == 4 + 1 + METRIC_COLUMNS + 1 + 1
    assert f"({3_002 - METRIC_COLUMNS} more metric(s) of these rows not shown; use --json for all)" in out


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_on_a_stream_that_is_not_utf8_the_table_stays_aligned(encoding):
    """Under a C locale or PYTHONIOENCODING=ascii the stream escaped what it cannot encode after rich laid the table
    out (`é✓` printed as `\\xe9\\u2713` in a cell sized for two characters): every column right of it moved. The
    values are escaped first and the cells sized as printed."""
    import io

    from kprof.cli._render import _console_class

    res = _wide_result()
    res.results[0]["metrics"] = {**res.results[0]["metrics"], "débit✓": 1.5}
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding, errors="backslashreplace")
    results_table(res, out=_console_class()(file=stream, width=200, highlight=False, soft_wrap=True, markup=False))
    stream.flush()
    lines = [line for line in raw.getvalue().decode(encoding).splitlines() if line[:1] in "+|"]
    assert len({len(line) for line in lines}) == 1, lines
    assert "d\\xe9bit\\u2713" in lines[1] if encoding == "ascii" else "débit\\u2713" in lines[1]
