#!/usr/bin/env python
"""Every GPU timer mode on three shapes, on a GPU: a smoke test and a table to compare with GPU-NOTES.md.

    python tests/benchmarks/gpu_timer_smoke.py [--budget 1.0]

Shapes: bf16 GEMM 256x128x128 and 4096^3 (torch.matmul), bf16 rms_norm 1x4096 (F.rms_norm).
Modes: cupti (cold L2), cupti-warm (cold_l2=False), events (cold L2), cupti-graph and events-graph (CUDA-graph
replay over enough input copies to exceed 2x L2). "vs events" is the row's median over the events row of the
same shape, measured in this run. Exits 1 if any row raised.
"""

from __future__ import annotations

import argparse
import sys
import traceback


def shapes(torch):
    """name -> (make one copy: () -> closure, bytes of one copy's inputs)."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16

    def gemm(m, n, k):
        def make():
            a = torch.randn(m, k, device="cuda", dtype=bf16, generator=g)
            b = torch.randn(k, n, device="cuda", dtype=bf16, generator=g)
            return lambda: a @ b
        return make, 2 * (m * k + k * n)

    def rms_norm(tokens, hidden):
        def make():
            scale = torch.rand(hidden, device="cuda", generator=g) * 4 + 0.25
            x = (torch.randn(tokens, hidden, device="cuda", generator=g) * scale).to(bf16)
            w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(bf16)
            return lambda: F.rms_norm(x, (hidden,), w, 1e-6)
        return make, 2 * (tokens * hidden + hidden)

    return {"gemm 256x128x128": gemm(256, 128, 128), "gemm 4096^3": gemm(4096, 4096, 4096),
            "rms_norm 1x4096": rms_norm(1, 4096)}


MODES = {
    "cupti": dict(timer="cupti"),
    "cupti-warm": dict(timer="cupti", cold_l2=False),
    "events": dict(timer="events"),
    "cupti-graph": dict(timer="cupti", graph=True),
    "events-graph": dict(timer="events", graph=True),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=1.0, help="StopRule budget_s per row (default 1.0)")
    args = p.parse_args()

    import importlib.metadata as md

    import torch

    from kprof.measure.gpu_timer import cupti_available, rotation_copies, time_gpu
    from kprof.measure.stats import StopRule

    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU", file=sys.stderr)
        return 1
    try:
        cupti_version = md.version("cupti-python")
    except md.PackageNotFoundError:
        cupti_version = "not installed"
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, L2 {props.L2_cache_size >> 20} MiB; torch {torch.__version__}; "
          f"cupti-python {cupti_version}; cupti_available: {cupti_available() or 'yes'}")

    rows, failed = [], 0
    for shape, (make, nbytes) in shapes(torch).items():
        fn = make()
        copies = rotation_copies(nbytes)
        rotations = None
        for mode, kw in MODES.items():
            try:
                if kw.get("graph") and rotations is None:
                    rotations = [make() for _ in range(copies)]
                t = time_gpu(fn, StopRule(budget_s=args.budget),
                             rotations=rotations if kw.get("graph") else None, **kw)
            except Exception as e:  # noqa: BLE001 - every failure is reported, then the exit code says so
                failed += 1
                print(f"\n[{shape} / {mode}] raised:", file=sys.stderr)
                traceback.print_exc()
                rows.append((shape, mode, None, f"{type(e).__name__}: {e}"))
                continue
            rows.append((shape, mode, t, None))
        del rotations
        torch.cuda.empty_cache()

    def median(t):
        xs = sorted(t.samples_ms)
        return xs[len(xs) // 2]

    base = {shape: median(t) for shape, mode, t, _ in rows if mode == "events" and t is not None}
    head = (f"{'shape':<18} {'mode':<13} {'median_us':>10} {'vs events':>9} {'n':>5} {'stop':<11} {'wall_s':>7} "
            f"{'gpu/wall':>8} {'kernels':>7}  {'attribution':<21} first kernel")
    print("\n" + head + "\n" + "-" * len(head))
    for shape, mode, t, err in rows:
        if t is None:
            print(f"{shape:<18} {mode:<13} ERROR {err[:150]}")
            continue
        m = median(t)
        ratio = f"{m / base[shape]:.3f}" if shape in base else "-"
        first = t.kernels[0][:48] if t.kernels else "-"
        print(f"{shape:<18} {mode:<13} {m * 1e3:>10.2f} {ratio:>9} {len(t.samples_ms):>5} {t.stop_reason:<11} "
              f"{t.wall_s:>7.3f} {t.gpu_s / t.wall_s:>8.3f} {len(t.kernels):>7}  {t.notes['attribution']:<21} "
              f"{first}")
    print("\nnotes:")
    for shape, mode, t, _ in rows:
        if t is not None:
            print(f"  {shape} / {mode}: warmup={t.warmup} dropped={t.dropped} {t.notes}")
    if failed:
        print(f"\n{failed} row(s) raised", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
