"""CPU tests of tests/benchmarks/model_step.py: its layers map onto kprof specs, its kernel-to-op assignment,
its composition and verdict arithmetic, and the whole per-phase pipeline on an emulated device (every
dispatched torch op stands in for a kernel; CUDA graphs replay the names they captured)."""

from __future__ import annotations

import importlib.util
import os
import sys
import tarfile
import time

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _load():
    spec = importlib.util.spec_from_file_location("model_step", os.path.join(HERE, "model_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ms = _load()
import _decoder as dec  # noqa: E402  (model_step put its directory on sys.path)

from kprof.runners.registry import lookup  # noqa: E402
from kprof.specs import validate  # noqa: E402

TINY_DENSE = dec.Config("tiny-dense", hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16)
TINY_MOE = dec.Config("tiny-moe", hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2)
DECODE = dec.Phase("decode_b3", "decode", 3, 32)
PREFILL = dec.Phase("prefill_24", "prefill", 1, 24)
DECODE_24 = dec.Phase("decode_b24", "decode", 24, 32)  # 24 tokens, as PREFILL: the same GEMM and norm specs


# ----- (a) the layers and their kprof specs -------------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY_DENSE, TINY_MOE], ids=lambda c: c.name)
@pytest.mark.parametrize("ph", [DECODE, PREFILL], ids=lambda p: p.name)
def test_tiny_layer_runs_on_cpu_and_makes_exactly_its_kprof_calls(cfg, ph):
    model = dec.Model(cfg, 2, "cpu")
    buf = model.buffers(ph)
    trace = dec.Trace()
    x = dec.run_layer(model.layer(0, ph, buf, buf.x0, dec.Calls(trace)), trace.mark)
    assert x.shape == (ph.tokens, cfg.hidden) and x.dtype == torch.bfloat16 and torch.isfinite(x).all()
    ops = dec.layer_ops(cfg, ph)
    layouts = dec.check_trace(ops, trace)
    assert set(layouts) == {o.name for o in ops if o.table}
    for o in ops:
        if o.table:  # every covered op's spec is a valid spec of the CUDA table, exactly as canonicalized
            assert validate(lookup(o.table, "torch").args, [o.spec]) == [o.spec]
    # the GEMM operands and norm inputs have the runners' layout: contiguous row-major
    gemms = [lay for lay in layouts.values() if "a_contiguous" in lay]
    assert gemms and all(lay["a_contiguous"] and lay["b_contiguous"] for lay in gemms)
    y = model.forward(ph, buf, dec.Calls())
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_layers_differ_and_weights_are_scaled():
    model = dec.Model(TINY_DENSE, 2, "cpu")
    a, b = model.weights
    assert not torch.equal(a.wqkv, b.wqkv)
    assert abs(a.w_up.float().std().item() * TINY_DENSE.hidden ** 0.5 - 1) < 0.1  # N(0, 1)/sqrt(fan_in)
    assert (a.attn_norm.float() - 1).abs().max() < 0.6  # norm weights around 1, never zero


def test_check_trace_refuses_a_layer_that_differs_from_its_op_list():
    model = dec.Model(TINY_DENSE, 1, "cpu")
    buf = model.buffers(DECODE)
    trace = dec.Trace()
    dec.run_layer(model.layer(0, DECODE, buf, buf.x0, dec.Calls(trace)), trace.mark)
    ops = dec.layer_ops(TINY_DENSE, DECODE)
    wrong = [o._replace(spec={**o.spec, "n": o.spec["n"] + 1}) if o.name == "qkv" else o for o in ops]
    with pytest.raises(dec.LayerMismatch, match="'qkv' called single_gemm"):
        dec.check_trace(wrong, trace)
    with pytest.raises(dec.LayerMismatch, match="announced ops"):
        dec.check_trace(ops[:-1], trace)
    uncovered_gemm = [o._replace(table=None, spec=None) if o.name == "o" else o for o in ops]
    with pytest.raises(dec.LayerMismatch, match="uncovered op 'o'"):
        dec.check_trace(uncovered_gemm, trace)


def test_moe_ffn_matches_a_per_token_oracle():
    cfg, ph = TINY_MOE, dec.Phase("decode_b7", "decode", 7, 8)
    model = dec.Model(cfg, 1, "cpu")
    buf = model.buffers(ph)
    w = model.weights[0]
    h = torch.randn(ph.tokens, cfg.hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(7))
    got = dec.run_layer(model._moe(ph, w, h, buf, dec.Calls())).float()
    i = cfg.intermediate
    w13, w2 = w.w_up.transpose(-2, -1).float(), w.w_down.transpose(-2, -1).float()  # [E, 2I, H], [E, H, I]
    checked = 0
    for t in range(ph.tokens):
        logits = (h[t:t + 1] @ w.router).float() + w.router_bias.float()  # bf16 GEMM, as the layer rounds it
        ranked = logits[0].sort(descending=True).values
        if ranked[cfg.topk - 1] - ranked[cfg.topk] < 0.02 * ranked[cfg.topk - 1].abs() + 0.01:
            continue  # a near tie for the last expert: the layer's rounding may pick either one
        checked += 1
        top_w, top_i = torch.softmax(logits, -1)[0].topk(cfg.topk)
        top_w = top_w / top_w.sum()
        want = torch.zeros(cfg.hidden)
        for weight, e in zip(top_w, top_i.tolist()):
            gu = w13[e] @ h[t].float()
            want += weight * (w2[e] @ (torch.nn.functional.silu(gu[:i]) * gu[i:]))
        assert torch.allclose(got[t], want, rtol=0.05, atol=0.05 * want.abs().max().item()), t
    assert checked >= ph.tokens - 2


def test_real_configs_map_to_valid_kprof_specs():
    for cfg in dec.CONFIGS.values():
        for ph in dec.PHASES.values():
            for o in dec.layer_ops(cfg, ph):
                if o.table:
                    assert validate(lookup(o.table, "torch").args, [o.spec]) == [o.spec], (cfg.name, ph.name, o)
    qwen = {o.name: o.spec for o in dec.layer_ops(dec.CONFIGS["qwen2.5-7b"], dec.PHASES["decode_b8"])}
    assert qwen["qkv"] == {"m": 8, "n": 4608, "k": 3584, "dtype": "bf16"}
    assert qwen["gate_up"]["n"] == 37888 and qwen["down"] == {"m": 8, "n": 3584, "k": 18944, "dtype": "bf16"}
    assert qwen["attention"]["kv_len"] == 2048 and qwen["attention"]["num_kv_heads"] == 4
    mix = {o.name: o.spec for o in dec.layer_ops(dec.CONFIGS["mixtral-8x7b"], dec.PHASES["prefill_2048"])}
    assert mix["moe_gate_up"] == {"tokens": 2048, "experts": 8, "topk": 2, "hidden": 4096, "intermediate": 28672,
                                  "dtype": "bf16"}
    assert mix["moe_down"]["hidden"] == 14336 and mix["moe_down"]["intermediate"] == 4096
    assert mix["moe_silu_mul"] == {"tokens": 4096, "hidden": 14336, "dtype": "bf16"}
    assert mix["router"] == {"m": 2048, "n": 8, "k": 4096, "dtype": "bf16"}
    assert mix["attention"]["causal"] is True and mix["attention"]["seq_len"] == 2048


# ----- (b) kernel records -> ops ------------------------------------------------------------------------

SEQ = [("norm", ["rms"]), ("gemm", ["nvjet_splitK", "splitKreduce_kernel"]), ("view", []), ("add", ["add"])]


def _records(names_per_layer, layers, iterations, dur=lambda i: 10 + i % 7, start=1000):
    out, t = [], start
    for i in range(layers * iterations * len(names_per_layer)):
        d = dur(i)
        out.append((names_per_layer[i % len(names_per_layer)], t, t + d, i))
        t += d + 3
    return out


def test_assign_windows_groups_kernels_by_op_and_skips_work_outside():
    marks = [("norm", 100), ("gemm", 200), ("view", 300), ("add", 310), (dec.END, 400)]
    kernels = [("warmup", 10, 90, 0), ("rms", 110, 150, 1), ("nvjet_splitK", 210, 250, 2),
               ("splitKreduce_kernel", 255, 290, 3), ("add", 320, 390, 4), ("later", 500, 600, 5)]
    found = ms.assign_windows(list(reversed(kernels)), marks)
    assert ms.sequence_of(found, ["norm", "gemm", "view", "add"]) == SEQ
    with pytest.raises(ms.KernelMismatch, match="not inside one op's window"):
        ms.assign_windows(kernels + [("straddle", 280, 305, 6)], marks)


def test_split_layers_cuts_by_count_and_times_each_op():
    names = ["rms", "nvjet_splitK", "splitKreduce_kernel", "add"]
    kernels = _records(names, layers=3, iterations=2)
    chunks = ms.split_layers(list(reversed(kernels)), SEQ, 3, 2, "test")
    assert len(chunks) == 6 and all([k[0] for k in c] == names for c in chunks)
    samples = ms.op_samples(chunks, SEQ, 3, skip_first_layer=True)
    assert set(samples) == {"norm", "gemm", "view", "add"}
    assert all(len(v) == 4 for v in samples.values())  # 2 iterations x layers 1 and 2
    durations = [k[2] - k[1] for k in kernels]
    kept = [c for c in range(6) if c % 3]
    assert samples["gemm"] == [(durations[4 * c + 1] + durations[4 * c + 2]) / 1e3 for c in kept]  # split-K: both
    assert samples["view"] == [0.0] * 4
    assert ms.op_samples(chunks, SEQ, 3, skip_first_layer=False)["norm"] == [durations[4 * c] / 1e3 for c in range(6)]
    assert ms.overlaps(kernels) == 0 and ms.overlaps([("a", 0, 10, 0), ("b", 5, 20, 1)]) == 1
    assert len(ms.spans(chunks, 3, True)) == 4


def test_split_layers_fails_loudly_on_a_name_or_count_mismatch():
    names = ["rms", "nvjet_splitK", "splitKreduce_kernel", "add"]
    kernels = _records(names, layers=2, iterations=2)
    dropped = kernels[:6] + kernels[7:]  # layer 1 of iteration 0 lost its split-K reduce
    with pytest.raises(ms.KernelMismatch, match=r"kernel 6 \(iteration 0, layer 1, position 2 of 4, op 'gemm'\) "
                                                r"is 'add'; discovery found 'splitKreduce_kernel'"):
        ms.split_layers(dropped, SEQ, 2, 2, "test")
    with pytest.raises(ms.KernelMismatch, match="15 kernels, expected 2 iterations x 2 layers x 4 kernels = 16"):
        ms.split_layers(kernels[:-1], SEQ, 2, 2, "test")
    with pytest.raises(ms.KernelMismatch, match="first one past them is 'extra'"):
        ms.split_layers(kernels + [("extra", 10**9, 10**9 + 5, 99)], SEQ, 2, 2, "test")
    with pytest.raises(ms.KernelMismatch, match="launched no kernel"):
        ms.split_layers([], [("view", [])], 2, 2, "test")


# ----- (c) composition and verdicts ---------------------------------------------------------------------

OPS = [dec.Op("norm", "rms_norm", {}), dec.Op("gemm", "single_gemm", {}), dec.Op("copy", None, None),
       dec.Op("add", None, None)]


def test_compose_sums_layers_per_sample_and_reports_uncovered_share():
    eager = {"norm": [10.0, 20.0, 11.0], "gemm": [100.0, 90.0, 95.0], "copy": [5.0, 5.0, 6.0], "add": [5.0, 3.0, 4.0]}
    graph = {k: [v * 0.5 for v in vs] for k, vs in eager.items()}
    out = ms.compose(OPS, {"eager": eager, "graph": graph}, {"norm": 11.0, "gemm": 103.0})
    assert out["ops"]["norm"]["eager_us"] == 11.0 and out["ops"]["norm"]["err_eager"] == 0.0
    assert out["ops"]["gemm"]["err_eager"] == pytest.approx(103 / 95 - 1)
    assert out["ops"]["copy"]["err_eager"] is None and out["ops"]["copy"]["eager_us"] == 5.0
    assert out["ops"]["gemm"]["eager_vs_graph"] == pytest.approx(1.0)
    layer = out["layer"]
    assert layer["kprof_us"] == 114.0
    assert layer["eager_us"] == 110.0  # median of the per-sample sums 110, 110, 106; the sum of medians is 106
    assert layer["err_eager"] == pytest.approx(114 / 110 - 1)
    assert layer["err_graph"] == pytest.approx(114 / 55 - 1)
    assert layer["eager_total_us"] == 118.0 and layer["eager_vs_graph"] == pytest.approx(1.0)
    assert out["uncovered"]["eager_us"] == 10.0  # 10, 8, 10
    assert out["uncovered"]["share_eager"] == pytest.approx(10 / 120)  # median of 10/120, 8/118, 10/116


def test_compose_reports_each_ops_spread_over_layers():
    # two iterations of three layers: layer 1 slow for gemm
    eager = {"norm": [10.0] * 6, "gemm": [100.0, 110.0, 100.0, 100.0, 112.0, 100.0], "copy": [1.0] * 6,
             "add": [1.0] * 6}
    out = ms.compose(OPS, {"eager": eager, "graph": None}, {"norm": 10.0, "gemm": 100.0}, layers=3)
    g = out["ops"]["gemm"]
    assert g["eager_layers_us"] == {"fastest": 100.0, "mean": pytest.approx(311 / 3), "slowest": 111.0}
    assert g["err_eager_fastest_layer"] == 0.0 and g["err_eager"] == 0.0
    assert "graph_layers_us" not in g
    assert ms.by_layer([1.0, 2.0, 3.0, 5.0, 2.0, 3.0], 3) == [3.0, 2.0, 3.0]
    assert "eager_layers_us" not in ms.compose(OPS, {"eager": eager, "graph": None}, {"norm": 10.0})["ops"]["gemm"]


def test_compose_with_a_missing_row_or_mode():
    eager = {"norm": [10.0], "gemm": [100.0], "copy": [1.0], "add": [1.0]}
    out = ms.compose(OPS, {"eager": eager, "graph": None}, {"norm": 10.0, "gemm": None})
    assert out["layer"]["kprof_us"] is None and out["layer"]["kprof_missing"] == ["gemm"]
    assert out["layer"]["graph_us"] is None and out["ops"]["norm"]["err_graph"] is None
    assert out["ops"]["norm"]["err_eager"] == 0.0


def test_compose_with_an_op_that_ran_no_kernel_time_in_the_model_leaves_the_layer_missing():
    """A row summed against a layer in which its op measured nothing would flatter a layer whose rows read
    fast (here -5 % would read 0 %): the layer's error is missing for that mode, and the verdicts fail it."""
    eager = {"norm": [5.0, 5.0], "gemm": [95.0, 95.0], "copy": [1.0, 1.0], "add": [1.0, 1.0]}
    graph = {**eager, "norm": [0.0, 0.0]}  # the graph pass saw no kernel of norm
    out = ms.compose(OPS, {"eager": eager, "graph": graph}, {"norm": 5.0, "gemm": 90.0})
    assert out["layer"]["err_graph"] is None and out["layer"]["graph_us"] == 95.0  # 95 / 95 - 1 would read 0 %
    assert out["layer"]["graph_unmeasured"] == ["norm"] and out["ops"]["norm"]["err_graph"] is None
    assert out["layer"]["err_eager"] == pytest.approx(-0.05) and out["layer"]["eager_unmeasured"] == []
    phase = {"config": "a", "phase": "d1", **out}
    assert "a d1 layer" in ms.verdicts([phase])["graph"]["missing"]
    no_graph = ms.compose(OPS, {"eager": eager, "graph": None}, {"norm": 5.0, "gemm": 90.0})
    assert no_graph["layer"]["graph_unmeasured"] is None


def _phase(config, phase, errs, layer_err):
    ops = {name: {"covered": True, "table": "single_gemm", "err_eager": e, "err_graph": e, "eager_vs_graph": None}
           for name, e in errs.items()}
    ops["copy"] = {"covered": False, "table": None, "err_eager": None, "err_graph": None}
    return {"config": config, "phase": phase, "ops": ops,
            "layer": {"err_eager": layer_err, "err_graph": layer_err, "eager_vs_graph": None}}


def test_verdicts_pass_and_fail_against_the_targets():
    good = [_phase("a", "d1", {"qkv": 0.01, "o": -0.02, "down": 0.025}, 0.02),
            _phase("a", "p", {"qkv": -0.01, "o": 0.0, "down": 0.02}, -0.01)]
    v = ms.verdicts(good)["eager"]
    assert v["layer_pass"] and v["layer_within"] == "2/2"
    assert v["kernel_median_abs"] == pytest.approx(0.015) and v["kernel_median_pass"]
    assert v["kernel_max_abs"] == pytest.approx(0.025) and v["kernel_max_pass"] and v["families_over_target"] == {}

    bad = good + [_phase("b", "p", {"qkv": -0.12, "o": 0.0, "down": 0.02}, -0.045)]
    v = ms.verdicts(bad)["graph"]
    assert not v["layer_pass"] and v["layer_within"] == "2/3" and v["layer_over"][0]["where"] == "b p"
    assert not v["kernel_max_pass"] and v["kernel_max_where"] == "b p qkv"
    assert v["kernel_median_pass"]  # the median of |err| over all nine is 0.02
    assert list(v["families_over_target"]) == ["qkv"]
    assert v["families_over_target"]["qkv"]["over_max_at"] == ["b p: -12.0%"]


def test_verdicts_count_missing_numbers_as_failures():
    p = _phase("a", "d1", {"qkv": 0.0, "o": None}, None)
    v = ms.verdicts([p])["eager"]
    assert not v["layer_pass"] and v["layer_within"] == "0/1"
    assert not v["kernel_median_pass"] and not v["kernel_max_pass"]
    assert set(v["missing"]) == {"a d1 layer", "a d1 o"}
    assert not ms.verdicts([])["eager"]["layer_pass"]


def test_eager_vs_graph_agreement():
    a = _phase("a", "d1", {"qkv": 0.0}, 0.0)
    a["layer"]["eager_vs_graph"], a["ops"]["qkv"]["eager_vs_graph"] = 0.01, -0.04
    b = _phase("a", "p", {"qkv": 0.0}, 0.0)
    b["layer"]["eager_vs_graph"], b["ops"]["qkv"]["eager_vs_graph"] = -0.02, 0.02
    agree = ms.verdicts([a, b])["eager_vs_graph"]
    assert agree["layer_max_abs"] == pytest.approx(0.02) and agree["layer_max_where"] == "a p"
    assert agree["op_median_abs"] == pytest.approx(0.03) and agree["op_max_where"] == "a d1 qkv"


# ----- (d) rows from a real (CPU) ledger, composed into a layer -----------------------------------------

@pytest.fixture(scope="module")
def cpu_rows(tmp_path_factory):
    """Rows of the CPU backend, which has one power state: prefill reads sustained rows, as decode does."""
    db = str(tmp_path_factory.mktemp("rows") / "p.db")
    wanted = ms.wanted_specs(TINY_MOE, [DECODE, PREFILL], "sustained")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KPROF_TIME_BUDGET_S", "0.05")  # a short stopping budget: these figures are not judged
        mp.setenv("KPROF_POWER", "loaded")  # never read: fill_rows names the power state of every row
        return ms.fill_rows(wanted, "torch-cpu", db), wanted, db


def test_rows_from_the_cpu_backend_compose_a_layer(cpu_rows):
    rows, wanted, db = cpu_rows
    assert {power for _table, power in wanted} == {"sustained"}
    assert sum(map(len, wanted.values())) == len(rows)
    assert all(r["status"] == "ok" and r["time_us"] > 0 and r["citation"] for r in rows.values()), rows
    assert all(r["timing"].startswith("cpu-wall;l2=warm;eager;threads=") and r["power"] == "sustained"
               for r in rows.values())
    ops = dec.layer_ops(TINY_MOE, DECODE)
    samples = {o.name: [1.0, 2.0, 3.0] for o in ops}
    phase = {"config": TINY_MOE.name, "phase": DECODE.name, "samples_us": {"eager": samples, "graph": samples}}
    ms.attach_rows(phase, ops, rows, "sustained")
    assert phase["power"] == "sustained"
    covered = [o for o in ops if o.table]
    want = sum(rows[ms.row_key(o.table, o.spec, "sustained")]["time_us"] for o in covered)  # rms_norm's counted twice
    assert phase["layer"]["kprof_us"] == pytest.approx(want)
    assert phase["layer"]["eager_us"] == 2.0 * len(covered)
    assert phase["uncovered"]["share_eager"] == pytest.approx((len(ops) - len(covered)) / len(ops))
    norm = rows[ms.row_key("rms_norm", covered[0].spec, "sustained")]["time_us"]
    assert phase["ops"]["attn_norm"]["kprof_us"] == phase["ops"]["ffn_norm"]["kprof_us"] == norm
    assert phase["ops"]["attn_norm"]["row"]["status"] == "ok"
    assert phase["ops"]["attn_norm"]["row"]["power"] == "sustained"
    lines = ms.phase_lines(phase)
    assert "rows sustained" in lines[0] and any(line.lstrip().startswith("moe_down") for line in lines)


def test_fill_rows_reports_a_table_that_cannot_run(tmp_path):
    huge = {"m": 1 << 40, "n": 32, "k": 32, "dtype": "fp32"}  # 128 TiB of inputs: an oom row on any machine
    rows = ms.fill_rows({("single_gemm", "sustained"): [huge]}, "torch-cpu", str(tmp_path / "p.db"))
    (row,) = rows.values()
    assert row["status"] == "error" and row["time_us"] is None and row["citation"].startswith("kprof.")
    assert row["error"]["kind"] == "oom"


def test_fill_rows_asks_kprof_for_the_power_state_it_names(tmp_path):
    """The power state reaches kprof: the CPU backend has no loaded state and refuses it, row by row."""
    spec = {"tokens": 4, "hidden": 64, "dtype": "bf16"}
    rows = ms.fill_rows({("rms_norm", "loaded"): [spec]}, "torch-cpu", str(tmp_path / "p.db"))
    assert list(rows) == [ms.row_key("rms_norm", spec, "loaded")]
    (row,) = rows.values()
    assert row["status"] == "error" and row["power"] == "loaded"
    assert "power='loaded' applies to CUDA backends" in row["error"]  # model_step calls kprof.api: keywords
    assert not (tmp_path / "p.db").exists()


def test_pack_ledger_leaves_the_archive_alone(tmp_path):
    """After a fill, packing the ledger leaves only the archive: no LMDB file, lock file or claims directory."""
    db = str(tmp_path / "model_step.db")
    spec = {"m": 2, "n": 8, "k": 4, "dtype": "fp32"}
    (row,) = ms.fill_rows({("single_gemm", "sustained"): [spec]}, "torch-cpu", db).values()
    assert row["status"] == "ok" and os.path.isdir(db + "-claims")
    path = ms._pack_ledger(db, str(tmp_path))
    assert path == str(tmp_path / "model_step_ledger.tar.gz") and os.listdir(tmp_path) == ["model_step_ledger.tar.gz"]
    with tarfile.open(path) as tar:
        assert tar.getnames() == ["model_step.db"]


def test_a_spec_in_a_decode_and_a_prefill_phase_has_one_row_per_power_state():
    wanted = ms.wanted_specs(TINY_DENSE, [DECODE_24, PREFILL])  # default: prefill loaded
    shared = {o.name: o.spec for o in dec.layer_ops(TINY_DENSE, DECODE_24) if o.table == "single_gemm"}
    assert shared == {o.name: o.spec for o in dec.layer_ops(TINY_DENSE, PREFILL) if o.table == "single_gemm"}
    assert wanted[("single_gemm", "sustained")] == wanted[("single_gemm", "loaded")] == list(shared.values())
    assert ("attention_decode", "sustained") in wanted and ("attention_prefill", "loaded") in wanted
    assert ("attention_decode", "loaded") not in wanted and ("attention_prefill", "sustained") not in wanted
    both_sustained = ms.wanted_specs(TINY_DENSE, [DECODE_24, PREFILL], "sustained")
    assert {power for _t, power in both_sustained} == {"sustained"}
    assert both_sustained[("single_gemm", "sustained")] == list(shared.values())  # one row serves both phases
    assert ms.phase_power(DECODE_24, "loaded") == "sustained" and ms.phase_power(PREFILL, "loaded") == "loaded"
    assert ms.phase_power(PREFILL, "sustained") == "sustained"


def test_fill_rows_fills_each_power_state_and_keys_rows_by_it(monkeypatch, tmp_path):
    """api.run is asked once per (table, power state) with that power named, and each row lands under
    (table, spec, power): the decode and the prefill row of one spec stay apart."""
    from kprof import api
    from kprof.runners.catalog import timing_string

    calls = []

    def fake_run(table, backend, specs, *, mode, db, progress=None, cuda_graph=None, power=None):
        calls.append((table, power, cuda_graph, len(specs)))
        ms_per = {"sustained": 0.002, "loaded": 0.003}[power]  # loaded: the same kernel slower, power-capped
        timing = timing_string("cupti", "cold", bool(cuda_graph), power)
        return api.QueryResult(table, backend, "gpu", db, mode, len(specs), 0, "", [
            {"status": "ok", "citation": f"c-{power}", "event": None, "metrics": {"time_ms": ms_per},
             "provenance": {"timing": timing}, "stats": None} for _spec in specs])

    monkeypatch.setattr(api, "run", fake_run)
    wanted = ms.wanted_specs(TINY_DENSE, [DECODE_24, PREFILL])
    rows = ms.fill_rows(wanted, "torch", str(tmp_path / "p.db"), "graph")
    assert sorted(calls) == sorted((table, power, True, len(specs)) for (table, power), specs in wanted.items())
    gemm = next(o.spec for o in dec.layer_ops(TINY_DENSE, PREFILL) if o.name == "qkv")
    decode_row, prefill_row = (rows[ms.row_key("single_gemm", gemm, p)] for p in ("sustained", "loaded"))
    assert (decode_row["time_us"], decode_row["timing"]) == (2.0, "cupti;l2=cold;graph")
    assert (prefill_row["time_us"], prefill_row["timing"]) == (3.0, "cupti;l2=cold;graph;power=loaded")
    assert prefill_row["power"] == "loaded" and prefill_row["citation"] == "c-loaded"


def test_composition_reads_each_phase_its_own_power_states_rows():
    """decode_b24 and prefill_24 share their GEMM and norm specs: decode composes the sustained rows, prefill
    the loaded ones; under --prefill-power sustained, prefill shares decode's rows and an op with no row of
    its state is missing rather than borrowing the other state's."""
    rows = {}
    for ph, power, us in ((DECODE_24, "sustained", 2.0), (PREFILL, "loaded", 3.0)):
        for o in dec.layer_ops(TINY_DENSE, ph):
            if o.table:
                rows[ms.row_key(o.table, o.spec, power)] = {"status": "ok", "time_us": us, "power": power,
                                                            "timing": f"t;{power}"}
    for ph, power, us in ((DECODE_24, "sustained", 2.0), (PREFILL, "loaded", 3.0)):
        ops = dec.layer_ops(TINY_DENSE, ph)
        samples = {o.name: [1.0] for o in ops}
        phase = {"config": TINY_DENSE.name, "phase": ph.name, "samples_us": {"eager": samples, "graph": samples}}
        ms.attach_rows(phase, ops, rows, ms.phase_power(ph))
        covered = [o.name for o in ops if o.table]
        assert phase["power"] == power
        assert {phase["ops"][n]["kprof_us"] for n in covered} == {us}
        assert {phase["ops"][n]["row"]["power"] for n in covered} == {power}
        assert phase["layer"]["kprof_us"] == us * len(covered)
    phase = {"config": TINY_DENSE.name, "phase": PREFILL.name, "samples_us": {}}
    ms.attach_rows(phase, dec.layer_ops(TINY_DENSE, PREFILL), rows, "sustained")  # --prefill-power sustained
    assert phase["ops"]["qkv"]["kprof_us"] == 2.0 and phase["ops"]["qkv"]["row"]["power"] == "sustained"
    assert phase["ops"]["attention"]["kprof_us"] is None and phase["ops"]["attention"]["row"]["status"] == "missing"
    assert phase["layer"]["kprof_missing"] == ["attention"] and phase["layer"]["kprof_us"] is None


def test_row_method_graph_passes_cuda_graph_or_the_environment():
    def with_arg(table, backend, specs, *, cuda_graph=None, power=None):
        pass

    def without(table, backend, specs):
        pass

    assert ms._method_kwargs("default", with_arg) == ({}, {})
    assert ms._method_kwargs("graph", with_arg) == ({"cuda_graph": True}, {})
    assert ms._method_kwargs("graph", without) == ({}, {"KPROF_CUDA_GRAPH": "1"})
    assert ms._method_kwargs("default", with_arg, "loaded") == ({"power": "loaded"}, {})
    assert ms._method_kwargs("graph", with_arg, "sustained") == ({"cuda_graph": True, "power": "sustained"}, {})
    with pytest.raises(TypeError, match="takes no power state"):
        ms._method_kwargs("default", without, "sustained")


# ----- (e) the per-phase pipeline on an emulated device -------------------------------------------------

class _Device:
    """Every torch op dispatched that is not a view is a "kernel" (name, start, end), as on a GPU a view launches
    nothing; a CUDA graph captures the names its body dispatched and replays them as kernels. Timestamps share
    time.perf_counter_ns."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.kernels, self.capturing = [], None
        device = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                t0 = time.perf_counter_ns()
                out = func(*args, **(kwargs or {}))
                if not func.is_view:
                    device.emit(str(func), t0)
                return out

        self.mode = Mode()

    def emit(self, name, t0=None):
        if self.capturing is not None:
            self.capturing.append(name)
            return
        t0 = time.perf_counter_ns() if t0 is None else t0
        self.kernels.append((name, t0, max(time.perf_counter_ns(), t0 + 1), len(self.kernels)))

    def session(self):
        device = self

        class Session:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

            def timestamp(self):
                return time.perf_counter_ns()

            def collect(self):
                out, device.kernels = device.kernels, []
                return out, []

        return Session

    def graph_api(self):
        device = self

        class Graph:
            names = ()

            def replay(self):
                for n in self.names:
                    device.emit(n)

        class capture:
            def __init__(self, g):
                self.g = g

            def __enter__(self):
                device.capturing = []

            def __exit__(self, *exc):
                self.g.names, device.capturing = device.capturing, None

        return Graph, capture


class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def emulated(monkeypatch):
    import contextlib

    import kprof.measure._cupti as cupti

    def make():
        device = _Device()
        graph, capture = device.graph_api()
        monkeypatch.setattr(cupti, "Session", device.session())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "Stream", _Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", graph)
        monkeypatch.setattr(torch.cuda, "graph", capture)
        return device

    return make


def _plan(layers=3, iters=2, prefill_power="loaded"):
    return ms.Plan([TINY_MOE], [DECODE], layers, iters, 1, "unused", None, "default", True, prefill_power)


@pytest.mark.parametrize("ph, power", [(DECODE, "sustained"), (PREFILL, "loaded")], ids=lambda x: getattr(x, "name", x))
@pytest.mark.parametrize("cfg", [TINY_DENSE, TINY_MOE], ids=lambda c: c.name)
def test_run_phase_on_an_emulated_device(emulated, cfg, ph, power):
    device = emulated()
    model = dec.Model(cfg, 3, "cpu")
    with device.mode:
        p = ms.run_phase(model, ph, _plan())
    assert p["errors"] == {} and p["retries"] == {} and p["power"] == power
    names = [o.name for o in dec.layer_ops(cfg, ph)]
    for mode in ms.MODES:
        assert list(p["samples_us"][mode]) == names
        assert all(len(v) == 2 * 2 for v in p["samples_us"][mode].values())  # 2 iterations x layers 1, 2
        assert p["kernels"][mode]["qkv"] and p["layer_span_us"][mode] > 0
    assert p["kernels"]["graph"] == p["kernels"]["eager"]
    if ph.kind == "decode":
        assert p["layouts"]["attention"]["k_contiguous"]
    covered_names = [o.name for o in dec.layer_ops(cfg, ph) if o.table]
    places = p["activation_mod_2mib"]  # every covered op's activation, in each of the 3 layers
    assert sorted(places) == sorted(covered_names) and all(len(v) == 3 for v in places.values())
    assert all(0 <= x < dec.PAGE for v in places.values() for x in v)
    ops = dec.layer_ops(cfg, ph)
    other = {"sustained": "loaded", "loaded": "sustained"}[power]
    rows = {ms.row_key(o.table, o.spec, pw): {"status": "ok", "time_us": us, "power": pw}
            for o in ops if o.table for pw, us in ((power, 5.0), (other, 50.0))}
    ms.attach_rows(p, ops, rows, p["power"])
    covered = [o for o in ops if o.table]
    assert p["layer"]["kprof_us"] == 5.0 * len(covered)  # both rms_norm ops read the one row of the phase's state
    assert p["layer"]["err_eager"] is not None and p["uncovered"]["share_graph"] > 0
    doc = {"gpu": "emulated", "torch": torch.__version__, "plan": {"layers": 3, "iters": 2},
           "row_timings": ["cupti;l2=cold;eager"], "phases": [p], "verdicts": ms.verdicts([p])}
    text = "\n".join(ms.summary_lines(doc))
    assert "layer sum within 3%" in text and "max <= 8%" in text and cfg.name in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("per layer, covered ops"))
    assert lines[header].split()[4] == "power" and lines[header + 1].split()[2] == power
    assert [line.split(":")[0] for line in lines if line.startswith("  vs ")] == ["  vs eager", "  vs graph"]
    assert lines[-1].startswith("in-model eager vs graph: layers within")


def test_run_phase_retries_a_mismatched_pass_once_then_fails_it(emulated, monkeypatch):
    device = emulated()
    model = dec.Model(TINY_DENSE, 3, "cpu")
    real, calls = ms.split_layers, []

    def flaky(kernels, sequence, layers, iterations, what):
        calls.append(what)
        if len(calls) == 1 or what.endswith("graph"):  # eager fails once; graph every time
            raise ms.KernelMismatch(f"{what}: kernel 6 is 'add'; discovery found 'splitKreduce_kernel' there")
        return real(kernels, sequence, layers, iterations, what)

    monkeypatch.setattr(ms, "split_layers", flaky)
    with device.mode:
        p = ms.run_phase(model, DECODE, _plan())
    assert "discovery found" in p["retries"]["eager"] and len(p["samples_us"]["eager"]["qkv"]) == 4
    assert "eager" not in p["errors"] and "KernelMismatch" in p["errors"]["graph"] and "graph" not in p["samples_us"]
    assert len(calls) == 4
    rows = {ms.row_key(o.table, o.spec, "sustained"): {"status": "ok", "time_us": 1.0}
            for o in dec.layer_ops(TINY_DENSE, DECODE) if o.table}
    ms.attach_rows(p, dec.layer_ops(TINY_DENSE, DECODE), rows, p["power"])
    assert p["layer"]["err_eager"] is not None and p["layer"]["err_graph"] is None
    assert "tiny-dense decode_b3 layer" in ms.verdicts([p])["graph"]["missing"]


# ----- the script's arguments ---------------------------------------------------------------------------

def test_plan_quick_and_full_and_bad_names():
    quick = ms.make_plan(ms.parse_args(["--quick", "--out", "x"]))
    assert (quick.layers, quick.iters) == (4, 3) and [p.name for p in quick.phases] == ["decode_b1", "prefill_2048"]
    assert [c.name for c in quick.configs] == ["qwen2.5-7b", "mixtral-8x7b"] and quick.skip_first_layer
    full = ms.make_plan(ms.parse_args(["--out", "x", "--configs", "mixtral-8x7b", "--layers", "8"]))
    assert full.layers == 8 and full.iters == 10 and len(full.phases) == 4 and full.configs[0].experts == 8
    assert quick.prefill_power == full.prefill_power == "loaded"
    assert [full.power(ph) for ph in full.phases] == ["sustained"] * 3 + ["loaded"]
    sustained = ms.make_plan(ms.parse_args(["--prefill-power", "sustained"]))
    assert {sustained.power(ph) for ph in sustained.phases} == {"sustained"}
    with pytest.raises(SystemExit):
        ms.parse_args(["--prefill-power", "hot"])
    with pytest.raises(ValueError, match="unknown phase"):
        ms.make_plan(ms.parse_args(["--phases", "decode_b2"]))
    with pytest.raises(ValueError, match="at least 1"):
        ms.make_plan(ms.parse_args(["--layers", "0"]))
    assert quick.busy_s == full.busy_s == ms.BUSY_S == 0.0
    assert ms.make_plan(ms.parse_args(["--busy-s", "0.5"])).busy_s == 0.5
    for bad in ("-1.5", "nan", "inf"):
        with pytest.raises(ValueError, match=rf"--busy-s \({bad}\) must be a finite number"):
            ms.make_plan(ms.parse_args(["--busy-s", bad]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_main_without_a_gpu_exits_2(tmp_path, capsys):
    assert ms.main(["--quick", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_main_counts_a_config_whose_model_failed_to_build_against_the_targets(monkeypatch, tmp_path, capsys):
    """A config whose layers cannot be built (out of GPU memory) leaves its phases failed in the JSON and the
    verdicts, never a PASS over the configs that did run."""
    import json

    import kprof.measure.gpu_timer as gpu_timer

    class Model:
        def __init__(self, cfg, layers, device):
            if cfg.experts:
                raise RuntimeError("CUDA out of memory")
            self.cfg = cfg

    def run_phase(model, ph, plan):
        samples = {o.name: [10.0] * 3 for o in dec.layer_ops(model.cfg, ph)}
        return {"config": model.cfg.name, "phase": ph.name, "layers_used": "1..3", "errors": {},
                "samples_us": {"eager": samples, "graph": samples}}

    def fill_rows(wanted, backend, db, row_method, log):
        return {ms.row_key(table, spec, power): {"table": table, "spec": spec, "power": power, "status": "ok",
                                                 "time_us": 10.0, "timing": None}
                for (table, power), specs in wanted.items() for spec in specs}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu_timer, "cupti_available", lambda: None)
    monkeypatch.setattr(dec, "Model", Model)
    monkeypatch.setattr(ms, "run_phase", run_phase)
    monkeypatch.setattr(ms, "fill_rows", fill_rows)
    monkeypatch.setattr(ms, "_environment", lambda: {"gpu_name": "emulated"})
    assert ms.main(["--quick", "--out", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "model_step.json").read_text())
    assert [(p["config"], p["phase"]) for p in doc["phases"]] == [
        (c, p) for c in ("qwen2.5-7b", "mixtral-8x7b") for p in ("decode_b1", "prefill_2048")]
    for mode in ms.MODES:
        v = doc["verdicts"][mode]
        assert not v["layer_pass"] and v["layer_within"] == "2/4"
        assert not v["kernel_median_pass"] and not v["kernel_max_pass"]
        assert v["missing"] == ["mixtral-8x7b decode_b1 layer", "mixtral-8x7b prefill_2048 layer"]
    assert doc["failures"] == [f"mixtral-8x7b {p} model: RuntimeError: CUDA out of memory"
                               for p in ("decode_b1", "prefill_2048")]
    out = capsys.readouterr().out
    assert "layer FAIL 2/4" in out and "mixtral-8x7b decode_b1" in out
    doc["phases"].reverse()  # a failed config first: the header names the layers the others used
    assert "4 layers (used 1..3)" in ms.summary_lines(doc)[0]


def test_summary_names_each_phase_kinds_table_of_an_op():
    """attention is attention_decode in decode columns and attention_prefill in prefill ones: the summary's table
    column names both, not the first phase's alone."""
    phases = []
    for ph in (DECODE, PREFILL):
        ops = dec.layer_ops(TINY_DENSE, ph)
        power = ms.phase_power(ph)
        rows = {ms.row_key(o.table, o.spec, power): {"status": "ok", "time_us": 1.0} for o in ops if o.table}
        samples = {o.name: [1.0] for o in ops}
        p = {"config": TINY_DENSE.name, "phase": ph.name, "samples_us": {"eager": samples, "graph": samples}}
        ms.attach_rows(p, ops, rows, power)
        phases.append(p)
    doc = {"gpu": "emulated", "torch": torch.__version__, "plan": {"layers": 3, "iters": 2}, "row_timings": [],
           "phases": phases, "verdicts": ms.verdicts(phases)}
    lines = ms.summary_lines(doc)
    (attention,) = [line for line in lines if line.startswith("  attention ")]
    assert attention.split()[:2] == ["attention", "attention_decode/prefill"]
    (qkv,) = [line for line in lines if line.startswith("  qkv ")]
    assert qkv.split()[:2] == ["qkv", "single_gemm"]
    header = next(line for line in lines if line.startswith(TINY_DENSE.name))
    assert header.index(DECODE.name) + len(DECODE.name) == attention.index("+0.0/") + len("+0.0/  +0.0")
    phases[0]["ops"]["attention"]["err_eager"] = phases[1]["ops"]["attention"]["err_eager"] = 0.1
    over = ms.verdicts(phases)["eager"]["families_over_target"]  # the JSON's family names both tables too
    assert list(over) == ["attention"] and over["attention"]["table"] == "attention_decode/prefill"


def test_a_db_that_is_no_ledger_is_refused_before_the_gpu_passes(tmp_path):
    """--db naming a file that is not a ledger, a directory, or a file in a directory that does not exist failed
    only when the rows were filled, after every GPU pass (a traceback and no JSON, or every row an error); --out
    naming a file is refused with them."""
    (tmp_path / "notes.txt").write_text("not a ledger")
    for bad, why in ((tmp_path / "notes.txt", "not a kprof ledger"), (tmp_path, "is a directory"),
                     (tmp_path / "missing" / "p.db", "its directory does not exist")):
        with pytest.raises(ValueError, match=f"--db {bad}: .*{why}"):
            ms.make_plan(ms.parse_args(["--db", str(bad)]))
    with pytest.raises(ValueError, match="--out .*notes.txt is a file; name a directory"):
        ms.make_plan(ms.parse_args(["--out", str(tmp_path / "notes.txt")]))  # else a traceback once the GPU is up
    good = tmp_path / "p.db"
    assert ms.make_plan(ms.parse_args(["--db", str(good)])).db == str(good)  # kprof creates it
    ms.fill_rows({("single_gemm", "sustained"): [{"m": 2, "n": 8, "k": 4, "dtype": "fp32"}]}, "torch-cpu", str(good))
    assert ms.make_plan(ms.parse_args(["--db", str(good)])).db == str(good)  # a ledger: its ok rows are reused


def test_fill_rows_into_a_file_that_is_no_ledger_reports_errors_without_raising(tmp_path):
    (tmp_path / "notes.txt").write_text("not a ledger")
    (row,) = ms.fill_rows({("single_gemm", "sustained"): [{"m": 2, "n": 8, "k": 4, "dtype": "fp32"}]}, "torch-cpu",
                          str(tmp_path / "notes.txt")).values()
    assert row["status"] == "error" and "not a kprof ledger" in row["error"]
