"""The kernel catalog: every (table, backend) kprof can measure, registered with its contract."""

from __future__ import annotations

from ..ledger.events import Contract
from .activation import SiluMulArgs
from .attention import AttentionDecodeArgs, AttentionPrefillArgs
from .gemm import SingleGemmArgs
from .norm import RmsNormArgs
from .registry import Entry, register

# The CPU timer's method, part of every torch-cpu key: rows timed another way never share a key.
CPU_TIMING = "cpu-wall;l2=warm;eager"

_FAMILIES = [
    # table, args, kernel_kind, runner, algorithm, layout, description
    ("single_gemm", SingleGemmArgs, "gemm", "kprof.runners.gemm:SingleGemm", "torch.matmul",
     "a[m,k] row-major, b[k,n] row-major, c[m,n] row-major", "C = A @ B"),
    ("rms_norm", RmsNormArgs, "norm", "kprof.runners.norm:RmsNorm", "torch.nn.functional.rms_norm",
     "x[tokens,hidden] contiguous, w[hidden]", "RMSNorm over hidden, eps 1e-6, with weight"),
    ("silu_mul", SiluMulArgs, "activation", "kprof.runners.activation:SiluMul", "silu(x[:, :h]) * x[:, h:]",
     "x[tokens,2*hidden] contiguous", "gated-MLP activation, two kernels"),
    ("attention_prefill", AttentionPrefillArgs, "attention", "kprof.runners.attention:AttentionPrefill",
     "torch sdpa (auto backend)", "q/k/v [batch,heads,seq,head_dim] contiguous",
     "self-attention over a whole prompt, GQA through enable_gqa"),
    ("attention_decode", AttentionDecodeArgs, "attention", "kprof.runners.attention:AttentionDecode",
     "torch sdpa (auto backend)", "q [batch,heads,1,head_dim], k/v [batch,kv_heads,kv_len,head_dim] contiguous",
     "one decode step against a dense KV cache"),
]

for table, args, kind, runner, algorithm, layout, description in _FAMILIES:
    register(Entry(table=table, backend="torch-cpu", args=args, kernel_kind=kind, metric_family="compute",
                   contract=Contract(algorithm=algorithm, layout=layout, numerics="dtype=spec; fp32 accumulate",
                                     timing=CPU_TIMING, profiler_revision=1),
                   runner=runner, device="cpu", description=description))
