#!/usr/bin/env python
"""Does a memory-bound row read slow in the seconds after heavy load, and does the GPU's state say so?

protocol_check.py case a (run 52, one H200, 2026-12-03) read the 8x6144x4096 bf16 decode GEMM +10.4 % slow as the
second spec after 20 s of back-to-back 8192^3 GEMMs, with the SM clock at 1980 MHz and the GPU at 48 C in its timed
samples, then within 0.3 % in the two passes after. This script repeats that on its own, one call:

  idle      the decode GEMMs timed as a row times them (CUPTI, cold L2 by the read sweep), --idle-reps times
  load      --load-s of back-to-back 8192^3 bf16 GEMMs (the protocol's load)
  after     the same rows back to back for --after-s, each stamped with its seconds since the load ended and
            NVML's readings: GPU and memory (HBM) temperature, power, SM and memory clocks, clock-event reasons

`--rounds` repeats load and after. It prints, per round, each row's time against the idle median beside the
readings, and last a short table: the largest shift after load and when it faded. Full results: OUT/after_load.json.

    python tests/benchmarks/after_load_check.py [--out DIR] [--load-s 20] [--after-s 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("kprof") is None:  # run from a checkout without kprof installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))

SPECS = ((8, 6144, 4096), (1, 6144, 4096), (64, 4096, 4096))  # (m, n, k), bf16: decode GEMMs of case a
MEMORY_TEMP_FIELD = 82  # NVML_FI_DEV_MEMORY_TEMP: the HBM temperature, in C


def nvml_reader(index: int = 0):
    """A reader of (gpu_c, mem_c, power_w, sm_mhz, mem_mhz, reasons) for CUDA device `index`; None where NVML
    cannot give a field."""
    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(index)

    def field(fid):
        try:
            (v,) = nv.nvmlDeviceGetFieldValues(h, [fid])
        except nv.NVMLError:
            return None
        if v.nvmlReturn != 0:
            return None
        kind = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}.get(v.valueType, "uiVal")
        return getattr(v.value, kind)

    def ask(fn, *args):
        try:
            return fn(h, *args)
        except nv.NVMLError:
            return None

    def read() -> dict:
        power = ask(nv.nvmlDeviceGetPowerUsage)
        return {"gpu_c": ask(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU), "mem_c": field(MEMORY_TEMP_FIELD),
                "power_w": power / 1e3 if power is not None else None,
                "sm_mhz": ask(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
                "mem_mhz": ask(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
                "reasons": ask(nv.nvmlDeviceGetCurrentClocksEventReasons)}

    return read


def fade(points: list[dict], base: float, tol: float = 0.02) -> dict:
    """The largest shift over the idle median and the seconds after the load at which every later row is within
    `tol` of it (None: not within the window). `points`: rows of {t, ms}, in time order."""
    shifts = [(p["t"], p["ms"] / base - 1) for p in points]
    if not shifts:
        return {"max_shift": None, "at_s": None, "within_after_s": None}
    t_max, worst = max(shifts, key=lambda s: s[1])
    within = None
    for i in range(len(shifts)):
        if all(abs(s) <= tol for _t, s in shifts[i:]):
            within = shifts[i][0]
            break
    return {"max_shift": worst, "at_s": t_max, "within_after_s": within}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "after-load-out")
    p.add_argument("--load-s", type=float, default=20.0)
    p.add_argument("--after-s", type=float, default=12.0)
    p.add_argument("--idle-reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.load_s <= 0 or args.after_s <= 0 or args.idle_reps < 1 or args.rounds < 1:
        print("--load-s and --after-s must be > 0, --idle-reps and --rounds >= 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("after_load_check needs a CUDA GPU", file=sys.stderr)
        return 2
    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule

    os.makedirs(args.out, exist_ok=True)
    read = nvml_reader(0)
    rule = StopRule(budget_s=0.1)
    g = torch.Generator("cuda").manual_seed(7)
    rows = {}
    for m, n, k in SPECS:
        a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        b = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        rows[f"{m}x{n}x{k}"] = (lambda a=a, b=b: torch.matmul(a, b))
    big = [torch.randn(8192, 8192, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]

    def time_row(fn) -> float:
        return statistics.median(time_gpu(fn, rule, cold_l2=True).samples_ms)

    def load(seconds: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            for _ in range(20):
                big[0] @ big[1]
            torch.cuda.synchronize()

    for fn in rows.values():  # first use: cuBLAS, CUPTI
        time_row(fn)
    idle = {name: [time_row(fn) for _ in range(args.idle_reps)] for name, fn in rows.items()}
    base = {name: statistics.median(v) for name, v in idle.items()}
    print("idle medians (us): " + ", ".join(f"{n} {v * 1e3:.2f}" for n, v in base.items()), flush=True)
    rounds = []
    for r in range(args.rounds):
        time.sleep(5.0)
        before = read()
        load(args.load_s)
        end = time.perf_counter()
        points = []
        while time.perf_counter() - end < args.after_s:
            for name, fn in rows.items():
                ms = time_row(fn)
                points.append({"t": time.perf_counter() - end, "row": name, "ms": ms, **read()})
        rounds.append({"before": before, "points": points})
        print(f"round {r + 1}: {'t s':>6} {'row':>14} {'us':>7} {'shift':>7} {'gpu C':>5} {'mem C':>5} {'W':>5} "
              f"{'SM':>5} {'mem':>5} reasons", flush=True)
        for q in points:
            print(f"         {q['t']:6.2f} {q['row']:>14} {q['ms'] * 1e3:7.2f} {q['ms'] / base[q['row']] - 1:+7.2%} "
                  f"{q['gpu_c']!s:>5} {q['mem_c']!s:>5} {q['power_w'] or 0:5.0f} {q['sm_mhz']!s:>5} "
                  f"{q['mem_mhz']!s:>5} {q['reasons']}", flush=True)
    summary = [{"round": i + 1, "row": name, **fade([q for q in rd["points"] if q["row"] == name], base[name])}
               for i, rd in enumerate(rounds) for name in rows]
    doc = {"config": vars(args), "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "idle": idle,
           "idle_median_ms": base, "rounds": rounds, "summary": summary}
    with open(os.path.join(args.out, "after_load.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{'round':>5} {'row':>14} {'max shift':>9} {'at s':>6} {'within 2 % after s':>18}")
    for s in summary:
        shift = "n/a" if s["max_shift"] is None else f"{s['max_shift']:+.2%}"
        at = "n/a" if s["at_s"] is None else f"{s['at_s']:.2f}"
        within = "never" if s["within_after_s"] is None else f"{s['within_after_s']:.2f}"
        print(f"{s['round']:>5} {s['row']:>14} {shift:>9} {at:>6} {within:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
