"""`kprof calibrate`: the ceilings are the maximum over a stated set of shapes, each cited, with how the set was
measured; query reports each ok row's fraction of them and flags a row above a ceiling.

Real CPU kernels where the pipeline is under test; hand-built rows (known values, known environments) where
the arithmetic is, so a wrong maximum, citation or flag cannot pass by chance."""

import json
import os
import re
from types import SimpleNamespace

import msgspec
import pytest

from kprof import api
from kprof.calibrate import CEILING_SETS, CEILING_SPECS, annotate, calibrate, ceilings, fractions
from kprof.cli import main
from kprof.ledger import KeyMaker, Row, ShapeCodec
from kprof.ledger.build import measured
from kprof.ledger.events import Environment, Method, Stats
from kprof.method import effective_entry
from kprof.runners.catalog import GPU_REVISION
from kprof.runners.registry import lookup

GPU = "Test GPU"  # a GPU key no real device has: hand-built rows only
CPU_FLOPS, CPU_BYTES = CEILING_SETS["cpu"]
GPU_FLOPS, GPU_FP8, GPU_BYTES = CEILING_SETS["cuda"]
CPU_GEMMS = [spec for _t, spec in CPU_FLOPS.members]
CPU_COPIES = [spec for t, spec in CPU_BYTES.members if t == "memcpy"]


def _row(spec, *, table="single_gemm", backend="torch-cpu", gpu=GPU, timing=None, tflops=1.0, gbps=1.0,
         env=Environment(), parent=None, time_ms=1.0, notes=None):
    """A measured event of `spec` with the given metrics (and, for a CUDA backend, the given timing string)."""
    entry = effective_entry(lookup(table, backend))
    contract = entry.contract if timing is None else msgspec.structs.replace(entry.contract, timing=timing)
    prov = KeyMaker(table, backend, gpu, contract, ShapeCodec(entry.args)).provenance(spec)
    stats = Stats(n=3, median=1.0, p10=1.0, p90=1.0, mean=1.0, stdev=0.0, cv=0.0, min=1.0, max=1.0)
    metrics = {"time_ms": time_ms, "tflops": tflops, "memory_bandwidth_gbps": gbps, "energy_j": None}
    return measured(prov, metrics, stats, Method(timer="cpu", l2="warm", stop_reason="converged", notes=notes or {}),
                    environment=env,
                    parent=parent)


def _env(sm_min, sm_max, power, throttle):
    return Environment(clocks={"sm_mhz_min": sm_min, "sm_mhz_max": sm_max, "power_w_mean": power},
                       throttle=throttle)


def test_query_has_no_ceiling_before_calibrate(h, capsys):
    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", "p.db", "--json"]) == 0
    capsys.readouterr()
    doc = h.read_json(capsys, "query", "p.db", h.gemm())
    assert "ceiling" not in doc["results"][0]  # the rows are as they were until ceilings exist


def _query(table, specs, db="p.db", **kw):
    return api.query(table, "torch-cpu", list(specs), db=db, **kw).results


def test_the_sets_are_stated_distinct_and_valid():
    assert [(s.metric, s.dtype) for s in CEILING_SETS["cpu"]] == [("tflops", None), ("memory_bandwidth_gbps", None)]
    assert [(s.metric, s.dtype) for s in CEILING_SETS["cuda"]] == [
        ("tflops", None), ("tflops", "fp8_e4m3"), ("memory_bandwidth_gbps", None)]
    for device, sets in CEILING_SETS.items():
        backend = {"cuda": "torch", "cpu": "torch-cpu"}[device]
        for s in sets:
            assert len(s.members) >= 3
            assert len({json.dumps(m, sort_keys=True) for m in s.members}) == len(s.members)
            for table, spec in s.members:
                msgspec.convert(spec, lookup(table, backend).args)  # raises on a spec the table refuses
    # the GPU's arithmetic set: bf16 only, prefill-sized GEMMs (every dimension >= 2048, at least 2^34 flops)
    # from square ones to long-k down projections
    assert {t for t, _x in GPU_FLOPS.members} == {"single_gemm"}
    assert {x["dtype"] for _t, x in GPU_FLOPS.members} == {"bf16"}
    assert 4 <= len(GPU_FLOPS.members) <= 10
    shapes = {(x["m"], x["n"], x["k"]) for _t, x in GPU_FLOPS.members}
    assert {(4096, 4096, 4096), (8192, 8192, 8192)} <= shapes
    assert all(min(s) >= 2048 and 2 * s[0] * s[1] * s[2] >= 2 ** 36 for s in shapes)
    assert any(k > 2 * max(m, n) for m, n, k in shapes)  # a long-k one
    # its bandwidth set: copies of 1, 2 and 4 GiB, and decode GEMMs whose weights are past twice a 60 MiB L2
    assert [x["bytes"] for t, x in GPU_BYTES.members if t == "memcpy"] == [1 << 30, 2 << 30, 4 << 30]
    decode = [x for t, x in GPU_BYTES.members if t == "single_gemm"]
    assert decode and all(x["m"] == 1 and x["dtype"] == "bf16" and 2 * x["n"] * x["k"] > 120 << 20 for x in decode)
    # and decode attention over a KV cache of 1 GiB or more (K and V, bf16)
    attention = [x for t, x in GPU_BYTES.members if t == "attention_decode"]
    assert attention and all(2 * 2 * x["batch"] * x["kv_len"] * x["num_kv_heads"] * x["head_dim"] >= 1 << 30
                             for x in attention)
    # fp8's own arithmetic set: fp8 GEMMs only, prefill-sized like the bf16 set, and bounding fp8 rows only
    assert {(t, x["dtype"]) for t, x in GPU_FP8.members} == {("single_gemm", "fp8_e4m3")}
    assert all(min(x["m"], x["n"], x["k"]) >= 2048 for _t, x in GPU_FP8.members)
    assert CEILING_SPECS["cuda"] == [(t, x, s.metric) for s in CEILING_SETS["cuda"] for t, x in s.members]


def test_every_member_of_every_set_has_a_label_and_a_method(h):
    """How a ceiling was measured names its shapes: a member of any table (decode attention has no m, n, k)."""
    from kprof.ceilings import _label, _method

    for sets in CEILING_SETS.values():
        for s in sets:
            labels = [_label(t, x) for t, x in s.members]
            assert len(set(labels)) == len(labels)
            assert all(label.startswith(t) for label, (t, _x) in zip(labels, s.members))
            rows = [(t, Row(x, "ok", b"k" * 32)) for t, x in s.members]
            assert _method(s, "cpu", rows, [], rows[-1])["at"] == labels[-1]
    assert _label("attention_decode", dict(GPU_BYTES.members[-1][1])) == \
        "attention_decode batch=128,kv_len=8192,num_heads=32,num_kv_heads=8,head_dim=128"


