"""single_gemm: C[m, n] = A[m, k] @ B[k, n].

- bf16/fp16/fp32: torch.matmul (cuBLAS on CUDA, oneDNN/MKL on CPU), B row-major.
- fp8_e4m3 (CUDA only): torch._scaled_mm with per-tensor fp32 scales scale_a/scale_b (amax / 448, the
  e4m3 maximum), bf16 output, use_fast_accum=False, and B column-major as _scaled_mm requires. The
  quantization happens at build time: the timed call is the scaled GEMM alone. The oracle is the fp64
  product of the dequantized fp8 inputs, so it checks the GEMM and its scales, not the quantization.

Counted work per invocation: flops = 2·m·n·k; minimum bytes = A + B read once + C written once
(bytes of each operand's dtype; fp8: 1-byte A and B, 2-byte bf16 C, plus the two 4-byte scales).
"""

from __future__ import annotations

from ._args import DTYPE_BYTES, FloatDtype, GemmDtype, KernelArgs, Size
from ._case import CHECK_ELEMENTS, Case, Unsupported, WrongResult, bind, check_close, check_shape, seed_of, torch_dtype

ORACLE_ROWS = 64  # the fp64 oracle recomputes at most this many rows: independent, and cheap for big shapes
E4M3_MAX = 448.0  # largest finite float8_e4m3fn

# The process-wide cuBLAS settings the `torch` backend's numerics string names (torch's defaults). A row
# measured under other settings would carry a numerics string that is not true, so the runner refuses.
CUDA_MATMUL_DEFAULTS = {"float32_matmul_precision": "highest", "allow_fp16_reduced_precision_reduction": True,
                        "allow_bf16_reduced_precision_reduction": True, "allow_fp16_accumulation": False}


class SingleGemmArgs(KernelArgs, frozen=True):
    m: Size
    n: Size
    k: Size
    dtype: GemmDtype


class CpuGemmArgs(SingleGemmArgs, frozen=True):
    """single_gemm on the CPU: fp8_e4m3 needs torch._scaled_mm on CUDA, so the CPU backend's specs refuse it at
    validation (exit 2, nothing written) instead of storing a failed row. Same fields, so the same keys."""

    dtype: FloatDtype


def require_default_cuda_matmul() -> None:
    """Raises Unsupported when this process changed a cuBLAS setting the contract's numerics depend on."""
    import torch

    cublas = torch.backends.cuda.matmul
    now = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
           **{name: getattr(cublas, name, CUDA_MATMUL_DEFAULTS[name])  # a torch without the knob: its default
              for name in CUDA_MATMUL_DEFAULTS if name.startswith("allow_")}}
    changed = {name: value for name, value in now.items() if value != CUDA_MATMUL_DEFAULTS[name]}
    if changed:
        raise Unsupported(f"cuBLAS settings {changed} differ from the torch defaults the backend's numerics "
                          f"record ({CUDA_MATMUL_DEFAULTS}); restore them before measuring")


def require_fp32_cpu_matmul() -> None:
    """Raises Unsupported when this process let oneDNN compute fp32 matmuls in a lower precision
    (`torch.set_float32_matmul_precision("high")` or `("medium")`: tf32 or bf16 on CPUs that have them), which
    a torch-cpu fp32 row's numerics (fp32) would not say."""
    import torch

    # oneDNN's own setting, "none" (torch's default) or "ieee" for fp32; a torch without it has the global one alone
    now = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None) or \
        torch.get_float32_matmul_precision()
    if now not in ("none", "ieee", "highest"):
        raise Unsupported(f"this process lets oneDNN compute fp32 matmuls in {now} "
                          f"(torch.backends.mkldnn.matmul.fp32_precision, set by torch.set_float32_matmul_precision), "
                          f"not the fp32 a torch-cpu fp32 row records; call torch.set_float32_matmul_precision("
                          f"'highest') before measuring")


