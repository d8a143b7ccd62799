#!/usr/bin/env python
"""Does what runs between two calls of a decode kernel change its time? One call on one GPU.

Decode kernels composed from kprof rows read 2-5 % below the same kernels inside 16-layer models
(docs/PERFORMANCE.md), at the same clock and L2 protocol; more weight allocations and a busy GPU were ruled
out. Inside a model each kernel follows the other kernels of its layer; a row's call follows only the L2 sweep
and the rewrite of its activations. This times each of six Qwen2.5-7B decode ops (batch 1: qkv, o, gate_up,
down GEMMs, rms_norm, silu_mul) with kprof's timer (CUPTI, cold L2 by a read sweep), with four things between
its calls, outside the timed region, after the sweep:

  row       nothing more (kprof's row)
  same      ten launches of one tiny kernel (an in-place add on 4 KiB): more kernels, no new code
  tiny      the other five ops at tiny shapes (their kernels' code, almost none of their data)
  layer     the other five ops at the model's shapes (their code and their data, as in the layer)

Each variant is timed in ROUNDS interleaved rounds; the figure is the median of the rounds' medians, and each
variant's change against `row`. If `tiny` moves the time as far as `layer`, a kernel's code and launch state
(instruction and constant caches) are what a row lacks; if only `layer` does, its predecessors' data.

    python tests/benchmarks/between_check.py [--out DIR] [--rounds 3]

Writes between_check.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROUNDS = 3
HIDDEN, INTER, QKV = 3584, 18944, 4608  # Qwen2.5-7B: hidden, intermediate, (28 + 2*4) heads x 128
OPS = {  # name: (table, model-shape spec, tiny spec)
    "attn_norm": ("rms_norm", {"tokens": 1, "hidden": HIDDEN, "dtype": "bf16"},
                  {"tokens": 1, "hidden": 256, "dtype": "bf16"}),
    "qkv": ("single_gemm", {"m": 1, "n": QKV, "k": HIDDEN, "dtype": "bf16"}, {"m": 1, "n": 256, "k": 256, "dtype": "bf16"}),
    "o": ("single_gemm", {"m": 1, "n": HIDDEN, "k": HIDDEN, "dtype": "bf16"}, {"m": 1, "n": 128, "k": 256, "dtype": "bf16"}),
    "gate_up": ("single_gemm", {"m": 1, "n": 2 * INTER, "k": HIDDEN, "dtype": "bf16"},
                {"m": 1, "n": 512, "k": 256, "dtype": "bf16"}),
    "silu_mul": ("silu_mul", {"tokens": 1, "hidden": INTER, "dtype": "bf16"}, {"tokens": 1, "hidden": 256, "dtype": "bf16"}),
    "down": ("single_gemm", {"m": 1, "n": HIDDEN, "k": INTER, "dtype": "bf16"}, {"m": 1, "n": 256, "k": 512, "dtype": "bf16"}),
}
VARIANTS = ("row", "same", "tiny", "layer")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(table: str, spec: dict):
    import msgspec

    from kprof.runners.registry import lookup

    entry = lookup(table, "torch")
    return entry.load_runner()().build(msgspec.convert(spec, entry.args), "cuda")


def rewrite(case):
    """The row's own step after the sweep: its activations rewritten in place (see kprof.runners.worker)."""
    import torch

    def as_bytes(t):
        t = t.unsqueeze(0) if t.dim() == 0 else t
        return t.view(torch.uint8) if t.is_floating_point() else t

    tensors = [as_bytes(case.inputs[i]) for i in case.warm]
    return lambda: [t.bitwise_or_(0) for t in tensors]


def hooks(name: str, model: dict, tiny: dict):
    """Per variant, what runs after the sweep and before the call of op `name`."""
    import torch

    own = rewrite(model[name])
    scratch = torch.zeros(1024, device="cuda")
    others = [op for op in OPS if op != name]

    def same():
        for _ in range(10):
            scratch.add_(0)
        own()

    def tiny_ops():
        for op in others:
            tiny[op].fn()
        own()

    def layer_ops():
        for op in others:
            model[op].fn()
        own()

    return {"row": own, "same": same, "tiny": tiny_ops, "layer": layer_ops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("between_check needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule

    started = time.perf_counter()
    model = {op: build(t, spec) for op, (t, spec, _tiny) in OPS.items()}
    tiny = {op: build(t, spec) for op, (t, _spec, spec) in OPS.items()}
    for case in list(model.values()) + list(tiny.values()):
        case.check()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < 0.3:  # wake the GPU before the first figure
        a @ a
    torch.cuda.synchronize()
    rule = StopRule(target=0.003, budget_s=0.5, min_work_n=200)
    medians: dict[str, dict[str, list[float]]] = {op: {v: [] for v in VARIANTS} for op in OPS}
    kernels: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for op in OPS:
            between = hooks(op, model, tiny)
            for v in VARIANTS:
                timing = time_gpu(model[op].fn, rule, timer="cupti", cold_l2=True, warm=between[v])
                medians[op][v].append(statistics.median(timing.samples_ms) * 1e3)
                kernels[op] = list(timing.kernels)
        log(f"round {r + 1}/{args.rounds} done in {time.perf_counter() - started:.0f} s")
    figures = {op: {v: statistics.median(xs) for v, xs in by.items()} for op, by in medians.items()}
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rounds": args.rounds,
           "ops": {op: {"table": t, "spec": s, "tiny_spec": ts} for op, (t, s, ts) in OPS.items()},
           "kernels": kernels, "medians_us": medians, "figures_us": figures, "wall_s": time.perf_counter() - started}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "between_check.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{doc['gpu']}, torch {doc['torch']}, {args.rounds} rounds, {doc['wall_s']:.0f} s")
    print(f"{'op':10s} {'row µs':>8s} " + " ".join(f"{v:>8s}" for v in VARIANTS[1:]) + "   (change against row)")
    for op, f in figures.items():
        print(f"{op:10s} {f['row']:8.2f} " + " ".join(f"{(f[v] / f['row'] - 1) * 100:+7.1f}%" for v in VARIANTS[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
