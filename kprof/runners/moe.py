"""moe_grouped_gemm: the grouped expert GEMM of a mixture-of-experts layer.

tokens·topk routed rows, grouped by expert, times each expert's weight: out[rows, intermediate] =
x[rows, hidden] @ w[e(row)]ᵀ, with w[experts, intermediate, hidden] stored as nn.Linear keeps it and
passed transposed ([experts, hidden, intermediate], column-major per expert), as torchtitan calls
torch._grouped_mm. Routing happens at build time, outside the timed call: router logits are token noise
plus a per-expert bias (some experts are popular, as in trained routers), softmax, top-k distinct experts
per token; rows are sorted by expert, so group sizes are uneven and some may be empty. `offs` holds the
int32 cumulative row ends of the groups (offs[e] = end of expert e's rows, offs[-1] = rows).

The algorithm is fixed per registry entry, never switched silently:
- `torch` (CUDA): torch._grouped_mm, one CUTLASS grouped GEMM launch. torch runs that kernel only for bf16
  on sm90/sm100 and otherwise falls back to a per-group loop with a device-to-host sync, so anything else
  is Unsupported here (use `torch-loop`).
- `torch-loop` (CUDA) and `torch-cpu`: a per-expert loop of torch.matmul into the rows of one output
  tensor (one GEMM launch per non-empty expert; group bounds are host integers fixed at build time).

Which experts a layer's tokens reach moves a small batch's time a lot: at 8 tokens, top-2 of 8, anywhere from
5 to 8 experts are read, and one draw put the up and down projections of one spec pair 20-29 % off a model's
layers (each of which routes differently). So on CUDA (`torch`) the row rotates over up to MAX_DRAWS routings
(`Case.refresh` copies the next one's rows and offsets into the placement about to run, after each L2 sweep,
outside the timed region): the row is the mean over routings, the time a model's layers spend on average. The
loop backends keep one routing (their launch count follows it, and a timer needs the same kernels every call).

Counted work per invocation: flops = 2·tokens·topk·hidden·intermediate; minimum bytes = routed activations
(rows·hidden) + the weights of every expert that received a row (active·hidden·intermediate) + outputs
(rows·intermediate), in the spec dtype (the mean over the draws where the row rotates). The oracle recomputes sampled rows (every sampled group's first
and last row among them) in fp64.
"""

from __future__ import annotations

from ._args import DTYPE_BYTES, FloatDtype, KernelArgs, Size
from ._case import Case, Unsupported, bind, check_close, check_shape, seed_of, torch_dtype

ORACLE_RANDOM_ROWS = 32
ORACLE_GROUPS = 16  # groups whose first and last rows the oracle always checks (offset errors show there)
EXPERT_BIAS = 0.7  # std of the per-expert router bias: loads differ by a few x between experts
MAX_DRAWS = 16  # routings a CUDA row rotates over at most
DRAW_BYTES = 1 << 30  # within this many bytes of routed activations in all (a prefill's are large)


class MoeGroupedGemmArgs(KernelArgs, frozen=True):
    tokens: Size
    experts: Size
    topk: Size
    hidden: Size
    intermediate: Size
    dtype: FloatDtype

    def __post_init__(self):
        if self.topk > self.experts:
            raise ValueError(f'field "topk" = {self.topk} exceeds experts ({self.experts}): a token is routed to topk '
                             f'distinct experts; use a topk of at most {self.experts}')


class GroupedMmArgs(MoeGroupedGemmArgs, frozen=True):
    """moe_grouped_gemm through torch._grouped_mm: its grouped kernel takes bf16 rows 16-byte aligned, so other specs
    are refused at validation (exit 2, nothing written) instead of stored as `unsupported` rows. Same fields, so the
    same keys."""

    def __post_init__(self):
        MoeGroupedGemmArgs.__post_init__(self)  # (msgspec Structs take no zero-argument super)
        if self.dtype != "bf16":
            raise ValueError(f'field "dtype" = {self.dtype!r}: torch._grouped_mm runs its grouped GEMM kernel for bf16 '
                             f'only; use dtype bf16, or backend torch-loop for {self.dtype}')
        if self.hidden % 8:
            raise ValueError(f'field "hidden" = {self.hidden}: torch._grouped_mm needs 16-byte aligned bf16 rows; use '
                             f'a multiple of 8 (e.g. {self.hidden + 8 - self.hidden % 8}), or backend torch-loop')


