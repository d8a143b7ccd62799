"""Spec input through the CLI: every accepted form, and every usage error (exit 2, nothing written)."""

import json
import os

import pytest

from kprof.cli import main

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

def test_repeated_spec(capsys, db):
    doc = _count(capsys, [*_spec(A), *_spec(B), *_spec(C), "--db", db])
    assert doc["count"] == 3 and doc["missing"] == [A, B, C]


def test_specs_json_object(tmp_path, capsys, db):
    doc = _count(capsys, ["--specs", _write(tmp_path, "one.json", json.dumps(A)), "--db", db])
    assert doc["count"] == 1 and doc["missing"] == [A]


def test_specs_json_list(tmp_path, capsys, db):
    doc = _count(capsys, ["--specs", _write(tmp_path, "list.json", json.dumps([A, B, C], indent=2)), "--db", db])
    assert doc["count"] == 3 and doc["missing"] == [A, B, C]


def test_specs_wrapped_list(tmp_path, capsys, db):
    path = _write(tmp_path, "wrapped.json", json.dumps({"specs": [A, B]}))
    doc = _count(capsys, ["--specs", path, "--db", db])
    assert doc["count"] == 2 and doc["missing"] == [A, B]


def test_specs_jsonl(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.jsonl", "\n".join(json.dumps(s) for s in (A, B, C)) + "\n\n")
    doc = _count(capsys, ["--specs", path, "--db", db])
    assert doc["count"] == 3 and doc["missing"] == [A, B, C]


def test_field_order_of_input_does_not_matter(capsys, db):
    shuffled = json.dumps({"dtype": "fp32", "k": 64, "m": 32, "n": 48})
    doc = _count(capsys, [*_spec(shuffled), "--db", db])
    assert doc["missing"] == [A] and list(doc["missing"][0]) == ["m", "n", "k", "dtype"]


def test_integral_float_is_accepted_and_keyed_as_int(capsys, db):
    assert main(["query", *GEMM, "--json", "--db", db, *_spec({**A, "m": 64.0}), *_spec({**A, "m": 64})]) == 0
    doc = json.loads(capsys.readouterr().out)
    as_float, as_int = doc["results"]
    assert as_float["key"] == as_int["key"]
    assert as_float["spec"] == as_int["spec"] == {**A, "m": 64}
    assert type(as_float["spec"]["m"]) is int


def test_attention_gqa_valid_spec_is_accepted(capsys, db):
    assert main(["count-missing", "attention_prefill", "--backend", "torch-cpu", "--json", "--db", db,
                 *_spec(PREFILL)]) == 0
    assert json.loads(capsys.readouterr().out)["missing"] == [PREFILL]


# ---- usage errors: exit 2, a message naming the spec index, the field and the fix; nothing written ----------

ERRORS = {
    "unknown field": ([A, {**A, "foo": 1}], ["spec 1", '"foo"', "use only {m, n, k, dtype}"]),
    "backend field": ([A, {**A, "backend": "torch-cpu"}], ["spec 1", '"backend"', "pass --backend instead"]),
    "wrong type": ([A, {**A, "m": "32"}], ["spec 1", '"m"', "Expected `int`", "use an integer greater than 0"]),
    "bool for int": ([A, {**A, "k": True}], ["spec 1", '"k"', "use an integer greater than 0"]),
    "non-integral float": ([A, {**A, "n": 32.5}], ["spec 1", '"n"', "use an integer greater than 0"]),
    "negative size": ([A, {**A, "m": -4}], ["spec 1", '"m"', "-4", "use an integer greater than 0"]),
    "zero size": ([{**A, "k": 0}, A], ["spec 0", '"k"', "use an integer greater than 0"]),
    "unknown dtype": ([A, B, {**A, "dtype": "fp64"}], ["spec 2", '"dtype"', "fp64",
                                                       "use one of bf16, fp16, fp32, fp8_e4m3"]),
    "missing field": ([A, {"m": 1, "n": 1, "dtype": "fp32"}], ["spec 1", '"k"', "missing", "{m, n, k, dtype}"]),
    "not an object": ([A, [1, 2]], ["spec 1", "expected a JSON object of {m, n, k, dtype}"]),
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


def test_malformed_jsonl_line_names_the_line_and_index(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.jsonl", json.dumps(A) + "\n" + json.dumps(B) + "\n" + '{"m": 1, "n": \n')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert "spec 2" in err and "line 3" in err and "not valid JSON" in err and "write it as a JSON object" in err
    _no_db(db)


def test_malformed_single_document_file(tmp_path, capsys, db):
    path = _write(tmp_path, "specs.json", '{"m": 1, "n": 2')
    assert main(["run", *GEMM, "--specs", path, "--db", db]) == 2
    err = capsys.readouterr().err
    assert path in err and "not valid JSON" in err and "fix the file" in err
    _no_db(db)


@pytest.mark.parametrize("text, needle", [("", "is empty"), ("  \n\n", "is empty"), ("[]", "holds no specs"),
                                          ('{"specs": []}', "holds no specs"), ("42", "holds a JSON int")])
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
