"""The pure logic of tests/benchmarks/protocol_check.py (the GPU script itself runs on a GPU only): its spec
sets, its statistics, its verdict table and its time estimate. No GPU, no torch."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import msgspec
import pytest

from kprof.runners.registry import entries, lookup

_PATH = os.path.join(os.path.dirname(__file__), "protocol_check.py")
_spec = importlib.util.spec_from_file_location("protocol_check", _PATH)
pc = importlib.util.module_from_spec(_spec)
sys.modules["protocol_check"] = pc
_spec.loader.exec_module(pc)


def _valid(table: str, spec: dict) -> None:
    msgspec.convert(spec, lookup(table, "torch").args)  # raises on an unknown field, a bad type or value


def _distinct(specs: list[dict]) -> bool:
    return len({json.dumps(s, sort_keys=True) for s in specs}) == len(specs)


def test_the_gemm_set_is_40_distinct_valid_bf16_specs():
    specs = pc.gemm_specs()
    assert len(specs) == 40 and _distinct(specs)
    for s in specs:
        _valid("single_gemm", s)
    assert {s["dtype"] for s in specs} == {"bf16"}
    assert {s["m"] for s in specs} == {1, 8, 64, 2048, 4096, 8192}
    assert pc.gemm(4096, 4096, 4096) in specs and pc.BIG in specs
    # every layer GEMM of both models at every decode and prefill size, but the one 8192^3 replaces
    for model in (pc.LLAMA3_8B, pc.QWEN25_7B):
        for n, k in model.values():
            sizes = {s["m"] for s in specs if (s["n"], s["k"]) == (n, k)}
            expected = set(pc.DECODE_M + pc.PREFILL_M)
            assert sizes == (expected - {4096} if (n, k) == pc.QWEN25_7B["gate_up"] else expected)


def test_the_quick_gemm_set_is_a_small_subset_with_both_big_gemms():
    quick, full = pc.gemm_specs(quick=True), pc.gemm_specs()
    assert 4 <= len(quick) <= 12 and _distinct(quick)
    assert all(s in full for s in quick)
    assert pc.gemm(4096, 4096, 4096) in quick and pc.BIG in quick
    assert any(s["m"] in pc.DECODE_M for s in quick) and any(s["m"] in pc.PREFILL_M for s in quick)


def test_the_sweep_is_100_valid_specs_covering_every_table():
    sweep = pc.sweep_specs()
    assert sum(map(len, sweep.values())) == 100
    assert set(sweep) == {e.table for e in entries() if e.backend == "torch"}  # every table of backend torch
    for table, specs in sweep.items():
        assert specs and _distinct(specs), table
        for s in specs:
            _valid(table, s)
    dtypes = {s["dtype"] for s in sweep["single_gemm"]}
    assert dtypes == {"bf16", "fp8_e4m3"}
    # what the runners refuse at build time: fp8 needs n, k % 16; the grouped GEMM bf16 and hidden % 8
    assert all(s["n"] % 16 == 0 and s["k"] % 16 == 0 for s in sweep["single_gemm"] if s["dtype"] == "fp8_e4m3")
    assert all(s["dtype"] == "bf16" and s["hidden"] % 8 == 0 for s in sweep["moe_grouped_gemm"])
    # mixed sizes: decode-sized and prefill-sized work in the same tables
    assert min(s["m"] for s in sweep["single_gemm"]) == 1 and max(s["m"] for s in sweep["single_gemm"]) >= 4096
    assert min(s["tokens"] for s in sweep["rms_norm"]) == 1 and max(s["tokens"] for s in sweep["rms_norm"]) >= 8192


def test_the_quick_sweep_still_covers_every_table_and_dtype():
    quick, full = pc.sweep_specs(quick=True), pc.sweep_specs()
    assert set(quick) == set(full)
    assert all(quick[t] and all(s in full[t] for s in quick[t]) for t in full)
    assert {s["dtype"] for s in quick["single_gemm"]} == {"bf16", "fp8_e4m3"}
    assert sum(map(len, quick.values())) < 25


def test_the_energy_specs_are_a_decode_a_mid_and_the_big_gemm():
    small, mid, big = pc.energy_specs()
    for s in (small, mid, big):
        _valid("single_gemm", s)
    assert small["m"] == 1 and 1 < mid["m"] < big["m"] and big == pc.BIG


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert pc.percentile(xs, 0) == 1.0 and pc.percentile(xs, 100) == 5.0
    assert pc.percentile(xs, 50) == 3.0
    assert pc.percentile(xs, 95) == pytest.approx(4.8)
    assert pc.percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        pc.percentile([], 50)


def test_spread_is_range_over_median():
    assert pc.spread([1.0, 1.02, 0.99, 1.01]) == pytest.approx(0.03 / 1.005)
    assert pc.spread([2.0, 2.0, 2.0, 2.0]) == 0.0
    assert pc.spread([1.0, 1.0, 1.0, 1.5]) == pytest.approx(0.5)  # the median, not the mean


def test_spread_summary_over_specs_measured_in_every_pass():
    times = [[1.0, 1.01, 1.0, 1.0],  # 1 %
             [2.0, 2.0, 2.0, 2.0],  # 0
             [1.0, 1.05, 1.0, 1.0],  # 5 %: the worst
             [1.0, None, 1.0, 1.0],  # a pass failed: incomplete, left out
             [3.0, 3.03, 3.0, 3.0]]  # 1 %
    s = pc.spread_summary(times)
    assert (s["specs"], s["incomplete"], s["worst"]) == (4, 1, 2)
    assert s["max"] == pytest.approx(0.05)
    assert s["p50"] == pytest.approx(0.01)
    assert s["p95"] == pytest.approx(0.01 + 0.85 * 0.04)  # between the 1 % and the 5 % spreads
    assert s["spreads"][3] is None
    empty = pc.spread_summary([[None, 1.0]])
    assert (empty["specs"], empty["incomplete"], empty["p95"], empty["max"]) == (0, 1, None, None)


def test_ratio_summary_splits_at_20_us():
    pairs = [(0.010, 0.013),  # 10 µs, +30 %: small
             (0.050, 0.051),  # 50 µs, +2 %
             (1.000, 0.970),  # 1 ms, -3 %: the worst large one
             (0.020, 0.020),  # exactly 20 µs: large
             (None, 0.5)]  # a side failed
    r = pc.ratio_summary(pairs)
    assert r["incomplete"] == 1
    assert (r["large"]["n"], r["small"]["n"]) == (3, 1)
    assert r["large"]["max_dev"] == pytest.approx(0.03) and r["large"]["worst"] == 2
    assert r["small"]["max_dev"] == pytest.approx(0.30) and r["small"]["worst"] == 0
    assert r["large"]["median_ratio"] == pytest.approx(1.0)
    assert r["all"]["n"] == 4 and r["all"]["max_dev"] == pytest.approx(0.30)
    none = pc.ratio_summary([(None, None)])
    assert none["large"]["max_dev"] is None and none["all"]["max_dev"] is None
    assert "multi" not in r  # no kernel counts: no split-K group


def test_ratio_summary_keeps_split_k_calls_apart():
    """A two-kernel call's events span the launch gap between its kernels: its own group, shown, not held to
    the one-kernel target; the small calls stay small whatever their kernel count."""
    pairs = [(0.0357, 0.0384), (0.050, 0.051), (0.010, 0.0103), (0.0302, 0.0307)]
    r = pc.ratio_summary(pairs, kernels=[2, 1, 2, None])
    assert (r["large"]["n"], r["multi"]["n"], r["small"]["n"]) == (2, 1, 1)
    assert r["multi"]["max_dev"] == pytest.approx(0.0384 / 0.0357 - 1) and r["multi"]["worst"] == 0
    assert r["large"]["max_dev"] == pytest.approx(0.02) and r["large"]["worst"] == 1
    assert r["all"]["n"] == 4


GOOD = {"a": {"spread": {"p95": 0.012, "max": 0.031}},
        "b": {"ratios": {"large": {"max_dev": 0.021}, "small": {"max_dev": 0.4}}},
        "c": {"ratios": {"all": {"max_dev": 0.029}}, "reference_drift": {"all": {"max_dev": 0.011}}},
        "d": {"wall_per_spec_s": 0.31, "energy_rows": 97, "ok_rows": 100},
        "e": {"max_dev": 0.04},
        "f": {"max_abs_drift": 0.012, "max_fraction": 0.987}}


def test_verdicts_meet_every_target_when_the_figures_do():
    rows = pc.verdicts(GOOD, wall_s=300.0)
    assert [r.case for r in rows] == ["a", "a", "b", "b", "b", "c", "c", "d", "d", "e", "f", "f", "all"]
    assert [r.met for r in rows] == ["yes", "yes", "yes", "-", "-", "yes", "-", "yes", "-", "yes", "yes", "yes",
                                     "yes"]
    by = {(r.case, r.target): r.result for r in rows}
    assert by[("a", "p95 spread over 4 passes <= 2 %")] == "1.20 %"
    assert by[("d", "fill wall per spec <= 0.35 s")] == "0.310 s"
    assert by[("c", "|eager after/eager before - 1|, every spec, max (shown)")] == "1.10 %"
    assert by[("d", "ok rows with energy_j (shown)")] == "97 of 100"
    assert by[("f", "max ceiling fraction of ok rows <= 1.0")] == "0.9870"


def test_verdicts_fail_a_missed_target_a_missing_figure_and_an_error():
    bad = json.loads(json.dumps(GOOD))
    bad["a"]["spread"]["max"] = 0.041
    bad["c"]["ratios"]["all"]["max_dev"] = None  # nothing measured
    bad["e"] = {"error": "NvmlError: the energy counter did not advance\nmore"}
    bad["f"]["max_fraction"] = 1.0001
    rows = pc.verdicts(bad, wall_s=700.0)
    met = {(r.case, r.target): r.met for r in rows}
    assert met[("a", "max spread over 4 passes <= 4 %")] == "no"
    assert met[("a", "p95 spread over 4 passes <= 2 %")] == "yes"
    assert met[("c", "|graph/eager - 1|, every spec, max <= 3 %")] == "no"
    assert met[("f", "max ceiling fraction of ok rows <= 1.0")] == "no"
    assert met[("all", "total wall <= 600 s")] == "no"
    (e,) = [r for r in rows if r.case == "e"]
    assert e.met == "no" and e.result == "error: NvmlError: the energy counter did not advance"


def test_verdicts_list_only_the_cases_run():
    rows = pc.verdicts({"b": GOOD["b"], "e": GOOD["e"]})
    assert [r.case for r in rows] == ["b", "b", "b", "e"]


def test_the_table_is_aligned_and_ends_with_the_last_verdict():
    text = pc.render(pc.verdicts(GOOD, wall_s=300.0))
    lines = text.splitlines()
    assert lines[0].split() == ["case", "target", "result", "met"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert len(lines) == 2 + 13
    col = lines[0].index("result")
    assert all(line[col - 2:col] == "  " for line in lines[2:])  # one column start for every row
    assert lines[-1].startswith("all") and lines[-1].endswith("yes")


def test_the_estimate_fits_the_budget_and_quick_is_shorter():
    full, quick = pc.estimate_seconds(pc.CASES, False), pc.estimate_seconds(pc.CASES, True)
    assert set(full) == set(pc.CASES) | {"total"}
    assert quick["total"] <= pc.STAGE_S  # a smoke run of every case fits the protocol stage's default limit
    assert quick["total"] < full["total"] / 2
    assert full["total"] == pytest.approx(pc.EST_STARTUP_S + sum(full[c] for c in pc.CASES), abs=0.1)
    # case f measures its own rows only when case a did not
    assert pc.estimate_seconds("f", False)["f"] > full["f"]


def test_the_estimate_counts_the_gemms_that_run_a_capped_row_dearer(tmp_path, monkeypatch):
    """--prefill-only runs cases a-c on 16 of the 40 GEMMs: the estimate counted all 40 (run 85: 146 s said, case a
    alone took 180 s), and costed a power-capped row as a decode one."""
    prefill = [g for g in pc.gemm_specs(False) if g["m"] not in pc.DECODE_M]
    load_s, idle_s, _ref, _n = pc._sizes(False)
    assert pc.estimate_seconds("a", False, prefill)["a"] == pytest.approx(4 * 16 * pc.EST_CAPPED_S + load_s + idle_s)
    assert pc.estimate_seconds("a", False)["a"] == pytest.approx(4 * (24 * pc.EST_DECODE_S + 16 * pc.EST_CAPPED_S)
                                                                 + load_s + idle_s)
    # main estimates the GEMMs it runs (case a itself stubbed: nothing runs on a GPU)
    monkeypatch.setattr(pc, "case_a", lambda ctx, specs, quick: {"specs": specs})
    assert pc.main(["--cases", "a", "--prefill-only", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "protocol_check.json").read_text())
    assert doc["cases"]["a"]["specs"] == prefill
    assert doc["config"]["estimate_s"] == pc.estimate_seconds("a", False, prefill)


def test_cases_over_the_stage_limit_are_split_into_calls_that_fit_it():
    assert pc.budget_note(pc.CASES, True) is None
    note = pc.budget_note(pc.CASES, False)
    assert note is not None and f"{pc.STAGE_S:.0f} s" in note
    calls = [c.split(",") for c in note.split(": ")[-1].replace("--cases ", "").split(", then ")]
    assert "".join(x for call in calls for x in call) == pc.CASES
    assert all(pc.estimate_seconds("".join(call), False)["total"] <= pc.STAGE_S for call in calls)


def test_cases_are_parsed_in_order_and_checked():
    assert pc.parse_cases("c,a, b") == "abc"
    assert pc.parse_cases("F") == "f"
    for bad in ("a,g", "", ","):
        with pytest.raises(SystemExit):
            pc.parse_cases(bad)


def test_compact_keeps_the_figures_of_an_ok_row_and_an_error():
    ok = {"spec": {"m": 1}, "status": "ok", "metrics": {"time_ms": 0.5, "energy_j": 0.1, "tflops": 2.0,
                                                          "memory_bandwidth_gbps": 3.0},
          "stats": {"n": 10, "cv": 0.01}, "citation": "kprof.x", "event": "ab", "provenance": {"timing": "t"}}
    row = pc.compact(ok)
    assert (row["time_ms"], row["energy_j"], row["gbps"], row["n"], row["timing"]) == (0.5, 0.1, 3.0, 10, "t")
    assert pc._ok_time(row) == 0.5
    err = pc.compact({"spec": {}, "status": "error", "metrics": None, "stats": None, "error": {"kind": "oom"}})
    assert err["time_ms"] is None and pc._ok_time(err) is None and err["error"] == {"kind": "oom"}


def test_a_mode_is_compared_with_the_mean_of_the_reference_rows_around_it():
    """Cases b and c: the reference of each spec is the mean of the default rows taken just before and just after
    the other mode's row, so a drift of the row between them is split, not charged to the mode; a failed row on
    any side leaves the spec out (incomplete)."""
    before = [1.000, 0.050, None, 0.010]
    after = [1.040, 0.050, 0.5, 0.010]
    other = [1.020, 0.051, 0.5, None]
    pairs = pc.bracketed_pairs(before, after, other)
    assert pairs[0] == (pytest.approx(1.020), 1.020)
    assert pairs[1] == (pytest.approx(0.050), 0.051)
    assert pairs[2] == (None, None) and pairs[3][1] is None
    r = pc.ratio_summary(pairs)
    assert r["incomplete"] == 2
    assert r["large"]["max_dev"] == pytest.approx(0.02) and r["large"]["worst"] == 1
    with pytest.raises(ValueError):
        pc.bracketed_pairs(before, after, other[:2])


def test_the_bracketed_order_runs_the_reference_first_and_last():
    names = [name for name, _method in pc.BRACKET]
    assert names[0] == "eager_before" and names[-1] == "eager_after" and set(names[1:-1]) == {"events", "graph"}
    assert dict(pc.BRACKET)["events"] == {"timer": "events"} and dict(pc.BRACKET)["graph"] == {"cuda_graph": True}
    assert dict(pc.BRACKET)["eager_before"] == dict(pc.BRACKET)["eager_after"] == {}


def test_where_the_time_went_sums_only_notes_that_are_time_spent(tmp_path):
    """case d's breakdown adds up every *_s note of the measured rows, but not settings or a position inside the
    energy window (energy_fit_from_s lies within energy_window_s)."""
    from kprof import synth
    from kprof.ledger import Ledger

    notes = {"warmup_s": "0.25", "sample_s": "0.5", "energy_window_s": "0.3", "energy_fit_from_s": "0.1",
             "capped_sample_s": "0.5", "capped_max_sample_s": "3.0", "state": "sustained, boost"}
    events = []
    for i in range(3):
        ev = synth.event(i)
        events.append(msgspec.structs.replace(ev, method=msgspec.structs.replace(ev.method, notes=notes)))
    db = str(tmp_path / "d.db")
    with Ledger.open(db) as ledger:
        ledger.append(events)
    assert pc._notes_seconds(db) == {"energy_window_s": 0.9, "sample_s": 1.5, "warmup_s": 0.75}
