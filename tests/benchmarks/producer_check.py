#!/usr/bin/env python
"""Does a decode silu_mul's time follow the GEMM that produced its input? One call on one GPU.

model_step reads the gated-MLP activation (`silu(x[:, :h]) * x[:, h:]`, two elementwise kernels) 1.3-1.5 µs
slower inside a model than its row, at decode (Mixtral-8x7B's experts: 6.6 against 5.1 µs at one token, −22 %),
while every other decode kernel is within a few per cent. Inside the model the kernel's input was written a
moment before by the gate/up GEMM, which streamed hundreds of MB of weights; a row's input is rewritten after
the L2 sweep (kprof's `warm`) and nothing heavy precedes it. This times the same silu_mul with kprof's timer
(CUPTI, cold L2 by a read sweep) and four things between the sweep and each call, outside the timed region:

  row       the row's own step: its input rewritten in place (kprof's row)
  producer  the gate/up GEMM of the model's shape writes the input (out=x), as in the layer
  other     the input rewritten, then the same GEMM writing another tensor: a heavy predecessor, not the producer
  copy      the input written by a copy from another buffer (a light producer)

and four that take `other` apart (run 29 found `other` as slow as the model, so the heavy predecessor is what
matters, not who wrote the input):

  tiny      the input rewritten, then a small GEMM of the same library (64 x 512 x 512): the GEMM's code,
            launch and shared-memory configuration without its bytes
  stream    the input rewritten, then the GEMM's weight bytes read by the sweep's own kernel (a reduction):
            the same bytes and pages streamed, without GEMM code
  other+1   `other`, then a one-element add: does one light kernel between the GEMM and the call absorb it?
  other+gap `other`, then a ~10 µs spin on one thread (torch.cuda._sleep): does the state decay in time?

and two that put the input back into L2 after a heavy step, to tell "the input is no longer in L2" from "the
heavy step leaves some other state behind" (page translations, the memory's state):

  producer+own  `producer`, then the input rewritten in place: the GEMM's output, made resident again
  stream+own    the weight bytes read first, then the input rewritten: the stream of `stream`, the input in L2

Each variant is timed twice: the call's kernels summed (the row's figure) and its first kernel alone (the
`silu` of the two), which says whether the difference lands on the kernel that follows the predecessor.

The GEMMs are dense stand-ins of the same bytes for the experts' grouped GEMM (m = tokens, n = 2 x hidden,
k = the model's hidden size). Each variant is timed in ROUNDS interleaved rounds; the figure is the median of the
rounds' medians, and each variant's change against `row`. If `producer` and `other` both move the time as far as
the model does, the kernel follows what a heavy predecessor leaves behind (its write-backs, the memory system's
state), which no row of the kernel alone can carry; if only `producer` does, it follows its input's producer.

    python tests/benchmarks/producer_check.py [--out DIR] [--rounds 3]

Writes producer_check.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # _variants lives beside this file, however the script is started
    sys.path.insert(0, _HERE)
from _variants import arguments, cuda, time_variants, written  # noqa: E402

ROUNDS = 3
# name: (tokens of the silu_mul, its hidden (the output width), the model's hidden size: the GEMM's k), and the
# in-model / row times model_step read (run 26, eager), for the table
CASES = {
    "mixtral b=1": (2, 14336, 4096, 6.56, 5.10),
    "mixtral b=8": (16, 14336, 4096, 7.17, 5.79),
    "mixtral b=64": (128, 14336, 4096, 13.76, 12.38),
    "qwen b=1": (1, 18944, 3584, None, None),
    "qwen b=8": (8, 18944, 3584, 5.89, 5.79),
}
VARIANTS = ("row", "producer", "other", "copy", "tiny", "stream", "other+1", "other+gap", "producer+own",
            "stream+own")
SPIN_CYCLES = 20_000  # torch.cuda._sleep: about 10 µs at an H200's 1.98 GHz SM clock


def build(tokens: int, hidden: int, device: str = "cuda"):
    import msgspec

    from kprof.runners.registry import lookup

    entry = lookup("silu_mul", "torch")
    return entry.load_runner()().build(msgspec.convert({"tokens": tokens, "hidden": hidden, "dtype": "bf16"},
                                                       entry.args), device)


def hooks(case, k: int):
    """Per variant, what runs after the sweep and before the call (on the case's device)."""
    import torch

    from kprof.measure._l2 import rewriter

    x = case.inputs[0]  # [tokens, 2 * hidden], the silu_mul's input
    own = rewriter(torch, [x])
    g = torch.Generator(x.device).manual_seed(0x51)
    a = torch.randn(x.shape[0], k, generator=g, device=x.device).to(torch.bfloat16)
    w = (torch.randn(k, x.shape[1], generator=g, device=x.device) * k ** -0.5).to(torch.bfloat16)
    elsewhere = torch.empty_like(x)
    source = x.clone()
    ta = torch.randn(64, 512, generator=g, device=x.device).to(torch.bfloat16)
    tw = (torch.randn(512, 512, generator=g, device=x.device) * 512 ** -0.5).to(torch.bfloat16)
    tout = torch.empty(64, 512, dtype=torch.bfloat16, device=x.device)
    weight_words = w.view(torch.int32) if w.shape[-1] % 2 == 0 else w.view(torch.int16)  # the weight's bytes
    total = torch.empty((), dtype=torch.int64, device=x.device)
    one = torch.zeros(1, device=x.device)

    def producer():
        torch.matmul(a, w, out=x)  # the GEMM writes the kernel's input, as gate/up does in the layer

    def other():
        own()
        torch.matmul(a, w, out=elsewhere)

    def copy():
        x.copy_(source)

    def tiny():
        own()
        torch.matmul(ta, tw, out=tout)

    def stream():
        own()
        torch.sum(weight_words.reshape(-1), dim=0, out=total)

    def other_light():
        other()
        one.add_(1)

    def other_gap():
        other()
        if x.is_cuda:
            torch.cuda._sleep(SPIN_CYCLES)

    def producer_own():
        producer()
        own()

    def stream_own():
        torch.sum(weight_words.reshape(-1), dim=0, out=total)
        own()

    return {"row": own, "producer": producer, "other": other, "copy": copy, "tiny": tiny, "stream": stream,
            "other+1": other_light, "other+gap": other_gap, "producer+own": producer_own, "stream+own": stream_own}


def main(argv=None) -> int:
    args = arguments(__doc__, argv, ROUNDS)
    torch = cuda("producer_check")
    if torch is None:
        return 2
    started = time.perf_counter()
    cases = {name: build(t, h) for name, (t, h, _k, _m, _r) in CASES.items()}
    for case in cases.values():
        case.check()
    between = {name: hooks(cases[name], k) for name, (_t, _h, k, _m, _r) in CASES.items()}
    calls = {name: case.fn for name, case in cases.items()}
    medians, kernels = time_variants(calls, between, VARIANTS, args.rounds)
    first = {name: first_kernel(names) for name, names in kernels.items()}
    first_medians, _ = time_variants(calls, between, VARIANTS, args.rounds, kernel_filter=first)
    about = dict(cases={name: dict(zip(("tokens", "hidden", "gemm_k", "in_model_us", "row_us_run26"), c))
                        for name, c in CASES.items()}, first_kernel=first)
    figures = written(torch, args.out, "producer_check", args.rounds, started, medians, kernels,
                      first_kernel_medians_us=first_medians, **about)["figures_us"]
    first_figures = {name: {v: statistics.median(xs) for v, xs in by.items()} for name, by in first_medians.items()}
    for title, table in (("silu_mul µs (CUPTI, cold L2, both kernels), change against row", figures),
                         ("its first kernel alone (silu) µs, change against row", first_figures)):
        print(title)
        print(f"{'case':14s} {'in model':>8s} {'row':>8s} " + " ".join(f"{v:>12s}" for v in VARIANTS[1:]))
        for name, f in table.items():
            in_model = CASES[name][3] if table is figures else None
            shown = f"{in_model:8.2f}" if in_model else f"{'-':>8s}"
            print(f"{name:14s} {shown} {f['row']:8.2f} "
                  + " ".join(f"{(f[v] / f['row'] - 1) * 100:+11.1f}%" for v in VARIANTS[1:]))
    return 0


def first_kernel(names) -> str:
    """A regex (re.search) that selects the call's first kernel by its full name; the call's kernels must differ
    in name, or the filter would select more than the first."""
    if not names or names.count(names[0]) != 1:
        raise ValueError(f"cannot single out the first of the kernels {names}")
    return "^" + re.escape(names[0]) + "$"


if __name__ == "__main__":
    sys.exit(main())
