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


def test_the_variants_that_take_other_apart_leave_the_input_as_the_row_does():
    case = pc.build(3, 64, "cpu")
    x = case.inputs[0]
    steps = pc.hooks(case, 32)
    before = x.clone()
    tiny = inspect.getclosurevars(steps["tiny"]).nonlocals
    tiny["tout"].zero_()
    steps["tiny"]()  # the input rewritten, a small GEMM of its own operands
    assert torch.equal(x, before) and torch.equal(tiny["tout"], tiny["ta"] @ tiny["tw"])
    assert tiny["tw"].numel() * tiny["tw"].element_size() < 1 << 20  # its bytes: not a weight stream
    stream = inspect.getclosurevars(steps["stream"]).nonlocals
    steps["stream"]()  # the GEMM's weight bytes read whole, by a reduction
    gemm = inspect.getclosurevars(steps["other"]).nonlocals
    assert stream["weight_words"].data_ptr() == gemm["w"].data_ptr()
    assert stream["weight_words"].numel() * stream["weight_words"].element_size() == gemm["w"].numel() * 2
    assert int(stream["total"]) == int(stream["weight_words"].to(torch.int64).sum())
    assert torch.equal(x, before)
    light = inspect.getclosurevars(steps["other+1"]).nonlocals
    steps["other+1"]()
    steps["other+gap"]()  # no GPU: the spin is skipped, the rest runs
    assert int(light["one"]) == 1 and torch.equal(x, before)
    version = x._version
    steps["stream+own"]()  # the stream, then the input rewritten: the same bytes
    assert torch.equal(x, before) and x._version > version
    steps["producer+own"]()  # the GEMM's output, rewritten unchanged
    assert torch.equal(x, gemm["a"] @ gemm["w"])


def test_the_first_kernel_filter_selects_one_name_only():
    import re

    pattern = pc.first_kernel(["void silu_kernel<(a)>", "void mul_kernel<b>"])
    assert re.search(pattern, "void silu_kernel<(a)>") and not re.search(pattern, "void mul_kernel<b>")
    assert not re.search(pattern, "void silu_kernel<(a)>_and_more")
    with pytest.raises(ValueError, match="first of the kernels"):
        pc.first_kernel(["k", "k"])


def test_the_cases_are_decode_sized_and_valid():
    for name, (tokens, hidden, k, in_model, row) in pc.CASES.items():
        assert 1 <= tokens <= 128 and hidden > k > 0, name
        assert (in_model is None) == (row is None)
        assert pc.build(tokens, hidden, "cpu").inputs[0].shape == (tokens, 2 * hidden)  # the table accepts it


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_main_without_a_gpu_exits_2(tmp_path, capsys):
    assert pc.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
