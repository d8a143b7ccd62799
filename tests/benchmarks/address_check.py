#!/usr/bin/env python
"""Which address bits of a decode kernel's activations move its time, and do a row's placements sample them as a
model's allocator does? One call on one GPU.

Profiler revision 5 places a decode-sized activation (<= 4 MiB) once per placement at a hashed 512-byte offset in
a fresh block (kprof.runners.cuda_device._offset). That fixed Mixtral's b=1 expert GEMMs (their time moved 15 %
with the address of their 16 KB activations) but moved the qkv GEMM rows 2-6 % further below a model's layers
(model_step, runs 22 and 24). This times each kernel below exactly as a row does (the registry's Case, CUPTI, cold
L2 by the read sweep, the activation rewritten after it) with its first activation placed:

  bits     at offset 0 and at each single bit from 512 B to 2 MiB inside one fresh block
  hashed   at the 16 offsets a revision-5 row uses (`_offset(k)`, each in its own block)
  clones   as the caching allocator places 16 clones made one after another (a model's same-size blocks)

and records every copy's address modulo 2 MiB. If `hashed` and `clones` disagree, the row samples the wrong
distribution; the bits that move the time say which one a model's allocator produces.

    python tests/benchmarks/address_check.py [--out DIR] [--budget 0.1]

Writes address_check.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import msgspec

CASES = [  # (name, table, backend, spec): Qwen2.5-7B and Mixtral-8x7B decode shapes, as model_step.py fills them
    ("qwen qkv b1", "single_gemm", "torch", {"m": 1, "n": 4608, "k": 3584, "dtype": "bf16"}),
    ("qwen qkv b8", "single_gemm", "torch", {"m": 8, "n": 4608, "k": 3584, "dtype": "bf16"}),
    ("qwen qkv b64", "single_gemm", "torch", {"m": 64, "n": 4608, "k": 3584, "dtype": "bf16"}),
    ("qwen o b8", "single_gemm", "torch", {"m": 8, "n": 3584, "k": 3584, "dtype": "bf16"}),
    ("qwen down b8", "single_gemm", "torch", {"m": 8, "n": 3584, "k": 18944, "dtype": "bf16"}),
    ("qwen rms_norm b8", "rms_norm", "torch", {"tokens": 8, "hidden": 3584, "dtype": "bf16"}),
    ("qwen silu_mul b8", "silu_mul", "torch", {"tokens": 8, "hidden": 18944, "dtype": "bf16"}),
    ("mixtral gate_up b1", "moe_grouped_gemm", "torch",
     {"tokens": 1, "experts": 8, "topk": 2, "hidden": 4096, "intermediate": 28672, "dtype": "bf16"}),
]
BITS = [0] + [1 << k for k in range(9, 22)]  # offset 0, then 512 B .. 2 MiB
COPIES = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(table: str, backend: str, spec: dict):
    from kprof.runners.registry import lookup

    entry = lookup(table, backend)
    case = entry.load_runner()().build(msgspec.convert(spec, entry.args), "cuda")
    case.check()
    return case


def timer(case, budget: float):
    """time(activation): the case's median µs with its first activation replaced, timed as a row times it."""
    import torch

    from kprof.measure.gpu_timer import time_gpu
    from kprof.measure.stats import StopRule
    from kprof.measure._l2 import rewriter

    i = case.warm[0]

    def time_with(act) -> float:
        inputs = list(case.inputs)
        inputs[i] = act
        t = time_gpu(lambda: case.call(*inputs), StopRule(budget_s=budget), timer="cupti", cold_l2=True,
                     warm=rewriter(torch, [act]))
        return statistics.median(t.samples_ms) * 1e3

    return case.inputs[i], time_with


def one(name: str, table: str, backend: str, spec: dict, budget: float) -> dict:
    import torch

    from kprof.runners.cuda_device import _offset, _placed_copy

    case = build(table, backend, spec)
    act, time_with = timer(case, budget)
    where = lambda t: t.data_ptr() % (2 << 20)  # noqa: E731 - the position inside a 2 MiB page
    bits, hashed, clones = {}, [], []
    for off in BITS:
        t = _placed_copy(torch, act, off)
        bits[str(off)] = {"us": time_with(t), "mod_2mib": where(t)}
    for k in range(1, COPIES + 1):
        t = _placed_copy(torch, act, _offset(k))
        hashed.append({"us": time_with(t), "mod_2mib": where(t)})
    made = [act.clone() for _ in range(COPIES)]  # one after another, as a model's same-size blocks come
    for t in made:
        clones.append({"us": time_with(t), "mod_2mib": where(t)})
    out = {"name": name, "table": table, "spec": spec, "bytes": act.numel() * act.element_size(),
           "original": {"us": time_with(act), "mod_2mib": where(act)}, "bits": bits, "hashed": hashed,
           "clones": clones}
    del case, made
    torch.cuda.empty_cache()
    return out


def summary(doc: dict) -> dict:
    bits = {int(k): v["us"] for k, v in doc["bits"].items()}
    base = bits[0]
    slowest = max(bits, key=bits.get)
    fastest = min(bits, key=bits.get)
    mean = lambda xs: statistics.fmean(x["us"] for x in xs)  # noqa: E731
    return {"base_us": base, "fastest_bit": fastest, "fastest_us": bits[fastest], "slowest_bit": slowest,
            "slowest_us": bits[slowest], "hashed_mean_us": mean(doc["hashed"]), "clones_mean_us": mean(doc["clones"]),
            "original_us": doc["original"]["us"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget", type=float, default=0.1, help="seconds of samples per placement")
    a = p.parse_args()
    import torch

    started = time.perf_counter()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": []}
    for name, table, backend, spec in CASES:
        try:
            doc = one(name, table, backend, spec, a.budget)
            doc["summary"] = summary(doc)
            log(f"{name}: {doc['summary']}")
        except Exception as e:  # noqa: BLE001 - one kernel failing keeps the others' figures
            doc = {"name": name, "error": f"{type(e).__name__}: {e}"}
            log(f"{name}: FAILED {doc['error']}")
        result["cases"].append(doc)
    result["wall_s"] = time.perf_counter() - started
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "address_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['gpu']}, torch {result['torch']}; activation placements, µs; wall {result['wall_s']:.0f} s")
    print(f"{'kernel':20s} {'bytes':>9s} {'offset 0':>9s} {'fastest (bit)':>18s} {'slowest (bit)':>18s} "
          f"{'hashed':>8s} {'clones':>8s} {'hashed/clones':>14s}")
    for doc in result["cases"]:
        if "error" in doc:
            print(f"{doc['name']:20s} {doc['error'][:90]}")
            continue
        s = doc["summary"]
        print(f"{doc['name']:20s} {doc['bytes']:9d} {s['base_us']:9.2f} {s['fastest_us']:9.2f} "
              f"({s['fastest_bit']:>7d}) {s['slowest_us']:9.2f} ({s['slowest_bit']:>7d}) {s['hashed_mean_us']:8.2f} "
              f"{s['clones_mean_us']:8.2f} {s['hashed_mean_us'] / s['clones_mean_us'] - 1:+13.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
