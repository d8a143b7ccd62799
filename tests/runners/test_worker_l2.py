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


def test_eager_cold_reads_the_activations_back_after_the_sweep():
    case = build("single_gemm")
    warm = device(graph=False)._warm(case)
    assert warm is not None and len(warm()) == 1  # one read of a, none of b
    assert device(graph=False, cold=False)._warm(case) is None  # warm L2: nothing to read back
    assert len(device(graph=True)._warm(case)()) == 1  # before each graph replay too
    assert device(graph=False)._warm(build("single_gemm")._replace(warm=())) is None
