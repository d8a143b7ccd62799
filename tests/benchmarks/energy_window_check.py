#!/usr/bin/env python
"""Why does a row's energy window read a power-capped GEMM 4-7 % over a 5 s window? One call on one GPU.

For case e's three specs of protocol_check.py (a decode GEMM, 2048x4096x4096, 8192^3; bf16, backend torch), each
measured `--passes` times by `api.run` into a new ledger each, in this process (KPROF_POOL=off), every check that
`settled_energy` makes of the board's power limit is traced: the counter steps it saw since the fit's start,
the power of each interval between them, and whether it moved the fit on. Beside each row: its energy notes and
the power of a 5 s reference window of the same callable (`measure_energy`, graph-launched, L2 warm).
Full traces go to energy_window_check.json under --out ($OUT, else .); a table is printed last.

    python tests/benchmarks/energy_window_check.py [--out DIR] [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

SPECS = [{"m": 1, "n": 6144, "k": 4096, "dtype": "bf16"}, {"m": 2048, "n": 4096, "k": 4096, "dtype": "bf16"},
         {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"}]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def traced():
    """Wraps _nvml_energy._last_over: each call's steps (seconds after the first poll), interval powers, answer."""
    import kprof.measure._nvml_energy as ne

    calls: list[dict] = []
    orig = ne._last_over

    def last_over(polls, since, limit_w, min_gap=0.09):
        out = orig(polls, since, limit_w, min_gap)
        t0 = polls[0][0] if polls else since
        pts = ne.tick_points(polls[:], since, math.inf)
        powers = [(b.mj - a.mj) / (b.t - a.t) / 1000 for a, b in zip(pts, pts[1:])]
        calls.append({"since_s": round(since - t0, 4), "limit_w": limit_w, "now_s": round(time.perf_counter() - t0, 4),
                      "steps_s": [round(p.t - t0, 4) for p in pts], "widths_ms": [round(p.width * 1e3, 2) for p in pts],
                      "interval_w": [round(w, 1) for w in powers],
                      "over_s": None if out is None else round(out - t0, 4)})
        return out

    ne._last_over = last_over
    exit_ = ne.CounterPolls.__exit__

    def exit_keeping_polls(self, *exc):  # each window's counter steps: (seconds after its first poll, W since last)
        out = exit_(self, *exc)
        t0 = self.polls[0][0] if self.polls else 0.0
        pts = ne.tick_points(self.polls, t0, math.inf)
        calls.append({"window": [(round(b.t - t0, 3), round((b.mj - a.mj) / (b.t - a.t) / 1000))
                                 for a, b in zip(pts, pts[1:])]})
        return out

    ne.CounterPolls.__exit__ = exit_keeping_polls
    return calls


def reference(spec: dict, seconds: float) -> tuple[float, float]:
    import msgspec
    import torch

    from kprof.measure._burst import burst
    from kprof.measure.nvml import measure_energy
    from kprof.runners.registry import lookup

    entry = lookup("single_gemm", "torch")
    case = entry.load_runner()().build(msgspec.convert(spec, entry.args), "cuda")
    t = time.perf_counter()
    for _ in range(3):
        case.fn()
    torch.cuda.synchronize()
    calls_fn, per_replay, _how = burst(case.fn, (time.perf_counter() - t) / 3, call_bytes=case.bytes)
    ref = measure_energy(calls_fn, seconds=seconds)
    return ref.power_w, ref.j_per_call / per_replay  # (W, J per call)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--ref-s", type=float, default=5.0)
    args = p.parse_args(argv)
    os.environ["KPROF_POOL"] = "off"
    from kprof import api

    calls = traced()
    work = tempfile.mkdtemp(prefix="energy-window-")
    rows = []
    for spec in SPECS:
        ref_w, ref_j = reference(spec, args.ref_s)
        ref_window = calls[-1].get("window")
        log(f"{spec['m']}x{spec['n']}x{spec['k']} reference steps (s, W): {ref_window}")
        for i in range(args.passes):
            before = len(calls)
            res = api.run("single_gemm", "torch", [spec], db=os.path.join(work, f"{len(rows)}.db"))
            doc = res.results[0]
            window = [c["window"] for c in calls[before:] if "window" in c]
            row = {"spec": spec, "pass": i, "status": doc["status"], "metrics": doc["metrics"],
                   "checks": [c for c in calls[before:] if "window" not in c], "windows": window, "ref_power_w": ref_w, "ref_j": ref_j, "ref_window": ref_window,
                   "ratio": doc["metrics"]["energy_j"] / ref_j if doc["metrics"].get("energy_j") else None}
            rows.append(row)
            log(f"{spec['m']}x{spec['n']}x{spec['k']} pass {i}: energy window steps (s, W) {window[:1]}")
            log(f"{spec['m']}x{spec['n']}x{spec['k']} pass {i}: {len(row['checks'])} checks, "
                f"{[c['interval_w'] for c in row['checks']]}, over {[c['over_s'] for c in row['checks']]}")
    with open(os.path.join(args.out, "energy_window_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'spec':18s} {'pass':>4s} {'checks':>6s} {'last check: interval W':40s} {'moved':>5s} {'ref W':>7s} {'row/ref':>7s}")
    for r in rows:
        last = r["checks"][-1] if r["checks"] else {}
        s = r["spec"]
        print(f"{s['m']}x{s['n']}x{s['k']:<8} {r['pass']:>4d} {len(r['checks']):>6d} "
              f"{str(last.get('interval_w')):40s} {sum(c['over_s'] is not None for c in r['checks']):>5d} "
              f"{r['ref_power_w']:7.1f} {r['ratio'] or float('nan'):7.4f}")
    ratios = [abs(r["ratio"] - 1) for r in rows if r["ratio"]]
    print(f"max |row energy / {args.ref_s:g} s reference - 1|: {max(ratios):.2%} over {len(ratios)} rows (target 5 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
