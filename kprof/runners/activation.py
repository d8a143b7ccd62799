"""silu_mul: out = silu(x[:, :h]) · x[:, h:], the gated MLP activation, as the production torch code
writes it (two kernels: silu, then the product; the timed closure includes both).

Counted work per invocation: flops = 5·tokens·hidden (silu as x·sigmoid(x): negate, exp, add, divide,
then the product); minimum bytes = x read (tokens·2·hidden) + out written (tokens·hidden), in the spec
dtype. The intermediate silu tensor the two-kernel form writes and reads back is not minimum traffic.
"""

from __future__ import annotations

from ._args import DTYPE_BYTES, FloatDtype, KernelArgs, Size
from ._case import Case, bind, check_rows, seed_of, torch_dtype


class SiluMulArgs(KernelArgs, frozen=True):
    tokens: Size
    hidden: Size  # the output width; the input is [tokens, 2 * hidden]
    dtype: FloatDtype


class SiluMul:
    @staticmethod
    def held_bytes(spec: SiluMulArgs) -> int:
        """Bytes of the [tokens, 2 * hidden] input and the output: the least the case holds at once."""
        return DTYPE_BYTES[spec.dtype] * 3 * spec.tokens * spec.hidden

    @classmethod
    def peak_bytes(cls, spec: SiluMulArgs) -> int:
        """The most the build holds at once: the input drawn in fp32 beside its copy in the spec's dtype."""
        size = DTYPE_BYTES[spec.dtype]
        return max(cls.held_bytes(spec), (4 + size * (size != 4)) * 2 * spec.tokens * spec.hidden)

    def build(self, spec: SiluMulArgs, device: str) -> Case:
        import torch
        import torch.nn.functional as F

        dt = torch_dtype(spec.dtype)
        g = torch.Generator(device).manual_seed(seed_of(spec))  # drawn on the device: fast for large inputs
        x = torch.randn(spec.tokens, 2 * spec.hidden, generator=g, device=device).mul_(2).to(dtype=dt)
        h = spec.hidden
        inputs = (x,)

        def call(x):
            return F.silu(x[:, :h]) * x[:, h:]

        fn = bind(call, inputs)

        def ref_of(start, end):
            x64 = x[start:end].double()
            gate, up = x64[:, :h], x64[:, h:]
            return gate / (1 + torch.exp(-gate)) * up

        def check():
            check_rows(fn(), ref_of, spec.dtype, "silu_mul", (spec.tokens, spec.hidden))

        n = spec.tokens * spec.hidden
        return Case(fn, check, flops=5.0 * n, bytes=float(self.held_bytes(spec)),
                    algorithm="silu(x[:, :h]) * x[:, h:]", inputs=inputs, call=call, warm=(0,))
