import json
import os

import pytest

from kprof.cli import main


def _query(capsys, h, db, *specs, extra=(), table="single_gemm") -> dict:
    return h.read_json(capsys, "query", db, *specs, extra=extra, table=table)


def test_query_on_nonexistent_db_is_a_usage_error_and_creates_nothing(tmp_path, ledger_path, capsys, h):
    """A --db that names no file is a mistyped path, not a ledger with every row missing."""
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", ledger_path,
                 "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"no ledger at {ledger_path}; pass --db or set KPROF_DB, or `kprof run` to create one" in captured.err
    assert os.listdir(tmp_path) == []  # no profile.db, no profile.db-lock


def test_query_on_empty_db_is_all_missing(ledger_path, capsys, h, local_gpu):
    from kprof.ledger import Ledger

    Ledger.open(ledger_path).close()
    specs = [h.gemm(), h.gemm(m=64), h.gemm(dtype="bf16")]
    doc = _query(capsys, h, ledger_path, *specs)
    assert set(doc) == h.QUERY_FIELDS
    assert (doc["table"], doc["backend"], doc["gpu_name"], doc["db"], doc["mode"]) == \
        ("single_gemm", "torch-cpu", local_gpu, ledger_path, "query")
    assert doc["count"] == doc["missing_count"] == 3
    assert len(doc["view_root"]) == 64
    assert [r["spec"] for r in doc["results"]] == specs
    for r in doc["results"]:
        assert r["status"] == "missing"
        assert set(h.RESULT_FIELDS) <= set(r)
        assert len(r["key"]) == 64  # the key the row would have
        assert r["event"] is r["citation"] is r["metrics"] is r["stats"] is r["provenance"] is None
        assert r["measured_at"] is None


def test_missing_keys_match_the_keys_of_measured_rows(ledger_path, capsys, h, local_gpu):
    from kprof.ledger import Ledger

    Ledger.open(ledger_path).close()
    before = _query(capsys, h, ledger_path, h.gemm())
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu))
    after = _query(capsys, h, ledger_path, h.gemm())
    assert before["results"][0]["key"] == after["results"][0]["key"]
    assert before["view_root"] != after["view_root"]


def test_query_after_run_has_the_contract_fields(ledger_path, capsys, h, local_gpu):
    specs = [h.gemm(), h.gemm(k=48)]
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path, "--json"]) == 0
    run_doc = json.loads(capsys.readouterr().out)
    doc = _query(capsys, h, ledger_path, *specs)
    assert list(doc) == ["table", "backend", "gpu_name", "db", "mode", "count", "missing_count", "view_root",
                         "results"]
    assert doc["mode"] == "query" and doc["count"] == 2 and doc["missing_count"] == 0
    assert doc["view_root"] == run_doc["view_root"]
    for r, spec, ran in zip(doc["results"], specs, run_doc["results"]):
        # the contract's fields; `error` is the only extra (null for ok rows)
        assert set(r) - h.RESULT_FIELDS == {"error"} and h.RESULT_FIELDS <= set(r)
        assert list(r)[:9] == ["spec", "status", "key", "event", "citation", "metrics", "stats", "provenance",
                               "measured_at"]
        assert r["error"] is None
        assert r["spec"] == spec and r["status"] == "ok"
        assert r["event"] == ran["event"] and r["key"] == ran["key"]
        assert r["citation"] == "kprof." + r["event"][:16]
        assert set(r["metrics"]) == h.METRICS
        assert r["metrics"]["energy_j"] is None  # no energy counter on the CPU
        assert r["metrics"]["time_ms"] > 0 and r["metrics"]["tflops"] > 0 and r["metrics"]["memory_bandwidth_gbps"] > 0
        assert r["stats"]["n"] >= 3 and r["stats"]["median"] == r["metrics"]["time_ms"]
        assert r["stats"]["p10"] <= r["stats"]["median"] <= r["stats"]["p90"]
        prov = r["provenance"]
        assert prov["table"] == "single_gemm" and prov["backend"] == "torch-cpu" and prov["gpu_key"] == local_gpu
        assert prov["shape"] == spec and prov["profiler_revision"] == 1
        assert {"algorithm", "layout", "numerics", "timing"} <= set(prov)
        assert r["measured_at"].endswith("+00:00")
    # flops sanity: tflops * time = 2mnk
    r = doc["results"][0]
    assert abs(r["metrics"]["tflops"] * 1e12 * r["metrics"]["time_ms"] / 1e3 - 2 * 32 ** 3) < 1e-3 * 2 * 32 ** 3


