"""Spec input through the CLI: every accepted form, and every usage error (exit 2, nothing written)."""

import json
import math
import os

import pytest

from kprof.cli import main
from kprof.ledger import Ledger

GEMM = ["single_gemm", "--backend", "torch-cpu"]
A = {"m": 32, "n": 48, "k": 64, "dtype": "fp32"}
B = {"m": 64, "n": 32, "k": 16, "dtype": "bf16"}
C = {"m": 16, "n": 16, "k": 16, "dtype": "fp16"}
PREFILL = {"batch": 1, "seq_len": 8, "num_heads": 8, "num_kv_heads": 2, "head_dim": 8, "causal": True,
           "dtype": "fp32"}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.05")
    monkeypatch.delenv("KPROF_DB", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "out" / "profile.db")


@pytest.fixture
def empty_db(tmp_path):
    """An empty ledger: the read verbs need one (a --db that names no file is a usage error)."""
    path = str(tmp_path / "ledger.db")
    Ledger.open(path).close()
    return path


def _spec(s) -> list[str]:
    return ["--spec", s if isinstance(s, str) else json.dumps(s)]


def _count(capsys, args) -> dict:
    assert main(["count-missing", *GEMM, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _write(tmp_path, name, text) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ---- accepted forms --------------------------------------------------------------------------------------

def test_repeated_spec(capsys, empty_db):
    doc = _count(capsys, [*_spec(A), *_spec(B), *_spec(C), "--db", empty_db])
    assert doc["count"] == 3 and doc["missing"] == [A, B, C]


def test_specs_json_object(tmp_path, capsys, empty_db):
    doc = _count(capsys, ["--specs", _write(tmp_path, "one.json", json.dumps(A)), "--db", empty_db])
    assert doc["count"] == 1 and doc["missing"] == [A]


def test_specs_json_list(tmp_path, capsys, empty_db):
    doc = _count(capsys, ["--specs", _write(tmp_path, "list.json", json.dumps([A, B, C], indent=2)), "--db", empty_db])
    assert doc["count"] == 3 and doc["missing"] == [A, B, C]


def test_specs_wrapped_list(tmp_path, capsys, empty_db):
    path = _write(tmp_path, "wrapped.json", json.dumps({"specs": [A, B]}))
    doc = _count(capsys, ["--specs", path, "--db", empty_db])
    assert doc["count"] == 2 and doc["missing"] == [A, B]


def test_specs_jsonl(tmp_path, capsys, empty_db):
    path = _write(tmp_path, "specs.jsonl", "\n".join(json.dumps(s) for s in (A, B, C)) + "\n\n")
    doc = _count(capsys, ["--specs", path, "--db", empty_db])
    assert doc["count"] == 3 and doc["missing"] == [A, B, C]


def test_field_order_of_input_does_not_matter(capsys, empty_db):
    shuffled = json.dumps({"dtype": "fp32", "k": 64, "m": 32, "n": 48})
    doc = _count(capsys, [*_spec(shuffled), "--db", empty_db])
    assert doc["missing"] == [A] and list(doc["missing"][0]) == ["m", "n", "k", "dtype"]


def test_attention_gqa_valid_spec_is_accepted(capsys, empty_db):
    assert main(["count-missing", "attention_prefill", "--backend", "torch-cpu", "--json", "--db", empty_db,
                 *_spec(PREFILL)]) == 0
    assert json.loads(capsys.readouterr().out)["missing"] == [PREFILL]


# ---- usage errors: exit 2, a message naming the spec index, the field and the fix; nothing written ----------

ERRORS = {
    "unknown field": ([A, {**A, "foo": 1}], ["spec 1", '"foo"', "use only {m, n, k, dtype}"]),
    "backend field": ([A, {**A, "backend": "torch-cpu"}],  # the table, not the runner's Struct (CpuGemmArgs)
                      ['spec 1: field "backend" is not a KernelArgs field of single_gemm; give the backend on its own instead (--backend; backend= in Python)']),
    "wrong type": ([A, {**A, "m": "32"}], ["spec 1", '"m"', "Expected `int`", "use an integer greater than 0"]),
    "bool for int": ([A, {**A, "k": True}], ["spec 1", 'field "k" = true is a bool; use an integer greater than 0']),
    "non-integral float": ([A, {**A, "n": 32.5}], ["spec 1", 'field "n" = 32.5 is a float; use an integer greater '
                                                   'than 0']),
    "integral float": ([A, {**A, "m": 64.0}], ["spec 1", 'field "m" = 64.0 is a float; use an integer greater than 0',
                                               'e.g. "m": 64']),
    "zero as a float": ([A, {**A, "k": 0.0}], ["spec 1", 'field "k" = 0.0 is a float; use an integer greater than 0 '
                                               "and at most 1099511627776\n"]),  # no e.g. "k": 0, itself refused
    "negative size": ([A, {**A, "m": -4}], ["spec 1", '"m"', "-4", "use an integer greater than 0"]),
    "zero size": ([{**A, "k": 0}, A], ["spec 0", '"k"', "use an integer greater than 0"]),
    "unknown dtype": ([A, B, {**A, "dtype": "fp64"}], ["spec 2", '"dtype"', "fp64",
                                                       "use one of bf16, fp16, fp32\n"]),  # the CPU's: no fp8
    "missing field": ([A, {"m": 1, "n": 1, "dtype": "fp32"}],
                      ['spec 1: field "k" is missing; a single_gemm spec needs {m, n, k, dtype}']),
    "not an object": ([A, [1, 2]], ["spec 1", "expected a JSON object of {m, n, k, dtype}, got a list ([1,2]); a spec "
                                   "is one object, not a list of them: one per --spec"]),
    "a wrapper as a spec": ([A, {"specs": [A]}], ['spec 1: field "specs" is not a KernelArgs field of single_gemm; a '
                                                  '{"specs": [...]} document is a whole --specs file (in Python, pass '
                                                  'its list), not one spec or JSONL line']),
    "null for a field": ([A, {**A, "dtype": None}], ['spec 1: field "dtype" = null: Expected `str`, got `null`']),
    "an object for a field": ([A, {**A, "m": {"v": True}}], ['spec 1: field "m" = {"v":true}: Expected `int`, got '
                                                             '`object`']),
    "null": ([A, None], ["spec 1: expected a JSON object of {m, n, k, dtype}, got null; write each spec as an object"]),
    "malformed json": ([A, '{"m": 32, "n": 48,'], ["spec 1", "--spec is not valid JSON", "write it as a JSON object"]),
}


def _no_db(db):
    parent = os.path.dirname(db)
    assert not os.path.exists(db)
    assert not os.path.exists(parent) or not [n for n in os.listdir(parent) if n.startswith("profile.db")]


@pytest.mark.parametrize("verb", ["run", "query", "count-missing"])
@pytest.mark.parametrize("case", list(ERRORS), ids=str)
def test_spec_error_via_spec(verb, case, capsys, db):
    specs, needles = ERRORS[case]
    args = [a for s in specs for a in _spec(s)]
    assert main([verb, *GEMM, *args, "--db", db, "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    for needle in needles:
        assert needle in out.err, (needle, out.err)
    _no_db(db)


@pytest.mark.parametrize("case", [c for c in ERRORS if c != "malformed json"], ids=str)
def test_spec_error_via_specs_file_names_the_list_index(case, tmp_path, capsys, db):
    specs, needles = ERRORS[case]
    path = _write(tmp_path, "specs.json", json.dumps({"specs": specs}))
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)
    _no_db(db)


def test_a_specs_file_past_the_size_limit_is_refused_unread(tmp_path, capsys, db):
    """A file of gigabytes (here sparse: it takes no disk) is refused from its size, before a byte is read: read whole,
    its specs would take ~16 times its size in memory."""
    from kprof.specs import MAX_FILE_BYTES

    path = _write(tmp_path, "specs.json", json.dumps([A]))
    os.truncate(path, MAX_FILE_BYTES + 1)
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert f"--specs {path} is {MAX_FILE_BYTES + 1:,} bytes, past the 256 MiB a specs file may hold" in err, err
    assert "split it into smaller files" in err
    _no_db(db)


def test_malformed_jsonl_line_names_the_line_and_index(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.jsonl", json.dumps(A) + "\n" + json.dumps(B) + "\n" + '{"m": 1, "n": \n')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert "spec 2" in err and "line 3" in err and "not valid JSON" in err and "write it as a JSON object" in err
    _no_db(db)


def test_a_jsonl_line_is_named_by_its_number_in_the_file_counting_blank_lines(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.jsonl", "\n" + json.dumps(A) + "\n\n\n" + '{"m": 1, "n": \n')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert "spec 1" in err and f"--specs {path} line 5 is not valid JSON" in err  # line 2 counted non-blank lines
    _no_db(db)


@pytest.mark.parametrize("verb", ["run", "count-missing"])
def test_a_jsonl_spec_refused_at_validation_is_named_by_its_line(verb, tmp_path, capsys, db):
    """A valid JSON line whose spec does not fit the table was named "spec 2" alone: with blank lines before it, the
    file's line 5, which the user's editor shows, could not be found from it."""
    path = _write(tmp_path, "specs.jsonl", json.dumps(A) + "\n\n" + json.dumps(B) + "\n\n" + json.dumps({**A, "m": -2})
                  + "\n" + json.dumps([A]) + "\n")
    assert main([verb, *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: spec 2: --specs {path} line 5: field "m" = -2') and "use an integer" in err, err
    path = _write(tmp_path, "specs.jsonl", json.dumps(A) + "\n\n" + json.dumps([A]) + "\n")
    assert main([verb, *GEMM, "--specs", path, "--db", db]) == 2
    assert f"spec 1: --specs {path} line 3: expected a JSON object" in capsys.readouterr().err
    _no_db(db)


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_pretty_printed_files_spec_refused_at_validation_is_named_by_its_line(wrapped, tmp_path, capsys, db):
    """json.dump(specs, f, indent=2) puts a spec on six lines: "spec 3" alone left the user counting objects."""
    from kprof.spec_input import _item_line

    specs = [A, B, C, {**A, "m": 0}, C]
    path = tmp_path / "specs.json"
    path.write_text("\ufeff" + json.dumps({"specs": specs} if wrapped else specs, indent=2).replace("\n", "\r\n"))
    assert main(["count-missing", *GEMM, "--specs", str(path), "--db", db]) == 2
    line = 1 + wrapped + 1 + 6 * 3  # "{" (wrapped), "[", three specs of six lines: the fourth opens on the next
    assert f'error: spec 3: --specs {path} line {line}: field "m" = 0:' in capsys.readouterr().err
    _no_db(db)
    text = '[{"s": "a[,\\"\\n", "t": [1, {}]},\n\n  {"m": 0}]'  # a string's "[" or "," is no item of the list
    assert (_item_line(text, 0), _item_line(text, 1), _item_line("{}", 0), _item_line("[1 2]", 1)) == (1, 3, None, None)


def test_several_specs_in_one_spec_or_jsonl_line_are_said_to_be_one_each(tmp_path, capsys, db):
    """`--spec '{...}{...}'` or two objects on one JSONL line read "trailing characters" one column past them, with
    "write it as a JSON object" as the fix: each was one."""
    one = json.dumps(A)
    assert main(["count-missing", *GEMM, "--spec", f"{one} {one}", "--db", db]) == 2
    assert (f"--spec is not valid JSON (JSON is malformed: trailing characters at column {len(one) + 2}); a --spec "
            f"holds one spec: give each its own --spec, or put them in a --specs file\n") in capsys.readouterr().err
    path = _write(tmp_path, "specs.jsonl", f"{one}\n{one},{one}\n")
    assert main(["count-missing", *GEMM, "--specs", path, "--db", db]) == 2
    assert (f"line 2 is not valid JSON (JSON is malformed: trailing characters at column {len(one) + 1}); a JSONL line "
            f"holds one spec, ending where its object does\n") in capsys.readouterr().err
    _no_db(db)


@pytest.mark.parametrize("comment", ["# GEMMs of layer 1", "// decode", "/* prefill */"])
@pytest.mark.parametrize("first", [True, False])
def test_a_comment_in_a_specs_file_is_named_as_a_comment(comment, first, tmp_path, capsys, db):
    """A comment line was "not valid JSON (invalid character (byte 0)); write it as a JSON object", or on line 1 "not
    valid JSON or JSONL (invalid character at line 1, column 1)": neither said that JSON has no comments."""
    body = [json.dumps(A), "", comment, json.dumps(B)] if not first else [comment, json.dumps(A), json.dumps(B)]
    path = _write(tmp_path, "specs.jsonl", "\n".join(body) + "\n")
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --specs {path} line {1 if first else 3} is a comment ({comment}); JSON and JSONL have no "
                   f"comments: remove the line, or keep notes in another file\n"), err
    _no_db(db)


@pytest.mark.parametrize("args, said", [
    (["--specs", ""], "error: --specs '': the path is empty; pass the path of a JSON or JSONL file of specs\n"),
    (["--spec", " "], "error: spec 0: --spec is not valid JSON (it is empty); write it as a JSON object"),
    (["--spec", '{"m": 1, "n": 2'], "--spec is not valid JSON (it ends before every [ and { it opens is closed)"),
    (["--spec", '{"m": 1,, "n": 2}'], "--spec is not valid JSON (JSON is malformed: object keys must be strings at "
                                      "column 9)"),
    (["--spec", '{"m": 1,\n "n": 2 "k": 3}'], "--spec is not valid JSON (JSON is malformed: expected ',' or '}' at "
                                              "line 2, column 9)"),
    (["--spec", '{"dtype": "\\ud800"}'], "--spec is not valid JSON (it holds a \\u escape of half a UTF-16 "
                                         "surrogate pair (\\ud800 to \\udfff, alone), which is no character"),
])
def test_an_empty_or_cut_off_spec_is_said_to_be_so(args, said, capsys, db):
    """`--specs ''` read as no --specs at all ("no specs given; pass --spec JSON or --specs PATH"), and msgspec's
    "Input data was truncated" stood for an empty --spec and for a string ending in a lone surrogate escape; its
    byte offset in a one-line text was a byte, not a column."""
    assert main(["count-missing", *GEMM, *args, "--db", db]) == 2
    err = capsys.readouterr().err
    assert said in err and "truncated" not in err and "(byte" not in err, err
    _no_db(db)


def test_a_file_given_to_spec_is_said_to_be_for_specs(tmp_path, capsys, db):
    """`--spec specs.json` (for --specs) read "--spec is not valid JSON (invalid character at column 1); write it as a
    JSON object": the path was parsed as JSON."""
    path = _write(tmp_path, "my specs.json", json.dumps([A, B]))
    assert main(["count-missing", *GEMM, *_spec(A), "--spec", path, "--db", db]) == 2
    said = f"error: spec 1: --spec {path}: that is a file, and --spec takes one spec as JSON text; pass the file with "
    assert capsys.readouterr().err == said + f"--specs '{path}'\n"
    _no_db(db)


@pytest.mark.parametrize("body, said", [
    ("[\n  A,\n  B,\n]\n", "trailing comma in array at line 4, column 1"),
    ('{"specs": [\n  A,\n  B\n', "it ends before every [ and { it opens is closed"),
    ('[\n  A,\n  {"m": 1 "n": 2}\n]\n', "expected ',' or '}' at line 3, column 11"),
])
def test_a_pretty_printed_file_with_a_mistake_is_named_where_it_is_not_as_its_first_line(body, said, tmp_path,
                                                                                        capsys, db):
    """A multi-line JSON document that does not parse was read as JSONL: "spec 0: line 1 is not valid JSON" (its
    line "["), with a spec object to write as the fix, wherever the mistake was."""
    path = _write(tmp_path, "specs.json", body.replace("A", json.dumps(A)).replace("B", json.dumps(B)))
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --specs {path} is not valid JSON or JSONL (") and said in err, err
    assert err.count("\n") == 1 and "fix the file" in err and "spec 0" not in err and "line 1" not in err
    _no_db(db)


@pytest.mark.parametrize("inner, held", [(json.dumps(A), "an object"), ("5", "a number (5)"),
                                         ("null", "null")])
def test_a_specs_wrapper_around_something_not_a_list_says_so(inner, held, tmp_path, capsys, db):
    """{"specs": {...}} was read as one spec and refused for its field "specs", with "use only {m, n, k, dtype}"."""
    path = _write(tmp_path, "specs.json", f'{{"specs": {inner}}}')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert f'--specs {path}: "specs" holds {held}, not a list; write {{"specs": [{{...}}, ...]}}' in err, err
    _no_db(db)


_HEAD = {"table": "single_gemm", "backend": "torch-cpu", "gpu_name": "cpu", "db": "profile.db", "count": 1,
         "missing_count": 1}


@pytest.mark.parametrize("doc, jq, specs", [
    ({**_HEAD, "missing": [A]}, ".missing", [A]),  # count-missing --json
    ({**_HEAD, "mode": "query", "view_root": "00", "results": [{"spec": A, "status": "missing"}]}, "[.results[].spec]",
     [A]),  # query or run --json, results.json
    ({"table": "single_gemm", "backend": "torch-cpu", "mode": "jit", "specs": [A]}, ".specs", [A]),  # request.json
])
def test_a_document_kprof_wrote_names_where_its_specs_are(doc, jq, specs, tmp_path, capsys, empty_db):
    """`count-missing --json` output fed back to --specs (a script's loop) was read as one spec, refused for its field
    "table" with "use only {m, n, k, dtype}", and a snapshot's request.json was told to "pass --backend instead",
    which the command had done."""
    path = _write(tmp_path, "out.json", json.dumps(doc))
    assert main(["count-missing", *GEMM, "--specs", path, "--db", empty_db]) == 2
    err = capsys.readouterr().err
    assert f"--specs {path} is " in err and "for single_gemm/torch-cpu, not a file of specs" in err, err
    assert f"jq '{jq}' {path} > specs.json" in err and "--backend" not in err and "KernelArgs" not in err, err
    alone = _write(tmp_path, "specs.json", json.dumps(specs))  # what the jq filter writes
    assert _count(capsys, ["--specs", alone, "--db", empty_db])["missing"] == [A]


def test_a_snapshots_curve_json_names_the_request_json_beside_it(tmp_path, capsys, empty_db):
    """A snapshot's curve.json given to --specs named "jq '.specs' request.json", a file of the working directory,
    not the snapshot's own request.json beside the curve.json."""
    snap = tmp_path / "snap"
    snap.mkdir()
    path = _write(snap, "curve.json", json.dumps({"table": "single_gemm", "backend": "torch-cpu", "axes": ["n"],
                                                   "points": [{"n": 8}]}))
    assert main(["count-missing", *GEMM, "--specs", path, "--db", empty_db]) == 2
    err = capsys.readouterr().err
    assert f"jq '.specs' {snap / 'request.json'} > specs.json" in err, err


def test_a_snapshots_job_meta_json_names_the_request_json_beside_it(tmp_path, capsys, empty_db):
    """job.meta.json, the one snapshot file naming no table, read 'field "command" is not a KernelArgs field'."""
    snap = tmp_path / "snap"
    assert main(["run", *GEMM, *_spec({"m": 1, "n": 8, "k": 8, "dtype": "fp32"}), "--fresh", "--output-dir",
                 str(snap)]) == 0
    capsys.readouterr()
    assert main(["count-missing", *GEMM, "--specs", str(snap / "job.meta.json"), "--db", empty_db]) == 2
    meta, request = snap / "job.meta.json", snap / "request.json"
    assert capsys.readouterr().err == (f"error: --specs {meta} is a snapshot's job.meta.json (how its run went), not "
                                       f"a file of specs; the snapshot's request.json holds its specs: jq '.specs' "
                                       f"{request} > specs.json\n")


def test_a_spec_written_with_its_table_and_backend_is_not_taken_for_kprof_output(tmp_path, capsys, empty_db):
    path = _write(tmp_path, "spec.json", json.dumps({"table": "single_gemm", "backend": "torch-cpu", **A}))
    assert main(["count-missing", *GEMM, "--specs", path, "--db", empty_db]) == 2
    err = capsys.readouterr().err
    assert 'spec 0: field "table" is not a KernelArgs field of single_gemm' in err and "jq" not in err, err


def test_a_spec_that_is_not_json_is_not_told_to_be_a_gemm_spec(capsys, db):
    """The fix offered a single_gemm spec as what to write, whatever the table: followed for rms_norm, it is refused
    again for every field."""
    assert main(["query", "rms_norm", "--backend", "torch-cpu", "--spec", "tokens=1", "--db", db]) == 2
    err = capsys.readouterr().err
    assert "write it as a JSON object of the table's fields (`kprof list` names them), e.g. " in err
    assert """'{"m": 128, "n": 256, "k": 64, "dtype": "bf16"}' for single_gemm""" in err
    _no_db(db)


def test_malformed_single_document_file(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.json", '{"m": 1, "n": 2')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert path in err and "not valid JSON" in err and "fix the file" in err
    _no_db(db)


@pytest.mark.parametrize("text, needle", [("", "is empty"), ("  \n\n", "is empty"), ("[]", "holds no specs"),
                                          ('{"specs": []}', "holds no specs"), ("42", "holds a number (42)"),
                                          ("null", "holds null;"), ('"m"', 'holds a string ("m");')])
def test_empty_or_non_spec_file(text, needle, tmp_path, capsys, db):
    path = _write(tmp_path, "specs.json", text)
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert needle in err and path in err
    _no_db(db)


def test_missing_file(tmp_path, capsys, db):
    path = str(tmp_path / "nope.json")
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and path in err and "pass the path" in err
    _no_db(db)


def test_a_specs_path_whose_tilde_the_shell_left_names_the_home_path(tmp_path, monkeypatch, capsys, db):
    """`--specs=~/specs.json`: bash expands no ~ after "=", and the file read "no such file" beside the user's file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path, "specs.json", json.dumps(A))
    assert main(["run", *GEMM, "--specs=~/specs.json", "--db", db]) == 2
    said = "error: --specs ~/specs.json: no such file; the shell left ~ as it is (after =, or quoted); pass --specs "
    assert capsys.readouterr().err == said + f"{tmp_path}/specs.json\n"
    _no_db(db)


@pytest.mark.parametrize("error, fix", [
    (PermissionError(13, "Permission denied"), "make it readable by this user (chmod u+r), or pass a copy that is"),
    (OSError(5, "Input/output error"), "pass a copy of it that can be read"),
])
def test_a_specs_file_that_cannot_be_read_says_how_to_make_it_readable(error, fix, tmp_path, monkeypatch, capsys, db):
    """A file this user may not read was told "pass the path of a JSON or JSONL file of specs": it was one."""
    from kprof import spec_input

    path = _write(tmp_path, "specs.json", json.dumps(A))

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(spec_input, "open", refuse, raising=False)  # root reads a chmod 000 file: refused here
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    assert capsys.readouterr().err == f"error: --specs {path}: cannot be read ({error.strerror}); {fix}\n"
    _no_db(db)


@pytest.mark.parametrize("target", ["gone.json", "specs.json"])
def test_a_specs_link_that_names_no_file_is_named_as_a_link(target, tmp_path, capsys, db):
    """A dangling link, or one to itself, read "no such file", while `ls` lists the file."""
    path = tmp_path / "specs.json"
    path.symlink_to(target)
    assert main(["run", *GEMM, "--specs", str(path), "--db", db]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --specs {path}: is a symbolic link to {target}, which names no file (moved, or a loop of "
                   f"links); pass the path of a JSON or JSONL file of specs\n"), err
    _no_db(db)


@pytest.mark.parametrize("kind", ["directory", "device"])
def test_a_specs_path_that_is_no_file_is_named_for_what_it_is(kind, tmp_path, capsys, db):
    path = str(tmp_path) if kind == "directory" else os.devnull
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert f"--specs {path}: is a {kind}" in err if kind == "directory" else "not a regular file" in err, err
    assert "no such file" not in err and "pass the path" in err
    _no_db(db)


def test_a_specs_file_that_is_not_utf8_names_the_byte(tmp_path, capsys, db):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"m": 32, "n": 48, "k": 64, "dtype": "fp32\xe9"}')
    assert main(["run", *GEMM, "--specs", str(path), "--db", db]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text (byte" in err and "0xe9" in err and "save it as UTF-8" in err, err
    _no_db(db)


def test_a_utf8_byte_order_mark_is_ignored(tmp_path, capsys, empty_db):
    bom = b"\xef\xbb\xbf"
    one = tmp_path / "bom.json"
    one.write_bytes(bom + json.dumps(A).encode())
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes(bom + "\n".join(json.dumps(s) for s in (A, B)).encode())
    assert _count(capsys, ["--specs", str(one), "--db", empty_db])["missing"] == [A]
    assert _count(capsys, ["--specs", str(lines), "--db", empty_db])["missing"] == [A, B]


@pytest.mark.parametrize("body, said", [
    ("A\n\ufeffB\n", "spec 1: --specs {path} line 2 is not valid JSON (a byte-order mark (U+FEFF) at column 1, as "
                       "joining files saved with one leaves; remove it)"),
    ("[A,\n\ufeffB]\n", "--specs {path} is not valid JSON or JSONL (a byte-order mark (U+FEFF) at line 2, column 1, "
                        "as joining files saved with one leaves; remove it)"),
])
def test_a_byte_order_mark_inside_a_file_is_named_as_such(body, said, tmp_path, capsys, db):
    """Two files saved with a byte-order mark, joined: the second's mark read "invalid character at column 1", a
    character no editor shows."""
    path = tmp_path / "specs.jsonl"
    path.write_bytes(("\ufeff" + body.replace("A", json.dumps(A)).replace("B", json.dumps(B))).encode())
    assert main(["run", *GEMM, "--specs", str(path), "--db", db]) == 2
    err = capsys.readouterr().err
    assert said.format(path=path) in err, err
    _no_db(db)


def test_a_character_json_does_not_read_is_named_and_utf16_said_so(tmp_path, capsys, db):
    """A file saved as UTF-16 without a byte-order mark read "object keys must be strings at line 1, column 2" (a
    NUL between its letters); a no-break space copied from a web page "object keys must be strings at column 8";
    a trailing NUL or a tab inside a string "invalid character". Each names the character, and UTF-16 the fix."""
    path = tmp_path / "specs.json"
    path.write_bytes(json.dumps(A).encode("utf-16"))  # with its byte-order mark, as PowerShell's > writes it
    assert main(["count-missing", *GEMM, "--specs", str(path), "--db", db]) == 2
    assert f"--specs {path} is UTF-16 text (byte 0 is 0xff); save it as UTF-8" in capsys.readouterr().err
    path.write_bytes(json.dumps(A).encode("utf-16-le"))
    assert main(["count-missing", *GEMM, "--specs", str(path), "--db", db]) == 2
    assert ("(the control character U+0000 at line 1, column 2, which a JSON string holds only escaped, as \\u0000; "
            "the file is UTF-16 text: save it as UTF-8)") in capsys.readouterr().err
    path.write_bytes(json.dumps(A).encode() + b"\n\0")
    assert main(["count-missing", *GEMM, "--specs", str(path), "--db", db]) == 2
    err = capsys.readouterr().err
    assert "line 2 is not valid JSON (the control character U+0000 at column 1, " in err and "UTF-16" not in err, err
    assert main(["count-missing", *GEMM, "--spec", json.dumps(A).replace(" ", "\u00a0", 1), "--db", db]) == 2
    assert "(the character U+00A0 at column 6, which JSON does not read as a space; write a space)" in \
        capsys.readouterr().err
    assert main(["count-missing", *GEMM, "--spec", json.dumps(A).replace("fp", "f\tp"), "--db", db]) == 2
    err = capsys.readouterr().err
    assert "(the control character U+0009 at column " in err and "holds only escaped, as \\u0009)" in err, err
    _no_db(db)


@pytest.mark.parametrize("encoding, said", [("utf-32", "is UTF-32 text (byte 0 is 0xff)"),
                                            ("utf-32-be", "which a JSON string holds only escaped, as \\u0000; the "
                                                          "file is UTF-32 text: save it as UTF-8"),
                                            ("utf-32-le", "the file is UTF-32 text: save it as UTF-8")])
def test_a_specs_file_saved_as_utf32_is_said_to_be_utf32_not_utf16(encoding, said, tmp_path, capsys, db):
    """A file saved as UTF-32 (PowerShell's Out-File -Encoding utf32) was said to be UTF-16 text, with its
    byte-order mark or without; a tab in a string was said to be a character "JSON takes only inside a string",
    where JSON takes a tab between its values and, in a string, only escaped."""
    path = tmp_path / "specs.json"
    path.write_bytes(json.dumps(A).encode(encoding))
    assert main(["count-missing", *GEMM, "--specs", str(path), "--db", db]) == 2
    err = capsys.readouterr().err
    assert said in err and "UTF-16" not in err, err
    _no_db(db)


@pytest.mark.parametrize("text, quote, column", [("{'m': 32}", "'", 2), ('{\u201cm\u201d: 32}', "\u201c", 2),
                                                 ('{"dtype": \u2018fp32\u2019}', "\u2018", 11)])
def test_a_quote_json_does_not_read_is_named(text, quote, column, tmp_path, capsys, db):
    """A Python dict's repr ({'m': 32}) or text copied from a document (\u201cm\u201d) read "object keys must be
    strings" or "invalid character": a quote no one sees as wrong."""
    what = "single quote" if quote == "'" else "typographic quote"
    said = f'a {what} ({quote}) at {{}}column {column}: JSON quotes with " alone; write " (json.dumps writes a Python'
    assert main(["count-missing", *GEMM, "--spec", text, "--db", db]) == 2
    assert said.format("") in capsys.readouterr().err
    path = tmp_path / "specs.json"
    path.write_text(f"[\n{json.dumps(A)},\n{text}\n]\n", encoding="utf-8")
    assert main(["count-missing", *GEMM, "--specs", str(path), "--db", db]) == 2
    assert said.format("line 3, ") in capsys.readouterr().err
    _no_db(db)


@pytest.mark.parametrize("word, fix", [("True", "JSON writes true"), ("None", "JSON writes null"),
                                       ("NaN", "JSON has no such number; use a finite one")])
def test_a_python_word_in_json_is_named(word, fix, capsys, db):
    """A Python dict's repr ({"causal": True}) or json.dumps of nan read "invalid character at column 79"."""
    text = json.dumps({**PREFILL, "causal": "X"}).replace('"X"', word)
    assert main(["count-missing", "attention_prefill", "--backend", "torch-cpu", "--spec", text, "--db", db]) == 2
    column = text.index(word) + 1
    said = f"--spec is not valid JSON ({word} at column {column} is Python's, not JSON: {fix})"
    assert said in capsys.readouterr().err
    _no_db(db)


def test_both_spec_and_specs(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.json", json.dumps([A]))
    assert main(["run", *GEMM, *_spec(B), "--specs", path, "--db", db]) == 2
    assert "not both" in capsys.readouterr().err
    _no_db(db)


def test_neither_spec_nor_specs(capsys, db):
    assert main(["run", *GEMM, "--db", db]) == 2
    err = capsys.readouterr().err
    assert "no specs given" in err and "--spec" in err and "--specs" in err
    _no_db(db)


@pytest.mark.parametrize("causal", [1, "yes", None])
def test_a_bool_field_given_another_type_says_to_use_a_json_boolean(causal, capsys, db):
    """The fix read "fix the value", which names no value that would do."""
    assert main(["run", "attention_prefill", "--backend", "torch-cpu", *_spec({**PREFILL, "causal": causal}),
                 "--db", db]) == 2
    err = capsys.readouterr().err
    assert 'spec 0: field "causal"' in err and "Expected `bool`" in err and "use true or false" in err
    _no_db(db)


@pytest.mark.parametrize("table, spec", [
    ("attention_prefill", {**PREFILL, "num_heads": 6, "num_kv_heads": 4}),
    ("attention_decode", {"batch": 1, "kv_len": 8, "num_heads": 5, "num_kv_heads": 2, "head_dim": 8,
                          "dtype": "bf16"}),
])
def test_heads_not_a_multiple_of_kv_heads(table, spec, capsys, db):
    ok = {k: v for k, v in spec.items()}
    ok.update(num_heads=4, num_kv_heads=2)
    assert main(["run", table, "--backend", "torch-cpu", *_spec(ok), *_spec(spec), "--db", db]) == 2
    err = capsys.readouterr().err
    assert "spec 1" in err and "num_heads" in err and "num_kv_heads" in err and "multiple" in err
    _no_db(db)


def test_specs_of_another_table_are_refused(capsys, db):
    assert main(["run", *GEMM, *_spec({"tokens": 8, "hidden": 64, "dtype": "fp32"}), "--db", db]) == 2
    err = capsys.readouterr().err
    assert "spec 0" in err and '"tokens"' in err and "{m, n, k, dtype}" in err
    _no_db(db)


# ---- JSON that no spec can be: refused at reading, naming where; nothing written ------------------------------

DEEP = "[" * 1000 + "]" * 1000  # past Python's recursion limit: once a RecursionError traceback
TEXT_ERRORS = {  # the second spec's text, and what the error says
    "exponent for an int": ('{"m": 1e3, "n": 48, "k": 64, "dtype": "fp32"}',
                            ['spec 1', 'field "m" = 1000.0 is a float', 'e.g. "m": 1000']),
    "float for an int": ('{"m": 1.0, "n": 48, "k": 64, "dtype": "fp32"}',
                         ['spec 1', 'field "m" = 1.0 is a float; use an integer greater than 0', 'e.g. "m": 1']),
    "duplicate key": ('{"m": 32, "n": 48, "k": 64, "dtype": "fp32", "m": 64}',
                      ['spec 1', 'gives field "m" twice in one object; give each field once']),
    "duplicate key, same value": ('{"m": 32, "n": 48, "n": 48, "k": 64, "dtype": "fp32"}',
                                  ['spec 1', 'gives field "n" twice']),
    "duplicate key in a nested object": ('{"m": {"a": 1, "a": 2}, "n": 48, "k": 64, "dtype": "fp32"}',
                                         ['spec 1', 'gives field "a" twice']),
    "deep value": ('{"m": ' + "[" * 40 + "]" * 40 + ', "n": 48, "k": 64, "dtype": "fp32"}',
                   ["nests arrays and objects deeper than 32 levels", "a spec is one flat JSON object"]),
    "deep past the recursion limit": (DEEP, ["nests arrays and objects deeper than 32 levels", "flat"]),
}


@pytest.mark.parametrize("verb", ["run", "query", "count-missing"])
@pytest.mark.parametrize("case", list(TEXT_ERRORS), ids=str)
def test_json_no_spec_can_be_via_spec(verb, case, capsys, db):
    text, needles = TEXT_ERRORS[case]
    assert main([verb, *GEMM, *_spec(A), *_spec(text), "--db", db, "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err
    for needle in needles:
        assert needle in out.err, (needle, out.err)
    _no_db(db)


@pytest.mark.parametrize("form", ["list", "wrapped", "jsonl"])
@pytest.mark.parametrize("case", list(TEXT_ERRORS), ids=str)
def test_json_no_spec_can_be_via_specs_file(form, case, tmp_path, capsys, db):
    text, needles = TEXT_ERRORS[case]
    body = {"list": f"[{json.dumps(A)}, {text}]", "wrapped": f'{{"specs": [{json.dumps(A)}, {text}]}}',
            "jsonl": f"{json.dumps(A)}\n{text}\n"}[form]
    path = _write(tmp_path, "specs.json", body)
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    if "float" not in needles[1]:  # refused at reading: the file is named (JSONL: its line too)
        assert f"--specs {path}{' line 2' if form == 'jsonl' else ''} " in err, err
    _no_db(db)
    assert os.listdir(tmp_path) == ["specs.json"]


def test_a_key_given_twice_in_the_wrapper_is_named(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.json", f'{{"specs": [{json.dumps(A)}], "specs": [{json.dumps(B)}]}}')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    assert f'--specs {path} gives field "specs" twice' in capsys.readouterr().err
    _no_db(db)


@pytest.mark.parametrize("levels", [32, 33])
def test_nesting_is_read_up_to_32_levels(levels, tmp_path, capsys, db):
    """32 levels is JSON the reader takes (the spec is then refused for its type, like any other); 33 is not."""
    deep = "[" * (levels - 3) + "1" + "]" * (levels - 3)  # under {"specs": [{"m": ...}]}
    path = _write(tmp_path, "specs.json", f'{{"specs": [{{"m": {deep}, "n": 1, "k": 1, "dtype": "fp32"}}]}}')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    if levels == 32:
        assert "deeper" not in err and 'spec 0: field "m"' in err and "Expected `int`, got `array`" in err
    else:
        assert f"--specs {path} nests arrays and objects deeper than 32 levels" in err
    _no_db(db)


def test_colons_in_strings_are_not_taken_for_keys(capsys, empty_db):
    """Keys are counted by their colons; a colon inside a string (or escaped) must not read as a repeated key."""
    odd = '{"m": 32, "n": 48, "k": 64, "dtype": "fp32:x\\u003a"}'
    assert main(["count-missing", *GEMM, *_spec(odd), "--db", empty_db]) == 2
    err = capsys.readouterr().err
    assert 'field "dtype"' in err and "twice" not in err


@pytest.mark.parametrize("value, needle", [(64.0, 'field "m" = 64.0 is a float'), (1e3, '"m" = 1000.0 is a float'),
                                           (True, 'field "m" = true is a bool')])
def test_the_python_api_refuses_a_float_or_bool_for_an_int(value, needle, empty_db):
    from kprof import api
    from kprof.errors import SpecError

    for read in (api.query, api.count_missing):
        with pytest.raises(SpecError, match=needle) as info:
            read("single_gemm", "torch-cpu", [A, {**A, "m": value}], db=empty_db)
        assert (info.value.index, info.value.field, info.value.value) == (1, "m", value)
        assert type(info.value.value) is type(value)  # the value as given (64.0 == 64 and True == 1 in Python)


def test_strict_reading_keeps_the_canonical_keys_of_valid_specs():
    """Spec input refuses 64.0 where the key codec takes it as 64: a valid spec's key is the same either way."""
    from kprof.ledger import KeyMaker, ShapeCodec
    from kprof.runners.registry import lookup
    from kprof.specs import validate

    entry = lookup("single_gemm", "torch-cpu")
    strict, loose = (KeyMaker(entry.table, entry.backend, "gpu", entry.contract, ShapeCodec(entry.args, strict=s))
                     for s in (True, False))
    for spec in (A, B, C, dict(reversed(A.items()))):
        assert strict.key(spec) == loose.key(spec) == loose.key({**spec, "m": float(spec["m"])})
        assert validate(entry.args, [spec]) == [{f: spec[f] for f in ("m", "n", "k", "dtype")}]


def test_a_missing_field_names_the_table_with_its_article():
    from kprof.errors import SpecError
    from kprof.runners.registry import lookup
    from kprof.specs import validate

    for table, backend, article in (("all_reduce", "gloo", "an"), ("single_gemm", "torch-cpu", "a")):
        entry = lookup(table, backend)
        with pytest.raises(SpecError, match=f"is missing; {article} {table} spec needs"):
            validate(entry.args, [{}], entry.table)


def test_numpy_scalars_read_as_the_python_values_they_hold(empty_db):
    """A simulator's specs often come from arrays: np.int64(32) is the int 32 (the same key), np.bool_ a bool, and
    np.float64(32.0), a float subclass, is refused for an int field as 32.0 is."""
    np = pytest.importorskip("numpy")
    from kprof import api
    from kprof.errors import SpecError
    from kprof.ledger import KeyMaker, ShapeCodec
    from kprof.runners.registry import lookup
    from kprof.specs import validate

    entry = lookup("single_gemm", "torch-cpu")
    keys = KeyMaker(entry.table, entry.backend, "gpu", entry.contract, ShapeCodec(entry.args, strict=True))
    arrayed = {"m": np.int64(32), "n": np.int32(48), "k": np.uint16(64), "dtype": np.str_("fp32")}
    assert keys.key(arrayed) == keys.key(A)
    assert validate(entry.args, [arrayed]) == [A]
    assert api.count_missing("single_gemm", "torch-cpu", [arrayed], db=empty_db).missing == [A]
    prefill = lookup("attention_prefill", "torch-cpu")
    assert validate(prefill.args, [{**PREFILL, "causal": np.True_}]) == [PREFILL]
    for value, needle in ((np.float64(32.0), 'field "m" = 32.0 is a float'), (np.True_, 'field "m" = true is a bool')):
        with pytest.raises(SpecError, match=needle) as info:
            api.query("single_gemm", "torch-cpu", [A, {**A, "m": value}], db=empty_db)
        assert (info.value.index, info.value.field, info.value.value) == (1, "m", value)
        assert type(info.value.value) is type(value)
    assert validate(entry.args, [{**A, "m": np.array(32)}]) == [A]  # a 0-d array holds one value as a scalar does
    for value in (np.array([32]), np.array([[32]])):  # an array of one value was read as that value, 32
        with pytest.raises(SpecError, match=r'spec 0: field "m" = array\(\[+32\]+\): Expected `int`, got '
                                            r'`numpy.ndarray`; use an integer'):
            validate(entry.args, [{**A, "m": value}])


def test_field_names_of_a_str_subclass_read_as_their_str_and_a_name_not_a_str_is_named(empty_db):
    """Specs built as dict(zip(np.array(names), values)) or keyed by a str Enum have names of a str subclass: they read
    as the str they hold (they were refused with "Expected `str` - at `key` in `$`; fix the values"); a name that is no
    str at all is named, with the fields to use."""
    import enum

    np = pytest.importorskip("numpy")
    from kprof import api
    from kprof.errors import SpecError

    Field = enum.Enum("Field", {"M": "m", "N": "n", "K": "k", "DTYPE": "dtype"}, type=str)
    for spec in (dict(zip(np.array(list(A)), A.values())), {Field(name): value for name, value in A.items()}):
        assert api.count_missing("single_gemm", "torch-cpu", [B, spec], db=empty_db).missing == [B, A]
    with pytest.raises(SpecError, match=r"spec 1: field name 1 \(int\) is not a str; name each field as a str, one "
                                        r"of \{m, n, k, dtype\}"):
        api.query("single_gemm", "torch-cpu", [A, {**A, 1: 2}], db=empty_db)


def test_a_field_with_a_default_may_be_left_out_and_its_key_holds_the_default(tmp_path):
    """A plugin's KernelArgs field with a default (`act: ... = "ok"`) was required all the same (`{"n": 100}` read
    'field "act" is missing'): it may be left out now, its shape holds the default, and the key is the same whether
    the default is given or omitted; another value is another key."""
    from typing import Literal

    from kprof.errors import SpecError
    from kprof.ledger import KeyMaker, Ledger, ShapeCodec
    from kprof.ledger.events import Contract
    from kprof.runners._args import KernelArgs, Size
    from kprof.specs import validate

    class Args(KernelArgs, frozen=True):
        n: Size
        act: Literal["ok", "fail"] = "ok"
        scale: float = 1.0

    contract = Contract(algorithm="a", layout="l", numerics="n", timing="t", profiler_revision=1)
    keys = KeyMaker("t", "cpu", "gpu", contract, ShapeCodec(Args, strict=True, name="t"))
    full = {"n": 8, "act": "ok", "scale": 1.0}
    assert keys.key({"n": 8}) == keys.key(full) == keys.key({"n": 8, "scale": 1}) == keys.key({"scale": 1.0, "n": 8})
    assert len({keys.key(full), keys.key({**full, "act": "fail"}), keys.key({**full, "scale": 0.5})}) == 3
    assert keys.provenance({"n": 8}).shape == full
    assert validate(Args, [{"n": 8}, {"n": 9, "act": "fail"}], "t") == [full, {**full, "n": 9, "act": "fail"}]
    with pytest.raises(SpecError, match=r'field "n" is missing; a t spec needs \{n\} \(optional: act, scale\)'):
        validate(Args, [{"act": "ok"}], "t")
    with Ledger.open(str(tmp_path / "p.db")) as ledger:  # a row's spec is the canonical one, default included
        view = ledger.view("t", "cpu", "gpu", contract, Args)
        assert [row.spec for row in view.get_many([{"n": 8}])] == [full]
        assert view.missing([{"n": 8}, full]) == [{"n": 8}, full]


def test_a_float_field_keys_minus_zero_as_zero_and_refuses_nan_and_inf(tmp_path):
    """A plugin's float field took nan and inf (a row whose --json spec reads null) and keyed -0.0 apart from 0.0, two
    rows of one spec; it refuses the first, naming the field, and keys -0.0 as 0.0, as it keys 1 as 1.0."""
    from kprof.errors import SpecError
    from kprof.ledger import KeyMaker, Ledger, ShapeCodec
    from kprof.ledger.events import Contract
    from kprof.runners._args import KernelArgs, Size
    from kprof.specs import validate

    class Args(KernelArgs, frozen=True):
        n: Size
        scale: float

    contract = Contract(algorithm="a", layout="l", numerics="n", timing="t", profiler_revision=1)
    keys = KeyMaker("t", "cpu", "gpu", contract, ShapeCodec(Args, strict=True, name="t"))
    assert keys.key({"n": 8, "scale": -0.0}) == keys.key({"n": 8, "scale": 0.0}) == keys.key({"n": 8, "scale": 0})
    assert validate(Args, [{"n": 8, "scale": -0.0}, {"n": 8, "scale": 2}], "t") == [{"n": 8, "scale": 0.0},
                                                                                    {"n": 8, "scale": 2.0}]
    with Ledger.open(str(tmp_path / "p.db")) as ledger:
        rows = ledger.view("t", "cpu", "gpu", contract, Args).get_many([{"n": 8, "scale": -0.0}, {"n": 8, "scale": 2}])
        assert [str(row.spec["scale"]) for row in rows] == ["0.0", "2.0"]
        assert rows[0].key == keys.key({"n": 8, "scale": 0.0})
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(SpecError, match=f'spec 1: field "scale" = {bad!r} is not a finite number; use a finite '):
            validate(Args, [{"n": 8, "scale": 1.0}, {"n": 8, "scale": bad}], "t")
        with pytest.raises(SpecError, match="is not a finite number"):
            keys.key({"n": 8, "scale": bad})
    with pytest.raises(SpecError, match='field "scale" = \'big\': Expected `float`, got `str`; use a number'):
        validate(Args, [{"n": 8, "scale": "big"}], "t")


def test_an_int_too_long_to_print_is_named_by_its_digits_not_a_crash_or_damage(tmp_path, capsys, empty_db):
    """Python writes no int past 4,300 digits: such a value (from a Python caller; JSON's reader refuses one) made
    the message that was to name it raise ValueError, a traceback, and inside a ledger read an IntegrityError
    ("ledger ... is damaged", exit 3); a 400-digit one was written whole. Each is a SpecError naming its digits."""
    from kprof.errors import IntegrityError, SpecError
    from kprof.ledger import Ledger
    from kprof.ledger.events import Contract
    from kprof.runners._args import KernelArgs, Size
    from kprof.specs import validate

    class Args(KernelArgs, frozen=True):
        n: Size
        offset: int = 0
        scale: float = 1.0

    huge = 10 ** 5000
    for spec, said in [({"n": huge}, 'field "n" = a 5,001-digit integer: Expected `int` <= '),
                       ({"n": -10 ** 60}, 'field "n" = a negative 61-digit integer: Expected `int` >= 1'),
                       ({"n": 8, "scale": huge}, 'field "scale" = a 5,001-digit integer: Number out of range'),
                       ([huge], "got a list (...); a spec is one object")]:
        with pytest.raises(SpecError) as exc:
            validate(Args, [spec], "t")
        assert said in str(exc.value) and exc.value.index == 0, str(exc.value)
    contract = Contract(algorithm="a", layout="l", numerics="n", timing="t", profiler_revision=1)
    with Ledger.open(str(tmp_path / "p.db")) as ledger:
        view = ledger.view("t", "cpu", "gpu", contract, Args)
        for offset, digits in [(huge, "5,001"), (-10 ** 100, "negative 101")]:
            try:
                view.get_many([{"n": 8}, {"n": 8, "offset": offset}])
            except IntegrityError as exc:
                raise AssertionError(f"a spec read as a damaged ledger: {exc}") from None
            except SpecError as exc:
                assert str(exc) == (f'spec 1: field "offset" = a {digits}-digit integer: past the 64-bit integers a '
                                    f'key can hold; use a smaller value')
    big = "1" + "0" * 5000
    assert main(["count-missing", *GEMM, "--spec", f'{{"m": {big}, "n": 1, "k": 1, "dtype": "fp32"}}', "--db",
                 empty_db]) == 2
    err = capsys.readouterr().err
    assert "it holds a number too large to read (an integer past 4,300 digits" in err and "$[" not in err, err


def test_an_int_past_64_bits_is_refused_at_validation_with_its_index_and_line(tmp_path):
    """A plugin's unbounded int field passed validation with 2**70 and was refused only when its key was made: by
    `run --fresh` with no index at all, by the others with no JSONL line. validate refuses it with both."""
    from kprof.errors import SpecError
    from kprof.runners._args import KernelArgs, Size
    from kprof.specs import parse_specs_file, validate

    class Args(KernelArgs, frozen=True):
        n: Size
        offset: int = 0

    ok = [{"n": 1, "offset": -(1 << 63)}, {"n": 1, "offset": (1 << 64) - 1}]
    assert [s["offset"] for s in validate(Args, ok, "t")] == [-(1 << 63), (1 << 64) - 1]
    for bad in (1 << 64, -(1 << 63) - 1, 2 ** 70):
        with pytest.raises(SpecError) as exc:
            validate(Args, [*ok, {"n": 1, "offset": bad}], "t")
        said = f'spec 2: field "offset" = {bad}: past the 64-bit integers a key can hold; use a smaller value'
        assert str(exc.value) == said
    path = _write(tmp_path, "specs.jsonl", '{"n": 1}\n\n\n{"n": 2, "offset": 1180591620717411303424}\n')
    with pytest.raises(SpecError, match=f'^spec 1: --specs {path} line 4: field "offset" = 1180591620717411303424: '
                                        f'past the 64-bit'):
        validate(Args, parse_specs_file(path), "t")


def test_a_long_name_or_value_is_shown_by_its_start(tmp_path, capsys, db):
    """A 100,000-character dtype made a 200 kB message (the value, then msgspec's "Invalid enum value" of it again),
    and so did a field name as long: each is shown by its first characters."""
    long = "x" * 100_000
    for doc in ({**A, "dtype": long}, {**A, long: 1}, {**A, "m": long}):
        path = _write(tmp_path, "specs.json", json.dumps(doc))
        assert main(["count-missing", *GEMM, "--specs", path, "--db", db]) == 2
        err = capsys.readouterr().err
        assert len(err) < 400 and "x" * 50 in err and "x..." in err, err
        assert "use one of" in err or "use only" in err or "use an integer" in err, err
    path = _write(tmp_path, "specs.json", f'{{"{long}": 1, "{long}": 2}}')
    assert main(["count-missing", *GEMM, "--specs", path, "--db", db]) == 2
    assert capsys.readouterr().err == f'error: --specs {path} gives field "{"x" * 57}..." twice in one object; give ' \
                                      f'each field once\n'
    _no_db(db)
