#!/usr/bin/env python
"""NVML smoke test on a GPU: the environment, telemetry of a busy GEMM loop, and `measure_energy` against a
long reference window.

    python tests/benchmarks/nvml_smoke.py [--index 0] [--size 8192] [--fit-s 1.5] [--ref-s 5] [--out DIR]

A bf16 size^3 matmul runs back to back throughout. In order: the GPU environment; a 2 s telemetry capture
(it also brings the GPU to its steady, power-capped state); `measure_energy` over a --fit-s window; a
--ref-s reference window read straight from pynvml, independent of kprof's energy code, two ways: plain
(the counter read at the window's ends: off by up to one ~0.1 s counter step at each end) and step-aligned
(both ends placed on a counter step, by running single synchronized calls until the counter moves); and
`measure_energy` again, to bracket any drift. Exits 1 when an estimate is more than --tolerance (5%) from a
reference, 2 when there is no GPU. The summary table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import msgspec

from kprof.measure.nvml import Telemetry, device_handle, gpu_environment, gpu_names, measure_energy


def reference(fn, sync, handle, seconds: float, chunk: int) -> dict:
    """J/call over `seconds` of back-to-back calls, from two raw counter readings (plain) and from two
    counter steps (aligned)."""
    import pynvml

    def energy() -> int:
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)

    def until_step(calls: int) -> tuple[int, int]:
        last = energy()
        while True:
            fn()
            sync()
            calls += 1
            now = energy()
            if now != last:
                return now, calls

    sync()
    c_p0, t_p0, calls = energy(), time.perf_counter(), 0
    c_a0, calls_a0 = until_step(calls)
    calls = calls_a0
    while time.perf_counter() - t_p0 < seconds:
        for _ in range(chunk):
            fn()
        sync()
        calls += chunk
    c_p1, t_p1, calls_p = energy(), time.perf_counter(), calls
    c_a1, calls_a1 = until_step(calls)
    return {"plain_j_per_call": (c_p1 - c_p0) / 1000 / calls_p, "plain_calls": calls_p,
            "plain_window_s": t_p1 - t_p0, "plain_power_w": (c_p1 - c_p0) / 1000 / (t_p1 - t_p0),
            "aligned_j_per_call": (c_a1 - c_a0) / 1000 / (calls_a1 - calls_a0),
            "aligned_calls": calls_a1 - calls_a0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=int, default=0, help="CUDA device")
    p.add_argument("--size", type=int, default=8192, help="GEMM size (bf16 size x size x size)")
    p.add_argument("--fit-s", type=float, default=1.5, help="measure_energy window")
    p.add_argument("--ref-s", type=float, default=5.0, help="reference window")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--out", help="directory for nvml_smoke.json")
    args = p.parse_args()

    names = gpu_names()
    if not names:
        print("nvml_smoke: no NVIDIA GPU visible through NVML; run it on a GPU host", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"nvml_smoke: NVML sees {names} but torch {torch.__version__} has no CUDA", file=sys.stderr)
        return 2

    env = gpu_environment(args.index)
    print("== environment")
    print(msgspec.json.format(msgspec.json.encode(env)).decode(), flush=True)

    torch.cuda.set_device(args.index)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = args.size
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def fn():
        torch.matmul(a, b, out=c)

    sync = torch.cuda.synchronize
    for _ in range(10):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(20):
        fn()
    sync()
    per_call_s = (time.perf_counter() - t) / 20
    chunk = max(1, int(0.025 / per_call_s))
    print(f"\n== GEMM {n}^3 bf16: {per_call_s * 1e3:.3f} ms/call back to back, "
          f"{2 * n**3 / per_call_s / 1e12:.0f} TFLOP/s", flush=True)

    print("\n== telemetry, 2 s of back-to-back GEMMs at 20 Hz")
    with Telemetry(args.index, hz=20) as tel:
        t = time.perf_counter()
        while time.perf_counter() - t < 2.0:
            for _ in range(chunk):
                fn()
            sync()
    summary = tel.summary()
    print(json.dumps(summary, indent=1))
    print("samples (t, sm_mhz, mem_mhz, power_w, temp_c, util_pct, reasons):")
    for s in tel.samples[:: max(1, len(tel.samples) // 8)]:
        print("  ", tuple(round(x, 3) if isinstance(x, float) else x for x in s))

    print(f"\n== measure_energy, {args.fit_s} s window", flush=True)
    fit1 = measure_energy(fn, seconds=args.fit_s, sync=sync, index=args.index)
    print(msgspec.json.encode(fit1).decode(), flush=True)

    print(f"\n== reference, {args.ref_s} s window", flush=True)
    ref = reference(fn, sync, device_handle(args.index), args.ref_s, chunk)
    print(json.dumps(ref, indent=1), flush=True)

    print(f"\n== measure_energy again, {args.fit_s} s window (brackets drift)", flush=True)
    fit2 = measure_energy(fn, seconds=args.fit_s, sync=sync, index=args.index)
    print(msgspec.json.encode(fit2).decode(), flush=True)

    rows = [  # (quantity, J/call, reference J/call or None)
        ("fit, before ref (J/call)", fit1.j_per_call, ref["aligned_j_per_call"]),
        ("fit, before ref vs plain ref", fit1.j_per_call, ref["plain_j_per_call"]),
        ("fit, after ref (J/call)", fit2.j_per_call, ref["aligned_j_per_call"]),
        ("two-read in fit window", fit1.two_read_j_per_call, None),
        ("ref, step-aligned (J/call)", ref["aligned_j_per_call"], None),
        ("ref, plain two-read (J/call)", ref["plain_j_per_call"], None),
    ]
    failed = []
    lines = [f"{'quantity':<30} {'value':>10} {'ratio':>8} {'ok':>4}"]
    for name, value, base in rows:
        ratio = value / base if base else None
        ok = ratio is None or abs(ratio - 1) <= args.tolerance
        if not ok:
            failed.append(name)
        lines.append(f"{name:<30} {value:>10.4f} {'' if ratio is None else f'{ratio:.4f}':>8} "
                     f"{'' if ratio is None else ('yes' if ok else 'NO'):>4}")
    lines += [
        f"{'fit uncertainty (1 sigma)':<30} {fit1.rel_uncertainty:>10.3%}",
        f"{'fit ticks / tick period (s)':<30} {fit1.ticks:>10d} {fit1.tick_s or 0:>8.4f}",
        f"{'fit power (W)':<30} {fit1.power_w:>10.1f}",
        f"{'power limit (W)':<30} {env.power_limit_w or 0:>10.1f}",
        f"{'telemetry SM MHz median':<30} {summary['sm_mhz_median'] or 0:>10.0f}",
        f"{'telemetry power W mean':<30} {summary['power_w_mean'] or 0:>10.1f}",
        f"{'telemetry throttle':<30} {','.join(summary['throttle']) or '-':>10}",
    ]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "nvml_smoke.json"), "w") as f:
            json.dump({"environment": msgspec.to_builtins(env), "telemetry": summary,
                       "fit_before": msgspec.to_builtins(fit1), "fit_after": msgspec.to_builtins(fit2),
                       "reference": ref, "failed": failed}, f, indent=1)
    print("\n== summary (ratio = estimate / reference; ok within "
          f"{args.tolerance:.0%})")
    print("\n".join(lines))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    if "power_cap" not in summary["throttle"]:
        print("note: no power_cap reason seen; the GEMM may not have reached the power limit")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
