"""`kprof calibrate` on the CPU backend, and the ceiling fractions `query --json` reports after it."""

import json

import pytest

from kprof.calibrate import CEILING_SPECS
from kprof.cli import main


def test_query_has_no_ceiling_before_calibrate(h, capsys):
    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", "p.db", "--json"]) == 0
    capsys.readouterr()
    doc = h.read_json(capsys, "query", "p.db", h.gemm())
    assert "ceiling" not in doc["results"][0]  # the rows are as they were until ceilings exist


def test_calibrate_measures_ceiling_rows_and_query_reports_fractions(h, capsys):
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json"]) == 0
    cal = json.loads(capsys.readouterr().out)
    by_metric = {c["metric"]: c for c in cal["ceilings"]}
    assert set(by_metric) == {"tflops", "memory_bandwidth_gbps"}
    assert [c["spec"] for c in cal["ceilings"]] == [spec for _t, spec, _m in CEILING_SPECS["cpu"]]
    assert all(c["value"] > 0 and c["citation"].startswith("kprof.") for c in cal["ceilings"])
    assert [r["status"] for r in cal["rows"]] == ["ok", "ok"]

    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(64, 64, 64)), "--db", "p.db"]) == 0
    capsys.readouterr()
    row = h.read_json(capsys, "query", "p.db", h.gemm(64, 64, 64))["results"][0]
    ceiling = row["ceiling"]
    assert ceiling["fraction"]["tflops"] == pytest.approx(row["metrics"]["tflops"] / by_metric["tflops"]["value"])
    assert ceiling["fraction"]["memory_bandwidth_gbps"] == pytest.approx(
        row["metrics"]["memory_bandwidth_gbps"] / by_metric["memory_bandwidth_gbps"]["value"])
    assert ceiling["citations"] == {m: c["citation"] for m, c in by_metric.items()}
    # the ceiling GEMM itself is at fraction 1 of the arithmetic ceiling
    big = h.read_json(capsys, "query", "p.db", CEILING_SPECS["cpu"][0][1])["results"][0]
    assert big["ceiling"]["fraction"]["tflops"] == pytest.approx(1.0)


def test_calibrate_again_measures_nothing_unless_forced(h, capsys):
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert [c["citation"] for c in again["ceilings"]] == [c["citation"] for c in first["ceilings"]]
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json", "--force"]) == 0
    forced = json.loads(capsys.readouterr().out)
    assert all(a["citation"] != b["citation"] for a, b in zip(forced["ceilings"], first["ceilings"]))


def test_calibrate_unknown_backend_is_a_usage_error(h, capsys, tmp_path):
    assert main(["calibrate", "--backend", "torch-tpu", "--db", "p.db"]) == 2
    assert "unknown backend 'torch-tpu'" in capsys.readouterr().err
    assert not (tmp_path / "p.db").exists()
