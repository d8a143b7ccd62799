#!/usr/bin/env python
"""Why does Mixtral's decode b=1 expert GEMM read 7-11 % above the model? One call on one GPU.

model_step.py (run 20) found torch._grouped_mm at 1 token, top-2 of 8 experts (Mixtral-8x7B gate/up: hidden 4096,
intermediate 2x14336) bimodal by layer inside the 16-layer model: ~183-203 µs on some layers, ~214-235 µs on
others (eager and graph alike), while the kprof row (the mean over 16 routings, two weight allocations) read 237 µs.
A token reaches exactly two experts, so a routing at b=1 is a pair of experts. This separates what the time follows:

  pairs   each of the 28 expert pairs routed by hand (x[2, hidden], offs putting row 0 on expert a and row 1 on
          expert b), timed as a row is (CUPTI, cold L2 by the read sweep, activations rewritten after it), on one
          weight allocation: does the time follow the pair?
  row     the registry's Case timed as `kprof run` times it (its 16 routings rotated by Case.refresh), beside the
          mean of the pair table over the same routings: does the row time what its routings predict?
  chain   LAYERS weight allocations (as a model's layers), one grouped GEMM each back to back with one fixed pair,
          eagerly and as one CUDA graph, every kernel's time from CUPTI: does a fixed pair alternate by layer
          (placement) or not (the pair)? `churn`: the same, each layer's activations gathered afresh
          (index_select, as the model's `gather`), so activations and outputs move between allocator blocks as
          in a model's forward.
  offsets the activations at several byte offsets inside one buffer: does the time follow their address?
  run     `kprof.api.run` (mode fresh: nothing stored) of the spec, with the energy run (the default) and
          without it, in the same process as the direct timings above: does the row's protocol move it?

    python tests/benchmarks/moe_decode_check.py [--out DIR] [--layers 16] [--iters 8]

Writes moe_decode_check.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

EXPERTS, TOPK = 8, 2
OPS = {"gate_up": (4096, 2 * 14336), "down": (14336, 4096)}  # Mixtral-8x7B: (hidden, intermediate) of the GEMM


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def weights(torch, g, hidden: int, inter: int):
    """w[experts, inter, hidden] as nn.Linear keeps it, passed transposed (as the runner and the model do)."""
    w = torch.empty(EXPERTS, inter, hidden, device="cuda", dtype=torch.bfloat16)
    for e in range(EXPERTS):
        w[e] = torch.randn(inter, hidden, generator=g, device="cuda") / hidden ** 0.5
    return w.transpose(-2, -1)


def offs_for(torch, pair) -> object:
    counts = [1 if e in pair else 0 for e in range(EXPERTS)]
    return torch.tensor(list(itertools.accumulate(counts)), device="cuda", dtype=torch.int32)


def time_pair(torch, x, w_t, offs) -> float:
    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule
    from kprof.measure._l2 import rewriter

    t = time_gpu(lambda: torch._grouped_mm(x, w_t, offs=offs), StopRule(budget_s=0.15), timer="cupti",
                 cold_l2=True, warm=rewriter(torch, [x, offs]))
    return statistics.median(t.samples_ms) * 1e3


def pairs_case(torch, op: str, g) -> dict:
    hidden, inter = OPS[op]
    w_t = weights(torch, g, hidden, inter)
    x = torch.randn(TOPK, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    table = {}
    for pair in itertools.combinations(range(EXPERTS), TOPK):
        table[f"{pair[0]}{pair[1]}"] = time_pair(torch, x, w_t, offs_for(torch, pair))
    again = {k: time_pair(torch, x, w_t, offs_for(torch, (int(k[0]), int(k[1])))) for k in list(table)[:4]}
    del w_t
    torch.cuda.empty_cache()
    return {"us": table, "repeat_us": again}


def row_case(torch, op: str, pair_us: dict) -> dict:
    """The registry's Case for the spec, timed as a row, and the pair table's mean over the row's routings."""
    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule
    from kprof.runners.moe import MoeGroupedGemmArgs, MoeGroupedMm

    hidden, inter = OPS[op]
    spec = MoeGroupedGemmArgs(tokens=1, experts=EXPERTS, topk=TOPK, hidden=hidden, intermediate=inter, dtype="bf16")
    case = MoeGroupedMm().build(spec, "cuda")
    case.check()
    draws = case.refresh.__self__  # the Draws whose routings the row rotates over
    pairs = ["".join(str(e) for e in (c > 0).nonzero().flatten().tolist()) for c in draws.counts]
    t = time_gpu(case.fn, StopRule(budget_s=0.3), timer="cupti", cold_l2=True, warm=case.refresh)
    n = len(pairs)
    # sample i was timed after refresh number (calls so far): the routing turn is not tracked per sample here,
    # so compare means: the row's median and mean, and the pair table's mean over the row's routings
    predicted = statistics.fmean(pair_us[p] for p in pairs)
    del case
    torch.cuda.empty_cache()
    return {"pairs": pairs, "routings": n, "row_median_us": statistics.median(t.samples_ms) * 1e3,
            "row_mean_us": statistics.fmean(t.samples_ms) * 1e3, "predicted_from_pairs_us": predicted}


