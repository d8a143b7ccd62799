"""Collectives: all_reduce, all_gather, reduce_scatter and all_to_all through torch.distributed, one process per rank.

Backends: `nccl` (one GPU per rank; a spec needs `world_size` GPUs) and `gloo` (CPU processes: the CPU twin that
runs the whole path in CI). A spec is (message_size_bytes, dtype, world_size); the ranks are started and timed
by `kprof.runners._ranks`: a collective needs every rank to run the same iterations, so its specs do not go
through the per-call adaptive timer.

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md there):
- `message_size_bytes` is nccl-tests' "size": the buffer each rank sends for all_reduce and all_to_all, and the
  whole gathered (all_gather) or scattered (reduce_scatter) buffer, i.e. world_size times the per-rank part.
- algbw = message_size_bytes / time; busbw = algbw x the collective's bus factor: 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather, reduce_scatter and all_to_all. busbw is comparable across world sizes and with the
  links' bandwidth; at world_size 1 the factor (and busbw) is 0.

Inputs and oracle: element i of the pattern is p(i) = i % 7 + 1 (never zero, no power-of-two period); rank r
holds (r+1)·p(i) (all_gather: its own slice of the pattern). Every output has a closed form, mult(i)·p(g(i)),
compared elementwise: exactly while every value is a small integer the dtype holds exactly (sums over world sizes up
to 8 in bf16, 23 in fp16, any in fp32), else with a relative tolerance of world_size units of the dtype's rounding.
A wrong chunk order is off by at least 1/7, a missing rank's part of a sum by at least 2/(n(n+1)): caught exactly
where the sums are exact. Counted work: flops = 0; bytes as above.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

import msgspec

from ._args import DTYPE_BYTES, FloatDtype, KernelArgs, Size
from ._case import WrongResult

__all__ = ["AllReduceArgs", "AllGatherArgs", "ReduceScatterArgs", "AllToAllArgs", "COLLECTIVES", "Collective",
           "CommCase", "AllReduce", "AllGather", "ReduceScatter", "AllToAll", "comm_metrics"]

WorldSize = Annotated[int, msgspec.Meta(gt=0, le=1024)]
_PERIOD = 7
_CHUNK = 1 << 24  # elements filled or checked per step: bounded temporaries on a 1 GiB message


class _CommArgs(KernelArgs, frozen=True):
    message_size_bytes: Size
    dtype: FloatDtype
    world_size: WorldSize


def _check_size(spec, split: bool) -> None:
    """message_size_bytes holds whole elements, and (split: the collective cuts it into one part per rank) whole
    parts. A function the tables' __post_init__ call: the key's canonical twin of a KernelArgs copies only that."""
    unit = DTYPE_BYTES[spec.dtype] * (spec.world_size if split else 1)
    if spec.message_size_bytes % unit:
        what = (f"world_size x the {spec.dtype} element size ({spec.world_size} x {DTYPE_BYTES[spec.dtype]} = {unit} "
                f"bytes): it is split into one part per rank") if split else f"the {spec.dtype} element size ({unit} bytes)"
        raise ValueError(f"field \"message_size_bytes\" = {spec.message_size_bytes} is not a multiple of {what}; "
                         f"e.g. {max(unit, spec.message_size_bytes // unit * unit)}")


class AllReduceArgs(_CommArgs, frozen=True):
    def __post_init__(self):
        _check_size(self, False)


class AllGatherArgs(_CommArgs, frozen=True):
    def __post_init__(self):
        _check_size(self, True)


class ReduceScatterArgs(_CommArgs, frozen=True):
    def __post_init__(self):
        _check_size(self, True)


class AllToAllArgs(_CommArgs, frozen=True):
    def __post_init__(self):
        _check_size(self, True)


class Collective(NamedTuple):
    table: str
    args: type
    bus: str  # the bus factor as text, for the row's notes
    calls: tuple[str, ...]  # torch.distributed functions, newest name first (the first that exists is used)

    def bus_factor(self, n: int) -> float:
        return 2 * (n - 1) / n if self.table == "all_reduce" else (n - 1) / n


COLLECTIVES = {c.table: c for c in (
    Collective("all_reduce", AllReduceArgs, "2(n-1)/n", ("all_reduce",)),
    Collective("all_gather", AllGatherArgs, "(n-1)/n", ("all_gather_single", "all_gather_into_tensor")),
    Collective("reduce_scatter", ReduceScatterArgs, "(n-1)/n", ("reduce_scatter_single", "reduce_scatter_tensor")),
    Collective("all_to_all", AllToAllArgs, "(n-1)/n", ("all_to_all_single",)),
)}


def comm_metrics(table: str, spec, time_ms: float, energy_j: float | None) -> dict:
    """The comm family's metrics of one row (see the module docstring for the definitions)."""
    algbw = spec.message_size_bytes / (time_ms / 1e3) / 1e9
    return {"time_ms": time_ms, "algbw_gbps": algbw, "busbw_gbps": algbw * COLLECTIVES[table].bus_factor(spec.world_size),
            "message_size_bytes": spec.message_size_bytes, "energy_j": energy_j}


