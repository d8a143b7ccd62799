"""Collectives on this host's GPUs: the nccl rows, their busbw curves, and all_reduce against a plain timed loop.

    python tests/benchmarks/comm_check.py [--out $OUT] [--tables all_reduce,...] [--world-sizes 2,4,8]
                                          [--max-bytes 1073741824] [--step 4] [--budget-s 0.25] [--loop-iters 20]

1. Rows: `kprof.api.run` (jit, the local pool, into a fresh ledger) of every table (all_reduce, all_gather,
   reduce_scatter, all_to_all), bf16, from 1 KiB to --max-bytes (x --step), at each world size of 2, 4, 8 that
   this host's GPU count allows. Each table's run writes its snapshot (curve.png: busbw against size, one line per
   world size); busbw_curves.png puts the four side by side.
2. Baseline: for each world size, a plain torch.distributed loop, nccl-tests style: every rank allocates the largest
   all_reduce message, warms up, then times --loop-iters all_reduces back to back between two CUDA events; its
   time is the maximum over ranks of (elapsed / iterations), its busbw size/time x 2(n-1)/n. The kprof row of the
   same size and world size must be within 10 % of it (the row: per iteration the slowest rank's CUPTI kernel
   time, L2 swept and the input rewritten before each op, after a barrier; the median over iterations).
3. One GPU: the nccl path still runs, at world_size 1 (a plumbing check: NCCL, the pool, the ranks, the ledger),
   and the table says multi-GPU was not available. NCCL does nothing for an in-place all_reduce on one rank, so
   that row is `unsupported` there.

Everything goes into comm_check.tar.gz under --out (default $OUT): the ledger, each run's snapshot and rows,
busbw_curves.png, comm_check.json. The short table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time

TABLES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
TOLERANCE = 0.10


def _gpu_count() -> int:
    """Visible GPUs, from NVML (this process leaves CUDA alone: the pool's workers and the loop's ranks use it)."""
    from kprof.measure.nvml import gpu_names

    return len(gpu_names())


def _wait_idle(seconds: float = 60.0) -> str:
    """Waits until the idle guard finds every GPU idle again (the last run's ranks gone), up to `seconds`; returns
    what was still busy, or ""."""
    from kprof.measure.nvml import gpu_inventory

    deadline = time.monotonic() + seconds
    while True:
        busy = "; ".join(f"gpu{g.ordinal}: {g.busy}" for g in gpu_inventory() if g.busy)
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(1.0)


def _sizes(max_bytes: int, step: int) -> list[int]:
    out, s = [], 1024
    while s <= max_bytes:
        out.append(s)
        s *= step
    if out[-1] != max_bytes:
        out.append(max_bytes)
    return out


def _loop_rank(rank: int, n: int, size: int, iters: int, store: str, out: str) -> None:
    """One rank of the plain loop: all_reduce back to back between two CUDA events (nccl-tests' timing)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=n,
                            device_id=torch.device("cuda", rank))
    x = torch.ones(size // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):  # three timed loops; the best is nccl-tests' steady state
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"ms": min(times), "all": times}, f)
    dist.destroy_process_group()


