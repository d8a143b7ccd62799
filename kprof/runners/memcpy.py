"""memcpy: copy `bytes` bytes between two buffers of one device, `dst.copy_(src)` on uint8 tensors.

On CUDA a same-dtype contiguous copy_ is one cudaMemcpyAsync device-to-device: CUPTI reports it as a
MEMCPY activity record, not a kernel (a CUPTI timer must enable that activity kind; see the case's
notes). On CPU it is ATen's copy loop.

The source holds a random byte pattern (values 1-255) with a prime period, so no page or cache line
repeats at a power-of-two stride and no byte is zero. The oracle resets the destination to the bitwise
complement of the source (so a copy that does nothing fails), runs the copy, checks the whole destination
equals the source, and checks sampled bytes against the host-side pattern.

Counted work per invocation: flops = 0 (tflops is null); minimum bytes = 2·bytes (every byte read once and
written once).
"""

from __future__ import annotations

from ._args import KernelArgs, Size
from ._case import Case, WrongResult, bind, seed_of

PERIOD = 1_048_573  # a prime just under 1 MiB: the source pattern's period
SAMPLES = 4096  # bytes the oracle compares against the host-side pattern


class MemcpyArgs(KernelArgs, frozen=True):
    bytes: Size


class Memcpy:
    @staticmethod
    def held_bytes(spec: MemcpyArgs) -> int:
        """The source and the destination: the least the case holds at once."""
        return 2 * spec.bytes

    def build(self, spec: MemcpyArgs, device: str) -> Case:
        import torch

        n = spec.bytes
        g = torch.Generator().manual_seed(seed_of(spec))
        tile = torch.randint(1, 256, (min(n, PERIOD),), generator=g, dtype=torch.uint8)
        src = torch.empty(n, dtype=torch.uint8, device=device)
        full, rest = divmod(n, len(tile))
        tile_dev = tile.to(device)
        if full:
            src[:full * len(tile)].view(full, len(tile)).copy_(tile_dev.expand(full, len(tile)))
        if rest:
            src[full * len(tile):].copy_(tile_dev[:rest])
        dst = torch.bitwise_not(src)
        inputs = (dst, src)

        def call(dst, src):
            return dst.copy_(src)

        fn = bind(call, inputs)
        where = torch.cat([torch.tensor([0, n - 1]), torch.randint(0, n, (SAMPLES,), generator=g)])

        def check():
            torch.bitwise_not(src, out=dst)
            out = fn()
            if not torch.equal(out, src):
                raise WrongResult(f"memcpy: the destination differs from the source in "
                                  f"{int((out != src).sum())} of {n} bytes")
            if not torch.equal(out[where.to(out.device)].cpu(), tile[where % len(tile)]):
                raise WrongResult("memcpy: sampled bytes differ from the source pattern")

        on_cuda = torch.device(device).type == "cuda"
        notes = {"gpu_op": "cudaMemcpyAsync device-to-device (a CUPTI MEMCPY record, not a kernel)"} if on_cuda else {}
        return Case(fn, check, flops=0.0, bytes=2.0 * n, algorithm="Tensor.copy_", notes=notes, inputs=inputs,
                    call=call)