class CommCase(NamedTuple):
    """What measure_specs hands a comm device: the collective and its spec. The ranks build the buffers and run the
    oracle check (before any timing) inside `CommDevice.measure` (kprof.runners._comm_device); `check` here has
    nothing left to do."""

    table: str
    spec: _CommArgs
    check: object = lambda: None

    def metrics(self, time_ms: float, energy_j: float | None) -> dict:
        return comm_metrics(self.table, self.spec, time_ms, energy_j)


# What one rank process holds before its buffers: a fresh interpreter with torch and torch.distributed imported (about
# 230 MB resident with torch 2.x on the CPU; counted low, so only a group that cannot fit is refused).
RANK_PROCESS_BYTES = 200 << 20


class _Runner:
    table = ""
    held_what = "its ranks' buffers, and each rank's interpreter with torch (about 200 MiB a rank)"

    def build(self, spec, device: str) -> CommCase:
        return CommCase(self.table, spec)

    def held_bytes(self, spec) -> int:
        """The bytes the ranks take together: each rank's input, output and pristine input copy, as `rank_buffers`
        makes them, plus the rank process itself, times world_size. On the CPU (gloo) every rank is a process of this
        host, so a spec past its memory is an `oom` row before any rank starts (the worker compares; see worker.py).
        The processes count: 1,000 ranks of a 4 KiB message need ~200 GB, and starting them had the OOM killer end
        the run itself (exit 137, no row, the rank directory left behind)."""
        return (_rank_bytes(self.table, spec) + RANK_PROCESS_BYTES) * spec.world_size


class AllReduce(_Runner):
    table = "all_reduce"


class AllGather(_Runner):
    table = "all_gather"


class ReduceScatter(_Runner):
    table = "reduce_scatter"


class AllToAll(_Runner):
    table = "all_to_all"


def _rank_bytes(table: str, spec) -> int:
    """One rank's buffers in bytes: input, output (all_reduce: in place) and the pristine input `reset` copies."""
    whole = spec.message_size_bytes
    part = whole // spec.world_size
    return {"all_reduce": 2 * whole, "all_gather": 2 * part + whole, "reduce_scatter": 2 * whole + part,
            "all_to_all": 3 * whole}[table]


# --- inside a rank process (kprof.runners._ranks) --------------------------------------------------------------

class RankBuffers(NamedTuple):
    op: object  # () -> None: the collective on the buffers (the timed call)
    reset: object  # () -> None: rewrites the input (all_reduce works in place), as its producer would have
    check: object  # () -> None: reset, op, compare with the closed form; raises WrongResult
    used: str  # the torch.distributed function called