def test_calibrate_measures_every_shape_once_and_the_ceiling_is_their_max(h, capsys):
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json"]) == 0
    cal = json.loads(capsys.readouterr().out)
    by_metric = {c["metric"]: c for c in cal["ceilings"]}
    assert set(by_metric) == {"tflops", "memory_bandwidth_gbps"}

    runs, found = calibrate(h.CPU, db="p.db")  # nothing missing: reads back what the command measured
    assert [(r.table, r.measured) for r in runs] == [("single_gemm", 0), ("memcpy", 0)]  # one run per table
    assert [c.citation for c in found] == [by_metric[c.metric]["citation"] for c in found]
    for c, s in zip(found, CEILING_SETS["cpu"]):
        rows = [dict(r, table=t) for t, x in s.members for r in _query(t, [x])]
        assert [r["status"] for r in rows] == ["ok"] * len(s.members)  # every shape of the set was measured
        values = [r["metrics"][s.metric] for r in rows]
        best = rows[values.index(max(values))]
        assert c.value == max(values) == by_metric[s.metric]["value"]
        assert (c.table, c.spec, c.citation) == (best["table"], best["spec"], best["citation"])
        assert list(c.shapes) == [{"table": t, "spec": x} for t, x in s.members]
        assert [(r["table"], r["spec"], r["value"], r["citation"]) for r in c.rows] == [
            (r["table"], r["spec"], r["metrics"][s.metric], r["citation"]) for r in rows]
        n = len(s.members)
        assert (c.method["measured"], c.method["of"], c.method["missing"]) == (n, n, [])
        assert c.method["timing"] == effective_entry(lookup("single_gemm", h.CPU)).contract.timing
        assert c.method["summary"].startswith(f"max over {n}/{n} shapes (at {best['table']} ")

    # a row's fractions are of the maxima, and the rows of the set are at most 1 (one of them exactly 1)
    assert main(["run", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(64, 64, 64)), "--db", "p.db"]) == 0
    capsys.readouterr()
    row = h.read_json(capsys, "query", "p.db", h.gemm(64, 64, 64))["results"][0]
    ceiling = row["ceiling"]
    assert ceiling["fraction"]["tflops"] == pytest.approx(row["metrics"]["tflops"] / by_metric["tflops"]["value"])
    assert ceiling["fraction"]["memory_bandwidth_gbps"] == pytest.approx(
        row["metrics"]["memory_bandwidth_gbps"] / by_metric["memory_bandwidth_gbps"]["value"])
    assert ceiling["citations"] == {m: c["citation"] for m, c in by_metric.items()}
    shares = [fractions(r["metrics"], found)["tflops"] for r in _query("single_gemm", CPU_GEMMS)]
    assert max(shares) == 1.0 and all(x <= 1.0 for x in shares)

    # again: nothing is measured and the ceilings are the same rows; --force measures every shape anew
    runs, again = calibrate(h.CPU, db="p.db")
    assert [r.measured for r in runs] == [0, 0] and again == found
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json", "--force"]) == 0
    forced = json.loads(capsys.readouterr().out)
    assert all(a["citation"] != b["citation"] for a, b in zip(forced["ceilings"], cal["ceilings"]))
    runs, refound = calibrate(h.CPU, db="p.db")
    assert all(r["citation"] not in {x["citation"] for x in c.rows} for a, c in zip(found, refound) for r in a.rows)


def test_calibrate_gives_its_rows_fractions_of_the_ceilings_it_reports(h, capsys, local_gpu):
    """Each table's run annotated its rows before the next table was measured: under --force, the GEMM rows cited
    the copies' ceiling from before (an event now superseded) at fractions of its value, not of the one reported."""
    old = h.append("p.db", *[_row(x, table="memcpy", gpu=local_gpu, gbps=1e6) for x in CPU_COPIES])
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json", "--force"]) == 0
    cal = json.loads(capsys.readouterr().out)
    ceiling = {c["metric"]: c for c in cal["ceilings"]}
    assert ceiling["memory_bandwidth_gbps"]["value"] < 1e6  # the copies measured again replaced the old rows
    assert len(cal["rows"]) == len(CEILING_SPECS["cpu"]) and all(r["status"] == "ok" for r in cal["rows"])
    for row in cal["rows"]:
        got = row["ceiling"]
        assert got["citations"] == {m: ceiling[m]["citation"] for m in got["fraction"]}
        assert got["fraction"] == {m: pytest.approx(row["metrics"][m] / ceiling[m]["value"]) for m in got["fraction"]}
        assert not set(got["citations"].values()) & {"kprof." + i.hex()[:16] for i in old}
        assert "above_ceiling" not in got  # the set's own rows are at most their maximum


def test_the_ceiling_is_the_max_wherever_it_lies_in_the_set(h):
    specs = CPU_GEMMS
    events = [_row(specs[0], tflops=3.0, env=_env(1500, 1700, 690.0, ["power_cap"])),
              _row(specs[1], tflops=7.0, env=_env(1400, 1980, 700.0, [])),
              _row(specs[2], tflops=5.0, env=_env(1600, 1800, 650.0, ["thermal"]))]
    ids = h.append("p.db", *events)
    (c,) = ceilings(h.CPU, GPU, db="p.db")  # no copy rows: that ceiling is absent, not zero
    assert (c.metric, c.value, c.table, c.spec) == ("tflops", 7.0, "single_gemm", specs[1])
    assert c.citation == "kprof." + ids[1].hex()[:16]
    assert [r["value"] for r in c.rows] == [3.0, 7.0, 5.0]
    m = c.method
    assert m["clocks"]["sm_mhz_min"] == [1400, 1600] and m["clocks"]["sm_mhz_max"] == [1700, 1980]
    assert m["clocks"]["power_w_mean"] == [650.0, 700.0]
    assert m["throttle"] == ["power_cap", "thermal"]
    assert m["at"] == "single_gemm 768x768x768"
    assert "SM 1400-1980 MHz" in m["summary"] and "650-700 W" in m["summary"]
    assert "throttle power_cap,thermal" in m["summary"]

    # the best row re-measured lower: the ceiling moves to the next best, and says which shape holds it
    h.append("p.db", _row(specs[1], tflops=2.0, parent=ids[1]))
    (c,) = ceilings(h.CPU, GPU, db="p.db")
    assert (c.value, c.spec, c.citation) == (5.0, specs[2], "kprof." + ids[2].hex()[:16])


