"""Which inputs a cold-L2 row reads warm (the activations a model's previous kernel just wrote) and which it
rotates under a CUDA graph (the weights): the decisions of the worker, on CPU-built cases."""

import types

import msgspec
import pytest

import kprof.measure.gpu_timer as gpu_timer
from kprof.runners.registry import lookup
from kprof.runners.worker import MAX_ROTATIONS, _CudaDevice

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


def test_eager_cold_reads_the_activations_back_after_the_sweep():
    case = build("single_gemm")
    warm = device(graph=False)._warm(case)
    assert warm is not None and len(warm()) == 1  # one read of a, none of b
    assert device(graph=False, cold=False)._warm(case) is None  # warm L2: nothing to read back
    assert device(graph=True)._warm(case) is None  # a graph rotates instead


def test_a_graph_rotates_copies_of_the_weights_and_shares_the_activations(monkeypatch):
    monkeypatch.setattr(gpu_timer, "rotation_copies", lambda nbytes: 5)
    case = build("single_gemm")
    calls = []
    case = case._replace(call=lambda a, b: calls.append((a, b)))
    rotations = device(graph=True)._rotations(case)
    assert len(rotations) == 5
    for r in rotations:
        r()
    assert all(a is case.inputs[0] for a, _b in calls)  # the activation is the same tensor in every copy
    assert len({id(b) for _a, b in calls}) == 5  # each copy has its own weights


def test_rotations_are_capped_and_an_all_activation_case_is_not_copied(monkeypatch):
    monkeypatch.setattr(gpu_timer, "rotation_copies", lambda nbytes: 100_000)
    assert len(device(graph=True)._rotations(build("rms_norm"))) == MAX_ROTATIONS
    assert len(device(graph=True)._rotations(build("silu_mul"))) == 1  # its one input is an activation
    assert device(graph=False)._rotations(build("rms_norm")) is None