class SingleGemm:
    @staticmethod
    def held_bytes(spec: SingleGemmArgs) -> int:
        """Bytes of A, B and C in their dtypes (fp8: 1-byte A and B, a bf16 C): the least the case holds at once."""
        if spec.dtype == "fp8_e4m3":
            return spec.m * spec.k + spec.k * spec.n + 2 * spec.m * spec.n
        return DTYPE_BYTES[spec.dtype] * (spec.m * spec.k + spec.k * spec.n + spec.m * spec.n)

    @classmethod
    def peak_bytes(cls, spec: SingleGemmArgs) -> int:
        """The most the build holds at once: A and B drawn in fp32 beside their copies in the spec's dtype."""
        size = 1 if spec.dtype == "fp8_e4m3" else DTYPE_BYTES[spec.dtype]
        drawn = (4 + size * (size != 4)) * (spec.m * spec.k + spec.k * spec.n)
        return max(cls.held_bytes(spec), drawn)

    def build(self, spec: SingleGemmArgs, device: str) -> Case:
        import torch

        on_cuda = torch.device(device).type == "cuda"
        if spec.dtype == "fp8_e4m3" and not on_cuda:
            raise Unsupported("fp8_e4m3 GEMM needs torch._scaled_mm on a CUDA device; use backend torch")
        if on_cuda:
            require_default_cuda_matmul()
        elif spec.dtype == "fp32":
            require_fp32_cpu_matmul()
        # Inputs are drawn on the device itself (a host draw of a large operand costs seconds), from a
        # generator seeded by the spec: the same inputs on every run of one device and torch.
        g = torch.Generator(device).manual_seed(seed_of(spec))
        # Activations ~ N(0, 1); weights scaled by 1/sqrt(k) so outputs stay O(1) as in a real layer.
        a = torch.randn(spec.m, spec.k, generator=g, device=device)
        b = torch.randn(spec.k, spec.n, generator=g, device=device).div_(spec.k ** 0.5)  # in place: no 2nd copy
        # The first and last rows (a tail tile's bug shows in the last), and random ones: a spec's sample left both
        # out as often as not once m passes ORACLE_ROWS.
        rows = torch.randperm(spec.m, generator=torch.Generator().manual_seed(seed_of(spec)))[:ORACLE_ROWS - 2]
        rows = torch.cat([torch.tensor([0, spec.m - 1]), rows]).unique()
        if spec.dtype == "fp8_e4m3":
            return _fp8_case(spec, device, a, b, rows)

        dt = torch_dtype(spec.dtype)
        inputs = (a.to(device=device, dtype=dt), b.to(device=device, dtype=dt))

        def call(a, b):
            return torch.matmul(a, b)

        def check():
            c = fn()
            check_shape(c, (spec.m, spec.n), "single_gemm")
            a_, b_ = inputs
            a64 = a_[rows.to(a_.device)].double()
            ref = a64.new_zeros(a64.shape[0], spec.n)
            step = max(1, CHECK_ELEMENTS // spec.n)  # B in fp64 a block of k at a time: whole, 4x a bf16 B
            for s in range(0, spec.k, step):
                ref += a64[:, s:s + step] @ b_[s:s + step].double()
            check_close(c[rows.to(c.device)], ref, spec.dtype, "single_gemm")

        fn = bind(call, inputs)
        return Case(fn, check, flops=2.0 * spec.m * spec.n * spec.k, bytes=float(self.held_bytes(spec)),
                    algorithm="torch.matmul", inputs=inputs, call=call, warm=(0,))


def _fp8_case(spec: SingleGemmArgs, device: str, a, b, rows) -> Case:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise Unsupported(f"torch._scaled_mm (fp8_e4m3) needs compute capability >= 8.9; this GPU is sm{major}{minor}")
    if spec.k % 16 or spec.n % 16:
        raise Unsupported(f"torch._scaled_mm needs k and n divisible by 16; got k={spec.k}, n={spec.n}")
    fp8 = torch.float8_e4m3fn

    def quantize(x):  # per-tensor scale: the tensor's amax maps to the e4m3 maximum
        scale = x.abs().max().clamp_min(1e-12) / E4M3_MAX
        return (x / scale).to(fp8), scale.to(torch.float32)

    a8, scale_a = quantize(a)
    bt8, scale_b = quantize(b.T.contiguous())  # B stored [n, k] row-major: b8 = bt8.T is [k, n] column-major
    inputs = (a8.to(device), bt8.to(device).T, scale_a.to(device), scale_b.to(device))

    def call(a, b, scale_a, scale_b):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                use_fast_accum=False)

    def check():
        c = fn()
        if c.dtype != torch.bfloat16:
            raise WrongResult(f"single_gemm fp8_e4m3: torch._scaled_mm returned {c.dtype}, not bf16")
        check_shape(c, (spec.m, spec.n), "single_gemm fp8_e4m3")
        dev = c.device  # fp64 on the kernel's device: the oracle's K x N product is costly on the host
        a64 = a8[rows].to(dev).double() * scale_a.to(dev).double()
        b64 = bt8.T.to(dev).double() * scale_b.to(dev).double()
        # bf16 output rounding is the only error left once the oracle sees the same fp8 inputs and scales
        check_close(c[rows.to(dev)], a64 @ b64, "bf16", "single_gemm fp8_e4m3 (torch._scaled_mm)")

    fn = bind(call, inputs)
    return Case(fn, check, flops=2.0 * spec.m * spec.n * spec.k,
                bytes=float(spec.m * spec.k + spec.k * spec.n + 2 * spec.m * spec.n + 8),
                algorithm="torch._scaled_mm", inputs=inputs, call=call, warm=(0, 2),
                notes={"fp8_scales": "per-tensor fp32 scale_a, scale_b = amax/448", "fp8_out_dtype": "bf16"})
