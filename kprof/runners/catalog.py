"""The kernel catalog: every (table, backend) kprof can measure, registered with its contract.

Backends: `torch-cpu` (CPU, timed by wall clock), `torch` (CUDA, SDPA and cuBLAS choose their kernels),
`torch-flash` / `torch-efficient` / `torch-cudnn` / `torch-math` (CUDA attention with one SDPA backend
forced) and `torch-loop` (CUDA MoE GEMM as a per-expert loop, beside `torch`'s torch._grouped_mm).

single_gemm's fp8_e4m3 rows live in the `torch` entry, whose numerics string states the fp8 scale
contract next to the other dtypes' rules: dtype is a spec axis, so a simulator asks one (table, backend)
for every dtype, and a separate fp8 backend would split one GEMM curve across two scopes, each holding
Unsupported rows for the other's dtypes.
"""

from __future__ import annotations

from ..ledger.events import Contract
from .activation import SiluMulArgs
from .comm import AllGatherArgs, AllReduceArgs, AllToAllArgs, ReduceScatterArgs
from .attention import AttentionDecodeArgs, AttentionPrefillArgs
from .gemm import CpuGemmArgs, SingleGemmArgs
from .memcpy import MemcpyArgs
from .moe import GroupedMmArgs, MoeGroupedGemmArgs
from .norm import RmsNormArgs
from ._entry import Entry

__all__ = ["ENTRIES", "CPU_TIMING", "GPU_TIMING", "POWER_STATES", "TIMERS", "cpu_timing", "parse_timing", "timing_power",
           "timing_string", "timing_threads"]

TIMERS = ("cupti", "events", "cpu-wall")


POWER_STATES = ("sustained", "loaded")


def timing_string(timer: str, l2: str, graph: bool, power: str = "sustained") -> str:
    """The timing part of a contract, e.g. "events;l2=cold;graph": rows timed another way never share a key.
    The power state is named only when it is not the default ("...;power=loaded"), so the keys of default
    rows are what they were before the power state existed."""
    if timer not in TIMERS:
        raise ValueError(f"timer {timer!r} is not one of {', '.join(TIMERS)}")
    if l2 not in ("cold", "warm"):
        raise ValueError(f"l2 {l2!r} is not cold or warm")
    if power not in POWER_STATES:
        raise ValueError(f"power {power!r} is not one of {', '.join(POWER_STATES)}")
    base = f"{timer};l2={l2};{'graph' if graph else 'eager'}"
    return base if power == "sustained" else f"{base};power={power}"


def parse_timing(timing: str) -> tuple[str, str, bool]:
    """(timer, l2, graph) of a contract's timing part: the inverse of `timing_string` (see `timing_power`)."""
    timer, l2, mode = (timing.split(";") + ["", ""])[:3]
    return timer, l2.removeprefix("l2="), mode == "graph"


def timing_power(timing: str) -> str:
    """The power state a contract's timing names: "sustained" unless it says "power=loaded"."""
    for part in timing.split(";")[3:]:
        if part.startswith("power="):
            return part.removeprefix("power=")
    return "sustained"


# The CPU timer's method, part of every torch-cpu key (byte for byte as first released). A torch-cpu compute row is
# timed with a stated number of torch threads, named after it (`cpu_timing`; kprof.method.cpu_threads picks it): the
# same GEMM on 1 and 2 threads differs up to 2x, so rows of two thread counts never share a key. Rows keyed without
# a count (before it was named) read as stale. gloo's rank processes run one thread each and keep CPU_TIMING.
CPU_TIMING = "cpu-wall;l2=warm;eager"


def cpu_timing(threads: int) -> str:
    """The timing of a torch-cpu row measured with `threads` torch threads: "cpu-wall;l2=warm;eager;threads=2"."""
    return f"{CPU_TIMING};threads={threads}"


