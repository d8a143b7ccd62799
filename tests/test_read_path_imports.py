"""The read path (list, scopes, query, count-missing, show, audit, the Python read API) never imports torch, cupti or
pynvml: checked in a fresh interpreter, where nothing else could have imported them first."""

import json
import subprocess
import sys

import msgspec

from kprof.ledger import KeyMaker, Ledger, ShapeCodec
from kprof.ledger.build import failed, measured
from kprof.ledger.events import Method, Stats
from kprof.measure.env import cpu_model
from kprof.method import effective_entry
from kprof.runners.registry import lookup

HEAVY = ("torch", "cupti", "pynvml")
SPECS = [{"m": 32, "n": 32, "k": 32, "dtype": "fp32"}, {"m": 64, "n": 32, "k": 32, "dtype": "bf16"},
         {"m": 8, "n": 8, "k": 8, "dtype": "fp16"}]

SCRIPT = r"""
import json, sys
db, gpu, specs, report = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
import kprof.cli, kprof.perf_api, kprof.api
from kprof.cli import main

spec_args = [a for s in specs for a in ("--spec", json.dumps(s))]
codes = {
    "list": main(["list", "--json"]),
    "list-human": main(["list"]),
    "query": main(["query", "single_gemm", "--backend", "torch-cpu", *spec_args, "--db", db, "--json"]),
    "query-human": main(["query", "single_gemm", "--backend", "torch-cpu", *spec_args, "--db", db]),
    "query-local-gpu": main(["query", "single_gemm", "--backend", "torch-cpu", *spec_args, "--db", db, "--json",
                             "--gpu-name", gpu]),
    "query-auto-gpu": main(["query", "single_gemm", "--backend", "torch-cpu", *spec_args, "--db", db, "--json"]),
    "count-missing": main(["count-missing", "single_gemm", "--backend", "torch-cpu", *spec_args, "--db", db,
                           "--json"]),
    "count-missing-nodb": main(["count-missing", "rms_norm", "--backend", "torch-cpu", "--spec",
                                '{"tokens": 1, "hidden": 8, "dtype": "fp32"}', "--db", db + ".absent"]),
    "audit": main(["audit", "--db", db, "--json"]),
    "scopes": main(["scopes", "--db", db, "--json"]),
    "scopes-human": main(["scopes", "--db", db]),
}
row = kprof.perf_api.get_single_gemm(backend="torch-cpu", gpu_key=gpu, db=db, **specs[0])
missing = kprof.perf_api.count_single_gemm(specs, backend="torch-cpu", gpu_key=gpu, db=db)
q = kprof.api.query("single_gemm", "torch-cpu", specs, db=db)
scopes = [[s.table, s.backend, s.gpu_name, s.rows] for s in kprof.api.scopes(db)]
codes["show"] = main(["show", q.results[0]["citation"], "--db", db, "--json"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cupti", "pynvml"))
with open(report, "w") as f:
    json.dump({"codes": codes, "heavy": heavy, "row_ok": row is not None, "missing": missing,
               "statuses": [r["status"] for r in q.results], "scopes": scopes}, f)
"""


def _ledger(path: str, gpu: str) -> None:
    entry = effective_entry(lookup("single_gemm", "torch-cpu"))
    keys = KeyMaker(entry.table, entry.backend, gpu, entry.contract, ShapeCodec(entry.args))
    stats = Stats(n=3, median=0.1, p10=0.1, p90=0.1, mean=0.1, stdev=0.0, cv=0.0, min=0.1, max=0.1)
    metrics = {"time_ms": 0.1, "tflops": 1.0, "memory_bandwidth_gbps": 1.0, "energy_j": None}
    old = msgspec.structs.replace(entry.contract, profiler_revision=0)
    stale_keys = KeyMaker(entry.table, entry.backend, gpu, old, ShapeCodec(entry.args))
    led = Ledger.open(path)
    try:
        led.append([measured(keys.provenance(SPECS[0]), metrics, stats, Method(timer="cpu")),
                    failed(keys.provenance(SPECS[1]), "oom", "out of memory"),
                    measured(stale_keys.provenance(SPECS[2]), metrics, stats, Method(timer="cpu"))])
    finally:
        led.close()


def test_read_path_imports_no_measurement_library(tmp_path):
    db, report = str(tmp_path / "profile.db"), tmp_path / "report.json"
    gpu = cpu_model()
    _ledger(db, gpu)
    p = subprocess.run([sys.executable, "-c", SCRIPT, db, gpu, json.dumps(SPECS), str(report)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(report.read_text())
    assert doc["codes"] == {"list": 0, "list-human": 0, "query": 0, "query-human": 0, "query-local-gpu": 0,
                            "query-auto-gpu": 0, "count-missing": 0, "count-missing-nodb": 2, "audit": 0, "show": 0,
                            "scopes": 0, "scopes-human": 0}
    assert doc["scopes"] == [["single_gemm", "torch-cpu", gpu, 3]]
    assert doc["statuses"] == ["ok", "failed", "stale"]
    assert doc["row_ok"] is True and doc["missing"] == 2
    assert doc["heavy"] == [], f"the read path imported {doc['heavy']}"


def test_importing_the_package_and_registry_is_light(tmp_path):
    code = ("import sys, kprof, kprof.api, kprof.perf_api, kprof.specs, kprof.artifacts, kprof.ledger, "
            "kprof.runners.registry as r, kprof.runners.catalog, kprof.measure.stats; r.entries(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY,))
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
