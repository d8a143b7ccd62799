"""What the benchmarks that time one callable under several preambles share (between_check, producer_check): the
command line, the GPU check and wake-up, and the interleaved rounds of kprof's timer (CUPTI, cold L2 by a read
sweep) with each preamble as the `warm` step between the sweep and the call, outside the timed region."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def arguments(doc: str, argv, rounds: int, batch: int | None = None, variants: bool = False):
    """--out and --rounds; --batch too where `batch` (its default) is given, --variants where `variants`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--rounds", type=int, default=rounds)
    if batch is not None:
        p.add_argument("--batch", type=int, default=batch)
    if variants:
        p.add_argument("--variants", default=None, help="comma-separated variants to time (row always)")
    args = p.parse_args(argv)
    for name in ("rounds", "batch"):
        if getattr(args, name, 1) < 1:  # else the GPU work runs and the result's medians fail on no rounds
            p.error(f"--{name} {getattr(args, name)}: must be at least 1, e.g. --{name} 1")
    return args


def cuda(name: str):
    """torch with a CUDA device awake (0.3 s of GEMMs: a GPU's first kernels run slow), or None, said on stderr."""
    import torch

    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA GPU; none is visible", file=sys.stderr)
        return None
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < 0.3:
        a @ a
    torch.cuda.synchronize()
    return torch


def time_variants(calls: dict, between: dict, variants: tuple, rounds: int,
                  kernel_filter: dict | None = None) -> tuple[dict, dict]:
    """({name: {variant: [median µs of each round]}}, {name: kernel names}): each call timed with each variant's
    preamble (`between[name][variant]`), every variant once per round, the rounds interleaved. `kernel_filter`:
    {name: regex}, only the call's kernels whose names match are summed."""
    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule

    started = time.perf_counter()
    rule = StopRule(target=0.003, budget_s=0.5, min_work_n=200)
    medians = {name: {v: [] for v in variants} for name in calls}
    kernels = {}
    for r in range(rounds):
        for name, fn in calls.items():
            for v in variants:
                timing = time_gpu(fn, rule, timer="cupti", cold_l2=True, warm=between[name][v],
                                  kernel_filter=(kernel_filter or {}).get(name))
                medians[name][v].append(statistics.median(timing.samples_ms) * 1e3)
                kernels[name] = list(timing.kernels)
        log(f"round {r + 1}/{rounds} done in {time.perf_counter() - started:.0f} s")
    return medians, kernels


def written(torch, out: str, name: str, rounds: int, started: float, medians: dict, kernels: dict, **about) -> dict:
    """The result document (`about` the cases, each figure the median of the rounds' medians), written to
    out/name.json; returns it, its `figures_us` for the table."""
    import json

    figures = {case: {v: statistics.median(xs) for v, xs in by.items()} for case, by in medians.items()}
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rounds": rounds, **about,
           "kernels": kernels, "medians_us": medians, "figures_us": figures, "wall_s": time.perf_counter() - started}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{doc['gpu']}, torch {doc['torch']}, {rounds} rounds, {doc['wall_s']:.0f} s")
    return doc