def offsets_case(torch, op: str, g) -> dict:
    """The activations as views at byte offsets inside one buffer (16-byte aligned, as TMA needs)."""
    hidden, inter = OPS[op]
    w_t = weights(torch, g, hidden, inter)
    offs = offs_for(torch, (0, 1))
    buf = torch.randn(TOPK * hidden + (1 << 20), generator=g, device="cuda", dtype=torch.bfloat16)
    out = {}
    for off in (0, 256, 512, 1024, 2048, 4096, 8192, 65536, 1 << 20):
        x = buf[off // 2: off // 2 + TOPK * hidden].view(TOPK, hidden)
        out[str(off)] = time_pair(torch, x, w_t, offs)
    del w_t
    torch.cuda.empty_cache()
    return out


def run_case(op: str) -> dict:
    """The spec through kprof.api.run (mode fresh), with and without the energy run."""
    import tempfile

    from kprof import api

    hidden, inter = OPS[op]
    spec = {"tokens": 1, "experts": EXPERTS, "topk": TOPK, "hidden": hidden, "intermediate": inter, "dtype": "bf16"}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, energy in (("energy", None), ("no_energy", "0")):
            if energy is None:
                os.environ.pop("KPROF_ENERGY_S", None)
            else:
                os.environ["KPROF_ENERGY_S"] = energy
            res = api.run("moe_grouped_gemm", "torch", [spec], mode="fresh", db=os.path.join(tmp, "k.db"))
            row = res.results[0]
            out[label] = {"time_us": (row.get("metrics") or {}).get("time_ms", float("nan")) * 1e3,
                          "status": row.get("status"), "row": row}
    os.environ.pop("KPROF_ENERGY_S", None)
    return out


def chain_case(torch, op: str, g, layers: int, iters: int, pair=(0, 1), churn: bool = False) -> dict:
    """One grouped GEMM per layer allocation, back to back, eager and as a graph: each layer's median µs."""
    from kprof.measure._cupti import Session
    from kprof.measure._sampling import side_warmup

    hidden, inter = OPS[op]
    ws = [weights(torch, g, hidden, inter) for _ in range(layers)]
    x = torch.randn(TOPK, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    offs = offs_for(torch, pair)
    rows = torch.arange(TOPK, device="cuda")

    def forward():
        y = None
        for w in ws:
            xs = x.index_select(0, rows) if churn else x
            y = torch._grouped_mm(xs, w, offs=offs)
        return y

    out = {"pair": f"{pair[0]}{pair[1]}", "ptr_mib": [w.data_ptr() / 2 ** 20 for w in ws]}
    with Session() as session:
        for _ in range(3):
            forward()
        side_warmup(torch, [forward])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        torch.cuda.synchronize()
        for mode, run in (("eager", forward), ("graph", graph.replay)):
            session.collect()
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
            kernels, _ = session.collect()
            gemms = sorted((k for k in kernels if "GemmUniversal" in k[0] or "gemm" in k[0].lower()
                            and "prepare_grouped" not in k[0]), key=lambda k: k[1])
            per = [[] for _ in range(layers)]
            for i, k in enumerate(gemms[-iters * layers:]):
                per[i % layers].append((k[2] - k[1]) / 1e3)
            out[mode] = [statistics.median(p) for p in per]
            log(f"  chain{' churn' if churn else ''} {op} {mode}: " + " ".join(f"{v:.1f}" for v in out[mode]))
    ws.clear()
    graph = None  # noqa: F841 - the graph and its memory go now
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--iters", type=int, default=8)
    a = p.parse_args()
    import torch

    started = time.perf_counter()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "ops": {}}
    for op in OPS:
        g = torch.Generator("cuda").manual_seed(7)
        doc = {"pairs": pairs_case(torch, op, g)}
        us = doc["pairs"]["us"]
        log(f"{op} pairs: " + " ".join(f"{k}:{v:.1f}" for k, v in us.items()))
        doc["row"] = row_case(torch, op, us)
        log(f"{op} row: {doc['row']}")
        doc["chain"] = chain_case(torch, op, g, a.layers, a.iters)
        doc["churn"] = chain_case(torch, op, g, a.layers, a.iters, churn=True)
        doc["offsets"] = offsets_case(torch, op, g)
        log(f"{op} offsets: {doc['offsets']}")
        doc["run"] = run_case(op)
        log(f"{op} run: " + ", ".join(f"{k} {v['time_us']:.1f} µs ({v['status']})" for k, v in doc["run"].items()))
        result["ops"][op] = doc
    result["wall_s"] = time.perf_counter() - started
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "moe_decode_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['gpu']}, torch {result['torch']}; Mixtral-8x7B experts at 1 token, top-2; "
          f"wall {result['wall_s']:.0f} s")
    print(f"{'op':8s} {'pairs min':>9s} {'median':>7s} {'max':>7s} {'direct':>7s} {'pred.':>7s} {'run':>7s} "
          f"{'run -E':>7s} {'offsets':>13s} {'chain eager':>13s} {'chain graph':>13s} {'churn eager':>13s} "
          f"{'churn graph':>13s}")
    span = lambda xs: f"{min(xs):6.1f}-{max(xs):<6.1f}"  # noqa: E731
    for op, d in result["ops"].items():
        us = list(d["pairs"]["us"].values())
        c, ch, r = d["chain"], d["churn"], d["run"]
        print(f"{op:8s} {min(us):9.1f} {statistics.median(us):7.1f} {max(us):7.1f} {d['row']['row_median_us']:7.1f} "
              f"{d['row']['predicted_from_pairs_us']:7.1f} {r['energy']['time_us']:7.1f} "
              f"{r['no_energy']['time_us']:7.1f} {span(list(d['offsets'].values()))} {span(c['eager'])} "
              f"{span(c['graph'])} {span(ch['eager'])} {span(ch['graph'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