def _fill(t, offset: int, scale: float) -> None:
    """t[i] = scale * p(offset + i), in steps of _CHUNK elements."""
    import torch

    for s in range(0, t.numel(), _CHUNK):
        idx = torch.arange(offset + s, offset + min(s + _CHUNK, t.numel()), device=t.device)
        t[s:s + idx.numel()].copy_((idx % _PERIOD + 1).to(torch.float32) * scale)


def rank_buffers(table: str, spec, rank: int, device) -> RankBuffers:
    """The buffers of `rank` for one spec, the collective on them, and its oracle (a closed form per element)."""
    import torch
    import torch.distributed as dist

    from ._case import torch_dtype

    n, dtype = spec.world_size, torch_dtype(spec.dtype)
    elements = spec.message_size_bytes // DTYPE_BYTES[spec.dtype]
    part = elements // n
    c = COLLECTIVES[table]
    used = next(name for name in c.calls if hasattr(dist, name))
    call = getattr(dist, used)
    total = n * (n + 1) / 2  # sum over ranks of (r+1)
    if table == "all_reduce":
        inp = torch.empty(elements, dtype=dtype, device=device)
        out, pristine = inp, torch.empty_like(inp)
        _fill(pristine, 0, rank + 1)
        op = lambda: call(inp)  # noqa: E731
        expect = (lambda i: total, lambda i: i)
    elif table == "all_gather":
        inp, out = torch.empty(part, dtype=dtype, device=device), torch.empty(elements, dtype=dtype, device=device)
        pristine = torch.empty_like(inp)
        _fill(pristine, rank * part, rank + 1)
        op = lambda: call(out, inp)  # noqa: E731
        expect = (lambda i: i // part + 1, lambda i: i)
    elif table == "reduce_scatter":
        inp, out = torch.empty(elements, dtype=dtype, device=device), torch.empty(part, dtype=dtype, device=device)
        pristine = torch.empty_like(inp)
        _fill(pristine, 0, rank + 1)
        op = lambda: call(out, inp)  # noqa: E731
        expect = (lambda i: total, lambda i: rank * part + i)
    else:  # all_to_all: chunk j of the input goes to rank j; chunk j of the output came from rank j
        inp, out = torch.empty(elements, dtype=dtype, device=device), torch.empty(elements, dtype=dtype, device=device)
        pristine = torch.empty_like(inp)
        _fill(pristine, 0, rank + 1)
        op = lambda: call(out, inp)  # noqa: E731
        expect = (lambda i: i // part + 1, lambda i: rank * part + i % part)

    def reset():
        inp.copy_(pristine)

    def check():
        out.fill_(-1)
        reset()
        op()
        _compare(out, expect, spec, table, rank)

    return RankBuffers(op, reset, check, f"torch.distributed.{used}")


def _compare(out, expect, spec, table: str, rank: int) -> None:
    import torch

    mult, index = expect
    n, eps = spec.world_size, torch.finfo(out.dtype).eps
    # Every value (a sum's partial sums too) is an integer up to 7 x the largest multiplier: while those are exact in
    # the dtype (below 2/eps: 256 in bf16), so is any order of additions, and nothing else passes; beyond, the rounding
    # of world_size additions (a rank's missing part of a bf16 sum over 8 ranks is 1/36, under that bound).
    largest = _PERIOD * (n * (n + 1) // 2 if table in ("all_reduce", "reduce_scatter") else n)
    tol = 0.0 if largest <= 2 / eps else min(0.05, eps * n)
    for s in range(0, out.numel(), _CHUNK):
        i = torch.arange(s, min(s + _CHUNK, out.numel()), device=out.device)
        want = (index(i) % _PERIOD + 1).double() * mult(i)
        got = out[s:s + i.numel()].double()
        err = ((got - want).abs() / want).nan_to_num(nan=float("inf"))
        worst = int(err.argmax())
        if not err[worst] <= tol:
            raise WrongResult(f"{table} (world_size {spec.world_size}, {spec.dtype}): rank {rank}, element {s + worst} "
                              f"is {got[worst].item():g}, the closed form gives {want[worst].item():g} (relative "
                              f"tolerance {tol:.2g})")
