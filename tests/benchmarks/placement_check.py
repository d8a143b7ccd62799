#!/usr/bin/env python
"""Does a decode GEMM's time depend on where its weights were allocated? One call on one GPU.

Inside the 16-layer models of model_step.py, the decode `down` and `gate_up` GEMMs of one forward differ by layer
(Qwen2.5-7B, batch 8: down 36.0-40.2 µs, the same layers slow in eager and graph, at batch 8 and 64), and kprof's
rows sit at the fast end (36.5 µs), although each row rotates over several copies of its weights. This times the
same GEMM (x[m, k] @ w[k, n], bf16, cold L2 by kprof's read sweep, CUPTI) on each of many weight allocations, made
three ways:

  runner   each weight made as kprof's single_gemm runner makes it: an fp32 randn, scaled, cast to bf16
  clones   one weight made so, then cloned (the copies a row rotates over)
  model    the weights of 16 decoder layers made in a model's order (qkv, o, gate_up, down per layer, each a bf16
           randn), and this GEMM's weight taken from each layer

Each allocation is timed in ROUNDS interleaved rounds (the median of its rounds' medians). Per style: min, median,
mean and max over allocations, and how many are more than 2 % above the fastest. If `model` spreads and the other
two do not, a row's copies do not sample the placements a model's layers get. Also records each weight's address
and its offset inside the caching allocator's segment.

    python tests/benchmarks/placement_check.py [--out DIR] [--rounds 2] [--copies 16]

Writes placement_check.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HIDDEN, INTER, QKV = 3584, 18944, 4608  # Qwen2.5-7B
OPS = {"down": (INTER, HIDDEN), "gate_up": (HIDDEN, 2 * INTER)}  # (k, n) of the weight
M = 8
SLOW = 0.02


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def runner_weight(torch, g, k: int, n: int):
    b = torch.randn(k, n, generator=g, device="cuda") / k ** 0.5
    return b.to(torch.bfloat16)


def make(torch, style: str, op: str, copies: int, g) -> tuple[list, list]:
    """(the weights to time, everything else the style allocated, kept alive as a model keeps its layers)."""
    k, n = OPS[op]
    if style == "runner":
        return [runner_weight(torch, g, k, n) for _ in range(copies)], []
    if style == "clones":
        first = runner_weight(torch, g, k, n)
        return [first] + [first.clone() for _ in range(copies - 1)], []
    out, layers = [], []
    for _ in range(copies):  # a model's layer: qkv, o, gate_up, down, each a bf16 randn, in that order
        layer = {"qkv": torch.randn(HIDDEN, QKV, generator=g, device="cuda", dtype=torch.bfloat16),
                 "o": torch.randn(HIDDEN, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16),
                 "gate_up": torch.randn(HIDDEN, 2 * INTER, generator=g, device="cuda", dtype=torch.bfloat16),
                 "down": torch.randn(INTER, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)}
        out.append(layer[op].mul_(1.0 / math.sqrt(k)))
        layers.append(layer)
    return out, layers


def segments(torch) -> list[tuple[int, int]]:
    return sorted((s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot())


def where(ptr: int, segs) -> dict:
    for base, size in segs:
        if base <= ptr < base + size:
            return {"ptr": ptr, "segment": base, "segment_mib": size / 2 ** 20, "offset_mib": (ptr - base) / 2 ** 20}
    return {"ptr": ptr}


def time_one(torch, x, w) -> float:
    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule

    out = torch.empty(x.shape[0], w.shape[1], device="cuda", dtype=torch.bfloat16)
    t = time_gpu(lambda: torch.matmul(x, w, out=out), StopRule(budget_s=0.1), timer="cupti", cold_l2=True)
    return statistics.median(t.samples_ms) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--copies", type=int, default=16)
    a = p.parse_args()
    import torch

    started = time.perf_counter()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "m": M, "copies": a.copies,
              "rounds": a.rounds, "styles": {}}
    table = []
    for op, (k, n) in OPS.items():
        g = torch.Generator("cuda").manual_seed(1)
        x = torch.randn(M, k, generator=g, device="cuda", dtype=torch.bfloat16)
        for style in ("runner", "clones", "model"):
            weights, kept = make(torch, style, op, a.copies, g)
            segs = segments(torch)
            rounds = [[time_one(torch, x, w) for w in weights] for _ in range(a.rounds)]
            per = [statistics.median(r[i] for r in rounds) for i in range(len(weights))]
            fast = min(per)
            doc = {"us": per, "rounds_us": rounds, "where": [where(w.data_ptr(), segs) for w in weights],
                   "min": fast, "median": statistics.median(per), "mean": statistics.fmean(per), "max": max(per),
                   "slow": sum(v > fast * (1 + SLOW) for v in per)}
            result["styles"][f"{op}/{style}"] = doc
            table.append((op, style, doc))
            log(f"{op:8s} {style:7s} " + " ".join(f"{v:6.2f}" for v in per))
            del weights, kept
            torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - started
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "placement_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['gpu']}, torch {result['torch']}; m={M}, {a.copies} allocations per style, {a.rounds} rounds; "
          f"wall {result['wall_s']:.0f} s")
    print(f"{'op':8s} {'style':7s} {'min µs':>8s} {'median':>8s} {'mean':>8s} {'max':>8s} {'mean/min':>9s} "
          f"{'>2% slow':>9s}")
    for op, style, d in table:
        print(f"{op:8s} {style:7s} {d['min']:8.2f} {d['median']:8.2f} {d['mean']:8.2f} {d['max']:8.2f} "
              f"{d['mean'] / d['min'] - 1:+8.1%} {d['slow']:>5d}/{len(d['us'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