def test_a_cpu_ceiling_says_the_host_load_it_was_measured_under(h, capsys, monkeypatch):
    """On the CPU the state that matters is the host's load (other work slows every sample alike): a ceiling
    measured on a busy host said nothing of it, and calibrate's text output said nothing of how any was measured."""
    busy = {"host_load_1m": "3.10", "host_busy": "load 3.10 over 2 cores: other work shared them"}
    h.append("p.db", _row(CPU_GEMMS[0], tflops=3.0, notes={"host_load_1m": "0.40"}),
             _row(CPU_GEMMS[1], tflops=7.0, notes=busy), _row(CPU_GEMMS[2], tflops=5.0))
    (c,) = ceilings(h.CPU, GPU, db="p.db")
    assert (c.method["host_load_1m"], c.method["host_busy"]) == ([0.4, 3.1], 1)
    assert c.method["summary"].endswith("; host load 0.40-3.10, busy over 1 row(s)")
    h.append("p.db", *[_row(x, table="memcpy", gbps=10.0, notes={"host_load_1m": "0.50"}) for x in CPU_COPIES])
    by = {c.metric: c for c in ceilings(h.CPU, GPU, db="p.db")}
    assert (by["memory_bandwidth_gbps"].method["host_load_1m"], by["memory_bandwidth_gbps"].method["host_busy"]) == \
        ([0.5, 0.5], 0)
    assert by["memory_bandwidth_gbps"].method["summary"].endswith("; host load 0.50-0.50")

    from kprof.cli import calibrate as verb

    monkeypatch.setattr(verb, "run_calibrate", lambda *a, **k: ([], list(by.values())))
    monkeypatch.setattr(verb, "complete", lambda *a: True)
    assert main(["calibrate", "--backend", "torch-cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "  " + by["tflops"].method["summary"]
    assert lines[3] == "  " + by["memory_bandwidth_gbps"].method["summary"]


def test_a_partly_measured_set_says_what_is_missing(h):
    copies = CPU_COPIES
    h.append("p.db", _row(copies[0], table="memcpy", gbps=10.0), _row(copies[2], table="memcpy", gbps=4.0))
    (c,) = ceilings(h.CPU, GPU, db="p.db")
    n = len(CPU_BYTES.members)
    assert (c.metric, c.value, c.table, c.spec) == ("memory_bandwidth_gbps", 10.0, "memcpy", copies[0])
    assert (c.method["measured"], c.method["of"]) == (2, n)
    assert c.method["missing"] == [{"table": t, "spec": x} for t, x in CPU_BYTES.members
                                   if x not in (copies[0], copies[2])]
    assert c.method["summary"].startswith(f"max over 2/{n} shapes (at memcpy 64 MiB)")
    # the set's GEMM streams faster than any copy: the ceiling is its row, in another table
    (matvec,) = [x for t, x in CPU_BYTES.members if t == "single_gemm"]
    (eid,) = h.append("p.db", _row(matvec, gbps=12.5, tflops=0.001))
    by_metric = {c.metric: c for c in ceilings(h.CPU, GPU, db="p.db")}
    c = by_metric["memory_bandwidth_gbps"]
    assert (c.value, c.table, c.spec, c.citation) == (12.5, "single_gemm", matvec, "kprof." + eid.hex()[:16])
    assert "tflops" not in by_metric  # only the arithmetic set's own rows make that ceiling


def test_ceilings_are_read_under_one_timing_method(h):
    timing = "events;l2=cold;eager"
    h.append("p.db", *[_row(x, backend="torch", timing=timing, tflops=100.0 + i)
                       for i, (_t, x) in enumerate(GPU_FLOPS.members)])
    assert ceilings("torch", GPU, db="p.db") == []  # the default (cupti) rows do not exist
    flops = {c.metric: c for c in ceilings("torch", GPU, db="p.db", timing=timing)}["tflops"]
    assert flops.value == 100.0 + len(GPU_FLOPS.members) - 1 and flops.method["timing"] == timing


def test_ceilings_make_one_view_per_table(h, monkeypatch):
    """A table in more than one set (single_gemm is in each of the three on CUDA) was read through a view made for
    each set: 5 views a query on CUDA, ~0.5 ms each to make. One view per table now, and the same ceilings."""
    from kprof.ledger import Ledger

    h.append("p.db", *[_row(s, tflops=v, gbps=0.1) for s, v in zip(CPU_GEMMS, (3.0, 7.0, 5.0))],
             *[_row(s, table="memcpy", gbps=v) for s, v in zip(CPU_COPIES, (10.0, 20.0, 15.0))])
    made, view = [], Ledger.view
    monkeypatch.setattr(Ledger, "view", lambda self, table, *a: (made.append(table), view(self, table, *a))[1])
    assert {c.metric: c.value for c in ceilings(h.CPU, GPU, db="p.db")} == {"tflops": 7.0,
                                                                            "memory_bandwidth_gbps": 20.0}
    assert sorted(made) == ["memcpy", "single_gemm"]
    made.clear()
    assert ceilings("torch", GPU, db="p.db") == []
    assert sorted(made) == ["attention_decode", "memcpy", "single_gemm"]


def _above_ceiling_ledger(h):
    """Ceiling rows of known value, and three rows: below both ceilings, above the arithmetic one, and
    exactly at it."""
    h.append("p.db", *[_row(s, tflops=v, gbps=0.1) for s, v in zip(CPU_GEMMS, (3.0, 7.0, 5.0))],
             *[_row(s, table="memcpy", gbps=v) for s, v in zip(CPU_COPIES, (10.0, 20.0, 15.0))])
    others = [h.gemm(64, 64, 64), h.gemm(96, 96, 96), h.gemm(128, 128, 128)]
    h.append("p.db", _row(others[0], tflops=3.5, gbps=5.0), _row(others[1], tflops=8.4, gbps=5.0),
             _row(others[2], tflops=7.0, gbps=20.0))
    return others


def test_a_row_above_a_ceiling_is_flagged_never_capped(h):
    others = _above_ceiling_ledger(h)
    found = ceilings(h.CPU, GPU, db="p.db")
    docs = api.query("single_gemm", h.CPU, others, gpu_name=GPU, db="p.db").results
    annotate(docs, found)
    below, above, at = (d["ceiling"] for d in docs)
    assert below["fraction"] == {"tflops": 0.5, "memory_bandwidth_gbps": 0.25} and "above_ceiling" not in below
    assert above["fraction"]["tflops"] == pytest.approx(1.2) and above["above_ceiling"] is True
    assert at["fraction"] == {"tflops": 1.0, "memory_bandwidth_gbps": 1.0} and "above_ceiling" not in at
    assert above["citations"] == {c.metric: c.citation for c in found}
    assert set(above["method"]) == {"tflops", "memory_bandwidth_gbps"}
    assert above["method"]["tflops"].startswith("max over 3/3 shapes (at single_gemm 768x768x768)")
    # rows that are not ok get nothing; no ceilings, nothing at all
    missing = api.query("single_gemm", h.CPU, [h.gemm(8, 8, 8)], gpu_name=GPU, db="p.db").results
    annotate(missing, found)
    assert "ceiling" not in missing[0]
    plain = {k: v for k, v in docs[1].items() if k != "ceiling"}  # an ok row above a ceiling, unannotated
    annotate([plain], [])
    assert plain["status"] == "ok" and "ceiling" not in plain


def test_a_row_above_a_ceiling_says_why(h):
    """`above_ceiling` alone left a user to guess why a row beat the calibration set (a CPU's 1 MiB copy read 4.5
    times the bandwidth ceiling): `why` names the cause the row and the ceiling show, and `values` each ceiling,
    so a fraction can be checked against the row `citations` names."""
    others = _above_ceiling_ledger(h)

    def ceiling_of(table, spec):
        (doc,) = api.query(table, h.CPU, [spec], gpu_name=GPU, db="p.db").results
        return doc["ceiling"]

    above = ceiling_of("single_gemm", others[1])  # 8.4 TFLOP/s over the set's 7.0, in the state it was measured
    assert above["values"] == {"tflops": 7.0, "memory_bandwidth_gbps": 20.0}
    assert set(above["why"]) == {"tflops"}
    assert above["why"]["tflops"].startswith("faster than every row of the set as it was measured (max over 3/3 "
                                             "shapes (at single_gemm 768x768x768)")
    # the command as it runs on the row's host: `kprof calibrate --force` measures a CUDA GPU (exit 2 on a CPU)
    assert "kprof calibrate --backend torch-cpu --db p.db --force` measures it again" in above["why"]["tflops"]
    assert "why" not in ceiling_of("single_gemm", others[0])

    small = {"bytes": 1 << 20}  # 0.477 MiB a call at 50 GB/s (its time, 0.01 ms, is made up)
    h.append("p.db", _row(small, table="memcpy", gbps=50.0, time_ms=0.01))
    (why,) = ceiling_of("memcpy", small)["why"].items()  # 3 of the 4 shapes: the matrix-vector product is missing
    assert why[0] == "memory_bandwidth_gbps" and re.fullmatch(r"the ceiling is the max over 3 of its 4 shapes; `("
                                                              r"OMP_NUM_THREADS=\d+ )?kprof calibrate --backend "
                                                              r"torch-cpu --db p.db` measures the rest", why[1])
    (matvec,) = [x for t, x in CPU_BYTES.members if t == "single_gemm"]
    h.append("p.db", _row(matvec, gbps=5.0, tflops=0.001))  # 4.77 MiB a call: the least of the set
    why = ceiling_of("memcpy", small)["why"]["memory_bandwidth_gbps"]
    assert why == ("moves 0.477 MiB a call, less than any row of the set (4.77 MiB): a cache can serve a working set "
                   "that small, and this row is timed with warm caches; the ceiling is memory's")
    assert ceiling_of("single_gemm", others[1])["why"]["tflops"].startswith("faster than every row")

    bf16 = h.gemm(64, 64, 64, dtype="bf16")
    h.append("p.db", _row(bf16, tflops=9.0, gbps=0.1))
    assert ceiling_of("single_gemm", bf16)["why"] == {"tflops": "a bf16 row, bounded by the ceiling of fp32 GEMMs: "
                                                                "no calibration set is of bf16, whose arithmetic may "
                                                                "run faster"}


def test_query_json_flags_a_row_above_a_ceiling(h, capsys):
    others = _above_ceiling_ledger(h)
    doc = h.read_json(capsys, "query", "p.db", *others, extra=["--gpu-name", GPU])
    below, above, _at = (r["ceiling"] for r in doc["results"])
    assert above["above_ceiling"] is True and "above_ceiling" not in below
    assert set(above["method"]) == {"tflops", "memory_bandwidth_gbps"}


def test_calibrate_unknown_backend_is_a_usage_error(h, capsys, tmp_path):
    assert main(["calibrate", "--backend", "torch-tpu", "--db", "p.db"]) == 2
    assert "unknown backend 'torch-tpu'" in capsys.readouterr().err
    assert not (tmp_path / "p.db").exists()


def test_the_arithmetic_ceiling_is_taken_at_the_max_sm_clock(h):
    """Power-capped GEMMs are timed at clocks that differ from pass to pass: the ceiling is each row's rate per
    clock times the max clock, so a row timed nearer boost cannot pass it; bandwidth is not scaled."""
    specs = [spec for _t, spec in GPU_FLOPS.members]
    timed = {0: 1500.0, 1: 1980.0}  # the rest: no timed clock in the method, the telemetry median instead
    events = []
    for i, spec in enumerate(specs[:3]):
        env = Environment(clocks={"sm_max_mhz": 1980.0, **({"sm_mhz_median": 1800.0} if i == 2 else {})})
        prov = KeyMaker("single_gemm", "torch", GPU, lookup("single_gemm", "torch").contract,
                        ShapeCodec(lookup("single_gemm", "torch").args)).provenance(spec)
        stats = Stats(n=3, median=1.0, p10=1.0, p90=1.0, mean=1.0, stdev=0.0, cv=0.0, min=1.0, max=1.0)
        notes = {"timed_sm_mhz_median": str(timed[i])} if i in timed else {}
        events.append(measured(prov, {"time_ms": 1.0, "tflops": 600.0, "memory_bandwidth_gbps": 100.0,
                                      "energy_j": None}, stats, Method(timer="cupti", notes=notes), environment=env))
    h.append("p.db", *events)
    (c,) = ceilings("torch", GPU, db="p.db")
    assert c.metric == "tflops" and c.value == pytest.approx(600.0 * 1980 / 1500) and c.spec == specs[0]
    assert [r["value"] for r in c.rows] == [600.0] * 3
    assert [r["at_max_clock"] for r in c.rows] == pytest.approx([792.0, 600.0, 660.0])
    assert c.method["clock_scaled"].startswith("3 of 3 rows' tflops x the max SM clock (1980 MHz)")
    assert ", scaled to the max SM clock" in c.method["summary"]
    # a row of the same rate per clock, timed at boost: at its ceiling, not above it
    docs = [{"status": "ok", "metrics": {"tflops": 792.0}}, {"status": "ok", "metrics": {"tflops": 800.0}}]
    annotate(docs, [c])
    assert docs[0]["ceiling"]["fraction"]["tflops"] == pytest.approx(1.0) and "above_ceiling" not in docs[0]["ceiling"]
    assert docs[1]["ceiling"]["above_ceiling"] is True


def test_the_calibrate_a_row_above_its_ceiling_names_is_of_its_ledger(h, capsys, tmp_path, monkeypatch):
    """`kprof query ... --db 'team ledgers/p.db' --json` of a row above its ceiling said why with "`kprof calibrate
    --backend torch-cpu --force` measures it again": pasted, that calibrates $KPROF_DB or ./profile.db (creating it),
    and the ceilings of the ledger read stay as they were. The command names the ledger read, quoted for a shell."""
    import shlex

    db = str(tmp_path / "team ledgers" / "p.db")
    os.makedirs(os.path.dirname(db))
    monkeypatch.chdir(os.path.dirname(db))
    others = _above_ceiling_ledger(h)
    monkeypatch.chdir(tmp_path)
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(others[1]), "--gpu-name", GPU, "--db", db,
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["results"][0]
    why, threads = doc["ceiling"]["why"]["tflops"], doc["provenance"]["timing"].rpartition("threads=")[2]
    assert shlex.split(why.split("`")[1]) == [f"OMP_NUM_THREADS={threads}", "kprof", "calibrate", "--backend", h.CPU,
                                              "--db", db, "--force"], why


def test_the_calibrate_a_row_above_its_ceiling_names_is_of_its_thread_count(h, capsys, monkeypatch):
    """A torch-cpu row above its ceiling, read under OMP_NUM_THREADS=1, said "`kprof calibrate --backend torch-cpu
    --db p.db --force` measures it again": pasted in a shell without the variable, that measured ceilings under the
    physical cores' thread count, not the ones the row is read against. The command names the thread count the row
    (and its ceilings) were timed under, as the variable that sets it."""
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    others = _above_ceiling_ledger(h)
    assert main(["query", "single_gemm", "--backend", h.CPU, *h.spec_args(others[1]), "--gpu-name", GPU, "--db",
                 "p.db", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["results"][0]
    assert doc["provenance"]["timing"].endswith(";threads=1")
    assert "`OMP_NUM_THREADS=1 kprof calibrate --backend torch-cpu --db p.db --force` measures it again" in \
        doc["ceiling"]["why"]["tflops"]


def test_a_row_is_bounded_by_the_ceiling_of_its_own_dtype(h):
    """fp8 GEMMs run about twice as fast as bf16 ones: an fp8 row is given the fp8 set's ceiling, a bf16 (or any
    other) row the bf16 set's; without fp8 rows in the ledger, an fp8 row falls back to the bf16 ceiling, flagged."""
    bf16 = [_row(x, backend="torch", tflops=600.0 + i) for i, (_t, x) in enumerate(GPU_FLOPS.members)]
    ids = h.append("p.db", *bf16)
    fp8_row = {"m": 1024, "n": 4096, "k": 4096, "dtype": "fp8_e4m3"}
    bf16_row = {"m": 1024, "n": 4096, "k": 4096, "dtype": "bf16"}
    h.append("p.db", _row(fp8_row, backend="torch", tflops=900.0), _row(bf16_row, backend="torch", tflops=500.0))
    top = 600.0 + len(GPU_FLOPS.members) - 1

    def shares():
        found = ceilings("torch", GPU, db="p.db")
        docs = api.query("single_gemm", "torch", [fp8_row, bf16_row], gpu_name=GPU, db="p.db").results
        annotate(docs, found)
        return found, [d["ceiling"] for d in docs]

    found, (fp8, other) = shares()
    assert [(c.metric, c.dtype) for c in found] == [("tflops", None)]
    assert fp8["fraction"]["tflops"] == pytest.approx(900.0 / top) and fp8["above_ceiling"] is True
    assert fp8["why"]["tflops"].startswith("a fp8_e4m3 row, bounded by the ceiling of bf16 GEMMs")
    assert other["fraction"]["tflops"] == pytest.approx(500.0 / top) and "above_ceiling" not in other

    fp8_ids = h.append("p.db", *[_row(x, backend="torch", tflops=1200.0 + i)
                                 for i, (_t, x) in enumerate(GPU_FP8.members)])
    found, (fp8, other) = shares()
    by = {(c.metric, c.dtype): c for c in found}
    assert set(by) == {("tflops", None), ("tflops", "fp8_e4m3")}
    best8 = by[("tflops", "fp8_e4m3")]
    assert best8.value == 1200.0 + len(GPU_FP8.members) - 1 and best8.citation == "kprof." + fp8_ids[-1].hex()[:16]
    assert fp8["fraction"]["tflops"] == pytest.approx(900.0 / best8.value) and "above_ceiling" not in fp8
    assert fp8["citations"]["tflops"] == best8.citation
    assert fp8["method"]["tflops"] == best8.method["summary"] and "fp8_e4m3 GEMMs" in best8.method["set"]
    assert fp8["method"]["tflops"].startswith(f"max over {len(GPU_FP8.members)}/{len(GPU_FP8.members)} shapes")
    assert other["fraction"]["tflops"] == pytest.approx(500.0 / top)
    assert other["citations"]["tflops"] == "kprof." + ids[-1].hex()[:16]
    assert fractions({"tflops": 900.0}, found, "fp8_e4m3") == {"tflops": pytest.approx(900.0 / best8.value)}
    assert fractions({"tflops": 900.0}, found, "fp16") == {"tflops": pytest.approx(900.0 / top)}


def test_an_optional_set_that_fails_does_not_fail_calibrate(h, capsys, monkeypatch):
    """A set of one dtype is optional (fp8 GEMMs fail on a GPU without fp8): its failed rows are listed, the exit
    code is the required sets' (0 here), and no ceiling of that dtype exists. A failed row of a required set is
    still exit 1."""
    from kprof.ceilings import CeilingSet

    fp8 = CeilingSet("tflops", (("single_gemm", {"m": 1 << 40, "n": 64, "k": 64, "dtype": "bf16"}),), "bf16 GEMMs",
                     "bf16")  # 8 TiB of inputs: the row fails (oom), as fp8 rows do on a GPU without fp8
    monkeypatch.setitem(CEILING_SETS, "cpu", [CPU_FLOPS, fp8, CPU_BYTES])
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json"]) == 0
    cal = json.loads(capsys.readouterr().out)
    assert [(c["metric"], c["dtype"]) for c in cal["ceilings"]] == [("tflops", None), ("memory_bandwidth_gbps", None)]
    failed = [r for r in cal["rows"] if r["status"] != "ok"]
    assert [r["spec"]["dtype"] for r in failed] == ["bf16"]
    required = CeilingSet("tflops", CPU_FLOPS.members + fp8.members, "fp32 GEMMs and one that fails")
    monkeypatch.setitem(CEILING_SETS, "cpu", [required, CPU_BYTES])
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", "--json"]) == 1


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_collective_backend_is_refused_naming_the_backends_calibrate_takes(backend, h, capsys, tmp_path):
    """gloo calibrated torch-cpu's ceilings under its own name; nccl blamed backend torch, which was not passed."""
    assert main(["calibrate", "--backend", backend, "--db", "p.db"]) == 2
    err = capsys.readouterr().err
    assert f"backend {backend!r} measures collectives" in err and "ceilings are compute and memory ceilings" in err
    assert "--backend torch or torch-cpu" in err and "backend torch measures" not in err
    assert os.listdir(tmp_path) == []


def test_the_text_output_shows_a_cpu_ceiling_to_four_significant_digits(h, capsys, monkeypatch):
    """A CPU's 0.0457 TFLOP/s printed as 0.0."""
    from kprof.calibrate import Ceiling
    from kprof.cli import calibrate as verb

    found = [Ceiling("tflops", 0.045712, "single_gemm", {"m": 768}, "kprof.0123456789abcdef"),
             Ceiling("memory_bandwidth_gbps", 4812.34, "memcpy", {"bytes": 1}, "kprof.fedcba9876543210")]
    monkeypatch.setattr(verb, "run_calibrate", lambda *a, **k: ([], found))
    monkeypatch.setattr(verb, "complete", lambda *a: True)
    assert main(["calibrate", "--backend", "torch-cpu"]) == 0
    out = capsys.readouterr().out
    assert "tflops: 0.04571 TFLOP/s" in out and "memory_bandwidth_gbps: 4,812.3 GB/s" in out


def test_the_help_says_only_query_json_gives_the_fractions(capsys):
    """The help said `query reports fractions of them`, where query's table shows none: only --json's `ceiling`."""
    from kprof.cli import main

    for argv in (["--help"], ["calibrate", "--help"]):
        assert main(argv) == 0
        said = " ".join(capsys.readouterr().out.replace("│", " ").split())
        assert "query --json gives each ok row's fraction of them" in said, said


def test_cpu_ceilings_are_read_under_the_timing_named(h, monkeypatch):
    """A torch-cpu timing names its torch threads: ceilings(timing=...) of a 1-thread calibration read this process's
    thread count instead (the CPU was taken to have one method), and found none of the rows it named."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = effective_entry(lookup("single_gemm", h.CPU)).contract.timing
    h.append("p.db", *[_row(x, tflops=1.0 + i) for i, x in enumerate(CPU_GEMMS)])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ceilings(h.CPU, GPU, db="p.db") == []  # this process's rows (2 threads) do not exist
    flops = {c.metric: c for c in ceilings(h.CPU, GPU, db="p.db", timing=one)}["tflops"]
    assert flops.value == len(CPU_GEMMS) and flops.method["timing"] == one


def test_the_text_output_names_a_failed_row_s_table_and_error_in_words(h, capsys, monkeypatch):
    """A calibration whose rows failed printed `{'bytes': 67108864}: error {'kind': 'timeout', 'message': ...}`:
    no table, the error as a dict's repr, and nothing said of the ceilings it did not find."""
    from kprof.ceilings import CeilingSet

    huge = {"m": 1 << 40, "n": 64, "k": 64, "dtype": "fp32"}  # 8 TiB of inputs: oom before anything is built
    copy = {"bytes": 1 << 40}  # 1 TiB, copied: oom as well
    monkeypatch.setitem(CEILING_SETS, "cpu", [CeilingSet("tflops", (("single_gemm", huge),), "fp32 GEMMs"),
                                              CeilingSet("memory_bandwidth_gbps", (("memcpy", copy),), "copies")])
    assert main(["calibrate", "--backend", h.CPU, "--db", "p.db"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"single_gemm {huge}: error (oom: MemoryError: out of memory before building" in out
    assert f"memcpy {copy}: error (oom: " in out
    assert "'kind'" not in out and "no ceiling: no row of a calibration set is ok" in out


def test_a_calibration_of_another_thread_count_is_named_not_silently_absent(h, capsys, monkeypatch):
    """Ceilings calibrated on 1 torch thread, rows read on 2: `query --json` gave the rows no `ceiling` and said
    nothing of why (the calibration reads stale under the other count). It now says on stderr, naming both timings and
    the two fixes; the JSON document is the contract's, and the API's QueryResult carries the same note."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    h.append("p.db", *[_row(x, tflops=1.0 + i) for i, x in enumerate(CPU_GEMMS)],
             *[_row(x, table="memcpy", gbps=10.0) for x in CPU_COPIES])
    row = h.gemm(64, 64, 64)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    h.append("p.db", _row(row, tflops=0.5, gbps=1.0))
    doc = h.read_json(capsys, "query", "p.db", row, extra=["--gpu-name", GPU])
    assert set(doc) == h.QUERY_FIELDS and "ceiling" not in doc["results"][0]
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(row), "--db", "p.db", "--gpu-name", GPU,
                 "--json"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("note: no tflops or memory_bandwidth_gbps ceiling for these rows: the calibration rows of "
                          "'Test GPU' here were timed cpu-wall;l2=warm;eager;threads=1 (profiler revision 1), not "
                          "cpu-wall;l2=warm;eager;threads=2"), err
    # the calibrate it names is of this ledger: without --db it measured ./profile.db's ceilings, not p.db's
    assert "set OMP_NUM_THREADS to that count" in err and "`kprof calibrate --backend torch-cpu --db p.db`" in err
    assert api.query(h.GEMM, h.CPU, [row], gpu_name=GPU, db="p.db").ceiling_note == err
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(row), "--db", "p.db", "--gpu-name", GPU]) == 0
    assert capsys.readouterr().err == ""  # the table shows no ceiling: nothing to explain
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the calibration's own count: its ceilings, and nothing to say
    res = api.query(h.GEMM, h.CPU, [CPU_GEMMS[0]], gpu_name=GPU, db="p.db")
    assert res.results[0]["ceiling"]["fraction"]["tflops"] == 1.0 / 3.0 and res.ceiling_note is None
    # a CUDA calibration timed with events, rows read under the default timer: the read's own flags measure it
    cupti = effective_entry(lookup(h.GEMM, "torch")).contract.timing
    h.append("p.db", *[_row(x, backend="torch", timing="events;l2=cold;eager", tflops=100.0)
                       for _t, x in GPU_FLOPS.members], _row(h.gemm(dtype="bf16"), backend="torch", timing=cupti))
    note = api.query(h.GEMM, "torch", [h.gemm(dtype="bf16")], gpu_name=GPU, db="p.db").ceiling_note
    assert f"were timed events;l2=cold;eager (profiler revision {GPU_REVISION}), not cupti;l2=cold;eager" in note, note
    assert note.endswith("; with this read's --timer, --l2, --cuda-graph and --power, `kprof calibrate --backend "
                         "torch --db p.db` measures the ceilings under this one"), note



def test_the_calibrate_a_ceiling_note_names_quotes_its_ledger_as_a_shell_takes_it(h, monkeypatch):
    """The note of a calibration timed another way named `kprof calibrate ... --db my runs/p.db`: copied, the shell
    reads --db my and a stray argument. The path is quoted, as the unknown GPU key's commands quote it."""
    import shlex

    db = "my runs/p.db"
    os.mkdir("my runs")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    h.append(db, *[_row(x, tflops=1.0 + i) for i, x in enumerate(CPU_GEMMS)],
             *[_row(x, table="memcpy", gbps=10.0) for x in CPU_COPIES])
    row = h.gemm(64, 64, 64)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    h.append(db, _row(row, tflops=0.5, gbps=1.0))
    note = api.query(h.GEMM, h.CPU, [row], gpu_name=GPU, db=db).ceiling_note
    command = note[note.rindex("`kprof calibrate"):].split("`")[1]
    assert shlex.split(command) == ["kprof", "calibrate", "--backend", "torch-cpu", "--db", db], note

def test_a_calibration_of_an_older_revision_says_so_not_to_set_the_thread_count(h, capsys, monkeypatch):
    """Ceilings calibrated by an older kprof (an older profiler revision), rows read on the same thread count: the note
    told to set OMP_NUM_THREADS to the count it already had. It says the calibration is of an older revision, and
    that `kprof calibrate` measures the ceilings again."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    old = [msgspec.structs.replace(e, provenance=msgspec.structs.replace(e.provenance, profiler_revision=0))
           for e in [_row(x, tflops=2.0) for x in CPU_GEMMS] + [_row(x, table="memcpy", gbps=10.0) for x in CPU_COPIES]]
    row = h.gemm(64, 64, 64)
    h.append("p.db", *[measured(e.provenance, e.metrics, e.stats, e.method) for e in old], _row(row, tflops=0.5))
    note = api.query(h.GEMM, h.CPU, [row], gpu_name=GPU, db="p.db").ceiling_note
    assert ("were timed cpu-wall;l2=warm;eager;threads=1 (profiler revision 0), not cpu-wall;l2=warm;eager;threads=1 "
            "(profiler revision 1); they are of an older profiler revision (stale): `kprof calibrate --backend "
            "torch-cpu --db p.db` measures the ceilings under this one") in note, note
    assert "OMP_NUM_THREADS" not in note


def test_calibrate_on_a_busy_host_says_its_ceilings_may_be_low(h, capsys, monkeypatch):
    """A calibration timed while other work took the host's cores (a 2-core host beside a busy loop read its GEMM
    ceiling 7x low) exited 0 and said so only as `busy over 3 row(s)` at the end of a method line, nothing at all with
    --json, where `run` prints a note: every row then read several times its ceiling. It now notes it on stderr, with
    the command that measures the ceilings again: of this ledger (the command named none, so after `calibrate --db
    team.db` it measured ./profile.db's ceilings and left team.db's low)."""
    busy = {"host_load_1m": "4.20", "host_busy": "load 4.20 over 2 cores: other work shared them"}
    h.append("p.db", _row(CPU_GEMMS[0], tflops=3.0, notes=busy), _row(CPU_GEMMS[1], tflops=2.0),
             *[_row(x, table="memcpy", gbps=10.0, notes={"host_load_1m": "0.50"}) for x in CPU_COPIES])
    found = ceilings(h.CPU, GPU, db="p.db")
    from kprof.cli import calibrate as verb

    ran = SimpleNamespace(table=h.GEMM, gpu_name=GPU, db="p.db", results=[], measured=0, seconds=0.0)
    monkeypatch.setattr(verb, "run_calibrate", lambda *a, **k: ([ran], found))
    monkeypatch.setattr(verb, "complete", lambda *a: True)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for json_flag in ([], ["--json"]):
        assert main(["calibrate", "--backend", "torch-cpu", "--db", "p.db", *json_flag]) == 0
        err = " ".join(capsys.readouterr().err.split())
        assert err == ("note: other work took the host's cores while rows behind these ceilings were timed (tflops 1 "
                       "of 2 row(s), their notes say host_busy): the ceilings may be low, and rows read above them; "
                       "measure them again on a quieter host with `kprof calibrate --backend torch-cpu --db p.db "
                       "--force`"), err
    quiet = [c for c in found if c.metric == "memory_bandwidth_gbps"]
    monkeypatch.setattr(verb, "run_calibrate", lambda *a, **k: ([ran], quiet))
    assert main(["calibrate", "--backend", "torch-cpu"]) == 0
    assert capsys.readouterr().err == ""



def test_the_calibrate_a_busy_host_note_names_keeps_the_thread_count_the_environment_chose(h, capsys, monkeypatch):
    """`OMP_NUM_THREADS=4 kprof calibrate --backend torch-cpu` on a busy host named `kprof calibrate --backend torch-cpu
    --db p.db --force`: pasted where the variable is unset, it calibrates at the default thread count, another timing,
    and the 4-thread ceilings stay low. The command begins with the thread variable that chose the count."""
    import shlex

    busy = {"host_load_1m": "4.20", "host_busy": "load 4.20 over 2 cores: other work shared them"}
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    h.append("p.db", _row(CPU_GEMMS[0], tflops=3.0, notes=busy), _row(CPU_GEMMS[1], tflops=2.0),
             *[_row(x, table="memcpy", gbps=10.0) for x in CPU_COPIES])
    found = ceilings(h.CPU, GPU, db="p.db")
    from kprof.cli import calibrate as verb

    ran = SimpleNamespace(table=h.GEMM, gpu_name=GPU, db="p.db", results=[], measured=0, seconds=0.0)
    monkeypatch.setattr(verb, "run_calibrate", lambda *a, **k: ([ran], found))
    monkeypatch.setattr(verb, "complete", lambda *a: True)
    assert main(["calibrate", "--backend", "torch-cpu", "--db", "p.db"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert shlex.split(err[err.rindex("with `"):].split("`")[1]) == [
        "OMP_NUM_THREADS=4", "kprof", "calibrate", "--backend", "torch-cpu", "--db", "p.db", "--force"], err


def test_the_calibrate_a_busy_host_note_names_is_the_command_as_typed(h, capsys, monkeypatch):
    """`OMP_NUM_THREADS=4 python -m launcher kernel-profile calibrate --backend torch-cpu` on a busy host named
    `OMP_NUM_THREADS=4 kprof calibrate ...`: the launcher's user may have no `kprof` (every other command a message
    names is the launcher's there; this one, begun by the thread variable, was left as it was). It is as typed."""
    import shlex
    import sys

    busy = {"host_load_1m": "4.20", "host_busy": "load 4.20 over 2 cores: other work shared them"}
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    h.append("p.db", _row(CPU_GEMMS[0], tflops=3.0, notes=busy), _row(CPU_GEMMS[1], tflops=2.0),
             *[_row(x, table="memcpy", gbps=10.0) for x in CPU_COPIES])
    found = ceilings(h.CPU, GPU, db="p.db")
    from kprof.cli import calibrate as verb

    ran = SimpleNamespace(table=h.GEMM, gpu_name=GPU, db="p.db", results=[], measured=0, seconds=0.0)
    monkeypatch.setattr(verb, "run_calibrate", lambda *a, **k: ([ran], found))
    monkeypatch.setattr(verb, "complete", lambda *a: True)
    launcher = (sys.executable, "-m", "launcher", "kernel-profile")
    assert main(["calibrate", "--backend", "torch-cpu", "--db", "p.db"], prog=launcher) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert shlex.split(err[err.rindex("with `"):].split("`")[1]) == [
        "OMP_NUM_THREADS=4", *launcher, "calibrate", "--backend", "torch-cpu", "--db", "p.db", "--force"], err

def test_ceilings_of_a_db_that_names_no_ledger_raise_as_every_read_does(h, monkeypatch):
    """`ceilings(db=...)` of a mistyped path answered [], as for a ledger never calibrated, where every other read
    (api.query, perf_api) raises LedgerPathError naming the path. A calibration that stored nothing (every spec
    unavailable: no ledger file) still finds no ceiling rather than a path error."""
    from kprof.errors import LedgerPathError

    with pytest.raises(LedgerPathError, match="no ledger at typo.db"):
        ceilings(h.CPU, GPU, db="typo.db")
    nothing = SimpleNamespace(gpu_name=GPU, db="never.db", results=[])
    monkeypatch.setattr(api, "run", lambda *a, **k: nothing)
    assert calibrate(h.CPU) == ([nothing, nothing], []) and not os.path.exists("never.db")


def test_calibrate_says_how_many_rows_it_measured_and_that_a_second_one_measured_none(h, capsys, monkeypatch):
    """A second calibration (on a quieter host, say) read the first's rows and printed the same ceilings as if it had
    measured them: nothing told the two apart. Its output now counts the specs it measured, and where none, says
    --force measures them again."""
    from kprof.ceilings import CeilingSet

    monkeypatch.setitem(CEILING_SETS, "cpu", [CeilingSet("tflops", (("single_gemm", h.gemm()),), "fp32 GEMMs"),
                                              CeilingSet("memory_bandwidth_gbps", (("memcpy", {"bytes": 1 << 16}),),
                                                         "copies")])
    outs = []
    for force in ([], [], ["--force"]):
        assert main(["calibrate", "--backend", h.CPU, "--db", "p.db", *force]) == 0
        outs.append(capsys.readouterr().out.splitlines()[-1])
    assert outs[0].startswith("measured 2 of 2 calibration spec(s) in ") and outs[2].startswith("measured 2 of 2 ")
    assert outs[1] == "measured nothing: all 2 calibration spec(s) have rows in the ledger; --force measures them again"


def test_a_fresh_run_gives_its_rows_their_fractions_of_the_ceilings(h, local_gpu):
    """`run --fresh` (measure, store nothing) gave its ok rows no `ceiling` where `run` and `query` give the same rows
    theirs: trying a kernel against the device's ceilings without storing it read as "never calibrated"."""
    h.append("p.db", *[_row(x, gpu=local_gpu, tflops=1.0 + i) for i, x in enumerate(CPU_GEMMS)])
    before = h.digest("p.db")
    (doc,) = api.run(h.GEMM, h.CPU, [h.gemm()], mode="fresh", db="p.db").results
    assert doc["status"] == "ok" and doc["citation"] is None and h.digest("p.db") == before
    assert doc["ceiling"]["values"] == {"tflops": 3.0}
    assert doc["ceiling"]["fraction"] == {"tflops": doc["metrics"]["tflops"] / 3.0}


def test_the_calibrate_an_older_revision_note_names_measures_under_the_read_s_timer(h, capsys):
    """CUDA ceilings calibrated with events by an older kprof, rows read with `--timer events`: the note said
    `kprof calibrate --backend torch --db p.db`, which measures under the default timer (cupti), so the same query
    still had no ceiling after it. The command it names carries the read's method flags."""
    old = [msgspec.structs.replace(e, provenance=msgspec.structs.replace(e.provenance,
                                                                       profiler_revision=GPU_REVISION - 1))
           for e in [_row(x, backend="torch", timing="events;l2=cold;eager", tflops=100.0) for _t, x in
                     GPU_FLOPS.members]]
    row = h.gemm(dtype="bf16")
    h.append("p.db", *[measured(e.provenance, e.metrics, e.stats, e.method) for e in old],
             _row(row, backend="torch", timing="events;l2=cold;eager"))
    assert main(["query", h.GEMM, "--backend", "torch", *h.spec_args(row), "--db", "p.db", "--gpu-name", GPU,
                 "--timer", "events", "--json"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert (f"were timed events;l2=cold;eager (profiler revision {GPU_REVISION - 1}), not events;l2=cold;eager "
            f"(profiler revision {GPU_REVISION}); they are of an older profiler revision (stale): `kprof calibrate "
            f"--backend torch --db p.db --timer events` measures the ceilings under this one") in err, err
