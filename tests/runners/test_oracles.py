"""The runners' oracles against wrong kernels: a result of the wrong shape or dtype, and a wrong value in the rows,
heads or batches an oracle samples, fail the check as `wrong_result` (never a `crash` row, never an ok one).
test_cpu_runners.py holds the tolerances and the sabotage of every value."""

import msgspec
import pytest
import torch
import torch.nn.functional as F

from kprof.runners import moe
from kprof.runners._case import WrongResult
from kprof.runners.registry import lookup
from kprof.runners.worker import classify
from test_cpu_runners import CALLABLE as TIMED, SMALL  # the small spec of each table, the callable each times

# The families whose result the callable returns whole (MoE's expert loop: its own test below).
CALLABLE = {table: timed for table, timed in TIMED.items() if table != "moe_grouped_gemm"}


def _case(table, dtype, backend="torch-cpu", runner=None, **shape):
    entry = lookup(table, backend)
    spec = msgspec.convert({**(shape or SMALL[table]), "dtype": dtype}, entry.args)
    return (runner or entry.load_runner())().build(spec, "cpu")


def _dropping_last_row(real):
    def kernel(*a, **kw):  # the whole result less its last row (the last query of every attention head)
        out = real(*a, **kw)
        return out[..., :-1, :] if out.dim() == 4 else out[:-1]
    return kernel


def _upcast(real):
    return lambda *a, **kw: real(*a, **kw).float()  # right values, in fp32 where the spec says bf16


# silu_mul's patched silu is one factor of a product: a row fewer does not broadcast, and the kernel itself fails.
@pytest.mark.parametrize("table, sabotage, match", [
    *[(t, _dropping_last_row, "result has shape") for t in CALLABLE if t != "silu_mul"],
    *[(t, _upcast, "result is torch.float32") for t in CALLABLE],
], ids=lambda v: getattr(v, "__name__", v))
def test_a_result_of_the_wrong_shape_or_dtype_is_a_wrong_result(table, sabotage, match, monkeypatch):
    """A result missing rows was compared by broadcasting against the oracle (a `crash` row, or an IndexError where
    the oracle samples rows), and a result in another dtype than the row's bytes count was stored as ok."""
    case = _case(table, "bf16")
    module, name = CALLABLE[table]
    monkeypatch.setattr(module, name, sabotage(getattr(module, name)))
    with pytest.raises(WrongResult, match=match) as caught:
        case.check()
    assert classify(caught.value) == "wrong_result"


@pytest.mark.parametrize("sabotage, match", [(lambda out: out[:-1], "result has shape"),
                                             (lambda out: out.float(), "result is torch.float32")])
def test_moe_result_of_the_wrong_shape_or_dtype_is_a_wrong_result(sabotage, match, monkeypatch):
    """The same for the MoE GEMM, through torch._grouped_mm (its CPU loop: the runner's CUDA-only guard lifted), as the
    expert loop writes into one output it makes itself."""
    monkeypatch.setattr(moe, "_require_grouped_mm", lambda *a: None)
    case = _case("moe_grouped_gemm", "bf16", backend="torch", runner=moe.MoeGroupedMm)
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: sabotage(real(*a, **kw)))
    with pytest.raises(WrongResult, match=match) as caught:
        case.check()
    assert classify(caught.value) == "wrong_result"


def test_a_result_missing_whole_blocks_of_rows_is_a_wrong_result(monkeypatch):
    """The row-block oracle follows the result's rows: one holding only its first blocks was checked block by block
    and passed."""
    import kprof.runners._case as case_module

    monkeypatch.setattr(case_module, "CHECK_ELEMENTS", 64)  # one 64-wide row per block
    case = _case("rms_norm", "fp32")
    real = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda *a, **kw: real(*a, **kw)[:4])
    with pytest.raises(WrongResult, match=r"result has shape \(4, 64\), the spec's is \(8, 64\)"):
        case.check()