def timing_threads(timing: str) -> int | None:
    """The torch thread count a contract's timing names ("...;threads=N"), or None where it names none."""
    for part in timing.split(";")[3:]:
        if part.startswith("threads="):
            return int(part.removeprefix("threads="))
    return None


# The GPU contract's method: CUPTI kernel time, L2 flushed before each call, eager launches.
# KPROF_TIMER / KPROF_L2 / KPROF_CUDA_GRAPH choose another (kprof.api.effective_entry), and with it the key.
GPU_TIMING = timing_string("cupti", "cold", False)

CPU_NUMERICS = "dtype=spec; fp32 accumulate"
# cuBLAS under torch's default settings (kprof.runners.gemm.CUDA_MATMUL_DEFAULTS, checked at build time)
_CUBLAS = ("dtype=spec in/out, fp32 accumulate (cuBLAS: fp32 without TF32; fp16/bf16 reduced-precision "
           "split-K reductions allowed, torch defaults)")
_GEMM_CUDA = (f"{_CUBLAS}; fp8_e4m3: torch._scaled_mm, per-tensor fp32 scale_a/scale_b (amax/448), "
              f"bf16 out, use_fast_accum=False")
_SDPA = "dtype=spec q/k/v/out, fp32 softmax and accumulate, scale 1/sqrt(head_dim)"
_SDPA_NUMERICS = {
    None: f"{_SDPA}, in the SDPA backend torch selects (recorded per row)",
    "flash": f"{_SDPA}; flash runs fp16/bf16 only",
    "efficient": _SDPA,
    "cudnn": f"{_SDPA}; cudnn runs fp16/bf16 only",
    "math": f"{_SDPA}; math upcasts fp16/bf16 q/k/v to fp32 (fp16/bf16 reduction off) and rounds the output",
}

_GEMM_LAYOUT = "a[m,k] row-major, b[k,n] row-major, c[m,n] row-major"
_PREFILL_LAYOUT = "q [batch,heads,seq,head_dim], k/v [batch,kv_heads,seq,head_dim] contiguous"
_DECODE_LAYOUT = "q [batch,heads,1,head_dim], k/v [batch,kv_heads,kv_len,head_dim] contiguous"
# CUDA rows time attention on the layout a model's QKV projection leaves (kprof.runners.attention).
_PACKED = "[batch,tokens,(heads+2*kv_heads)*head_dim]"
_PREFILL_LAYOUT_CUDA = (f"q [batch,heads,seq,head_dim], k/v [batch,kv_heads,seq,head_dim] head views of one packed "
                        f"{_PACKED} projection output (head_dim contiguous)")
_DECODE_LAYOUT_CUDA = (f"q [batch,heads,1,head_dim] a head view of a packed {_PACKED} projection output; "
                       f"k/v [batch,kv_heads,kv_len,head_dim] contiguous")
_MOE_LAYOUT = ("x[tokens*topk,hidden] row-major, rows grouped by expert; w[experts,intermediate,hidden] "
               "contiguous, passed transposed; out[tokens*topk,intermediate]")
_MEMCPY_LAYOUT = "src, dst uint8[bytes] contiguous, separate allocations on one device"

_FAMILIES = [
    # table, args, kernel_kind, runner, algorithm, layout, description
    ("single_gemm", SingleGemmArgs, "gemm", "kprof.runners.gemm:SingleGemm", "torch.matmul", _GEMM_LAYOUT,
     "C = A @ B"),
    ("rms_norm", RmsNormArgs, "norm", "kprof.runners.norm:RmsNorm", "torch.nn.functional.rms_norm",
     "x[tokens,hidden] contiguous, w[hidden]", "RMSNorm over hidden, eps 1e-6, with weight"),
    ("silu_mul", SiluMulArgs, "activation", "kprof.runners.activation:SiluMul", "silu(x[:, :h]) * x[:, h:]",
     "x[tokens,2*hidden] contiguous", "gated-MLP activation, two kernels"),
    ("attention_prefill", AttentionPrefillArgs, "attention", "kprof.runners.attention:AttentionPrefill",
     "torch sdpa (auto backend)", _PREFILL_LAYOUT, "self-attention over a whole prompt, GQA through enable_gqa"),
    ("attention_decode", AttentionDecodeArgs, "attention", "kprof.runners.attention:AttentionDecode",
     "torch sdpa (auto backend)", _DECODE_LAYOUT, "one decode step against a dense KV cache"),
]