def test_gpu_name_filters_rows(ledger_path, capsys, h, local_gpu):
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu), h.make_event(h.gemm(m=64), "NVIDIA H200"))
    local = _query(capsys, h, ledger_path, h.gemm(), h.gemm(m=64))
    assert [r["status"] for r in local["results"]] == ["ok", "missing"] and local["gpu_name"] == local_gpu
    h200 = _query(capsys, h, ledger_path, h.gemm(), h.gemm(m=64), extra=["--gpu-name", "NVIDIA H200"])
    assert [r["status"] for r in h200["results"]] == ["missing", "ok"] and h200["gpu_name"] == "NVIDIA H200"
    assert h200["results"][1]["provenance"]["gpu_key"] == "NVIDIA H200"
    other = _query(capsys, h, ledger_path, h.gemm(), extra=["--gpu-name", "Some Other GPU"])
    assert other["missing_count"] == 1 and other["results"][0]["status"] == "missing"
    # a key of one GPU is never the key of another
    assert local["results"][0]["key"] != other["results"][0]["key"]


def test_stale_row_from_an_older_profiler_revision(ledger_path, capsys, h, local_gpu):
    old = h.make_event(h.gemm(), local_gpu, revision=0, time_ms=0.25)
    h.append(ledger_path, old)
    doc = _query(capsys, h, ledger_path, h.gemm(), h.gemm(m=64))
    stale, missing = doc["results"]
    assert stale["status"] == "stale" and missing["status"] == "missing"
    assert doc["missing_count"] == 2  # stale counts as missing
    assert stale["provenance"]["profiler_revision"] == 0  # the old row's own provenance
    assert stale["metrics"]["time_ms"] == 0.25 and stale["citation"].startswith("kprof.")
    assert stale["key"] != old.key.hex()  # the key asked for is the current revision's


def test_stale_row_superseded_by_a_current_one(ledger_path, capsys, h, local_gpu):
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu, revision=0, time_ms=0.25))
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu, time_ms=0.5))
    doc = _query(capsys, h, ledger_path, h.gemm())
    assert doc["results"][0]["status"] == "ok" and doc["results"][0]["metrics"]["time_ms"] == 0.5
    assert doc["missing_count"] == 0


def test_failed_row(ledger_path, capsys, h, local_gpu):
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu, kind="failed"), h.make_event(h.gemm(m=64), local_gpu))
    doc = _query(capsys, h, ledger_path, h.gemm(), h.gemm(m=64))
    failed, ok = doc["results"]
    assert failed["status"] == "failed" and ok["status"] == "ok"
    assert doc["missing_count"] == 1
    assert failed["metrics"] is None and failed["stats"] is None
    assert failed["error"] == {"kind": "crash", "message": "segfault in the kernel"}
    assert failed["citation"] == "kprof." + failed["event"][:16]


def test_failed_remeasure_makes_the_row_failed(ledger_path, capsys, h, local_gpu):
    """The contract: `failed` means the last attempt failed; the good row stays in the history."""
    first = h.make_event(h.gemm(), local_gpu)
    h.append(ledger_path, first)
    from kprof.ledger import _codec

    eid = _codec.event_id(_codec.encode(first))
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu, kind="failed", parent=eid))
    doc = _query(capsys, h, ledger_path, h.gemm())
    assert doc["results"][0]["status"] == "failed" and doc["results"][0]["event"] != eid.hex()
    assert doc["missing_count"] == 1
    assert main(["show", doc["results"][0]["citation"], "--db", ledger_path, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [e["type"] for e in shown["history"]] == ["measured", "failed"]


def test_human_output_has_spec_columns_and_status(ledger_path, capsys, h, local_gpu):
    h.append(ledger_path, h.make_event(h.gemm(), local_gpu), h.make_event(h.gemm(k=48), local_gpu, kind="failed"))
    rc = main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(), h.gemm(k=48), h.gemm(k=80)),
               "--db", ledger_path])
    out = capsys.readouterr().out
    assert rc == 0
    header = next(line for line in out.splitlines() if "status" in line)
    for col in ("m", "n", "k", "dtype", "status", "time_ms", "citation"):
        assert f" {col} " in header
    assert "ok" in out and "failed" in out and "missing" in out and "80" in out and "fp32" in out
    assert "1 of 3 ok, 2 missing" in out and local_gpu in out


@pytest.mark.parametrize("verb", ["query", "count-missing"])
def test_unknown_table_lists_known_tables(verb, tmp_path, capsys, h):
    assert main([verb, "single_gem", "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", "x.db"]) == 2
    err = capsys.readouterr().err
    assert "unknown table 'single_gem'" in err
    for table in ("single_gemm", "rms_norm", "silu_mul", "attention_prefill", "attention_decode"):
        assert table in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("verb", ["query", "count-missing"])
