"""producer_check.py on CPU: each variant's step does what it says to the silu_mul's input, the call then reads
it, and without a GPU the script refuses with exit 2."""

import importlib.util
import inspect
import pathlib

import pytest
import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location("producer_check", pathlib.Path(__file__).with_name("producer_check.py"))
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


def test_each_variant_writes_the_input_as_it_says():
    case = pc.build(3, 64, "cpu")
    x = case.inputs[0]
    steps = pc.hooks(case, 32)
    assert set(steps) == set(pc.VARIANTS)
    before = x.clone()
    version = x._version
    steps["row"]()  # rewritten in place: the same bytes
    assert torch.equal(x, before) and x._version > version
    version = x._version
    gemm = inspect.getclosurevars(steps["other"]).nonlocals  # the GEMM's operands and its output buffer
    gemm["elsewhere"].zero_()
    steps["other"]()  # the input rewritten, the GEMM's output elsewhere
    assert torch.equal(x, before) and x._version > version
    assert torch.equal(gemm["elsewhere"], torch.matmul(gemm["a"], gemm["w"])) and gemm["elsewhere"].abs().sum() > 0
    steps["producer"]()  # the GEMM's output is now the input, and the call reads it
    assert not torch.equal(x, before) and x.shape == before.shape
    produced = x.clone()
    assert torch.equal(case.fn(), F.silu(produced[:, :64]) * produced[:, 64:])
    steps["copy"]()  # back to the values the case was built with, by a copy
    assert torch.equal(x, before)


def test_the_cases_are_decode_sized_and_valid():
    for name, (tokens, hidden, k, in_model, row) in pc.CASES.items():
        assert 1 <= tokens <= 128 and hidden > k > 0, name
        assert (in_model is None) == (row is None)
        assert pc.build(tokens, hidden, "cpu").inputs[0].shape == (tokens, 2 * hidden)  # the table accepts it


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_main_without_a_gpu_exits_2(tmp_path, capsys):
    assert pc.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
