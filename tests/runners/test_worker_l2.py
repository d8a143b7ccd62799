"""Which inputs a cold-L2 row reads warm (the activations a model's previous kernel just wrote): the runners'
declarations and the worker's read-back, on CPU-built cases."""

import msgspec
import pytest
import torch

from kprof.runners.registry import lookup
from kprof.runners.cuda_device import CudaDevice

SPECS = {
    "single_gemm": {"m": 4, "n": 16, "k": 8, "dtype": "fp32"},
    "rms_norm": {"tokens": 4, "hidden": 16, "dtype": "fp32"},
    "silu_mul": {"tokens": 4, "hidden": 16, "dtype": "fp32"},
    "attention_prefill": {"batch": 1, "seq_len": 8, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8,
                          "causal": True, "dtype": "fp32"},
    "attention_decode": {"batch": 1, "kv_len": 8, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "fp32"},
    "moe_grouped_gemm": {"tokens": 4, "experts": 2, "topk": 1, "hidden": 8, "intermediate": 16, "dtype": "fp32"},
}
# The activations of each table, by input position: what a model's previous kernel has just written.
ACTIVATIONS = {"single_gemm": (0,), "rms_norm": (0,), "silu_mul": (0,), "attention_prefill": (0, 1, 2),
               "attention_decode": (0,), "moe_grouped_gemm": (0,)}


def build(table):
    entry = lookup(table, "torch-cpu")
    return entry.load_runner()().build(msgspec.convert(SPECS[table], entry.args), "cpu")


def device(graph, cold=True):
    import torch

    d = object.__new__(CudaDevice)  # the worker's decisions only: no CUDA device behind it (CPU tensors)
    d.graph, d.cold, d.torch = graph, cold, torch
    return d


@pytest.mark.parametrize("table", sorted(SPECS))
def test_every_runner_names_its_activations(table):
    assert build(table).warm == ACTIVATIONS[table]


def test_eager_cold_rewrites_the_activations_after_the_sweep():
    case = build("single_gemm")
    a, b = case.inputs[0], case.inputs[1]
    before, versions = a.clone(), (a._version, b._version)
    warm = device(graph=False)._warm(case)
    out = warm()
    assert len(out) == 1 and out[0].data_ptr() == a.data_ptr()  # one rewrite of a, none of b
    assert torch.equal(a, before) and a._version > versions[0] and b._version == versions[1]  # written, unchanged
    assert device(graph=False, cold=False)._warm(case) is None  # warm L2: nothing to read back
    assert len(device(graph=True)._warm(case)()) == 1  # before each graph replay too
    assert device(graph=False)._warm(build("single_gemm")._replace(warm=())) is None


def test_a_case_with_draws_loads_the_next_one_instead_of_rewriting(monkeypatch):
    """An MoE row's refresh (the next routing copied in) writes its activations itself: it replaces the
    rewrite, after every sweep, eager or graph; without cold L2 nothing runs between calls."""
    calls = []
    case = build("moe_grouped_gemm")._replace(refresh=lambda targets=None: calls.append(1))
    monkeypatch.setattr("kprof.measure._l2.rewriter", lambda *a: pytest.fail("rewrote instead of refreshing"))
    for graph in (False, True):
        device(graph=graph)._warm(case)()
    assert calls == [1, 1]
    assert device(graph=False, cold=False)._warm(case) is None


def test_rows_rotate_over_placements_of_the_weights_and_of_small_activations():
    """Eager and graph rows alike: placement k holds its own weight copy and its own activation copy, equal in
    value and layout, the activation at its own offset in a fresh block; placement 0 is the case's inputs."""
    from kprof.runners.cuda_device import _offset

    case = build("single_gemm")
    calls = []
    case = case._replace(call=lambda a, b: calls.append((a, b)))
    for graph in (False, True):
        calls.clear()
        placements, warms, notes = device(graph=graph)._placements(case)
        assert len(placements) == len(warms) == 16 and notes == {"input_copies": "16", "activation_copies": "16"}
        for p in placements:
            p()
        a0, b0 = case.inputs
        assert calls[0] == (a0, b0)
        assert len({a.data_ptr() for a, _b in calls}) == 16 and len({b.data_ptr() for _a, b in calls}) == 16
        for k, (a, b) in enumerate(calls[1:], 1):
            assert a.equal(a0) and b.equal(b0) and a.stride() == a0.stride()
            assert a.data_ptr() - a.untyped_storage().data_ptr() == _offset(k)
        rewritten = warms[3]()  # placement 3's activation only (dirty in L2 before its call)
        assert [t.data_ptr() for t in rewritten] == [calls[3][0].data_ptr()]


def test_activation_offsets_are_aligned_and_spread_over_a_block():
    from kprof.runners.cuda_device import _offset

    offsets = [_offset(k) for k in range(1, 16)]
    assert all(o % 512 == 0 and 0 <= o < 2 << 20 for o in offsets) and len(set(offsets)) == 15
    assert max(offsets) - min(offsets) > 1 << 20  # not one stride's neighbourhood


