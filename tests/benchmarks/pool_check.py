"""Does the local pool give the rows a plain run gives, and does its idle guard keep off a busy GPU? (one GPU)

    python tests/benchmarks/pool_check.py --out DIR [--rounds 2]

1. Same rows: the same specs measured `--fresh` in this process (KPROF_POOL=off, the plain run) and on the pool
   (KPROF_POOL=on: a spawned worker on the idle GPU; the default stays in process on one GPU), alternating, `--rounds` times each: the keys must be identical, and the
   pool/plain time ratio is shown beside the plain/plain spread of the same call (the noise it is judged by).
2. A jit run (the default: in process, the one idle GPU being device 0) into a ledger, then `query`: every row ok, and the same keys.
3. Idle guard: a second process keeps the GPU busy (a GEMM loop holding 4 GiB); `run` must refuse to measure on it
   (`need 1 idle GPU(s), found 0`, exit 1, the verdict named), and KPROF_PROFILE_GPUS=0 must bypass the guard and
   say so.
Writes pool_check.json (every command's rows, stderr and wall time) under --out; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SPECS = {
    "single_gemm": [{"m": m, "n": n, "k": k, "dtype": "bf16"} for m, n, k in
                    [(1, 4096, 4096), (8, 4096, 14336), (64, 4096, 4096), (4096, 4096, 4096)]],
    "rms_norm": [{"tokens": t, "hidden": 4096, "dtype": "bf16"} for t in (1, 64)],
}

BUSY = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
hold = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
open(sys.argv[1], "w").close()
while True:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


def kprof(args, env=None, cwd=None):
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "kprof", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, cwd=cwd, timeout=500)
    wall = time.perf_counter() - t
    doc = None
    if p.stdout.strip():
        try:
            doc = json.loads(p.stdout)
        except json.JSONDecodeError:
            doc = {"stdout": p.stdout[-2000:]}
    return {"args": args, "env": env or {}, "code": p.returncode, "wall_s": round(wall, 2), "doc": doc,
            "stderr": p.stderr[-4000:]}


def rows(res) -> dict:
    return {r["key"]: r for r in res["doc"]["results"]} if res["doc"] and "results" in res["doc"] else {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="pool-check-")
    report: dict = {"same_rows": {}, "jit": {}, "guard": {}}
    table_lines = []
    ok = True
    for table, specs in SPECS.items():
        path = os.path.join(work, f"{table}.json")
        with open(path, "w") as f:
            json.dump(specs, f)
        base = ["run", table, "--backend", "torch", "--specs", path, "--json"]
        runs = {"plain": [], "pool": []}
        for _ in range(a.rounds):
            runs["plain"].append(kprof(base + ["--fresh"], {"KPROF_POOL": "off"}))
            runs["pool"].append(kprof(base + ["--fresh"], {"KPROF_POOL": "on"}))  # auto stays in process on one GPU
        report["same_rows"][table] = runs
        plain, pool = [rows(r) for r in runs["plain"]], [rows(r) for r in runs["pool"]]
        same_keys = all(set(p) == set(plain[0]) for p in plain + pool) and len(plain[0]) == len(specs)
        ok &= same_keys and all(r["code"] == 0 for rs in runs.values() for r in rs)
        for key, row in plain[0].items():
            t = {w: [rs[key]["metrics"]["time_ms"] for rs in (plain if w == "plain" else pool)] for w in runs}
            ratio = statistics.median(t["pool"]) / statistics.median(t["plain"]) - 1
            spread = (max(t["plain"]) - min(t["plain"])) / statistics.median(t["plain"])
            table_lines.append((table, json.dumps(row["spec"], separators=(",", ":")), statistics.median(t["plain"]),
                                ratio, spread, same_keys))
        # 2. jit into a ledger on the pool, then query
        db = os.path.join(work, "p.db")
        filled = kprof(base + ["--db", db])
        queried = kprof(["query", table, "--backend", "torch", "--specs", path, "--json", "--db", db])
        report["jit"][table] = {"run": filled, "query": queried}
        jit_ok = filled["code"] == 0 and queried["doc"]["missing_count"] == 0 and set(rows(queried)) == set(plain[0])
        ok &= jit_ok
        report["jit"][table]["ok"] = jit_ok

    # 3. the idle guard against a busy GPU
    ready = os.path.join(work, "busy.ready")
    busy = subprocess.Popen([sys.executable, "-c", BUSY, ready])
    try:
        t = time.time()
        while not os.path.exists(ready) and time.time() - t < 120:
            time.sleep(0.2)
        time.sleep(2.0)  # NVML's utilization covers its last sample period
        path = os.path.join(work, "single_gemm.json")
        db = os.path.join(work, "guard.db")
        guarded = kprof(["run", "single_gemm", "--backend", "torch", "--specs", path, "--json", "--db", db])
        forced = kprof(["run", "single_gemm", "--backend", "torch", "--specs", path, "--json", "--db", db],
                       {"KPROF_PROFILE_GPUS": "0"})
    finally:
        busy.kill()
        busy.wait()
    errors = [r.get("error") for r in (guarded["doc"] or {}).get("results", [])]
    guard_ok = (guarded["code"] == 1 and all(e and e["message"].startswith("need 1 idle GPU(s), found 0")
                                            for e in errors) and "gpu0 skipped" in guarded["stderr"])
    forced_ok = forced["code"] == 0 and "forced by KPROF_PROFILE_GPUS" in forced["stderr"]
    report["guard"] = {"guarded": guarded, "forced": forced, "guard_ok": guard_ok, "forced_ok": forced_ok}
    ok &= guard_ok and forced_ok
    with open(os.path.join(a.out, "pool_check.json"), "w") as f:
        json.dump(report, f, indent=1)

    print(f"{'table':12} {'spec':44} {'plain ms':>10} {'pool/plain':>11} {'plain spread':>13} keys")
    for table, spec, t, ratio, spread, same in table_lines:
        print(f"{table:12} {spec:44} {t:10.4f} {ratio:+11.2%} {spread:13.2%} {'same' if same else 'DIFFER'}")
    for table, j in report["jit"].items():
        print(f"jit {table}: run exit {j['run']['code']} in {j['run']['wall_s']} s, query ok={j['ok']}")
    for name in ("plain", "pool"):
        walls = [r["wall_s"] for rs in report["same_rows"].values() for r in rs[name]]
        print(f"{name} --fresh wall per call: median {statistics.median(walls):.1f} s")
    print(f"busy GPU: exit {guarded['code']}, refused={guard_ok}; stderr: "
          f"{[ln for ln in guarded['stderr'].splitlines() if 'devices' in ln][:1]}")
    print(f"KPROF_PROFILE_GPUS=0 on the busy GPU: exit {forced['code']}, said bypassed={forced_ok}")
    print("POOL CHECK", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
