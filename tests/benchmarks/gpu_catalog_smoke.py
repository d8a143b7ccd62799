#!/usr/bin/env python
"""GPU catalog smoke: builds and checks one realistic spec per (table, CUDA backend) of the catalog (two
for single_gemm: bf16 and fp8_e4m3) and prints one line each:

    table  backend  spec  algorithm  check  first-call ms  warm ms

`first-call ms` is the wall time of the first invocation after build (lazy initialization, cuBLAS/cuDNN
heuristics, module loading), synchronized; `warm ms` the median of 20 later invocations by CUDA events,
back to back with warm L2 — a sanity figure, not a measurement. `check` is ok, unsupported (the spec
cannot run this way here: the reason is printed) or error. Exits 1 when any row is an error.

    python tests/benchmarks/gpu_catalog_smoke.py [--table T] [--backend B]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import msgspec

SPECS = {
    "single_gemm": [{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16"},
                    {"m": 4096, "n": 4096, "k": 4096, "dtype": "fp8_e4m3"}],
    "rms_norm": [{"tokens": 4096, "hidden": 8192, "dtype": "bf16"}],
    "silu_mul": [{"tokens": 4096, "hidden": 14336, "dtype": "bf16"}],
    "attention_prefill": [{"batch": 2, "seq_len": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                           "causal": True, "dtype": "bf16"}],
    "attention_decode": [{"batch": 32, "kv_len": 8192, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                          "dtype": "bf16"}],
    "moe_grouped_gemm": [{"tokens": 4096, "experts": 128, "topk": 8, "hidden": 4096, "intermediate": 1536,
                          "dtype": "bf16"}],
    "memcpy": [{"bytes": 1 << 30}],
}


def _warm_ms(fn, n: int = 20) -> float:
    import torch

    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def smoke(entry, raw: dict, device: str = "cuda") -> dict:
    import torch

    from kprof.runners._case import Unsupported

    row = {"table": entry.table, "backend": entry.backend, "spec": json.dumps(raw, separators=(",", ":")),
           "algorithm": "", "check": "error", "first_ms": None, "warm_ms": None, "detail": ""}
    try:
        case = entry.load_runner()().build(msgspec.convert(raw, entry.args), device)
        row["algorithm"] = case.algorithm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        case.fn()
        torch.cuda.synchronize()
        row["first_ms"] = (time.perf_counter() - t0) * 1e3
        case.check()
        row["warm_ms"] = _warm_ms(case.fn)
        row["check"] = "ok"
        row["detail"] = ", ".join(f"{k}={v}" for k, v in case.notes.items())
    except Unsupported as exc:
        row["check"], row["detail"] = "unsupported", str(exc)
    except Exception as exc:  # every failure is a row, and the others go on
        row["detail"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    finally:
        case = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table")
    parser.add_argument("--backend")
    args = parser.parse_args(argv)
    import torch

    from kprof.runners.registry import entries

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to smoke-test", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name} sm{props.major}{props.minor}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    rows = []
    for entry in entries():
        if entry.device != "cuda" or entry.metric_family != "compute" or (args.table and entry.table != args.table) \
                or (args.backend and entry.backend != args.backend):  # collectives: comm_check.py
            continue
        for raw in SPECS[entry.table]:
            row = smoke(entry, raw)
            rows.append(row)
            first = f"{row['first_ms']:.2f}" if row["first_ms"] is not None else "-"
            warm = f"{row['warm_ms']:.3f}" if row["warm_ms"] is not None else "-"
            print(f"{row['table']:<18} {row['backend']:<16} {row['spec']:<100} {row['algorithm']:<24} "
                  f"{row['check']:<11} {first:>10} {warm:>9}  {row['detail']}", flush=True)
    errors = [r for r in rows if r["check"] == "error"]
    counts = {k: sum(r["check"] == k for r in rows) for k in ("ok", "unsupported", "error")}
    print(f"# {len(rows)} specs: {counts['ok']} ok, {counts['unsupported']} unsupported, {counts['error']} error")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
