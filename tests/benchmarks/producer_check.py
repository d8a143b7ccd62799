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

The GEMMs are dense stand-ins of the same bytes for the experts' grouped GEMM (m = tokens, n = 2 x hidden,
k = the model's hidden size). Each variant is timed in ROUNDS interleaved rounds; the figure is the median of the
rounds' medians, and each variant's change against `row`. If `producer` and `other` both move the time as far as
the model does, the kernel follows what a heavy predecessor leaves behind (its write-backs, the memory system's
state), which no row of the kernel alone can carry; if only `producer` does, it follows its input's producer.

    python tests/benchmarks/producer_check.py [--out DIR] [--rounds 3]

Writes producer_check.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

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
VARIANTS = ("row", "producer", "other", "copy")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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

    def producer():
        torch.matmul(a, w, out=x)  # the GEMM writes the kernel's input, as gate/up does in the layer

    def other():
        own()
        torch.matmul(a, w, out=elsewhere)

    def copy():
        x.copy_(source)

    return {"row": own, "producer": producer, "other": other, "copy": copy}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("producer_check needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule

    started = time.perf_counter()
    cases = {name: build(t, h) for name, (t, h, _k, _m, _r) in CASES.items()}
    for case in cases.values():
        case.check()
    between = {name: hooks(cases[name], k) for name, (_t, _h, k, _m, _r) in CASES.items()}
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < 0.3:  # wake the GPU before the first figure
        a @ a
    torch.cuda.synchronize()
    rule = StopRule(target=0.003, budget_s=0.5, min_work_n=200)
    medians: dict[str, dict[str, list[float]]] = {name: {v: [] for v in VARIANTS} for name in CASES}
    kernels: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for name, case in cases.items():
            for v in VARIANTS:
                timing = time_gpu(case.fn, rule, timer="cupti", cold_l2=True, warm=between[name][v])
                medians[name][v].append(statistics.median(timing.samples_ms) * 1e3)
                kernels[name] = list(timing.kernels)
        log(f"round {r + 1}/{args.rounds} done in {time.perf_counter() - started:.0f} s")
    figures = {name: {v: statistics.median(xs) for v, xs in by.items()} for name, by in medians.items()}
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rounds": args.rounds,
           "cases": {name: dict(zip(("tokens", "hidden", "gemm_k", "in_model_us", "row_us_run26"), c))
                     for name, c in CASES.items()},
           "kernels": kernels, "medians_us": medians, "figures_us": figures, "wall_s": time.perf_counter() - started}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "producer_check.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{doc['gpu']}, torch {doc['torch']}, {args.rounds} rounds, {doc['wall_s']:.0f} s; silu_mul µs (CUPTI, "
          f"cold L2), change against row")
    print(f"{'case':14s} {'in model':>8s} {'row':>8s} " + " ".join(f"{v:>9s}" for v in VARIANTS[1:]))
    for name, f in figures.items():
        in_model = CASES[name][3]
        shown = f"{in_model:8.2f}" if in_model else f"{'-':>8s}"
        print(f"{name:14s} {shown} {f['row']:8.2f} "
              + " ".join(f"{(f[v] / f['row'] - 1) * 100:+8.1f}%" for v in VARIANTS[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
