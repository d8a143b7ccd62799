"""single_gemm: C[m, n] = A[m, k] @ B[k, n], through torch.matmul (cuBLAS on CUDA, oneDNN/MKL on CPU)."""

from __future__ import annotations

from ._args import DTYPE_BYTES, GemmDtype, KernelArgs, Size
from ._case import Case, Unsupported, check_close, seed_of, torch_dtype

ORACLE_ROWS = 64  # the fp64 oracle recomputes this many sampled rows: independent, and cheap for big shapes


class SingleGemmArgs(KernelArgs, frozen=True):
    m: Size
    n: Size
    k: Size
    dtype: GemmDtype


class SingleGemm:
    def build(self, spec: SingleGemmArgs, device: str) -> Case:
        import torch

        if spec.dtype == "fp8_e4m3":
            raise Unsupported("fp8_e4m3 GEMM needs torch._scaled_mm on a CUDA device; use backend torch")
        dt = torch_dtype(spec.dtype)
        g = torch.Generator().manual_seed(seed_of(spec))
        # Activations ~ N(0, 1); weights scaled by 1/sqrt(k) so outputs stay O(1) as in a real layer.
        a = torch.randn(spec.m, spec.k, generator=g).to(device=device, dtype=dt)
        b = (torch.randn(spec.k, spec.n, generator=g) / spec.k ** 0.5).to(device=device, dtype=dt)
        rows = torch.randperm(spec.m, generator=g)[:ORACLE_ROWS]

        def fn():
            return torch.matmul(a, b)

        def check():
            c = fn()
            ref = a[rows.to(a.device)].double().cpu() @ b.double().cpu()
            check_close(c[rows.to(c.device)].cpu(), ref, spec.dtype, "single_gemm")

        size = DTYPE_BYTES[spec.dtype]
        return Case(fn, check, flops=2.0 * spec.m * spec.n * spec.k,
                    bytes=float(size * (spec.m * spec.k + spec.k * spec.n + spec.m * spec.n)))