def plain_loop(n: int, size: int, iters: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "t")
        mp.start_processes(_loop_rank, args=(n, size, iters, store, out), nprocs=n, start_method="spawn")
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(n)]
    ms = max(r["ms"] for r in per_rank)
    algbw = size / (ms / 1e3) / 1e9
    return {"world_size": n, "bytes": size, "iters": iters, "time_ms": ms, "per_rank": per_rank,
            "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n}


def plot_all(runs: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 4), dpi=110, squeeze=False)
    for ax, (table, doc) in zip(axes[0], runs.items()):
        series: dict[int, list] = {}
        for r in doc["results"]:
            if r["status"] == "ok":
                series.setdefault(r["spec"]["world_size"], []).append((r["spec"]["message_size_bytes"],
                                                                       r["metrics"]["busbw_gbps"]))
        for n, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"{n} GPUs")
        ax.set_xscale("log", base=2)
        ax.set_title(table, fontsize=9)
        ax.set_xlabel("message_size_bytes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("busbw_gbps")
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tables", default=",".join(TABLES))
    ap.add_argument("--world-sizes", default="", help="default: 2, 4, 8 as far as the GPUs go (1 with one GPU)")
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=0.25, help="KPROF_TIME_BUDGET_S per spec")
    ap.add_argument("--loop-iters", type=int, default=20)
    ap.add_argument("--backend", default="nccl", help="gloo: a CPU dry run of this script (no baseline)")
    args = ap.parse_args()
    os.environ["KPROF_TIME_BUDGET_S"] = str(args.budget_s)  # before the pool's workers start

    from kprof import api, artifacts

    gpus = _gpu_count()
    if gpus == 0 and args.backend == "nccl":
        print("comm_check: no CUDA GPU visible (NVML lists none); nothing measured", file=sys.stderr)
        return 2
    if args.world_sizes:
        sizes_n = [int(w) for w in args.world_sizes.split(",")]
    else:
        sizes_n = [w for w in (2, 4, 8) if w <= gpus] or [1]
    multi = gpus >= 2 and args.backend == "nccl"
    sizes = _sizes(args.max_bytes, args.step)
    work = tempfile.mkdtemp(prefix="comm_check-")
    db = os.path.join(work, "profile.db")
    report: dict = {"gpus": gpus, "world_sizes": sizes_n, "sizes": sizes, "budget_s": args.budget_s, "runs": {},
                    "loops": [], "started": datetime.datetime.now().isoformat(timespec="seconds")}
    runs = {}
    for table in args.tables.split(","):
        specs = [{"message_size_bytes": s, "dtype": "bf16", "world_size": n} for n in sizes_n for s in sizes]
        if args.backend == "nccl":
            busy = _wait_idle()
            if busy:
                print(f"# {table}: GPUs still busy after 60 s ({busy}); measuring anyway", flush=True)
        started, t = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
        res = api.run(table, args.backend, specs, db=db, mode="jit")
        seconds = time.perf_counter() - t
        artifacts.snapshot(os.path.join(work, f"snapshot_{table}"), res, specs, started_at=started, seconds=seconds,
                           command=f"comm_check.py {table}")
        doc = res.to_json()
        runs[table] = doc
        report["runs"][table] = {"wall_s": round(seconds, 1), "exit_code": res.exit_code, "pool": res.pool,
                                 "rows": [{"spec": r["spec"], "status": r["status"], "metrics": r["metrics"],
                                           "error": r.get("error")} for r in doc["results"]]}
        print(f"# {table}: {sum(r['status'] == 'ok' for r in doc['results'])}/{len(specs)} ok in {seconds:.0f} s",
              flush=True)
    plot_all(runs, os.path.join(work, "busbw_curves.png"))

    verdicts = []
    if multi and "all_reduce" in runs:
        big = max(sizes)
        for n in sizes_n:
            row = next((r for r in runs["all_reduce"]["results"] if r["spec"] == {"message_size_bytes": big,
                        "dtype": "bf16", "world_size": n}), None)
            try:
                _wait_idle()
                loop = plain_loop(n, big, args.loop_iters)
            except Exception as e:  # noqa: BLE001 - reported in the table
                loop = {"world_size": n, "error": f"{type(e).__name__}: {e}"}
            report["loops"].append(loop)
            if row is None or row["status"] != "ok" or "error" in loop:
                verdicts.append((n, None, None, "FAIL (no row or no loop)"))
                continue
            ratio = row["metrics"]["busbw_gbps"] / loop["busbw_gbps"]
            verdicts.append((n, row["metrics"]["busbw_gbps"], loop["busbw_gbps"],
                             "ok" if abs(ratio - 1) <= TOLERANCE else f"FAIL (ratio {ratio:.3f})"))
    report["verdicts"] = verdicts

    with open(os.path.join(work, "comm_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.makedirs(args.out, exist_ok=True)
    tar = os.path.join(args.out, "comm_check.tar.gz")
    with tarfile.open(tar, "w:gz") as t:
        t.add(work, arcname="comm_check")
    shutil.rmtree(work, ignore_errors=True)  # all of it is in the tarball

    # the short table, last
    out = io.StringIO()
    print(f"\n# comm_check: {gpus} GPU(s), world sizes {sizes_n}, bf16, {sizes[0]} B .. {sizes[-1]} B; -> {tar}",
          file=out)
    if args.backend != "nccl":
        print(f"# a dry run on {args.backend}: no GPU measured, no baseline", file=out)
    elif not multi:
        print("# multi-GPU not available: only the world_size 1 plumbing check ran (no busbw, no baseline)", file=out)
    print(f"{'table':<15}{'n':>3}{'ok':>7}{'1KiB us':>10}{'1MiB busbw':>12}{'max busbw':>11}", file=out)
    for table, doc in runs.items():
        for n in sizes_n:
            rows = [r for r in doc["results"] if r["spec"]["world_size"] == n]
            ok = {r["spec"]["message_size_bytes"]: r["metrics"] for r in rows if r["status"] == "ok"}
            small = f"{ok[1024]['time_ms'] * 1e3:.1f}" if 1024 in ok else "-"
            mid = f"{ok[1 << 20]['busbw_gbps']:.1f}" if (1 << 20) in ok else "-"
            top = f"{ok[max(ok)]['busbw_gbps']:.1f}" if ok else "-"
            print(f"{table:<15}{n:>3}{f'{len(ok)}/{len(rows)}':>7}{small:>10}{mid:>12}{top:>11}", file=out)
            for r in rows:
                if r["status"] != "ok":
                    print(f"   {r['spec']['message_size_bytes']} B: {r['status']}: "
                          f"{str((r.get('error') or {}).get('message', ''))[:160]}", file=out)
    for n, row, loop, verdict in verdicts:
        print(f"all_reduce {max(sizes)} B at {n} GPUs: kprof busbw {row or 0:.1f} GB/s, plain loop {loop or 0:.1f} "
              f"GB/s: {verdict} (tolerance {TOLERANCE:.0%})", file=out)
    print(out.getvalue(), flush=True)
    bad = any(v[3] != "ok" for v in verdicts) or any(d["exit_code"] not in (0, 1) for d in report["runs"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
