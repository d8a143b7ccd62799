#!/usr/bin/env python
"""Are kprof's GPU rows reproducible, and do its timing modes agree? One call on one GPU, backend torch.

  a  reproducibility. 40 bf16 GEMMs: the qkv, o, gate_up and down GEMMs of a Llama-3-8B and a Qwen2.5-7B
     layer at decode (m = 1, 8, 64) and prefill (m = 2048, 4096) sizes; Llama's o at m = 4096 is 4096^3, and
     8192^3 (power-capped) takes the place of Qwen's gate_up at m = 4096. Four passes, each JIT into its own
     new ledger: (1) idle GPU, (2) right after 20 s of back-to-back 8192^3 bf16 GEMMs, (3) the specs in reverse
     order, (4) idle again, after 10 s with nothing running. Per spec, spread = (max - min) / median of its four
     medians. Targets: p95 <= 2 %, max <= 4 %.
  b  timers. CUDA events vs CUPTI (the default) on the same 40: |events / cupti - 1| <= 3 % for
     one-kernel calls >= 20 µs; the smaller ones are shown too (there events include the launch overhead, so
     they are not held to it), and so are calls of two kernels (cuBLAS split-K): events span the launch gap
     between them, which CUPTI's sum of kernel times leaves out.
  c  graphs. CUDA-graph replay vs eager launches (the sweep before each call or replay), same 40:
     every spec within 3 %.
     b and c run together, bracketed, spec by spec: the default row, the events row, the graph row and the
     default row again, each JIT into its own ledger as `run` makes rows (energy window first, then the
     timing); each mode is compared with the mean of the two default rows around it, and the two default
     rows' own difference (`reference_drift`) is shown beside it.
  d  fill throughput. 100 specs over every table (single_gemm bf16 and fp8_e4m3, rms_norm, silu_mul,
     attention_prefill, attention_decode, moe_grouped_gemm, memcpy; Llama/Qwen/Mixtral-class shapes, mixed
     sizes), JIT into a new ledger with energy on (the default): wall per spec = sum of result.seconds / sum of
     result.measured over the tables <= 0.35 s. Also how many ok rows hold energy_j.
  e  energy. A decode GEMM, a mid GEMM and 8192^3: the row's energy_j vs a 5 s window of
     `kprof.measure.nvml.measure_energy` on the runner's callable, within 5 %. The reference runs the callable
     back to back with a warm L2, as measure_energy does (and as the row's own energy window does).
  f  ceilings and drift. `kprof.calibrate.calibrate("torch")` into the ledger of pass 1, then
     `kprof.remeasure.remeasure(db, 20, 0.03)` right after: no row drifts over 3 %; and the largest ceiling
     fraction of any ok row of that ledger is <= 1.0. The fractions of case d's rows are shown too (fp8 rows
     run faster than the bf16 ceiling and are expected above it).

Each case runs in its own try/except (an error is recorded, the others go on). Every raw figure goes to
protocol_check.json under --out ($OUT, else the current directory), rewritten after each case; progress goes
to stderr; the verdict table (target, result, met) is printed last. --quick: 10 GEMMs, 16 sweep specs, 3 s of
load, 2 s idle, 1 s energy references, 5 rows re-measured (a smoke run of every code path, ~4 minutes).
The estimate printed first says when the cases are more than the protocol stage's default time limit holds,
and how to split them.

    python tests/benchmarks/protocol_check.py [--out DIR] [--quick] [--cases a,b,c,d,e,f] [--workdir DIR]
        [--prefill-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

CASES = "abcdef"
BACKEND, DEVICE = "torch", "cuda"

# Layer GEMMs (n, k) of C[m, n] = A[m, k] @ B[k, n]: fused qkv, attention output, fused gate+up, down.
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
QWEN25_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
DECODE_M = (1, 8, 64)
PREFILL_M = (2048, 4096)
BIG = {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"}
SMALL_KERNEL_MS = 0.020  # case b holds kernels from 20 µs up to its target

# Targets, as fractions (wall in seconds per spec).
TARGETS = {"a_p95": 0.02, "a_max": 0.04, "b_max": 0.03, "c_max": 0.03, "d_wall_per_spec_s": 0.35, "e_max": 0.05,
           "f_drift": 0.03, "f_fraction": 1.0, "total_wall_s": 600.0}  # total: one device call

# What the estimate assumes, from H200 runs with energy on (the default): wall seconds per row of a decode GEMM
# (m <= 64; runs 52-55: a pass of the 40 in 43-47 s, its 16 prefill GEMMs in 21-27 s) and of a power-capped
# prefill GEMM (m >= 2048; runs 77, 78 and 85: the 16 in 37-46 s a pass since the capped stop rule of
# 2026-12-04), per spec of case d's sweep (0.8-1.24 s in runs 65-83; the d target is 0.35), calibrate's set (21
# specs, 5 of them case a's and most of the rest power-capped GEMMs; 15 new rows took 18-23 s before that stop
# rule), and the fixed costs. A row costs the same whether its `run` call holds 40 specs or one (runs 39, 44: the
# bracketed rows of b and c, 160, in 180 s).
EST_DECODE_S, EST_CAPPED_S, EST_SPEC_S = 0.85, 2.3, 1.0
EST_STARTUP_S, EST_CALIBRATE_S = 20.0, 30.0


def gemm(m: int, n: int, k: int, dtype: str = "bf16") -> dict:
    return {"m": m, "n": n, "k": k, "dtype": dtype}


# ---- spec sets ------------------------------------------------------------------------------------------

def gemm_specs(quick: bool = False) -> list[dict]:
    """Case a-c's GEMMs: 8 layer GEMMs x 5 sizes, with 8192^3 in place of Qwen's gate_up at m = 4096 (40).
    Quick: Llama's four at m = 1 and 2048, 4096^3 and 8192^3 (10)."""
    out = [gemm(m, n, k) for model in (LLAMA3_8B, QWEN25_7B) for n, k in model.values() for m in DECODE_M + PREFILL_M]
    out[out.index(gemm(4096, *QWEN25_7B["gate_up"]))] = dict(BIG)
    if quick:
        out = [gemm(m, n, k) for n, k in LLAMA3_8B.values() for m in (1, 2048)] + [gemm(4096, 4096, 4096), dict(BIG)]
    return out


