"""Every CUDA runner (backends torch, torch-flash/-efficient/-cudnn/-math, torch-loop) builds, passes its
oracle, and keeps fn() == call(*inputs) on a GPU. Skipped without CUDA."""

import msgspec
import pytest
import torch

from kprof.runners._case import Unsupported, check_close
from kprof.runners.registry import entries, lookup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = {
    "single_gemm": {"m": 128, "n": 256, "k": 512, "dtype": "bf16"},
    "rms_norm": {"tokens": 64, "hidden": 4096, "dtype": "bf16"},
    "silu_mul": {"tokens": 64, "hidden": 2048, "dtype": "bf16"},
    "attention_prefill": {"batch": 2, "seq_len": 256, "num_heads": 16, "num_kv_heads": 4, "head_dim": 128,
                          "causal": True, "dtype": "bf16"},
    "attention_decode": {"batch": 4, "kv_len": 1024, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                         "dtype": "bf16"},
    "moe_grouped_gemm": {"tokens": 256, "experts": 16, "topk": 4, "hidden": 1024, "intermediate": 512,
                         "dtype": "bf16"},
    "memcpy": {"bytes": (64 << 20) + 3},
}
CUDA = [e for e in entries() if e.device == "cuda" and e.metric_family == "compute"]  # collectives: test_comm.py, comm_check.py


def _build(entry, **over):
    if entry.backend == "torch-efficient" and "num_heads" in GPU[entry.table]:
        # the memory-efficient kernel has no grouped-query path for dense inputs: MHA specs only
        over = {"num_kv_heads": GPU[entry.table]["num_heads"], **over}
    spec = msgspec.convert({**GPU[entry.table], **over}, entry.args)
    return entry.load_runner()().build(spec, "cuda")


def _sdp_flags():
    return [torch._C._get_flash_sdp_enabled(), torch._C._get_mem_efficient_sdp_enabled(),
            torch._C._get_math_sdp_enabled(), torch._C._get_cudnn_sdp_enabled()]


def _run_or_skip_cudnn(entry, **over):
    """cuDNN attention's shape support depends on the cuDNN build, and torch._grouped_mm's kernel on the GPU
    generation: an Unsupported there is reported, not failed."""
    try:
        return _build(entry, **over)
    except Unsupported as exc:
        if entry.backend == "torch-cudnn":
            pytest.skip(f"cuDNN SDPA cannot run this spec here: {exc}")
        if (entry.table, entry.backend) == ("moe_grouped_gemm", "torch") and \
                torch.cuda.get_device_capability()[0] not in (9, 10):
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("entry", CUDA, ids=lambda e: f"{e.table}/{e.backend}")
def test_cuda_runner_checks_and_call_matches_fn(entry):
    before = _sdp_flags()
    case = _run_or_skip_cudnn(entry)
    case.check()
    assert all(t.device.type == "cuda" for t in case.inputs)
    out = case.fn().clone()
    again = case.call(*[t.clone() for t in case.inputs])  # the timer's rotated copies
    if entry.table == "memcpy":
        assert torch.equal(again, out)
    else:
        check_close(again, out.double(), GPU[entry.table]["dtype"], entry.table)
    assert case.algorithm and case.bytes > 0 and (case.flops > 0) == (entry.table != "memcpy")
    assert _sdp_flags() == before
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8_e4m3"])
def test_gemm_dtypes(dtype):
    case = _build(lookup("single_gemm", "torch"), dtype=dtype)
    case.check()
    assert case.algorithm == ("torch._scaled_mm" if dtype == "fp8_e4m3" else "torch.matmul")
    if dtype == "fp8_e4m3":
        a8, b8, scale_a, scale_b = case.inputs
        assert b8.stride() == (1, 512) and scale_a.numel() == 1 and case.fn().dtype == torch.bfloat16


def test_gemm_fp8_shape_rules():
    with pytest.raises(Unsupported, match="divisible by 16"):
        _build(lookup("single_gemm", "torch"), n=200, dtype="fp8_e4m3")
    _build(lookup("single_gemm", "torch"), m=1, dtype="fp8_e4m3").check()  # any m


@pytest.mark.parametrize("forced", ["flash", "efficient", "cudnn", "math"])
@pytest.mark.parametrize("table", ["attention_prefill", "attention_decode"])
def test_forced_sdpa_backend_is_the_one_used(table, forced):
    entry = lookup(table, f"torch-{forced}")
    case = _run_or_skip_cudnn(entry)
    assert case.algorithm == forced == case.notes["sdpa_backend"]
    case.check()


@pytest.mark.parametrize("forced", ["flash", "cudnn"])
def test_fp16_bf16_only_backends_refuse_fp32(forced):
    with pytest.raises(Unsupported):
        _build(lookup("attention_prefill", f"torch-{forced}"), dtype="fp32")


@pytest.mark.parametrize("forced", ["efficient", "math"])
def test_fp32_attention(forced):
    case = _build(lookup("attention_decode", f"torch-{forced}"), dtype="fp32")
    case.check()


def test_efficient_backend_refuses_grouped_query_attention():
    with pytest.raises(Unsupported, match="same num_heads"):
        spec = msgspec.convert(GPU["attention_decode"], lookup("attention_decode", "torch-efficient").args)
        lookup("attention_decode", "torch-efficient").load_runner()().build(spec, "cuda")


def test_auto_backend_is_recorded():
    case = _build(lookup("attention_prefill", "torch"))
    assert case.algorithm in ("flash", "efficient", "cudnn", "math")


def test_grouped_mm_bf16_only_and_loop_for_the_rest():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm's grouped kernel needs sm90/sm100")
    grouped = _build(lookup("moe_grouped_gemm", "torch"))
    loop = _build(lookup("moe_grouped_gemm", "torch-loop"))
    check_close(grouped.fn(), loop.fn().double(), "bf16", "grouped vs loop")
    with pytest.raises(msgspec.ValidationError, match="bf16 only"):  # refused at validation: exit 2, no row
        _build(lookup("moe_grouped_gemm", "torch"), dtype="fp16")
    _build(lookup("moe_grouped_gemm", "torch-loop"), dtype="fp16").check()
    # an intermediate size that is not a multiple of 8 (torch pads the output rows)
    _build(lookup("moe_grouped_gemm", "torch"), intermediate=500).check()


def test_memcpy_notes_the_cupti_record():
    case = _build(lookup("memcpy", "torch"))
    assert "cudaMemcpyAsync" in case.notes["gpu_op"] and case.bytes == 2 * GPU["memcpy"]["bytes"]