# Numerics of each family on backend `torch` (CUDA); every torch-cpu entry keeps CPU_NUMERICS.
_CUDA_NUMERICS = {
    "single_gemm": _GEMM_CUDA,
    "rms_norm": "dtype=spec in/out, weight in dtype=spec, fp32 statistics (opmath), eps 1e-6",
    "silu_mul": "dtype=spec in/out; silu computed in fp32 and rounded to dtype, then the product in fp32, rounded",
    "attention_prefill": _SDPA_NUMERICS[None],
    "attention_decode": _SDPA_NUMERICS[None],
}
_CUDA_LAYOUT = {"single_gemm": f"{_GEMM_LAYOUT}; fp8_e4m3: b[k,n] column-major (as torch._scaled_mm requires)",
                "attention_prefill": _PREFILL_LAYOUT_CUDA, "attention_decode": _DECODE_LAYOUT_CUDA}
_CUDA_ALGORITHM = {"single_gemm": "torch.matmul; fp8_e4m3: torch._scaled_mm"}


# The profiler revision of CUDA rows. 2 (2026-12-01): cold L2 is a read sweep that leaves clean lines (the
# write flush before it made the timed kernel pay dirty write-backs: decode GEMMs read +12 % to +27 % over
# the same kernels in a model), and every row is timed under the thermal and power protocol
# (kprof.measure._state). Rows of revision 1 read as stale. CPU rows keep revision 1: their timer is unchanged.
# 3 (2026-12-01): a power-capped row's time is the mean of samples spanning at least 1 s (the median of 0.5 s
# moved up to 4.3 % between passes: the cap's controller swings the clock, and the per-call times are not
# one-peaked); the torch MoE grouped GEMM rotates over draws of its routing (kprof.runners.moe).
# 4 (2026-12-01): an eager row rotates over up to 16 allocations of its cold inputs (4 before) and its time is
# the mean of each allocation's median: a memory-bound kernel's time depends on where its weights lie (a decode
# GEMM read 5 % slower on some allocations), and the median of all samples named the commonest placement, the
# fastest layer of a model, where a sum over a model's layers needs their mean.
# 5 (2026-12-02): a row's placements also move its activations where they are small (decode's: up to 4 MiB),
# each placement's copy at its own offset: Mixtral's b=1 expert GEMMs moved 15 % with their activations' address
# and a model's layers alternated between two speeds with its allocator's blocks (moe_decode_check.py); graph rows
# rotate over the same placements, one CUDA graph each (revision 4 graph rows timed one allocation).
# 6 (2026-12-05): the events timer's zero (what an event pair adds to a kernel) is 2 r(c) - r(2c) over sleep
# kernels of c and 2c cycles, whatever clock they run at; revision 5 sized one sleep to the settled clock, which in a
# power-capped row is the cap's (~1530 MHz) while the light sleeps ran at ~1980 MHz, so those rows' events samples
# read ~2 µs slow (+1-2 % on prefill GEMMs against CUPTI, protocol_check run 89). And attention_prefill's layout
# names k/v [batch,kv_heads,seq,head_dim] head views, as the runner builds them; revision 5 said q/k/v
# [batch,heads,...], untrue of every GQA row. And a row re-anchors its state only after off-state batches in a
# row: off-state batches spread over a row (a thermal blip now and then) reached the count, the last blip became
# the reference and good batches after it were discarded (6 rows of run 38). And energy_j past a draw over the power
# limit is fitted over a capped kernel's 1 s, not 0.2 s (which read the cap controller's dip: -8.4 %, an H100).
# CUPTI rows are otherwise timed as in 5.
GPU_REVISION = 6
CPU_REVISION = 1
# A torch-cpu table's own revision where it moved past CPU_REVISION. attention_prefill 2 (2026-12-05): its layout names
# k/v [batch,kv_heads,seq,head_dim], as the runner builds them; revision 1 said q/k/v [batch,heads,seq,head_dim],
# untrue of every GQA row (num_kv_heads < num_heads), whose k and v hold num_kv_heads heads.
CPU_REVISIONS = {"attention_prefill": 2}