def _attn(batch, seq_or_kv, heads, kv_heads, *, causal=None, key="seq_len"):
    spec = {"batch": batch, key: seq_or_kv, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": 128}
    if causal is not None:
        spec["causal"] = causal
    spec["dtype"] = "bf16"
    return spec


def sweep_specs(quick: bool = False) -> dict[str, list[dict]]:
    """Case d's 100 specs over every table of backend torch. Quick: the first two of each table and dtype (16)."""
    llama, qwen = list(LLAMA3_8B.values()), list(QWEN25_7B.values())
    bf16 = [gemm(m, n, k) for m in (1, 32, 256, 1024) for n, k in llama] + [gemm(4096, n, k) for n, k in qwen]
    fp8 = [gemm(m, n, k, "fp8_e4m3") for m in (16, 2048) for n, k in llama]
    fp8 += [gemm(512, n, k, "fp8_e4m3") for n, k in (QWEN25_7B["o"], QWEN25_7B["down"])]
    norm = [{"tokens": t, "hidden": h, "dtype": "bf16"} for t in (1, 16, 256, 2048, 8192, 32768) for h in (4096, 3584)]
    silu = [{"tokens": t, "hidden": h, "dtype": "bf16"} for t in (1, 16, 256, 2048, 8192, 16384)
            for h in (14336, 18944)]
    prefill = [_attn(1, s, 32, 8, causal=True) for s in (512, 1024, 2048, 4096, 8192)]
    prefill += [_attn(1, s, 28, 4, causal=True) for s in (1024, 4096)]
    prefill += [_attn(4, s, 32, 8, causal=True) for s in (1024, 2048)]
    prefill += [_attn(1, 2048, 32, 8, causal=False), _attn(2, 2048, 28, 4, causal=True),
                _attn(8, 512, 32, 8, causal=True)]
    decode = [_attn(b, kv, 32, 8, key="kv_len") for b in (1, 8, 32, 128) for kv in (1024, 8192)]
    decode += [_attn(b, 4096, 28, 4, key="kv_len") for b in (1, 16, 64)]
    decode += [_attn(b, kv, 32, 8, key="kv_len") for b, kv in ((4, 32768), (64, 2048), (256, 512))]
    mixtral = [{"tokens": t, "experts": 8, "topk": 2, "hidden": 4096, "intermediate": 14336, "dtype": "bf16"}
               for t in (1, 16, 128, 512, 2048)]
    qwen3_moe = [{"tokens": t, "experts": 128, "topk": 8, "hidden": 2048, "intermediate": 768, "dtype": "bf16"}
                 for t in (4, 32, 256, 1024, 4096)]
    deepseek_lite = [{"tokens": t, "experts": 64, "topk": 6, "hidden": 2048, "intermediate": 1408, "dtype": "bf16"}
                     for t in (64, 1024)]
    memcpy = [{"bytes": b} for b in (1 << 20, 8 << 20, 64 << 20, 256 << 20, 512 << 20, 1 << 30, 2 << 30, 4 << 30)]
    groups = {"single_gemm": [bf16, fp8], "rms_norm": [norm], "silu_mul": [silu], "attention_prefill": [prefill],
              "attention_decode": [decode], "moe_grouped_gemm": [mixtral + qwen3_moe + deepseek_lite],
              "memcpy": [memcpy]}
    return {table: [s for g in parts for s in (g[:2] if quick else g)] for table, parts in groups.items()}


def energy_specs() -> list[dict]:
    """Case e: a decode GEMM (Llama qkv at m = 1, ~16 µs), a mid one (2048 x 4096 x 4096, ~0.1 ms), 8192^3."""
    return [gemm(1, *LLAMA3_8B["qkv"]), gemm(2048, 4096, 4096), dict(BIG)]


# ---- statistics -----------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics (numpy's default)."""
    if not xs:
        raise ValueError("percentile of no values")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def spread_summary(times: list[list[float | None]]) -> dict:
    """Per spec, the spread of its medians over the passes; p50/p95/max over the specs measured in every pass
    (the others are counted as incomplete). `worst` is the index of the spec with the largest spread."""
    spreads = [spread(t) if t and all(x is not None for x in t) else None for t in times]
    done = [(i, s) for i, s in enumerate(spreads) if s is not None]
    if not done:
        return {"specs": 0, "incomplete": len(times), "p50": None, "p95": None, "max": None, "worst": None,
                "spreads": spreads}
    values = [s for _i, s in done]
    return {"specs": len(done), "incomplete": len(times) - len(done), "p50": percentile(values, 50),
            "p95": percentile(values, 95), "max": max(values), "worst": max(done, key=lambda x: x[1])[0],
            "spreads": spreads}


def ratio_summary(pairs: list[tuple[float | None, float | None]], floor_ms: float = SMALL_KERNEL_MS,
                  kernels: list[int | None] | None = None) -> dict:
    """other / reference per spec, split at `floor_ms` of reference time: count, median ratio, median and max
    of |ratio - 1|, and the index of the worst spec, for the calls at or above the floor ("large") and below
    it ("small"). With `kernels` (kernels per call, from the reference rows), the large calls of more than one
    kernel (cuBLAS split-K: a GEMM and its reduce) are their own group, "multi": CUDA events span the launch
    gap between a call's kernels, which CUPTI's sum of kernel times leaves out, as a sum of rows does. Pairs
    missing either side are counted as incomplete."""
    out = {"incomplete": sum(1 for r, o in pairs if r is None or o is None)}
    kernels = kernels or [None] * len(pairs)
    groups = [("large", lambda r, k: r >= floor_ms and (k or 1) == 1), ("small", lambda r, k: r < floor_ms)]
    if any((k or 1) > 1 for k in kernels):
        groups.append(("multi", lambda r, k: r >= floor_ms and (k or 1) > 1))
    for name, keep in groups:
        got = [(i, o / r) for i, ((r, o), k) in enumerate(zip(pairs, kernels))
               if r is not None and o is not None and keep(r, k)]
        devs = [abs(x - 1) for _i, x in got]
        out[name] = {"n": len(got), "median_ratio": statistics.median([x for _i, x in got]) if got else None,
                     "p50_dev": percentile(devs, 50) if devs else None, "max_dev": max(devs) if devs else None,
                     "worst": max(got, key=lambda x: abs(x[1] - 1))[0] if got else None}
    every = [abs(o / r - 1) for r, o in pairs if r is not None and o is not None]
    out["all"] = {"n": len(every), "max_dev": max(every) if every else None,
                  "p95_dev": percentile(every, 95) if every else None}
    return out


# ---- verdicts -------------------------------------------------------------------------------------------

class Verdict(NamedTuple):
    case: str
    target: str
    result: str
    met: str  # "yes", "no", or "-" (reported, no target)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.2f} %"


def _check(value: float | None, limit: float) -> str:
    return "no" if value is None else ("yes" if value <= limit else "no")


def _seconds(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _fraction(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


# Per case: (target, the figure's path in the case's results, its limit or None when only shown, format).
CHECKS = {
    "a": [("p95 spread over 4 passes <= 2 %", ("spread", "p95"), TARGETS["a_p95"], _pct),
          ("max spread over 4 passes <= 4 %", ("spread", "max"), TARGETS["a_max"], _pct)],
    "b": [("|events/cupti - 1|, 1-kernel calls >= 20 us, max <= 3 %", ("ratios", "large", "max_dev"), TARGETS["b_max"],
           _pct),
          ("|events/cupti - 1|, split-K calls >= 20 us, max (shown)", ("ratios", "multi", "max_dev"), None, _pct),
          ("|events/cupti - 1|, calls < 20 us, max (shown)", ("ratios", "small", "max_dev"), None, _pct)],
    "c": [("|graph/eager - 1|, every spec, max <= 3 %", ("ratios", "all", "max_dev"), TARGETS["c_max"], _pct),
          ("|eager after/eager before - 1|, every spec, max (shown)", ("reference_drift", "all", "max_dev"), None,
           _pct)],
    "d": [("fill wall per spec <= 0.35 s", ("wall_per_spec_s",), TARGETS["d_wall_per_spec_s"], _seconds),
          ("ok rows with energy_j (shown)", ("energy_rows",), None, lambda x: "n/a" if x is None else str(x))],
    "e": [("|row energy / 5 s reference - 1|, max <= 5 %", ("max_dev",), TARGETS["e_max"], _pct)],
    "f": [("remeasure drift, max |drift| <= 3 %", ("max_abs_drift",), TARGETS["f_drift"], _pct),
          ("max ceiling fraction of ok rows <= 1.0", ("max_fraction",), TARGETS["f_fraction"], _fraction)],
}


def _get(doc: dict, path: tuple):
    for part in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(part)
    return doc


def verdicts(cases: dict, wall_s: float | None = None) -> list[Verdict]:
    """The table's rows from the cases' results (only the cases run; a case that raised shows its error and
    fails its targets). A figure that is missing (nothing measured) fails its target."""
    rows: list[Verdict] = []
    for case in CASES:
        if case not in cases:
            continue
        doc = cases[case]
        for target, path, limit, fmt in CHECKS[case]:
            if "error" in doc:
                rows.append(Verdict(case, target, "error: " + doc["error"].splitlines()[0][:60],
                                    "-" if limit is None else "no"))
                continue
            value = _get(doc, path)
            result = fmt(value)
            if case == "d" and path == ("energy_rows",) and value is not None:
                result = f"{value} of {doc.get('ok_rows')}"
            rows.append(Verdict(case, target, result, "-" if limit is None else _check(value, limit)))
    if wall_s is not None:
        rows.append(Verdict("all", f"total wall <= {TARGETS['total_wall_s']:.0f} s", f"{wall_s:.0f} s",
                            _check(wall_s, TARGETS["total_wall_s"])))
    return rows


def render(rows: list[Verdict]) -> str:
    head = Verdict("case", "target", "result", "met")
    w = [max(len(getattr(r, f)) for r in [head, *rows]) for f in Verdict._fields]
    line = lambda r: "  ".join(getattr(r, f).ljust(w[i]) for i, f in enumerate(Verdict._fields)).rstrip()
    return "\n".join([line(head), "  ".join("-" * x for x in w), *map(line, rows)])


def estimate_seconds(cases: str, quick: bool, gemms: list[dict] | None = None) -> dict:
    """Expected wall seconds per case (and in total) from the specs and the EST_* assumptions. `gemms`: cases
    a-c's GEMMs as run (--prefill-only keeps the power-capped ones); default gemm_specs(quick)."""
    gemms = gemm_specs(quick) if gemms is None else gemms
    rows = sum(EST_DECODE_S if g["m"] in DECODE_M else EST_CAPPED_S for g in gemms)  # one row of each GEMM
    n_sweep = sum(map(len, sweep_specs(quick).values()))
    load_s, idle_s, ref_s, n_re = _sizes(quick)
    est = {"a": 4 * rows + load_s + idle_s,
           "b": 3 * rows,  # the bracketed rows, shared with c
           "c": rows,
           "d": n_sweep * EST_SPEC_S,
           "e": len(energy_specs()) * (EST_SPEC_S + ref_s + 1.5),  # + warm-up and the input build
           "f": EST_CALIBRATE_S + n_re * rows / max(len(gemms), 1) + (0 if "a" in cases else rows)}
    if "b" not in cases and "c" in cases:
        est["c"] += 3 * rows
    out = {c: round(est[c], 1) for c in cases}
    out["total"] = round(EST_STARTUP_S + sum(out.values()), 1)
    return out


STAGE_S = 330.0  # gpu_stage.sh's protocol stage stops the script after $PROTOCOL_S seconds, 330 by default


def budget_note(cases: str, quick: bool, gemms: list[dict] | None = None, limit: float = STAGE_S) -> str | None:
    """Where the estimate of `cases` is over `limit` (the protocol stage's default time limit), how to split them
    into calls that each fit it (in order; a case over the limit alone gets a call of its own); else None."""
    total = estimate_seconds(cases, quick, gemms)["total"]
    if total <= limit:
        return None
    calls = [""]
    for c in cases:
        if calls[-1] and estimate_seconds(calls[-1] + c, quick, gemms)["total"] > limit:
            calls.append("")
        calls[-1] += c
    split = ", then ".join(f"--cases {','.join(g)}" for g in calls)
    return (f"the estimate (~{total:.0f} s) is over the {limit:.0f} s that gpu_stage.sh's protocol stage gives it by "
            f"default ($PROTOCOL_S): raise that, or split the cases over calls that fit it: {split}")


def _sizes(quick: bool) -> tuple[float, float, float, int]:
    """(load seconds before pass 2, idle seconds before pass 4, energy reference seconds, rows re-measured)."""
    return (3.0, 2.0, 1.0, 5) if quick else (20.0, 10.0, 5.0, 20)


def parse_cases(text: str) -> str:
    wanted = {c.strip().lower() for c in text.split(",") if c.strip()}
    bad = sorted(wanted - set(CASES))
    if bad or not wanted:
        raise SystemExit(f"--cases {text!r}: give a comma-separated subset of {','.join(CASES)}")
    return "".join(c for c in CASES if c in wanted)


# ---- on the GPU -----------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


def compact(doc: dict) -> dict:
    """The figures of one result document that the checks use."""
    m = doc.get("metrics") or {}
    st = doc.get("stats") or {}
    return {"spec": doc["spec"], "status": doc["status"], "time_ms": m.get("time_ms"), "energy_j": m.get("energy_j"),
            "tflops": m.get("tflops"), "gbps": m.get("memory_bandwidth_gbps"), "n": st.get("n"), "cv": st.get("cv"),
            "citation": doc.get("citation"), "event": doc.get("event"), "error": doc.get("error"),
            "timing": (doc.get("provenance") or {}).get("timing")}


def _ok_time(row: dict) -> float | None:
    return row["time_ms"] if row["status"] == "ok" else None


class Context:
    """Where the ledgers go, what one case hands to another, and the one way every case runs specs."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.state: dict = {}

    def db(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.db")

    def run(self, table: str, specs: list[dict], *, db: str, label: str, mode: str = "jit", quiet: bool = False,
            **method):
        from kprof import api

        total = len(specs)

        def progress(n: int, todo: int, spec: dict) -> None:
            if not quiet and (n == todo or n % 10 == 0):
                log(f"  [{label}] {n}/{todo} {table} {json.dumps(spec)}")

        t = time.perf_counter()
        res = api.run(table, BACKEND, specs, mode=mode, db=db, progress=progress, **method)
        bad = sum(r["status"] != "ok" for r in res.results)
        if not quiet or bad:
            log(f"  [{label}] {table}: {total} specs, {res.measured} measured in {time.perf_counter() - t:.1f} s, "
                f"{bad} not ok")
        return res

    def rows(self, res, db: str | None) -> list[dict]:
        """Compact rows, with each stored row's method notes, clocks and throttle reasons from its event."""
        rows = [compact(doc) for doc in res.results]
        if db is None or not os.path.exists(db):
            return rows
        from kprof.ledger import Ledger

        with Ledger.open(db, readonly=True) as ledger:
            for row in rows:
                event = ledger.event(bytes.fromhex(row["event"])) if row["event"] else None
                if event is None:
                    continue
                method = getattr(event, "method", None)
                env = event.environment
                row["env"] = {"clocks": dict(env.clocks), "throttle": list(env.throttle),
                              "power_limit_w": env.power_limit_w}
                if method is not None:
                    row["method"] = {"stop_reason": method.stop_reason, "notes": dict(method.notes)}
        return rows


def heat(seconds: float) -> dict:
    """Back-to-back 8192^3 bf16 GEMMs for `seconds`: the GPU at its power limit and warm."""
    import torch

    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(8192, 8192, generator=g, device="cuda").to(torch.bfloat16)
    b = torch.randn(8192, 8192, generator=g, device="cuda").to(torch.bfloat16) / 90.5
    torch.cuda.synchronize()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.matmul(a, b)
        torch.cuda.synchronize()
        calls += 10
    wall = time.perf_counter() - t0
    del a, b
    torch.cuda.empty_cache()
    return {"load_s": wall, "calls": calls, "tflops": 2 * 8192 ** 3 * calls / wall / 1e12}


def case_a(ctx: Context, specs: list[dict], quick: bool) -> dict:
    load_s, idle_s, _ref, _n = _sizes(quick)
    passes = []
    for name in ("idle", "after_load", "reversed", "idle_again"):
        before: dict = {}
        if name == "after_load":
            log(f"  [a] {load_s:.0f} s of back-to-back 8192^3 bf16 GEMMs")
            before = heat(load_s)
        elif name == "idle_again":
            log(f"  [a] {idle_s:.0f} s with nothing running")
            time.sleep(idle_s)
            before = {"idle_s": idle_s}
        order = specs[::-1] if name == "reversed" else specs
        db = ctx.db(f"a_{name}")
        res = ctx.run("single_gemm", order, db=db, label=f"a/{name}")
        by_key = {_key(r["spec"]): r for r in ctx.rows(res, db)}
        passes.append({"name": name, "db": db, "seconds": res.seconds, "measured": res.measured, "before": before,
                       "rows": [by_key[_key(s)] for s in specs]})  # in spec order, whatever order was run
        if name == "idle":
            ctx.state["pass1_db"] = db
    times = [[_ok_time(p["rows"][i]) for p in passes] for i in range(len(specs))]
    summary = spread_summary(times)
    decode = [t for s, t in zip(specs, times) if s["m"] in DECODE_M]
    prefill = [t for s, t in zip(specs, times) if s["m"] not in DECODE_M]
    shift = {}
    for p in passes[1:]:  # a systematic move of a whole pass against pass 1 (median over specs)
        r = [b / a for a, b in zip((_ok_time(x) for x in passes[0]["rows"]), (_ok_time(x) for x in p["rows"]))
             if a and b]
        shift[p["name"]] = statistics.median(r) - 1 if r else None
    per_spec = [{"spec": s, "times_ms": t, "spread": x} for s, t, x in zip(specs, times, summary["spreads"])]
    worst = sorted((x for x in per_spec if x["spread"] is not None), key=lambda x: -x["spread"])[:5]
    return {"specs": specs, "passes": passes, "spread": {k: v for k, v in summary.items() if k != "spreads"},
            "spread_decode": {k: v for k, v in spread_summary(decode).items() if k != "spreads"},
            "spread_prefill": {k: v for k, v in spread_summary(prefill).items() if k != "spreads"},
            "pass_shift_vs_idle": shift, "per_spec": per_spec, "worst": worst}


# The bracketed order of cases b and c, per spec: the reference, the two other modes, the reference again.
BRACKET = (("eager_before", {}), ("events", {"timer": "events"}), ("graph", {"cuda_graph": True}),
           ("eager_after", {}))


def _bracketed(ctx: Context, specs: list[dict]) -> dict[str, list[dict]]:
    """Cases b and c measured together, spec by spec, as `run` makes rows: the default method (CUPTI, cold L2,
    eager), then CUDA events, then graph replay, then the default again, each into its own ledger, seconds
    apart. Energy stays on: a row's timing follows its energy window, which brings the GPU to the kernel's
    steady state (with energy off the timing settles from the previous spec's state, and a GEMM at the edge of
    the power cap was taken for capped in one row and not in the next: run 38).
    A power-capped GEMM's row moves by up to about 4 % between passes minutes apart (case a: the cap's
    controller settles elsewhere), so rows of two modes taken in two sweeps compare that move as well as the
    modes; bracketing each mode's row between two reference rows of the same spec compares the modes, and the
    two references' own difference shows what the row's drift is over the same seconds."""
    if "bracketed" not in ctx.state:
        rows: dict[str, list[dict]] = {name: [] for name, _method in BRACKET}
        for i, spec in enumerate(specs, 1):
            for name, method in BRACKET:
                db = ctx.db(f"bc_{name}")
                res = ctx.run("single_gemm", [spec], db=db, label=f"b,c/{name} {i}/{len(specs)}", quiet=True,
                              **method)
                rows[name].extend(ctx.rows(res, db))
            log(f"  [b,c] {i}/{len(specs)} {json.dumps(spec)}: "
                + ", ".join(f"{name} {_ms(rows[name][-1])}" for name, _method in BRACKET))
        ctx.state["bracketed"] = rows
    return ctx.state["bracketed"]


def _ms(row: dict) -> str:
    t = _ok_time(row)
    return "failed" if t is None else f"{t:.4f} ms"


def bracketed_pairs(before: list[float | None], after: list[float | None],
                    other: list[float | None]) -> list[tuple[float | None, float | None]]:
    """(reference, other) per spec, the reference the mean of the rows taken just before and just after the
    other mode's; None where any of the three failed."""
    return [((a + b) / 2 if a is not None and b is not None else None, o if a is not None and b is not None else None)
            for a, b, o in zip(before, after, other, strict=True)]


def _kernels(row: dict) -> int | None:
    """Kernels per call of a CUPTI row (None when the row does not say)."""
    try:
        return int(((row.get("method") or {}).get("notes") or {}).get("kernels_per_invocation"))
    except (TypeError, ValueError):
        return None


def _compare(ctx: Context, specs: list[dict], name: str) -> dict:
    rows = _bracketed(ctx, specs)
    before, after, other = ([_ok_time(r) for r in rows[n]] for n in ("eager_before", "eager_after", name))
    pairs = bracketed_pairs(before, after, other)
    kernels = [_kernels(r) for r in rows["eager_before"]] if name == "events" else None
    summary = ratio_summary(pairs, kernels=kernels)
    # the same method seconds apart: what the comparison cannot resolve below
    drift = ratio_summary(list(zip(before, after)), kernels=kernels)
    per_spec = [{"spec": s, "eager_before_ms": a, "eager_after_ms": b, "other_ms": o,
                 "ratio": o / ((a + b) / 2) if a and b and o else None}
                for s, a, b, o in zip(specs, before, after, other)]
    return {"method": dict(BRACKET)[name], "energy": "on (the default) on every side",
            "design": "per spec: cupti eager, events, graph, cupti eager again; the reference is the mean of the "
                      "two eager rows around the other mode's row",
            "ratios": summary, "reference_drift": drift, "per_spec": per_spec,
            "reference_rows": rows["eager_before"], "reference_rows_after": rows["eager_after"], "rows": rows[name]}


def case_b(ctx: Context, specs: list[dict], quick: bool) -> dict:
    return _compare(ctx, specs, "events")


def case_c(ctx: Context, specs: list[dict], quick: bool) -> dict:
    return _compare(ctx, specs, "graph")


# notes named *_s that are not time spent: settings, and a position inside the energy window
NOT_SPENT_S = frozenset({"capped_sample_s", "capped_max_sample_s", "energy_fit_from_s"})


def _notes_seconds(db: str) -> dict[str, float]:
    """Every method note named *_s (seconds: build, check, timer wall, timed GPU work, energy window, ...)
    summed over the ledger's measured rows: where the fill's wall time went."""
    from kprof.ledger import Ledger, _codec
    from kprof.ledger.events import Measured

    out: dict[str, float] = {}
    with Ledger.open(db, readonly=True) as ledger:
        for _seq, _eid, data in ledger.iter_log():
            event = _codec.event_decoder.decode(data)
            if type(event) is Measured:
                for k, v in event.method.notes.items():
                    if k.endswith("_s") and k not in NOT_SPENT_S:
                        try:
                            out[k] = out.get(k, 0.0) + float(v)
                        except ValueError:
                            pass
    return {k: round(v, 3) for k, v in sorted(out.items())}


def case_d(ctx: Context, sweep: dict[str, list[dict]], quick: bool) -> dict:
    db = ctx.db("d_sweep")
    per_table, rows = [], []
    for table, specs in sweep.items():
        res = ctx.run(table, specs, db=db, label=f"d/{table}")
        per_table.append({"table": table, "specs": len(specs), "seconds": res.seconds, "measured": res.measured,
                          "timed_s": res.timed_seconds, "not_ok": res.missing_count,
                          "s_per_spec": res.seconds / res.measured if res.measured else None})
        rows += [dict(compact(doc), table=table) for doc in res.results]
    seconds = sum(t["seconds"] for t in per_table)
    measured = sum(t["measured"] for t in per_table)
    ok = [r for r in rows if r["status"] == "ok"]
    ctx.state["sweep_rows"] = rows
    return {"wall_per_spec_s": seconds / measured if measured else None, "seconds": seconds, "measured": measured,
            "specs": len(rows), "ok_rows": len(ok), "energy_rows": sum(r["energy_j"] is not None for r in ok),
            "per_table": per_table, "where_the_time_went_s": _notes_seconds(db),
            "not_ok": [r for r in rows if r["status"] != "ok"], "rows": rows}


def case_e(ctx: Context, specs: list[dict], quick: bool) -> dict:
    import msgspec
    import torch

    from kprof.measure._burst import burst
    from kprof.measure.nvml import measure_energy
    from kprof.runners.registry import lookup

    _load, _idle, ref_s, _n = _sizes(quick)
    entry = lookup("single_gemm", BACKEND)
    runner = entry.load_runner()()
    db = ctx.db("e_energy")
    out = []
    for spec in specs:
        res = ctx.run("single_gemm", [spec], db=db, label="e/row")
        (row,) = ctx.rows(res, db)
        case = runner.build(msgspec.convert(spec, entry.args), DEVICE)
        log(f"  [e] {ref_s:g} s reference window for {json.dumps(spec)}")
        # Launched as the row's window is (a CUDA graph of calls, no host gaps), over 25x as long.
        t = time.perf_counter()
        for _ in range(3):
            case.fn()
        torch.cuda.synchronize()
        calls_fn, per_replay, how = burst(case.fn, (time.perf_counter() - t) / 3, call_bytes=case.bytes)
        ref = measure_energy(calls_fn, seconds=ref_s)
        ref = msgspec.structs.replace(ref, j_per_call=ref.j_per_call / per_replay, calls=ref.calls * per_replay)
        case = calls_fn = None
        torch.cuda.empty_cache()
        ratio = row["energy_j"] / ref.j_per_call if row["energy_j"] else None
        notes = (row.get("method") or {}).get("notes", {})
        out.append({"spec": spec, "row_energy_j": row["energy_j"], "row_time_ms": row["time_ms"],
                    "row_energy_notes": {k: v for k, v in notes.items() if k.startswith("energy")},
                    "reference": msgspec.to_builtins(ref), "ratio": ratio, "status": row["status"],
                    "error": row["error"]})
    devs = [abs(x["ratio"] - 1) for x in out if x["ratio"] is not None]
    return {"reference": f"measure_energy over {ref_s} s of graph-launched calls, L2 warm, as the row's own window",
            "specs": out, "max_dev": max(devs) if len(devs) == len(out) else None}


def case_f(ctx: Context, specs: list[dict], quick: bool) -> dict:
    from kprof import api
    from kprof.calibrate import CEILING_SPECS, calibrate, fractions
    from kprof.remeasure import remeasure

    _load, _idle, _ref, n_re = _sizes(quick)
    db = ctx.state.get("pass1_db")
    if db is None:  # case a did not run: the 40 rows first, into a new ledger
        db = ctx.db("f_rows")
        ctx.run("single_gemm", specs, db=db, label="f/rows")
    t = time.perf_counter()
    runs, found = calibrate(BACKEND, db=db)
    cal_s = time.perf_counter() - t
    log(f"  [f] calibrate: {sum(r.measured for r in runs)} rows in {cal_s:.1f} s; "
        + ", ".join(f"{c.metric} {c.value:,.1f} at {c.method.get('at')}" for c in found))
    report = remeasure(db, n_re, 0.03, seed=0, device=DEVICE)
    drifts = [abs(r.drift) if r.drift is not None else math.inf for r in report.rows]
    log(f"  [f] remeasure: {len(report.rows)} rows, {report.drifted} over 3 %")
    # every ok row of the ledger: the pass-1 GEMMs and the calibration sets, with the ceilings' fractions
    tables: dict[str, list[dict]] = {"single_gemm": list(specs)}
    for table, spec, _metric in CEILING_SPECS[DEVICE]:
        if spec not in tables.setdefault(table, []):
            tables[table].append(spec)
    docs = [dict(d, table=t) for t, todo in tables.items() for d in api.query(t, BACKEND, todo, db=db).results]
    shares = []
    for d in docs:
        share = fractions(d["metrics"], found, d["spec"].get("dtype")) if d["status"] == "ok" else None
        if share:
            shares.append({"table": d["table"], "spec": d["spec"], "fraction": share, "ceiling": d.get("ceiling")})
    # case d's rows (where it ran), each against the ceiling of its own dtype, by table and dtype: shown, not in
    # the target, since they lie in another ledger (a set member measured in both reads 1.000x of itself)
    sweep = {}
    for r in ctx.state.get("sweep_rows", []):
        share = fractions({"tflops": r["tflops"], "memory_bandwidth_gbps": r["gbps"]}, found, r["spec"].get("dtype")) \
            if r["status"] == "ok" else None
        if share:
            group = f"{r['table']} {r['spec'].get('dtype', '')}".strip()
            best = sweep.setdefault(group, {})
            for m, v in share.items():
                best[m] = max(best.get(m, 0.0), v)
    top = max((v for s in shares for v in s["fraction"].values()), default=None)
    return {"db_rows": len(docs), "calibrate_s": cal_s, "calibrated": sum(r.measured for r in runs),
            "ceilings": [c._asdict() for c in found], "remeasure": report.to_json(),
            "max_abs_drift": max(drifts) if drifts else None, "max_fraction": top,
            "above_ceiling": [s for s in shares if any(v > 1.0 for v in s["fraction"].values())],
            "fractions": shares, "sweep_max_fraction_by_group": sweep}


def environment() -> dict:
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import msgspec

        from kprof.measure.nvml import gpu_environment

        out.update(msgspec.to_builtins(gpu_environment(0)))
    except Exception as exc:  # noqa: BLE001 - provenance is recorded, never fatal
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _write(doc: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "protocol_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def _details(cases: dict) -> list[str]:
    """A few lines per case: what the verdict table cannot show."""
    out = []
    a = cases.get("a", {})
    if "worst" in a:
        out.append("a: pass shift vs idle (median): " + ", ".join(
            f"{k} {_pct(v)}" for k, v in a["pass_shift_vs_idle"].items()))
        out.append(f"a: decode p95 {_pct(a['spread_decode']['p95'])}, prefill p95 {_pct(a['spread_prefill']['p95'])}")
        for w in a["worst"][:3]:
            out.append(f"a: worst {json.dumps(w['spec'])}: spread {_pct(w['spread'])}, ms {w['times_ms']}")
    for c in "bc":
        d = cases.get(c, {})
        if "ratios" in d:
            r = d["ratios"]
            out.append(f"{c}: >= 20 us: n {r['large']['n']}, median ratio {r['large']['median_ratio']}; "
                       f"< 20 us: n {r['small']['n']}, median ratio {r['small']['median_ratio']}"
                       + (f"; split-K >= 20 us: n {r['multi']['n']}, median ratio {r['multi']['median_ratio']}"
                          if "multi" in r else ""))
            if "reference_drift" in d:
                out.append(f"{c}: the two reference rows apart, max {_pct(d['reference_drift']['all']['max_dev'])}, "
                           f"p95 {_pct(d['reference_drift']['all']['p95_dev'])}")
            if c == "b":  # the one-kernel calls >= 20 µs its target holds
                worst = r["large"]["worst"]
                far = None if worst is None else d["per_spec"][worst]
            else:
                far = max((x for x in d["per_spec"] if x["ratio"]), key=lambda x: abs(x["ratio"] - 1), default=None)
            if far:
                out.append(f"{c}: worst {json.dumps(far['spec'])}: {far['other_ms']:.4f} ms against "
                           f"{far['eager_before_ms']:.4f} / {far['eager_after_ms']:.4f} ms")
    d = cases.get("d", {})
    if "per_table" in d:
        out.append("d: s/spec by table: " + ", ".join(
            f"{t['table']} {t['s_per_spec']:.2f}" for t in d["per_table"] if t["s_per_spec"] is not None))
        out.append(f"d: where the time went (s): {d['where_the_time_went_s']}")
        out.append(f"d: not ok: {len(d['not_ok'])}")
    for x in cases.get("e", {}).get("specs", []):
        out.append(f"e: {json.dumps(x['spec'])}: row {x['row_energy_j']} J, reference "
                   f"{x['reference']['j_per_call']:.6g} J, ratio {x['ratio']}")
    f = cases.get("f", {})
    if "ceilings" in f:
        out.append("f: ceilings: " + "; ".join(f"{c['metric']} {c['value']:,.1f} ({c['method'].get('summary')})"
                                               for c in f["ceilings"]))
        out.append(f"f: rows above a ceiling: {len(f['above_ceiling'])}")
        if f["sweep_max_fraction_by_group"]:
            out.append("f: case d's rows, max fraction by table and dtype: " + ", ".join(
                f"{g} {max(v.values()):.3f}" for g, v in f["sweep_max_fraction_by_group"].items()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for protocol_check.json (default $OUT, else .)")
    p.add_argument("--quick", action="store_true", help="fewer specs, shorter waits: a smoke run")
    p.add_argument("--cases", default=",".join(CASES), help="a comma-separated subset of a,b,c,d,e,f")
    p.add_argument("--workdir", default=None, help="where the ledgers go (default: a temporary directory, removed)")
    p.add_argument("--prefill-only", action="store_true",
                   help="cases a-c on the prefill GEMMs only (m = 2048, 4096 and 8192^3: the power-capped ones)")
    args = p.parse_args(argv)
    cases = parse_cases(args.cases)
    out_dir = args.out or os.environ.get("OUT") or "."
    gemms, sweep = gemm_specs(args.quick), sweep_specs(args.quick)
    if args.prefill_only:
        gemms = [g for g in gemms if g["m"] not in DECODE_M]
    estimate = estimate_seconds(cases, args.quick, gemms)
    log(f"protocol_check: cases {','.join(cases)}{' (quick)' if args.quick else ''}; estimated GPU wall "
        f"~{estimate['total']:.0f} s ({estimate}; assumes {EST_DECODE_S} s a decode GEMM row, {EST_CAPPED_S} s a "
        f"power-capped one, {EST_SPEC_S} s a sweep spec, with energy)")
    if note := budget_note(cases, args.quick, gemms):
        log(f"note: {note}")
    started = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="kprof-protocol-")
    os.makedirs(workdir, exist_ok=True)
    ctx = Context(workdir)
    inputs = {"a": gemms, "b": gemms, "c": gemms, "d": sweep, "e": energy_specs(), "f": gemms}
    run = {"a": case_a, "b": case_b, "c": case_c, "d": case_d, "e": case_e, "f": case_f}
    doc = {"config": {"quick": args.quick, "prefill_only": args.prefill_only, "cases": cases, "targets": TARGETS,
                      "estimate_s": estimate,
                      "sizes": dict(zip(("load_s", "idle_s", "energy_reference_s", "remeasured"), _sizes(args.quick))),
                      "gemm_specs": gemms, "sweep_specs": sweep, "energy_specs": energy_specs()},
           "environment": environment(), "cases": {}}
    for c in cases:
        t = time.perf_counter()
        log(f"case {c} (estimate {estimate[c]:.0f} s)")
        try:
            doc["cases"][c] = run[c](ctx, inputs[c], args.quick)
        except Exception as exc:  # noqa: BLE001 - one case failing must not lose the others
            doc["cases"][c] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            log(f"case {c} FAILED: {type(exc).__name__}: {exc}")
        doc["cases"][c]["wall_s"] = time.perf_counter() - t
        log(f"case {c} done in {doc['cases'][c]['wall_s']:.1f} s")
        _write(doc, out_dir)
    wall = time.perf_counter() - started
    rows = verdicts(doc["cases"], wall_s=None if args.quick else wall)
    doc["wall_s"] = wall
    doc["verdicts"] = [r._asdict() for r in rows]
    path = _write(doc, out_dir)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    env = doc["environment"]
    print(f"{env.get('gpu_name', '?')}, driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, "
          f"cupti {env.get('cupti', '?')}; wall {wall:.0f} s (estimate {estimate['total']:.0f} s); {path}")
    for line in _details(doc["cases"]):
        print(line)
    print()
    print(render(rows), flush=True)
    return 1 if any("error" in d for d in doc["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
