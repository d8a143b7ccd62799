#!/usr/bin/env python
"""`kprof run` on the CPU backend: wall time per spec over a 50-spec sweep of the catalog, and the CPU
timer's repeatability (CV of the medians of 5 repeated measurements of the same spec).

    python tests/benchmarks/cpu_run_bench.py [--out DIR]

Each table's 10 specs go through one `kprof.api.run` call (the JIT fill a user runs) into a fresh
ledger; then 5 specs are re-measured 5 times each with mode="fresh" and the spread of their medians
is reported. The summary table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from kprof import api

SWEEP = {
    "single_gemm": [{"m": m, "n": 256, "k": 256, "dtype": d} for m in (1, 4, 16, 64, 128) for d in ("fp32", "bf16")],
    "rms_norm": [{"tokens": t, "hidden": h, "dtype": "fp32"} for t in (1, 16, 64, 256, 1024) for h in (1024, 4096)],
    "silu_mul": [{"tokens": t, "hidden": h, "dtype": "fp32"} for t in (1, 16, 64, 256, 1024) for h in (1024, 2048)],
    "attention_prefill": [{"batch": 1, "seq_len": s, "num_heads": 8, "num_kv_heads": kv, "head_dim": 64,
                           "causal": True, "dtype": "fp32"} for s in (16, 32, 64, 128, 256) for kv in (2, 8)],
    "attention_decode": [{"batch": b, "kv_len": kv, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                          "dtype": "fp32"} for b in (1, 4) for kv in (128, 256, 512, 1024, 2048)],
}
REPEAT = [("single_gemm", SWEEP["single_gemm"][6]), ("rms_norm", SWEEP["rms_norm"][5]),
          ("silu_mul", SWEEP["silu_mul"][4]), ("attention_prefill", SWEEP["attention_prefill"][6]),
          ("attention_decode", SWEEP["attention_decode"][8])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", help="directory for cpu_run_bench.json")
    args = p.parse_args()
    db = os.path.join(tempfile.mkdtemp(), "profile.db")
    sweep = {}
    for table, specs in SWEEP.items():
        res = api.run(table, "torch-cpu", specs, mode="jit", db=db)
        sweep[table] = {"specs": len(specs), "wall_s": res.seconds, "timed_s": res.timed_seconds,
                        "ok": res.count - res.missing_count,
                        "median_time_ms": [r["metrics"]["time_ms"] for r in res.results if r["metrics"]]}
        print(f"{table}: {len(specs)} specs in {res.seconds:.2f} s ({res.timed_seconds:.2f} s timed)", flush=True)
    repeat = {}
    for table, spec in REPEAT:
        medians = []
        for _ in range(5):
            res = api.run(table, "torch-cpu", [spec], mode="fresh", db=db)
            medians.append(res.results[0]["metrics"]["time_ms"])
        cv = statistics.stdev(medians) / statistics.fmean(medians)
        repeat[table] = {"spec": spec, "medians_ms": medians, "cv": cv}
        print(f"{table} x5: medians {['%.4g' % m for m in medians]} cv {cv:.2%}", flush=True)
    total_specs = sum(v["specs"] for v in sweep.values())
    total_wall = sum(v["wall_s"] for v in sweep.values())
    total_timed = sum(v["timed_s"] for v in sweep.values())
    doc = {"sweep": sweep, "repeat": repeat, "specs": total_specs, "wall_s": total_wall, "timed_s": total_timed,
           "date": time.strftime("%Y-%m-%d"), "budget_env": os.environ.get("KPROF_TIME_BUDGET_S")}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cpu_run_bench.json"), "w") as f:
            json.dump(doc, f, indent=1)
    print()
    print(f"{'figure':44s} {'value':>12s}")
    print(f"{'specs measured (5 tables)':44s} {total_specs:>12d}")
    print(f"{'ok rows':44s} {sum(v['ok'] for v in sweep.values()):>12d}")
    print(f"{'wall time per spec, s':44s} {total_wall / total_specs:>12.3f}")
    print(f"{'share of wall time inside the timed loop':44s} {total_timed / total_wall:>12.1%}")
    for table, r in repeat.items():
        print(f"{'CV of 5 medians, ' + table:44s} {r['cv']:>12.2%}")
    print(f"{'median CV of 5 medians (5 specs)':44s} {statistics.median(r['cv'] for r in repeat.values()):>12.2%}")


if __name__ == "__main__":
    main()