ENTRIES: list[Entry] = []  # every entry, in declaration order; kprof.runners.registry indexes them


def _register(table, args, kind, runner, backend, device, algorithm, layout, numerics, timing, description):
    revision = GPU_REVISION if device == "cuda" else CPU_REVISIONS.get(table, CPU_REVISION)
    ENTRIES.append(Entry(table=table, backend=backend, args=args, kernel_kind=kind, metric_family="compute",
                         contract=Contract(algorithm=algorithm, layout=layout, numerics=numerics, timing=timing,
                                           profiler_revision=revision),
                         runner=runner, device=device, description=description,
                         subprocess_env="cuda_env" if device == "cuda" else "default_env"))


_CPU_ARGS = {"single_gemm": CpuGemmArgs}  # a table whose CPU backend takes fewer values than its CUDA one

for table, args, kind, runner, algorithm, layout, description in _FAMILIES:
    _register(table, _CPU_ARGS.get(table, args), kind, runner, "torch-cpu", "cpu", algorithm, layout, CPU_NUMERICS,
              CPU_TIMING, description)
    _register(table, args, kind, runner, "torch", "cuda", _CUDA_ALGORITHM.get(table, algorithm),
              _CUDA_LAYOUT.get(table, layout), _CUDA_NUMERICS[table], GPU_TIMING, description)

# Attention with one SDPA backend forced on CUDA.
for forced in ("flash", "efficient", "cudnn", "math"):
    for table, args, runner, layout in (
            ("attention_prefill", AttentionPrefillArgs, "AttentionPrefill", _PREFILL_LAYOUT_CUDA),
            ("attention_decode", AttentionDecodeArgs, "AttentionDecode", _DECODE_LAYOUT_CUDA)):
        _register(table, args, "attention", f"kprof.runners.attention:{runner}{forced.capitalize()}",
                  f"torch-{forced}", "cuda", f"torch sdpa ({forced} backend forced)", layout,
                  _SDPA_NUMERICS[forced], GPU_TIMING, f"attention through SDPA's {forced} backend only")

# The MoE expert GEMM: one algorithm per entry; a runner refuses rather than switch algorithms.
_MOE = "tokens*topk rows routed by a softmax top-k router, grouped by expert, times each expert's weight"
_register("moe_grouped_gemm", GroupedMmArgs, "moe", "kprof.runners.moe:MoeGroupedMm", "torch", "cuda",
          "torch._grouped_mm", _MOE_LAYOUT, "bf16 in/out, fp32 accumulate (CUTLASS grouped GEMM)", GPU_TIMING,
          f"{_MOE}: one grouped GEMM launch (bf16, sm90/sm100)")
_register("moe_grouped_gemm", MoeGroupedGemmArgs, "moe", "kprof.runners.moe:MoeExpertLoop", "torch-loop", "cuda",
          "per-expert matmul loop", _MOE_LAYOUT, _CUBLAS, GPU_TIMING, f"{_MOE}: one torch.matmul per expert")
_register("moe_grouped_gemm", MoeGroupedGemmArgs, "moe", "kprof.runners.moe:MoeExpertLoop", "torch-cpu", "cpu",
          "per-expert matmul loop", _MOE_LAYOUT, CPU_NUMERICS, CPU_TIMING, f"{_MOE}: one torch.matmul per expert")