def test_a_strided_activation_keeps_its_layout_in_its_placed_copy():
    import torch

    from kprof.runners.cuda_device import _placed_copy

    t = torch.arange(24.0).view(4, 6)[:, 1:5]  # a view: strides (6, 1), 4 of 6 columns
    c = _placed_copy(torch, t, 1024)
    assert c.equal(t) and c.stride() == t.stride() and c.data_ptr() - c.untyped_storage().data_ptr() == 1024
    scale = torch.tensor(2.0)
    assert _placed_copy(torch, scale, 512).equal(scale)  # a 0-d scale is copied too
    broadcast = torch.ones(3).expand(4, 3)
    assert _placed_copy(torch, broadcast, 512) is broadcast  # stride 0: shared, never written through a copy


def test_activations_only_or_large_or_nothing_to_copy(monkeypatch):
    import kprof.runners.cuda_device as worker

    placements, warms, notes = device(graph=False)._placements(build("silu_mul"))  # its one input, an activation
    assert len(placements) == 16 and notes == {"input_copies": "1", "activation_copies": "16"}
    monkeypatch.setattr(worker, "ACTIVATION_COPY_BYTES", 1)  # a prefill's activations: shared by every placement
    case = build("single_gemm")
    placements, _warms, notes = device(graph=False)._placements(case)
    assert len(placements) == 16 and notes["activation_copies"] == "1"
    assert all(p.args[0] is case.inputs[0] for p in placements)
    assert device(graph=False)._placements(build("silu_mul")) is None
    monkeypatch.setattr(worker, "COPY_BYTES", 1)
    assert device(graph=False)._placements(case) is None
    assert device(graph=True)._placements(case) is None


def test_a_refreshing_case_loads_its_next_draw_into_the_placement_about_to_run():
    seen = []
    case = build("moe_grouped_gemm")._replace(refresh=lambda targets=None: seen.append(targets))
    placements, warms, _notes = device(graph=False)._placements(case)
    warms[5]()
    assert seen[-1][0] is placements[5].args[0]  # placement 5's routed activations


def test_a_row_over_copies_is_the_mean_of_each_copys_median():
    """Two of four allocations slow by 5 %: the union's median sits in the fast mode, the row (the mean of the
    copies' medians) between, as a sum over a model's layers, each on its own allocation, does."""
    from kprof.measure.stats import placement_notes
    from kprof.runners.worker import _time_ms

    per_copy = [1.0, 1.05, 1.0, 1.0]
    used = [i % 4 for i in range(3 + 40)]  # three untimed calls first (warm-up), then 40 timed ones
    samples = [per_copy[c] + 0.001 * (i % 3) for i, c in enumerate(used[3:])]
    notes = placement_notes(samples, used, 4, discarded=0)
    assert notes["estimator"] == "copy_mean" and notes["placement_spread"] == "0.0500"
    assert float(notes["copy_mean_ms"]) == pytest.approx(1.0125 + 0.001, abs=1e-9)
    assert [float(x) for x in notes["copy_medians_ms"].split(",")] == pytest.approx([1.001, 1.051, 1.001, 1.001])
    from kprof.measure.stats import summarize

    stats = summarize(samples)
    assert _time_ms(stats, notes) == pytest.approx(1.0135) and stats.median == pytest.approx(1.001)
    assert _time_ms(stats, {}) == stats.median and _time_ms(stats, {"estimator": "mean"}) == stats.mean
    # calls and samples no longer line up, or too few samples a copy: the plain median, and why
    assert placement_notes(samples, used, 4, discarded=1) == {
        "copy_estimator": "median of all samples (1 batch(es) discarded: calls and samples no longer line up)"}
    assert "fewer than 3" in placement_notes(samples[:8], used, 4, discarded=0)["copy_estimator"]


def test_a_copy_whose_median_is_zero_gives_the_median_of_all_samples_not_a_crash():
    """The events timer clamps a sample at 0 ms: a placement whose median read 0 made placement_spread divide by
    zero, and the row failed as a crash (ZeroDivisionError) though the timer had given samples."""
    from kprof.measure.stats import placement_notes

    used = [i % 2 for i in range(20)]
    samples = [0.0 if c == 0 else 0.002 for c in used]
    assert placement_notes(samples, used, 2, discarded=0) == {
        "copy_estimator": "median of all samples (a copy's median is 0 ms: the timer did not resolve it)"}


def test_copy_medians():
    from kprof.measure.stats import copy_medians

    assert copy_medians([1.0, 2.0, 1.0, 2.0, 1.0, 2.0], [0, 1, 0, 1, 0, 1], 2) == [1.0, 2.0]
    assert copy_medians([1.0, 2.0], [0, 1], 2) is None  # fewer than 3 samples a copy
    assert copy_medians([1.0], [0, 1], 2) is None  # lengths differ
