"""What a runner hands the measuring pipeline for one spec, and shared input/oracle helpers.

A Case's timed closure is `fn() == call(*inputs)`: `inputs` are the tensors the kernel reads, and any it
writes in place (memcpy's destination); `call` is the production callable on them, with every non-tensor
argument (shapes, flags, host-side group sizes) bound inside it. `warm` names which inputs are activations:
what a model's previous kernel has just written, so the cold-L2 timing rewrites them into L2 after its
sweep (dirty, as their producer leaves them), while weights and KV caches stay cold. A caller may also call `call` on clones of the inputs (a
clone keeps a tensor's strides, so a column-major operand stays column-major).
"""

from __future__ import annotations

import functools
import zlib
from typing import Callable, NamedTuple

import msgspec

from ..errors import KprofError

__all__ = ["Case", "WrongResult", "Unsupported", "seed_of", "check_shape", "check_close", "check_rows", "torch_dtype", "bind", "algorithm_notes"]


class WrongResult(KprofError):
    """The kernel's result disagrees with the independent oracle: nothing is timed or stored as ok."""


class Unsupported(KprofError):
    """The spec cannot run on this backend/device (a dtype or shape the kernel does not support)."""


class Case(NamedTuple):
    fn: Callable[[], object]  # the timed closure: the production public callable on prepared inputs
    check: Callable[[], None]  # runs the callable once and compares with the oracle; raises WrongResult
    flops: float  # counted floating-point operations of one invocation
    bytes: float  # minimum bytes one invocation must move
    algorithm: str = ""  # the implementation actually selected, when the library says
    kernel_filter: str | None = None  # a stable single kernel's name filter for CUPTI; None sums all
    notes: dict[str, str] = {}
    inputs: tuple = ()  # the tensors the timed callable reads (or writes in place), in call order
    call: Callable | None = None  # fn() == call(*inputs); the timer may call it on clones of the inputs
    # Positions in `inputs` of the activations: what the previous kernel of a model has just written, so in
    # L2 when this one starts (weights and KV caches are not). Cold-L2 timing evicts everything by a read
    # sweep, then rewrites these in place, outside the timed region.
    warm: tuple[int, ...] = ()
    # Loads the case's next input draw into its warm inputs, in place (an MoE layer's routing: which rows go to
    # which expert). Cold-L2 timing calls it after each sweep, instead of rewriting those inputs, so the row is
    # the mean over the draws, as a model's layers each route differently. Called with no argument it writes
    # `inputs`' warm tensors; given a tuple of tensors like them (in `warm` order), it writes those. None: one draw.
    refresh: Callable[..., object] | None = None


def bind(call: Callable, inputs: tuple) -> Callable[[], object]:
    """The timed closure of (call, inputs): a partial, so nothing but the call runs per invocation."""
    return functools.partial(call, *inputs)


def seed_of(spec: msgspec.Struct) -> int:
    """A deterministic seed per spec, so every run builds the same inputs."""
    return zlib.crc32(msgspec.json.encode(spec))


def torch_dtype(name: str):
    import torch

    from ._args import DTYPES

    return getattr(torch, DTYPES[name])


# Relative Frobenius-norm error allowed against an fp64 oracle, by the kernel's dtype. Loose enough for
# the dtype's rounding over long reductions, tight enough that a wrong layout or scale cannot pass.
CHECK_ELEMENTS = 1 << 22  # elements of an oracle's operand checked at once (fp64: 32 MiB per temporary)
TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 2e-2, "fp8_e4m3": 8e-2}
SLICE_ELEMENTS = 16  # the fewest elements of a slice (a row, column or head, or a run of them) check_close holds alone


def check_shape(got, shape: tuple[int, ...], what: str) -> None:
    """Raises WrongResult unless the kernel's whole result has the spec's shape: checked before an oracle samples
    its rows, where a missing one would be an IndexError (a `crash` row) and a block of them never looked at."""
    if tuple(got.shape) != tuple(shape):
        raise WrongResult(f"{what}: result has shape {tuple(got.shape)}, the spec's is {tuple(shape)}")


