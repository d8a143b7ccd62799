#!/usr/bin/env python
"""Does a power-capped row's second of samples start in the samples' own steady state? One call, one GPU.

A row's energy window runs the kernel back to back with a warm L2 (the GPU at its power cap, the SM clock held
low), and the timing follows it after a short settle (`cuda_device.SETTLED_CAPPED_S`). The samples themselves
sweep L2 before every call and pause between batches, so the GPU draws less than back to back and the cap's
controller may raise the clock while they run: a row that averages that ramp carries how fast the controller
moved, not the kernel. This script measures the prefill GEMMs of protocol_check (all power-capped on an H200)
through the same pipeline as `run` (`kprof.runners.worker.measure_specs`), with the timing's capped settle at
each of --settles, interleaved spec by spec, in four passes (idle, after 20 s of 8192^3 load, reversed, idle
again, as protocol_check case a). For every row it keeps the samples in call order and the state readings of the
timed batches.

Printed per settle: the per-spec spread over the four passes (p50 / p95 / max, as case a), the within-row drift
(mean of the last fifth of samples over the first fifth, minus 1) and the timed SM clock's first and last batch.
Full results (every row's samples summarised in fifths, clocks per batch) go to capped_settle_check.json under
--out ($OUT, else .). --keep-samples adds every row's samples in call order (µs, 3 decimals) and, for a capped
row, its batches' timeline (end time, sum, count): with KPROF_CAPPED_SAMPLE_S=3 KPROF_CAPPED_MAX_SAMPLE_S=3 (3 s
windows) any stopping rule for capped rows can then be tried offline by cutting the series short
(capped_stop_replay.py).

    python tests/benchmarks/capped_settle_check.py [--out DIR] [--settles 0.04,0.3,0.6] [--load-s 20] [--idle-s 10]
        [--keep-samples] [--shapes 8192x8192x8192,4096x28672x4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_check import gemm_specs, heat, percentile, spread  # noqa: E402

PREFILL_M = (2048, 4096, 8192)


def prefill_specs() -> list[dict]:
    return [s for s in gemm_specs() if s["m"] in PREFILL_M]


def shape_name(spec: dict) -> str:
    return f"{spec['m']}x{spec['n']}x{spec['k']}"


def select(specs: list[dict], shapes: str | None) -> list[dict]:
    """The specs named in `shapes` (MxNxK, comma-separated), in the order of `specs`; all of them for None."""
    if shapes is None:
        return specs
    wanted = {x.strip().lower() for x in shapes.split(",") if x.strip()}
    unknown = sorted(wanted - {shape_name(s) for s in specs})
    if unknown or not wanted:
        raise ValueError(f"--shapes {shapes!r}: {', '.join(unknown) or 'no shape'} is not one of the prefill GEMMs; "
                         f"pick from {', '.join(shape_name(s) for s in specs)}")
    return [s for s in specs if shape_name(s) in wanted]


def fifths(samples: list[float]) -> list[float]:
    """Mean of each fifth of the samples, in call order."""
    n = len(samples)
    return [statistics.fmean(samples[i * n // 5:(i + 1) * n // 5]) for i in range(5) if (i + 1) * n // 5 > i * n // 5]


class Capture:
    """Wraps gpu_timer.time_gpu: keeps the last timing's samples and the state readings of its kept batches. Also
    wraps the sampling loop's block_means, which a capped kernel's loop calls after every batch with its whole
    timeline so far, (end, sum of samples, count) per batch, and its start: the last call's are the row's."""

    def __init__(self):
        from kprof.measure import _sampling, gpu_timer

        self.module, self.inner, self.last = gpu_timer, gpu_timer.time_gpu, None
        self.sampling, self.inner_blocks, self.timeline = _sampling, _sampling.block_means, None

    def __enter__(self):
        def wrapped(*args, **kwargs):
            self.timeline = None
            timing = self.inner(*args, **kwargs)
            state = kwargs.get("state")
            self.last = (timing, list(state.kept) if state is not None else [])
            return timing

        def blocks(timeline, block_s, start):
            self.timeline = (timeline, start)
            return self.inner_blocks(timeline, block_s, start)

        self.module.time_gpu = wrapped
        self.sampling.block_means = blocks
        return self

    def __exit__(self, *exc):
        self.module.time_gpu = self.inner
        self.sampling.block_means = self.inner_blocks


def relative_timeline(captured) -> list[list[float]] | None:
    """A capped row's batches as [end s after the first sample's batch began, sum of samples ms, count]."""
    if captured is None:
        return None
    timeline, start = captured
    return [[round(end - start, 6), round(total, 6), count] for end, total, count in timeline]


def one_row(entry, gpu_key, device, spec, settle_s, capture, keep_samples: bool = False) -> dict:
    from kprof.ledger.events import Failed, Measured
    from kprof.runners import cuda_device
    from kprof.runners.worker import measure_specs

    cuda_device.SETTLED_CAPPED_S = settle_s
    capture.last = None  # (time_gpu's wrapper resets the timeline of each attempt)
    outcome = next(measure_specs(entry, [spec], gpu_key, device=device))
    ev = outcome.event
    row = {"spec": spec, "settle_s": settle_s, "wall_s": outcome.seconds}
    if type(ev) is not Measured or capture.last is None:
        failed = type(ev) is Failed
        row["error"] = f"{ev.error_kind}: {ev.message}"[:500] if failed else f"no timing ({type(ev).__name__})"
        return row
    timing, kept = capture.last
    notes = ev.method.notes
    samples = list(timing.samples_ms)
    est = notes.get("estimator", "median")
    row.update(time_ms=statistics.fmean(samples) if est == "mean" else statistics.median(samples), estimator=est,
               n=len(samples), fifths_ms=fifths(samples), power_capped=notes.get("power_capped"),
               settle_s_taken=notes.get("settle_s"), settled_sm_mhz=notes.get("settled_sm_mhz"),
               energy_settled_sm_mhz=notes.get("energy_settled_sm_mhz"),
               timed_sm_mhz=[r.sm_mhz for r in kept], timed_power_w=[r.power_w for r in kept],
               timed_temp_c=[r.temp_c for r in kept])
    if keep_samples:
        row["samples_us"] = [round(x * 1e3, 3) for x in samples]
        row["sample_s"] = notes.get("sample_s")
        row["timeline"] = relative_timeline(capture.timeline)  # None for a row that was not capped
    f = row["fifths_ms"]
    row["drift"] = f[-1] / f[0] - 1 if len(f) >= 2 else None
    return row


def summary(rows: list[dict], settles: list[float], passes: int) -> dict:
    out = {}
    for s in settles:
        mine = [r for r in rows if r["settle_s"] == s]
        by_spec: dict[str, list[float]] = {}
        for r in mine:
            if "time_ms" in r:
                by_spec.setdefault(json.dumps(r["spec"], sort_keys=True), []).append(r["time_ms"])
        spreads = [spread(v) for v in by_spec.values() if len(v) == passes]
        drifts = [r["drift"] for r in mine if r.get("drift") is not None]
        clocks = [(r["timed_sm_mhz"][0], r["timed_sm_mhz"][-1]) for r in mine if r.get("timed_sm_mhz")]
        out[str(s)] = {"specs": len(spreads), "failed": sum(1 for r in mine if "error" in r),
                       "spread_p50": percentile(spreads, 50) if spreads else None,
                       "spread_p95": percentile(spreads, 95) if spreads else None,
                       "spread_max": max(spreads) if spreads else None,
                       "drift_median": statistics.median(drifts) if drifts else None,
                       "drift_max_abs": max(abs(d) for d in drifts) if drifts else None,
                       "first_batch_mhz_median": statistics.median(c[0] for c in clocks) if clocks else None,
                       "last_batch_mhz_median": statistics.median(c[1] for c in clocks) if clocks else None,
                       "row_wall_s_mean": statistics.fmean(r["wall_s"] for r in mine) if mine else None}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--settles", default="0.04,0.3,0.6")
    p.add_argument("--load-s", type=float, default=20.0)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--keep-samples", action="store_true", help="every row's samples in call order, in the JSON")
    p.add_argument("--shapes", default=None,
                   help="only these of the 16 GEMMs, as MxNxK,MxNxK (e.g. the ones whose clock the cap swings)")
    args = p.parse_args(argv)
    settles = [float(x) for x in args.settles.split(",")]
    try:
        specs = select(prefill_specs(), args.shapes)
    except ValueError as exc:
        print(f"capped_settle_check: {exc}", file=sys.stderr)
        return 2
    from _variants import cuda

    if cuda("capped_settle_check") is None:
        return 2

    from kprof.measure.device_name import local_gpu_name
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup
    from kprof.runners.worker import prepare_device

    entry = effective_entry(lookup("single_gemm", "torch"))
    gpu_key = local_gpu_name()
    device = prepare_device(entry, gpu_key)
    rows: list[dict] = []
    started = time.perf_counter()
    plan = [("idle", "idle", specs), ("after_load", "load", specs), ("reversed", None, specs[::-1]),
            ("idle_again", "idle", specs)]
    os.makedirs(args.out, exist_ok=True)

    def write() -> dict:  # after every pass, so a run cut short by its time limit keeps the passes it finished
        doc = {"settles": settles, "specs": specs, "wall_s": time.perf_counter() - started, "rows": rows,
               "summary": summary(rows, settles, len(plan))}
        with open(os.path.join(args.out, "capped_settle_check.json"), "w") as f:
            json.dump(doc, f, indent=1)
        return doc

    with Capture() as capture:
        for name, before, order in plan:
            if before == "idle":
                time.sleep(args.idle_s)
            elif before == "load":
                heat(args.load_s)
            print(f"pass {name}: {len(order)} specs x {len(settles)} settles", file=sys.stderr, flush=True)
            for spec in order:
                for s in settles:
                    row = one_row(entry, gpu_key, device, spec, s, capture, args.keep_samples)
                    row["pass"] = name
                    rows.append(row)
            doc = write()

    def pct(x):
        return "—" if x is None else f"{100 * x:+.2f} %" if x < 0 else f"{100 * x:.2f} %"

    print(f"\n{len(specs)} prefill GEMMs, 4 passes, {doc['wall_s']:.0f} s")
    print("| capped settle s | specs | spread p50 | p95 | max | drift in row (median, max |.|) "
          "| first / last batch MHz | row wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for s, v in doc["summary"].items():
        print(f"| {s} | {v['specs']} ({v['failed']} failed) | {pct(v['spread_p50'])} | {pct(v['spread_p95'])} "
              f"| {pct(v['spread_max'])} | {pct(v['drift_median'])}, {pct(v['drift_max_abs'])} "
              f"| {v['first_batch_mhz_median']} / {v['last_batch_mhz_median']} | {v['row_wall_s_mean']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