@pytest.mark.parametrize("table, shape", [
    ("attention_prefill", {"batch": 1, "seq_len": 16, "num_heads": 8, "num_kv_heads": 8, "head_dim": 16,
                           "causal": False}),
    ("attention_prefill", {"batch": 3, "seq_len": 16, "num_heads": 8, "num_kv_heads": 2, "head_dim": 16,
                           "causal": True}),
    ("attention_decode", {"batch": 1, "kv_len": 32, "num_heads": 8, "num_kv_heads": 2, "head_dim": 16}),
])
def test_attention_oracle_checks_the_last_heads(table, shape, monkeypatch):
    """The oracle's (batch, head) pairs took heads i * 104729 % num_heads: 0-3 of 8, so a kernel wrong in the second
    half of the heads (the last kv head's group, with GQA) was stored as ok."""
    case = _case(table, "bf16", **shape)
    case.check()
    real = F.scaled_dot_product_attention

    def second_half_wrong(*a, **kw):
        out = real(*a, **kw)
        out[:, out.shape[1] // 2:] *= 1.5
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", second_half_wrong)
    with pytest.raises(WrongResult, match="relative error"):
        case.check()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("row", ["first", "last"])
def test_gemm_oracle_checks_the_first_and_last_rows(dtype, row, monkeypatch):
    """The oracle recomputed 64 random rows of C: at m=256 neither the first nor the last (a tail tile's) for fp32, so
    a kernel wrong there alone was stored as ok."""
    case = _case("single_gemm", dtype, m=256, n=48, k=64)
    case.check()
    real = torch.matmul

    def one_row_wrong(*a, **kw):
        out = real(*a, **kw)
        out[0 if row == "first" else -1] *= 1.5
        return out

    monkeypatch.setattr(torch, "matmul", one_row_wrong)
    with pytest.raises(WrongResult, match="relative error"):
        case.check()



def _last_column_zeroed(real):
    def kernel(*a, **kw):  # right but for the last column (a GEMM's last output feature, a norm's last channel)
        out = real(*a, **kw).clone()
        out[..., -1] = 0
        return out
    return kernel


@pytest.mark.parametrize("table, shape", [("single_gemm", {"m": 64, "n": 4096, "k": 32}),
                                          ("rms_norm", {"tokens": 16, "hidden": 16384})])
def test_one_wrong_column_of_a_wide_result_is_a_wrong_result(table, shape, monkeypatch):
    """The check was one relative norm over the whole result, which one wrong column among thousands barely moves: a
    bf16 GEMM with n=4096 whose last column was zeroed read 0.016 against a tolerance of 0.02 and was stored as ok.
    Each row and column (each head, for attention) is now held to the tolerance too."""
    case = _case(table, "bf16", **shape)
    case.check()
    module, name = TIMED[table]
    monkeypatch.setattr(module, name, _last_column_zeroed(getattr(module, name)))
    with pytest.raises(WrongResult, match=r"relative error .* at index \d+ of axis 1 ") as caught:
        case.check()
    assert classify(caught.value) == "wrong_result"


def _last_column_off_by_one(real):
    def kernel(*a, **kw):  # right but for the last column, one off (a bias or a tail tile written to the wrong place)
        out = real(*a, **kw).clone()
        out[..., -1] += 1
        return out
    return kernel


@pytest.mark.parametrize("table, shape", [("single_gemm", {"m": 1, "n": 4096, "k": 32}),
                                          ("single_gemm", {"m": 8, "n": 4096, "k": 32}),
                                          ("rms_norm", {"tokens": 1, "hidden": 16384})])
def test_one_wrong_column_of_a_result_with_few_rows_is_a_wrong_result(table, shape, monkeypatch):
    """A column of fewer than 16 elements (a decode GEMM's: one per row) was not checked alone, so a bf16 GEMM with
    m=1 and n=4096 whose last column was off by the outputs' scale was stored as ok. Runs of neighbouring columns that
    hold 16 elements are held to the tolerance now."""
    case = _case(table, "bf16", **shape)
    case.check()
    module, name = TIMED[table]
    monkeypatch.setattr(module, name, _last_column_off_by_one(getattr(module, name)))
    last = shape.get("n", shape.get("hidden")) - 1
    with pytest.raises(WrongResult, match=rf"relative error .* at indices \d+-{last} of axis 1 ") as caught:
        case.check()
    assert classify(caught.value) == "wrong_result"
