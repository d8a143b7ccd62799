"""How much faster does a sweep fill on N GPUs than on one? (a host with N >= 2 idle GPUs)

    python tests/benchmarks/pool_scaling.py --out DIR [--specs 200]

The same sweep (decode and prefill bf16 GEMMs and rms_norms, `--specs` of them) is filled into two fresh ledgers:
once with the pool held to GPU 0 (KPROF_PROFILE_GPUS=0) and once on every idle GPU (no variable: the idle guard
chooses). The speed-up is the one-GPU wall time over the N-GPU wall time, against the target 0.9 x N; the rows of
both ledgers must be ok and cover the same keys. With one GPU it says so and times the one-GPU fill only.
Writes pool_scaling.json under --out; prints a short table last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time


def sweep(n: int) -> list[dict]:
    shapes = itertools.cycle([(m, nn, k) for m in (1, 8, 32, 64, 128, 512, 2048, 4096)
                              for nn, k in ((4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096))])
    return [{"m": m, "n": nn, "k": k + 64 * (i // 32), "dtype": "bf16"} for i, (m, nn, k) in
            zip(range(n), shapes)]


def fill(specs_path: str, db: str, env: dict) -> dict:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "kprof", "run", "single_gemm", "--backend", "torch", "--specs",
                        specs_path, "--db", db, "--json"], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=3000)
    wall = time.perf_counter() - t
    doc = json.loads(p.stdout) if p.stdout.strip() else {}
    return {"code": p.returncode, "wall_s": round(wall, 2), "missing": doc.get("missing_count"),
            "keys": sorted(r["key"] for r in doc.get("results", [])), "stderr": p.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--specs", type=int, default=200)
    a = ap.parse_args()
    from kprof.measure.nvml import gpu_inventory

    idle = [g.ordinal for g in gpu_inventory() if g.idle]
    work = tempfile.mkdtemp(prefix="pool-scaling-")
    path = os.path.join(work, "specs.json")
    with open(path, "w") as f:
        json.dump(sweep(a.specs), f)
    one = fill(path, os.path.join(work, "one.db"), {"KPROF_PROFILE_GPUS": str(idle[0] if idle else 0)})
    many = fill(path, os.path.join(work, "many.db"), {}) if len(idle) > 1 else None
    report = {"idle_gpus": idle, "specs": a.specs, "one": one, "many": many}
    with open(os.path.join(a.out, "pool_scaling.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"idle GPUs: {idle}; {a.specs} specs")
    print(f"1 GPU : exit {one['code']}, {one['wall_s']} s, missing {one['missing']}")
    if many is None:
        print("N GPUs: not run (fewer than two idle GPUs on this host)")
        return 0 if one["code"] == 0 else 1
    n = len(idle)
    speedup = one["wall_s"] / many["wall_s"]
    same = one["keys"] == many["keys"]
    print(f"{n} GPUs: exit {many['code']}, {many['wall_s']} s, missing {many['missing']}, same keys {same}")
    print(f"speed-up {speedup:.2f}x on {n} GPUs (target >= {0.9 * n:.1f}x): "
          f"{'met' if speedup >= 0.9 * n else 'NOT met'}")
    return 0 if one["code"] == many["code"] == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