# Device memory bandwidth.
_register("memcpy", MemcpyArgs, "memory", "kprof.runners.memcpy:Memcpy", "torch", "cuda",
          "Tensor.copy_ (cudaMemcpyAsync device-to-device)", _MEMCPY_LAYOUT, "bytes copied verbatim (uint8)",
          GPU_TIMING, "device-to-device copy bandwidth")
_register("memcpy", MemcpyArgs, "memory", "kprof.runners.memcpy:Memcpy", "torch-cpu", "cpu",
          "Tensor.copy_ (ATen CPU copy)", _MEMCPY_LAYOUT, "bytes copied verbatim (uint8)", CPU_TIMING,
          "host memory copy bandwidth")

# Collectives (kprof.runners.comm): one process per rank, started and timed by kprof.runners._ranks; the row's time
# is the median over iterations of the slowest rank's time. `nccl` needs world_size GPUs (gpus_arg); `gloo` is its
# CPU twin. message_size_bytes is nccl-tests' size (see kprof.runners.comm). The family counts its own revisions.
COMM_REVISION = 1
# A table's own revision where it moved past COMM_REVISION. all_to_all 2 (2026-12-05, gloo and nccl): its algorithm
# names torch.distributed.all_to_all_single, the function its ranks call; revision 1 named torch.distributed.all_to_all,
# the list-of-tensors call they never made.
COMM_REVISIONS = {"all_to_all": 2}
_COMM = {
    # table: (args, runner, layout per rank, reduces, description)
    "all_reduce": (AllReduceArgs, "AllReduce", "x[size/elt] contiguous, reduced in place", True,
                   "sum of every rank's buffer, on every rank"),
    "all_gather": (AllGatherArgs, "AllGather", "in[size/elt/n] -> out[size/elt] contiguous, rank-major", False,
                   "every rank's part, concatenated on every rank"),
    "reduce_scatter": (ReduceScatterArgs, "ReduceScatter", "in[size/elt] -> out[size/elt/n] contiguous, rank-major",
                       True, "sum of every rank's buffer, rank r keeping part r"),
    "all_to_all": (AllToAllArgs, "AllToAll", "in[size/elt] -> out[size/elt] contiguous, n equal chunks (chunk j to / "
                   "from rank j)", False, "chunk j of every rank's buffer to rank j"),
}


def _register_comm(table, args, runner, layout, reduces, what):
    call = {"all_gather": "all_gather_single (all_gather_into_tensor before torch 2.13)",
            "reduce_scatter": "reduce_scatter_single (reduce_scatter_tensor before torch 2.13)",
            "all_to_all": "all_to_all_single"}.get(table, table)
    numerics = "dtype=spec; " + ("sum in dtype, as the library reduces" if reduces else "elements moved verbatim")
    for backend, device, timing, env, by in (
            ("nccl", "cuda", GPU_TIMING, "cuda_env", "NCCL (its choice of algorithm and protocol), one GPU per rank"),
            ("gloo", "cpu", CPU_TIMING, "default_env", "gloo, one CPU process per rank")):
        revision = COMM_REVISIONS.get(table, COMM_REVISION)
        ENTRIES.append(Entry(
            table=table, backend=backend, args=args, kernel_kind="collective", metric_family="comm",
            contract=Contract(algorithm=f"torch.distributed.{call} on {by}",
                              layout=f"per rank {layout}; size = message_size_bytes (nccl-tests' size)",
                              numerics=numerics, timing=timing, profiler_revision=revision),
            runner=f"kprof.runners.comm:{runner}", device=device, subprocess_env=env,
            gpus_arg="world_size" if device == "cuda" else "", description=f"{what} ({backend})"))


for _table, _comm in _COMM.items():
    _register_comm(_table, *_comm)