def test_unknown_backend_lists_the_tables_backends(verb, tmp_path, capsys, h):
    assert main([verb, "single_gemm", "--backend", "cutlass", *h.spec_args(h.gemm()), "--db", "x.db"]) == 2
    err = capsys.readouterr().err
    assert "no backend 'cutlass'" in err and "torch-cpu" in err
    assert os.listdir(tmp_path) == []


def test_missing_backend_option_is_a_usage_error(capsys, h):
    assert main(["query", "single_gemm", *h.spec_args(h.gemm())]) == 2
    assert "backend" in capsys.readouterr().err.lower()


def test_default_db_is_kprof_db_then_cwd(tmp_path, monkeypatch, capsys, h, local_gpu):
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--json"]) == 2
    assert "no ledger at profile.db" in capsys.readouterr().err  # the default, ./profile.db, does not exist yet
    env_db = str(tmp_path / "env.db")
    h.append(env_db, h.make_event(h.gemm(), local_gpu))
    monkeypatch.setenv("KPROF_DB", env_db)
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["db"] == env_db and doc["results"][0]["status"] == "ok"
    assert not os.path.exists(tmp_path / "profile.db")


def test_spaces_around_kprof_db_do_not_matter(tmp_path, monkeypatch, capsys, h, local_gpu):
    """The README says surrounding spaces of a KPROF_* setting do not matter, but KPROF_DB=' env.db ' was read as the
    file ' env.db ': a read said "no ledger at  env.db " (the spaces unseen), and `run` created a ledger of that name
    beside the one meant. The spaces are dropped, as every other KPROF_* setting's are."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    h.append("env.db", h.make_event(h.gemm(), local_gpu))
    monkeypatch.setenv("KPROF_DB", " env.db ")
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm()), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["db"] == "env.db" and doc["results"][0]["status"] == "ok"
    assert main(["run", "single_gemm", "--backend", h.CPU, *h.spec_args(h.gemm(m=8)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["db"] == "env.db"
    assert sorted(os.listdir(tmp_path)) == ["env.db", "env.db-claims", "env.db-lock"]


def test_a_long_table_builds_the_json_of_the_rows_it_prints_only(ledger_path, capsys, h, local_gpu, monkeypatch):
    """A table prints its first 50 rows and counts the rest: it built every row's JSON first (2 s of a 100,000-spec
    query's 3.3 s). It builds those it prints; a failed row past them still prints its error, and is counted, and
    --json still holds every row."""
    from kprof import api

    specs = [h.gemm(m=m) for m in range(1, 61)]
    h.append(ledger_path, h.make_event(specs[0], local_gpu), h.make_event(specs[55], local_gpu, kind="failed"))
    built, real = [], api._row_json
    monkeypatch.setattr(api, "_row_json", lambda *a: (built.append(a), real(*a))[1])
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(*specs), "--db", ledger_path]) == 0
    out = capsys.readouterr().out
    assert len(built) == 50
    assert "... and 10 more rows (9 missing, 1 failed); use --json for all" in out
    assert "1 of 60 ok, 59 missing (58 missing, 1 failed)" in out
    assert f"failed spec {json.dumps(specs[55])} (crash): segfault in the kernel" in out
    built.clear()
    doc = _query(capsys, h, ledger_path, *specs)
    assert len(built) == len(doc["results"]) == 60 and doc["missing_count"] == 59
    assert doc["results"][55]["error"] == {"kind": "crash", "message": "segfault in the kernel"}


def test_rows_of_a_newer_profiler_revision_are_named_in_a_note(ledger_path, capsys, h, local_gpu, monkeypatch):
    """Rows a newer kprof measured (a newer profiler revision) read as missing with no word: a user of an older install
    reading a newer ledger was not told why. `query` and `count-missing` now say so on stderr; the answer stays. The
    run it names measures them again here: the command's own (it said `kprof run`, a usage error as written)."""
    import shlex

    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    ours = effective_entry(lookup(h.GEMM, h.CPU)).contract.profiler_revision
    h.append(ledger_path, h.make_event(h.gemm(m=8), local_gpu, revision=ours + 3),
             h.make_event(h.gemm(m=16), local_gpu))
    specs = h.spec_args(h.gemm(m=8), h.gemm(m=16), h.gemm(m=32))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # a thread count set here would lead the command
        monkeypatch.delenv(name, raising=False)
    run = shlex.join(["kprof", "run", h.GEMM, "--backend", h.CPU, "--db", ledger_path, *specs])
    for verb in ("query", "count-missing"):
        assert main([verb, h.GEMM, "--backend", h.CPU, *specs, "--db", ledger_path, "--json"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["missing_count"] == 2
        assert f"note: 1 of 3 spec(s) has a row of profiler revision {ours + 3} in {ledger_path}, newer than this " \
               f"kprof's" in err and f"upgrade kprof to read them (`{run}` here measures those specs again" in err, err
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(m=32)), "--db", ledger_path]) == 0
    assert "newer" not in capsys.readouterr().err