def route(spec: MoeGroupedGemmArgs, g):
    """(token of each routed row, expert of each row, rows per expert), rows sorted by expert."""
    import torch

    logits = torch.randn(spec.tokens, spec.experts, generator=g) + EXPERT_BIAS * torch.randn(spec.experts, generator=g)
    chosen = torch.softmax(logits, -1).topk(spec.topk, dim=-1).indices.reshape(-1)  # slot t*topk+j of token t
    order = torch.sort(chosen, stable=True).indices
    counts = torch.bincount(chosen, minlength=spec.experts)
    return order // spec.topk, chosen[order], counts


def draws_for(spec: MoeGroupedGemmArgs) -> int:
    """How many routings a rotating row draws: MAX_DRAWS, fewer where their routed activations would pass
    DRAW_BYTES (a large batch's loads vary little from draw to draw anyway), at least one."""
    per = spec.tokens * spec.topk * spec.hidden * DTYPE_BYTES[spec.dtype]
    return max(1, min(MAX_DRAWS, DRAW_BYTES // max(per, 1)))


class Draws:
    """Routings of one spec as the grouped GEMM takes them (routed activations, int32 group ends): `first`,
    the one the oracle checks, then n - 1 more from `g`. `x` and `off` are the live inputs (a copy of the
    first); `refresh` copies the next routing into them in place."""

    def __init__(self, spec: MoeGroupedGemmArgs, hidden_states, g, n: int, first: tuple):
        import torch

        self.xs, self.offs, self.counts = [first[0]], [first[1]], [first[2]]
        for _ in range(n - 1):
            token_of_row, _expert, counts = route(spec, g)
            self.xs.append(hidden_states[token_of_row.to(hidden_states.device)])
            self.offs.append(counts.cumsum(0).to(device=hidden_states.device, dtype=torch.int32))
            self.counts.append(counts)
        self.x, self.off = self.xs[0].clone(), self.offs[0].clone()
        self.turn = 0

    def refresh(self, targets: tuple | None = None) -> None:
        """Copy the next routing into `targets` (a copy of the live (x, off), as a row's placements hold them),
        else into the live inputs."""
        self.turn = (self.turn + 1) % len(self.xs)
        x, off = targets if targets is not None else (self.x, self.off)
        x.copy_(self.xs[self.turn])
        off.copy_(self.offs[self.turn])

    def notes(self) -> dict[str, str]:
        active = [int((c > 0).sum()) for c in self.counts]
        return {"routings": str(len(self.xs)), "active_experts_mean": f"{sum(active) / len(active):.2f}",
                "active_experts_range": f"{min(active)}-{max(active)}"}


def _weights(spec: MoeGroupedGemmArgs, device: str, dt):
    """w[experts, intermediate, hidden] ~ N(0, 1/hidden), drawn on the device one expert at a time (a large
    layer's fp32 weights would not fit in host memory); deterministic for the spec on a given device type."""
    import torch

    g = torch.Generator(device).manual_seed(seed_of(spec) ^ 0x5EED)
    w = torch.empty(spec.experts, spec.intermediate, spec.hidden, device=device, dtype=dt)
    for e in range(spec.experts):
        w[e] = torch.randn(spec.intermediate, spec.hidden, generator=g, device=device) / spec.hidden ** 0.5
    return w


class _MoeGroupedGemm:
    grouped = False  # True: torch._grouped_mm; False: the per-expert matmul loop

    @staticmethod
    def held_bytes(spec: MoeGroupedGemmArgs) -> int:
        """Bytes of every expert's weight, the routed tokens and the output: the least the case holds at once."""
        rows = spec.tokens * spec.topk
        return DTYPE_BYTES[spec.dtype] * (spec.experts * spec.intermediate * spec.hidden
                                          + rows * (spec.hidden + spec.intermediate))

    def build(self, spec: MoeGroupedGemmArgs, device: str) -> Case:
        import torch

        on_cuda = torch.device(device).type == "cuda"
        if self.grouped:
            _require_grouped_mm(device, on_cuda)
        elif on_cuda:
            from .gemm import require_default_cuda_matmul

            require_default_cuda_matmul()
        elif spec.dtype == "fp32":  # oneDNN's fp32 precision, which a caller may have lowered
            from .gemm import require_fp32_cpu_matmul

            require_fp32_cpu_matmul()
        dt = torch_dtype(spec.dtype)
        g = torch.Generator().manual_seed(seed_of(spec))
        token_of_row, expert_of_row, counts = route(spec, g)
        rows = spec.tokens * spec.topk
        gd = torch.Generator(device).manual_seed(seed_of(spec) ^ 0xACE)  # activations drawn on the device
        hidden_states = torch.randn(spec.tokens, spec.hidden, generator=gd, device=device).to(dtype=dt)
        x = hidden_states[token_of_row.to(device)]  # the routed activations, grouped by expert
        w_t = _weights(spec, device, dt).transpose(-2, -1)  # [experts, hidden, intermediate], column-major
        ends = counts.cumsum(0)
        draws = None
        if self.grouped:
            offs = ends.to(device=device, dtype=torch.int32)
            n = draws_for(spec)
            if n > 1:  # the oracle checks the first routing, which the live inputs hold until timing starts
                more = torch.Generator().manual_seed(seed_of(spec) ^ 0xD4A)  # g stays the oracle's
                draws = Draws(spec, hidden_states, more, n, (x, offs, counts))
                x, offs = draws.x, draws.off
            inputs = (x, w_t, offs)

            def call(x, w_t, offs):
                return torch._grouped_mm(x, w_t, offs=offs)
        else:
            bounds = [(e, end - n, end) for e, (n, end) in enumerate(zip(counts.tolist(), ends.tolist())) if n]
            inputs = (x, w_t)

            def call(x, w_t):
                out = x.new_empty(x.shape[0], w_t.shape[-1])
                for e, start, end in bounds:
                    torch.matmul(x[start:end], w_t[e], out=out[start:end])
                return out

        fn = bind(call, inputs)
        sample = _oracle_rows(counts, ends, g)

        def check():
            out = fn()
            check_shape(out, (rows, spec.intermediate), "moe_grouped_gemm")
            got, ref = [], []
            for e in expert_of_row[sample].unique().tolist():
                picked = sample[expert_of_row[sample] == e].to(x.device)
                # fp64 on the kernel's device: a big expert's weights are cheap there, costly to copy out
                ref.append((x[picked].double() @ w_t[e].double()).cpu())
                got.append(out[picked].cpu())
            check_close(torch.cat(got), torch.cat(ref), spec.dtype, "moe_grouped_gemm")

        size = DTYPE_BYTES[spec.dtype]
        every = draws.counts if draws is not None else [counts]
        active = sum(int((c > 0).sum()) for c in every) / len(every)
        moved = size * (rows * spec.hidden + active * spec.hidden * spec.intermediate + rows * spec.intermediate)
        loads = sorted(counts.tolist(), reverse=True)
        notes = {"active_experts": str(int((counts > 0).sum())), "max_group_rows": str(loads[0]),
                 "min_group_rows": str(loads[-1]), **(draws.notes() if draws is not None else {"routings": "1"})}
        return Case(fn, check, flops=2.0 * rows * spec.hidden * spec.intermediate, bytes=float(moved),
                    algorithm="torch._grouped_mm" if self.grouped else "per-expert matmul loop", notes=notes,
                    inputs=inputs, call=call, warm=(0, 2) if self.grouped else (0,),
                    refresh=draws.refresh if draws is not None else None)


def _require_grouped_mm(device: str, on_cuda: bool) -> None:
    import torch

    if not on_cuda:
        raise Unsupported("torch._grouped_mm's grouped GEMM kernel runs on CUDA only; use backend torch-cpu")
    if not hasattr(torch, "_grouped_mm"):
        raise Unsupported(f"torch {torch.__version__} has no torch._grouped_mm; use backend torch-loop")
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        raise Unsupported(f"torch._grouped_mm runs its grouped GEMM kernel on sm90/sm100 only (this GPU is "
                          f"sm{major}{minor}, where it falls back to a per-group loop); use backend torch-loop")


def _oracle_rows(counts, ends, g):
    """Row indices the oracle recomputes: first and last rows of up to ORACLE_GROUPS non-empty groups, and
    ORACLE_RANDOM_ROWS random rows."""
    import torch

    nonempty = torch.nonzero(counts).flatten()
    groups = nonempty[torch.linspace(0, len(nonempty) - 1, min(ORACLE_GROUPS, len(nonempty))).long()]
    starts, lasts = ends[groups] - counts[groups], ends[groups] - 1
    anywhere = torch.randint(0, int(ends[-1]), (ORACLE_RANDOM_ROWS,), generator=g)
    return torch.cat([starts, lasts, anywhere]).unique()


class MoeGroupedMm(_MoeGroupedGemm):
    """Backend torch: one torch._grouped_mm call."""

    grouped = True


class MoeExpertLoop(_MoeGroupedGemm):
    """Backends torch-cpu and torch-loop: one torch.matmul per non-empty expert."""

    grouped = False