def check_close(got, ref, dtype: str, what: str) -> None:
    """Raises WrongResult unless `got` has the oracle's shape, the dtype `dtype` names (a row's bytes count its
    output in that dtype), finite values, and a relative error within TOLERANCE[dtype]. Compared as they are, a
    result of another shape would broadcast against the oracle: a crash, or a truncated result passing."""
    import torch

    if tuple(got.shape) != tuple(ref.shape):
        raise WrongResult(f"{what}: result has shape {tuple(got.shape)}, the oracle {tuple(ref.shape)}")
    if got.dtype != torch_dtype(dtype):
        raise WrongResult(f"{what}: result is {got.dtype}, not the {dtype} the spec's row counts")
    got64, ref64 = got.to(ref.device).double(), ref.double()  # the oracle runs where its inputs are
    if not torch.isfinite(got64).all():
        raise WrongResult(f"{what}: result has non-finite values")
    err = (torch.linalg.vector_norm(got64 - ref64) / torch.linalg.vector_norm(ref64).clamp_min(1e-30)).item()
    if err > TOLERANCE[dtype]:
        raise WrongResult(f"{what}: relative error {err:.3g} against the fp64 oracle exceeds {TOLERANCE[dtype]} "
                          f"for {dtype}")
    _check_slices(got64 - ref64, ref64, dtype, what)


def _check_slices(diff, ref, dtype: str, what: str) -> None:
    """Each index of each axis (a row, a column, a head) held to twice the whole's tolerance, and where one index holds
    fewer than SLICE_ELEMENTS elements (a decode GEMM's column holds one), each run of neighbouring indices that holds
    that many (a slice averages fewer roundings: one of a few elements would be a max-error check, which a correct
    bf16 split-K GEMM nears): the whole's norm dilutes an error confined to one of them (a bf16 GEMM's last column
    zeroed, of 4096, read 0.016 and passed). A slice's error is relative to its own norm, or to the whole's rms over as
    many elements where that is larger (a slice near zero rounds at the whole's scale, not its own)."""
    import torch

    if not ref.numel():
        return
    diff2, ref2 = diff.square(), ref.square()
    rms2 = ref2.mean()
    worst = (0.0, 0, 0, 0)  # (relative error, axis, first index, last index)
    for axis, size in enumerate(ref.shape):
        per = ref.numel() // size  # elements of one index
        run = -(-SLICE_ELEMENTS // per)  # indices per slice
        slices = size // run
        if slices < 2:  # one slice is the whole, checked already
            continue
        others = [d for d in range(ref.dim()) if d != axis]
        err2, norm2 = (diff2.sum(others), ref2.sum(others)) if others else (diff2, ref2)
        of = (torch.arange(size, device=ref.device) // run).clamp_max(slices - 1)  # the last slice takes the rest
        err2, norm2 = (x.new_zeros(slices).index_add_(0, of, x) for x in (err2, norm2))
        rel = (err2 / torch.maximum(norm2, rms2 * per * torch.bincount(of)).clamp_min(1e-60)).sqrt()
        at = int(rel.argmax())
        worst = max(worst, (rel[at].item(), axis, at * run, size - 1 if at == slices - 1 else at * run + run - 1))
    error, axis, first, last = worst
    if error > 2 * TOLERANCE[dtype]:
        where = f"index {first}" if first == last else f"indices {first}-{last}"
        raise WrongResult(f"{what}: relative error {error:.3g} at {where} of axis {axis} of the checked result (shape "
                          f"{tuple(ref.shape)}) against the fp64 oracle exceeds {2 * TOLERANCE[dtype]:g} for {dtype} "
                          f"(twice the whole result's {TOLERANCE[dtype]})")


def check_rows(got, ref_of, dtype: str, what: str, shape: tuple[int, ...]) -> None:
    """check_close over blocks of `got`'s rows, each against `ref_of(start, end)`, the fp64 oracle of those rows: the
    oracle's fp64 temporaries stay within CHECK_ELEMENTS whatever the spec's size (whole, a large norm's are several
    times its input: an allocation past the host's memory, which the OOM killer answers, on the CPU). `shape` is the
    whole result's: the blocks follow `got`'s rows, so a result missing whole blocks would otherwise pass."""
    check_shape(got, shape, what)
    step = max(1, CHECK_ELEMENTS // max(1, got[0].numel()))
    for start in range(0, got.shape[0], step):
        check_close(got[start:start + step], ref_of(start, start + step), dtype, what)


def algorithm_notes(case) -> dict[str, str]:
    """The method note naming the algorithm a case ran, where it names one."""
    return {"algorithm_used": case.algorithm} if case.algorithm else {}