def test_the_newer_revision_note_names_a_newer_row_measured_before_an_older_one(ledger_path, capsys, h, local_gpu):
    """The note found a spec's newer-revision row as the newest stale row of a view past every revision: where a row of
    an older revision of the spec was measured after it (an older install's run, a merge of its segment), that row
    was picked, and the note said nothing though the newer row is there. The row of the highest revision is picked."""
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    ours = effective_entry(lookup(h.GEMM, h.CPU)).contract.profiler_revision
    newer = h.make_event(h.gemm(m=8), local_gpu, revision=ours + 3)
    older = h.make_event(h.gemm(m=8), local_gpu, revision=ours - 1)
    assert older.measured_at >= newer.measured_at
    h.append(ledger_path, newer, older)
    for verb in ("query", "count-missing"):
        assert main([verb, h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(m=8)), "--db", ledger_path, "--json"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["missing_count"] == 1
        assert f"note: 1 of 1 spec(s) has a row of profiler revision {ours + 3} in {ledger_path}" in err, (verb, err)
    (row,) = _query(capsys, h, ledger_path, h.gemm(m=8))["results"]
    assert row["status"] == "stale" and row["provenance"]["profiler_revision"] == ours - 1  # this kprof's read


def test_the_newer_revision_note_names_a_newer_row_beside_a_failed_one_in_query_too(ledger_path, capsys, h, local_gpu):
    """A spec whose row of this revision failed and that has a row of a newer one (a newer kprof measured it): the
    note, which names the specs without an ok row that have such rows, came from `count-missing` but not `query`,
    which looked only at its missing and stale specs."""
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    ours = effective_entry(lookup(h.GEMM, h.CPU)).contract.profiler_revision
    h.append(ledger_path, h.make_event(h.gemm(m=8), local_gpu, kind="failed"),
             h.make_event(h.gemm(m=8), local_gpu, revision=ours + 1))
    for verb in ("query", "count-missing"):
        assert main([verb, h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(m=8)), "--db", ledger_path, "--json"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["missing_count"] == 1
        assert f"note: 1 of 1 spec(s) has a row of profiler revision {ours + 1} in {ledger_path}" in err, (verb, err)
    assert _query(capsys, h, ledger_path, h.gemm(m=8))["results"][0]["status"] == "failed"


def test_the_newer_revision_note_samples_a_large_request(ledger_path, capsys, h, local_gpu, tmp_path):
    """The note looked up the stale rows of up to 1,000 specs (about 45 µs each: 16 % of count-missing's whole process
    on 10,000 specs); it looks at _LOOKED_AT specs spread over those without an ok row, and says it sampled them."""
    from kprof.cli import read
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    ours = effective_entry(lookup(h.GEMM, h.CPU)).contract.profiler_revision
    h.append(ledger_path, *(h.make_event(h.gemm(m=m), local_gpu, revision=ours + 1) for m in range(1, 201)))
    specs = tmp_path / "specs.jsonl"
    specs.write_text("".join(json.dumps(h.gemm(m=m)) + "\n" for m in range(1, 201)))
    assert main(["count-missing", h.GEMM, "--backend", h.CPU, "--specs", str(specs), "--db", ledger_path]) == 0
    looked = len(range(0, 200, -(-200 // read._LOOKED_AT)))
    assert looked <= read._LOOKED_AT and f"note: {looked} of {looked} spec(s) sampled from the 200 without an ok row " \
        f"have rows of profiler revision {ours + 1}" in capsys.readouterr().err


def test_the_newer_revision_note_never_fails_the_answer(ledger_path, capsys, h, local_gpu, monkeypatch):
    """The note on rows of a newer profiler revision reads the ledger a second time, after the answer: where that read
    failed (the file removed or moved since, as a cleanup or a copy's rename does), the answer was lost, exit 2 naming
    no ledger at the path; the answer stands, with no note."""
    import os

    from kprof import api

    h.append(ledger_path, h.make_event(h.gemm(m=16), local_gpu))
    for verb in ("query", "count_missing"):
        def answered_then_moved(*args, _real=getattr(api, verb), **kwargs):
            res = _real(*args, **kwargs)
            os.replace(ledger_path, ledger_path + ".moved")
            return res

        monkeypatch.setattr(api, verb, answered_then_moved)
        argv = [verb.replace("_", "-"), h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(m=16), h.gemm(m=32)), "--db",
                ledger_path, "--json"]
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["missing_count"] == 1 and "note" not in err, err
        os.replace(ledger_path + ".moved", ledger_path)
