#!/usr/bin/env python
"""How often a warm-up window misses a kernel that external correlation attributes, on a GPU.

    python tests/benchmarks/attribution_check.py [--repeats 40] [--out DIR]

The CUPTI timer warms a callable up with each invocation both under a pushed external id and inside a
synchronized timestamp window. Correlation is taken where every window's kernels are among its invocation's;
before, it was taken only where the two agreed exactly, and a window that lacked its kernel (the record's
timestamps converted past the window) sent the timer to the windows, whose empty group then failed the row as an
unstable kernel set (an fp8 GEMM of the CLI smoke, twice in a row, 2026-12-04). This times small GEMMs (bf16 and
fp8, the shapes whose kernels end closest to their synchronize) and a norm `--repeats` times each, with a short
stop rule, and counts per shape: attributions, warm-ups with a late window (`attribution_why`), and errors.
Exits 1 if any timing raised.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


def shapes(torch):
    """name -> a callable over inputs built once."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    out = {}
    for m in (1, 16, 256):
        a = torch.randn(m, 4096, device="cuda", dtype=bf16, generator=g)
        b = torch.randn(4096, 4096, device="cuda", dtype=bf16, generator=g)
        out[f"bf16 {m}x4096x4096"] = (lambda a, b: lambda: a @ b)(a, b)
        a8, b8 = a.to(fp8), b.to(fp8).t().contiguous().t()  # B column-major, as _scaled_mm needs
        one = torch.ones((), device="cuda")
        out[f"fp8 {m}x4096x4096"] = (lambda a8, b8: lambda: torch._scaled_mm(
            a8, b8, scale_a=one, scale_b=one, out_dtype=bf16))(a8, b8)
    x, w = torch.randn(1, 4096, device="cuda", dtype=bf16, generator=g), torch.ones(4096, device="cuda", dtype=bf16)
    out["rms_norm 1x4096"] = lambda: F.rms_norm(x, (4096,), w)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule

    if not torch.cuda.is_available():
        print("attribution_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    rule = StopRule(max_samples=20, budget_s=0.2)
    counts: dict[str, collections.Counter] = {}
    whys: list[dict] = []
    for name, fn in shapes(torch).items():
        c = counts.setdefault(name, collections.Counter())
        for i in range(args.repeats):
            try:
                t = time_gpu(fn, rule)
            except Exception as exc:  # counted and kept: the point is how often
                c["error"] += 1
                whys.append({"shape": name, "repeat": i, "error": f"{type(exc).__name__}: {exc}"[:400]})
                continue
            c[t.notes.get("attribution", "?")] += 1
            if "past the window" in t.notes.get("attribution_why", ""):
                c["late_window"] += 1
                whys.append({"shape": name, "repeat": i, "why": t.notes["attribution_why"]})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attribution_check.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "repeats": args.repeats,
                       "counts": {k: dict(v) for k, v in counts.items()}, "events": whys}, f, indent=1)
    print(f"attribution_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.repeats} timings each")
    print(f"{'shape':20s} {'correlation':>11s} {'windows':>8s} {'late window':>11s} {'errors':>6s}")
    for name, c in counts.items():
        print(f"{name:20s} {c['external_correlation']:11d} {c['timestamp_window']:8d} {c['late_window']:11d} "
              f"{c['error']:6d}")
    return 1 if any(c["error"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
