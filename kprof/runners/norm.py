"""rms_norm: y = x / sqrt(mean(x²) + eps) · w over the last dim, through torch.nn.functional.rms_norm.

Counted work per invocation: flops = 4·tokens·hidden (square, sum, scale by the rsqrt, multiply by w);
minimum bytes = x read + y written (tokens·hidden each) + w read (hidden), in the spec dtype.
"""

from __future__ import annotations

from ._args import DTYPE_BYTES, FloatDtype, KernelArgs, Size
from ._case import Case, bind, check_rows, seed_of, torch_dtype

EPS = 1e-6


class RmsNormArgs(KernelArgs, frozen=True):
    tokens: Size
    hidden: Size
    dtype: FloatDtype


class RmsNorm:
    @staticmethod
    def held_bytes(spec: RmsNormArgs) -> int:
        """Bytes of x, its output and the weight: the least the case holds at once."""
        return DTYPE_BYTES[spec.dtype] * (2 * spec.tokens * spec.hidden + spec.hidden)

    @classmethod
    def peak_bytes(cls, spec: RmsNormArgs) -> int:
        """The most the build holds at once: x drawn in fp32 beside its copy in the spec's dtype."""
        size = DTYPE_BYTES[spec.dtype]
        return max(cls.held_bytes(spec), (4 + size * (size != 4)) * spec.tokens * spec.hidden + 4 * spec.hidden)

    def build(self, spec: RmsNormArgs, device: str) -> Case:
        import torch
        import torch.nn.functional as F

        dt = torch_dtype(spec.dtype)
        g = torch.Generator(device).manual_seed(seed_of(spec))  # drawn on the device: fast for large inputs
        # Hidden states with per-channel scale spread (as residual streams have), weights around 1. In place: one
        # fp32 draw of x at a time, not two.
        scale = torch.rand(spec.hidden, generator=g, device=device) * 4 + 0.25
        x = torch.randn(spec.tokens, spec.hidden, generator=g, device=device).mul_(scale).to(dtype=dt)
        w = (1 + 0.1 * torch.randn(spec.hidden, generator=g, device=device)).to(dtype=dt)
        shape = (spec.hidden,)
        inputs = (x, w)

        def call(x, w):
            return F.rms_norm(x, shape, w, EPS)

        fn = bind(call, inputs)

        def ref_of(start, end):
            x64 = x[start:end].double()
            return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()

        def check():
            check_rows(fn(), ref_of, spec.dtype, "rms_norm", (spec.tokens, spec.hidden))

        n = spec.tokens * spec.hidden
        return Case(fn, check, flops=4.0 * n, bytes=float(self.held_bytes(spec)),
                    algorithm="torch.nn.functional.rms_norm", inputs=inputs, call=call, warm=(0,))
