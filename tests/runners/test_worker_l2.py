"""Which inputs a cold-L2 row reads warm (the activations a model's previous kernel just wrote): the runners'
declarations and the worker's read-back, on CPU-built cases."""

import msgspec
import pytest

from kprof.runners.registry import lookup
from kprof.runners.worker import _CudaDevice

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
    d = object.__new__(_CudaDevice)  # the worker's decisions only: no CUDA device behind it
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


def test_eager_rows_rotate_over_copies_of_the_weights_and_share_the_activations():
    case = build("single_gemm")
    calls = []
    case = case._replace(call=lambda a, b: calls.append((a, b)))
    fn, copies = device(graph=False)._spread(case)
    assert copies == 4
    for _ in range(8):
        fn()
    assert all(a is case.inputs[0] for a, _b in calls)  # one activation tensor for every copy
    assert len({id(b) for _a, b in calls}) == 4 and calls[0][1] is calls[4][1]  # four weight copies, in turn


def test_no_copies_under_a_graph_past_the_byte_budget_or_of_activations_alone(monkeypatch):
    import kprof.runners.worker as worker

    case = build("single_gemm")
    assert device(graph=True)._spread(case) == (case.fn, 1)
    assert device(graph=False)._spread(build("silu_mul"))[1] == 1  # its one input is an activation
    monkeypatch.setattr(worker, "COPY_BYTES", 1)
    assert device(graph=False)._spread(case) == (case.fn, 1)


def test_the_rewrite_leaves_every_activation_value_as_it_was():
    import torch

    case = build("attention_prefill")
    before = [t.clone() for t in case.inputs]
    device(graph=False)._warm(case)()
    assert all(torch.equal(a, b) for a, b in zip(before, case.inputs))


def test_a_zero_dim_scale_is_rewritten_too():
    import torch

    case = build("single_gemm")
    scale = torch.tensor(0.5)
    case = case._replace(inputs=(*case.inputs, scale), warm=(0, 2))
    device(graph=False)._warm(case)()
    assert scale.item() == 0.5


def test_measure_records_carry_the_ledger_records_fields_in_order():
    """measure hands back its own records; the worker converts them field by field, so the two must agree."""
    import msgspec

    from kprof.ledger.events import Environment, Stats
    from kprof.measure.records import DeviceEnvironment, SampleStats
    from kprof.measure.stats import summarize
    from kprof.runners.worker import _record

    for ours, theirs in ((SampleStats, Stats), (DeviceEnvironment, Environment)):
        assert ours.__struct_fields__ == theirs.__struct_fields__
    stats = _record(Stats, summarize([1.0, 2.0, 3.0]))
    assert type(stats) is Stats and stats.median == 2.0 and stats.samples == [1.0, 2.0, 3.0]
    env = Environment(gpu_name="x")
    assert _record(Environment, env) is env  # a ledger record passes through
    assert msgspec.structs.asdict(_record(Environment, DeviceEnvironment(gpu_name="x"))) == msgspec.structs.asdict(env)
