#!/usr/bin/env python
"""Which stopping rule should a power-capped row use? Replays rules offline on long capped series.

Input: capped_settle_check.json written with --keep-samples under KPROF_CAPPED_SAMPLE_S=3
KPROF_CAPPED_MAX_SAMPLE_S=3, so every capped row carries 3 s of batches in call order (`timeline`: end time,
sum of samples, count per batch). Each rule is replayed on each row by cutting its timeline after the batch
where the rule would have stopped, exactly as the sampling loop (`kprof.measure._sampling._sample`) checks
after every batch. The row's time is the mean of the samples up to there.

Printed per rule: the per-spec spread over the passes (p50 / p95 / max, as protocol_check case a), the error
of each row against the mean of its own full series (median, p95, max |.|), how often a row is off its full
series by more than the rule's own target (a 95 % interval should miss about 5 % of the time), and the mean
sampled time per row. The rules are those of `kprof.measure._state.StateProtocol.capped_stop` with their knobs
varied, plus a lag-1 autocorrelation correction of the interval (`corrected_halfwidth`).

    python tests/benchmarks/capped_stop_replay.py RESULT.json [RESULT2.json.gz ...] [--out DIR]

Several results (machine starts) are pooled: the spread over passes is taken within each file, the errors and
seconds over all rows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol_check import percentile, spread  # noqa: E402

from kprof.measure.stats import block_means, mean_halfwidth  # noqa: E402

MAX_RHO = 0.9  # the most correlation corrected_halfwidth corrects for (a widening of 4.4x)


def lag1_autocorrelation(xs: list[float]) -> float:
    """The lag-1 autocorrelation of a series (lag-1 autocovariance over the variance, both about the series'
    mean); 0 for fewer than three values or a constant series."""
    n = len(xs)
    if n < 3:
        return 0.0
    mean = statistics.fmean(xs)
    d = [x - mean for x in xs]
    var = math.fsum(x * x for x in d)
    return math.fsum(a * b for a, b in zip(d, d[1:])) / var if var > 0 else 0.0


def corrected_halfwidth(blocks: list[float]) -> float:
    """mean_halfwidth widened for blocks that still correlate: the variance of the mean of an AR(1) series is
    (1 + rho) / (1 - rho) times the independent one, rho their lag-1 autocorrelation (a negative one taken as 0,
    one above MAX_RHO as MAX_RHO)."""
    r = min(max(lag1_autocorrelation(blocks), 0.0), MAX_RHO)
    return mean_halfwidth(blocks) * math.sqrt((1 + r) / (1 - r))


class Rule(NamedTuple):
    name: str
    min_s: float  # least sampled time
    max_s: float  # most sampled time
    block_s: float = 0.1
    min_blocks: int = 5
    target: float = 0.01  # 95 % half-width of the mean, relative
    corrected: bool = False  # widen the interval by the block means' lag-1 autocorrelation

    def stop(self, elapsed: float, blocks: list[float]) -> bool:
        if elapsed >= self.max_s:
            return True
        if elapsed < self.min_s or len(blocks) < self.min_blocks:
            return False
        return (corrected_halfwidth(blocks) if self.corrected else mean_halfwidth(blocks)) <= self.target


RULES = (
    Rule("fixed 3 s (reference)", 3.0, 3.0),
    Rule("fixed 1 s (before run 43)", 1.0, 1.0),
    Rule("fixed 0.5 s", 0.5, 0.5),
    Rule("blocks 0.1 s >= 5, 1 % (runs 43-47)", 0.5, 3.0),
    Rule("blocks 0.1 s >= 8, 1 %", 0.5, 3.0, min_blocks=8),
    Rule("blocks 0.1 s >= 10, 1 %", 0.5, 3.0, min_blocks=10),
    Rule("blocks 0.1 s >= 5, 1 %, rho-corrected", 0.5, 3.0, corrected=True),
    Rule("blocks 0.1 s >= 8, 1 %, rho-corrected", 0.5, 3.0, min_blocks=8, corrected=True),
    Rule("blocks 0.2 s >= 5, 1 %", 0.5, 3.0, block_s=0.2),
    Rule("blocks 0.1 s >= 5, 0.7 % (kprof's since run 47)", 0.5, 3.0, target=0.007),
    Rule("blocks 0.1 s >= 8, 0.7 %", 0.5, 3.0, min_blocks=8, target=0.007),
    Rule("blocks 0.1 s >= 5, 0.7 %, rho-corrected", 0.5, 3.0, target=0.007, corrected=True),
    Rule("blocks 0.1 s >= 5, 0.5 %", 0.5, 3.0, target=0.005),
)


def replay(timeline: list[list[float]], rule: Rule) -> tuple[float, float]:
    """(mean of the samples up to where `rule` stops, sampled seconds there) for one row's batches."""
    total, n = 0.0, 0
    for i, (end, sum_ms, count) in enumerate(timeline):
        total, n = total + sum_ms, n + count
        if n >= 3 and rule.stop(end, block_means(timeline[:i + 1], rule.block_s, 0.0)):
            return total / n, end
    return total / n, timeline[-1][0]


