"""Which inputs a cold-L2 row reads warm (the activations a model's previous kernel just wrote): the runners'
declarations and the worker's read-back, on CPU-built cases."""

import msgspec
import pytest

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
    d = object.__new__(CudaDevice)  # the worker's decisions only: no CUDA device behind it
    d.graph, d.cold = graph, cold
    return d


@pytest.mark.parametrize("table", sorted(SPECS))
def test_every_runner_names_its_activations(table):
    assert build(table).warm == ACTIVATIONS[table]


def test_eager_cold_rewrites_the_activations_after_the_sweep():
    case = build("single_gemm")
    warm = device(graph=False)._warm(case)
    assert warm is not None and len(warm()) == 1  # one read of a, none of b
    assert device(graph=False, cold=False)._warm(case) is None  # warm L2: nothing to read back
    assert len(device(graph=True)._warm(case)()) == 1  # before each graph replay too
    assert device(graph=False)._warm(build("single_gemm")._replace(warm=())) is None


def test_a_case_with_draws_loads_the_next_one_instead_of_rewriting():
    """An MoE row's refresh (the next routing copied in) writes its activations itself: it replaces the
    rewrite, after every sweep, eager or graph; without cold L2 nothing runs between calls."""
    calls = []
    case = build("moe_grouped_gemm")._replace(refresh=lambda: calls.append(1))
    for graph in (False, True):
        device(graph=graph)._warm(case)()
    assert calls == [1, 1]
    assert device(graph=False, cold=False)._warm(case) is None


def test_rows_rotate_over_copies_of_the_weights_and_share_the_activations():
    """Eager and graph rows alike get one closure per weight allocation (time_gpu rotates over them)."""
    case = build("single_gemm")
    calls = []
    case = case._replace(call=lambda a, b: calls.append((a, b)))
    for graph in (False, True):
        calls.clear()
        placements = device(graph=graph)._placements(case)
        assert len(placements) == 16
        for p in placements:
            p()
        assert all(a is case.inputs[0] for a, _b in calls)  # one activation tensor for every copy
        assert len({id(b) for _a, b in calls}) == 16 and calls[0][1] is case.inputs[1]  # the original first


def test_no_copies_past_the_byte_budget_or_of_activations_alone(monkeypatch):
    import kprof.runners.cuda_device as worker

    case = build("single_gemm")
    assert device(graph=False)._placements(build("silu_mul")) is None  # its one input is an activation
    monkeypatch.setattr(worker, "COPY_BYTES", 1)
    assert device(graph=False)._placements(case) is None
    assert device(graph=True)._placements(case) is None


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


def test_copy_medians():
    from kprof.measure.stats import copy_medians

    assert copy_medians([1.0, 2.0, 1.0, 2.0, 1.0, 2.0], [0, 1, 0, 1, 0, 1], 2) == [1.0, 2.0]
    assert copy_medians([1.0, 2.0], [0, 1], 2) is None  # fewer than 3 samples a copy
    assert copy_medians([1.0], [0, 1], 2) is None  # lengths differ