def evaluate(rows: list[dict], rules=RULES) -> dict:
    """Per rule: spread over passes, error against the row's own full series, misses of its target, mean seconds."""
    capped = [r for r in rows if r.get("timeline")]
    out = {}
    for rule in rules:
        by_spec: dict[str, list[float]] = {}
        errors, seconds, misses = [], [], 0
        for r in capped:
            full = sum(b[1] for b in r["timeline"]) / sum(b[2] for b in r["timeline"])
            mean, secs = replay(r["timeline"], rule)
            by_spec.setdefault(json.dumps([r.get("source", 0), r["spec"]], sort_keys=True), []).append(mean)
            errors.append(abs(mean / full - 1))
            seconds.append(secs)
            misses += abs(mean / full - 1) > rule.target
        passes = max((len(v) for v in by_spec.values()), default=0)
        spreads = [spread(v) for v in by_spec.values() if len(v) == passes and passes > 1]
        out[rule.name] = {
            "rows": len(capped), "specs": len(spreads),
            "spread_p50": percentile(spreads, 50) if spreads else None,
            "spread_p95": percentile(spreads, 95) if spreads else None,
            "spread_max": max(spreads) if spreads else None,
            "error_median": statistics.median(errors) if errors else None,
            "error_p95": percentile(errors, 95) if errors else None,
            "error_max": max(errors) if errors else None,
            "missed_target": misses / len(capped) if capped else None,
            "seconds_mean": statistics.fmean(seconds) if seconds else None}
    return out


def autocorrelations(rows: list[dict], block_s: float = 0.1) -> list[float]:
    """Lag-1 autocorrelation of each capped row's full-series block means."""
    out = []
    for r in rows:
        if r.get("timeline"):
            blocks = block_means(r["timeline"], block_s, 0.0)
            if len(blocks) >= 3:
                out.append(lag1_autocorrelation(blocks))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="capped_settle_check.json (or .json.gz) written with --keep-samples")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    rows = []
    for source, path in enumerate(args.results):
        try:
            with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
                mine = json.load(f)["rows"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"capped_stop_replay: cannot read {path!r} ({exc}); pass capped_settle_check.json",
                  file=sys.stderr)
            return 2
        if not any(r.get("timeline") for r in mine):
            print(f"capped_stop_replay: {path!r} has no capped row with a timeline; run capped_settle_check.py "
                  f"with --keep-samples", file=sys.stderr)
            return 2
        rows += [dict(r, source=source) for r in mine]
    result = evaluate(rows)
    rhos = autocorrelations(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "capped_stop_replay.json"), "w") as f:
        json.dump({"results": [os.path.basename(path) for path in args.results], "rules": [r._asdict() for r in RULES],
                   "result": result, "lag1_autocorrelation": rhos}, f,
                  indent=1)

    def pct(x):
        return "—" if x is None else f"{100 * x:.2f} %"

    if rhos:
        q = statistics.quantiles(rhos, n=4) if len(rhos) > 1 else [rhos[0]] * 3
        print(f"lag-1 autocorrelation of 0.1 s block means over 3 s ({len(rhos)} rows): min {min(rhos):+.2f}, "
              f"quartiles {q[0]:+.2f} / {q[1]:+.2f} / {q[2]:+.2f}, max {max(rhos):+.2f}")
    print("| rule | spread p50 | p95 | max | error vs own 3 s: median | p95 | max | off > target | s / row |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, v in result.items():
        print(f"| {name} | {pct(v['spread_p50'])} | {pct(v['spread_p95'])} | {pct(v['spread_max'])} "
              f"| {pct(v['error_median'])} | {pct(v['error_p95'])} | {pct(v['error_max'])} "
              f"| {pct(v['missed_target'])} | {v['seconds_mean']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
