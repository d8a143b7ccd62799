#!/usr/bin/env python
"""What do the correctness checks cost a fill, table by table? One call on one GPU.

A row's case is checked once against its fp64 oracle before any timing (kprof.runners.worker), and protocol_check's
case d counts those seconds (`check_s`) in a 100-spec fill: 5.0 s in run 55, 8.0 s in run 65 after the oracles
moved to bounded memory (blocks of rows, of k, and 64 query positions of attention). This builds case d's 100
specs (backend torch), in the order a fill meets them, and times each case's check() twice, synchronized: the
first call (what a fill pays, lazy library set-up included) and the second. It prints the seconds per table and
the specs whose first check took longest.

    python tests/benchmarks/oracle_cost.py [--out DIR]

Writes oracle_cost.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def timed_checks(table: str, spec: dict, torch) -> tuple[float, float]:
    """(first, second) seconds of the case's check(), each synchronized."""
    import msgspec

    from kprof.runners.registry import lookup

    entry = lookup(table, "torch")
    case = entry.load_runner()().build(msgspec.convert(spec, entry.args), "cuda")
    seconds = []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        case.check()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
    del case
    torch.cuda.empty_cache()
    return seconds[0], seconds[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("oracle_cost needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from protocol_check import sweep_specs

    started = time.perf_counter()
    rows = []
    for table, specs in sweep_specs().items():
        for spec in specs:
            first, second = timed_checks(table, spec, torch)
            rows.append({"table": table, "spec": spec, "first_s": first, "second_s": second})
    by_table = {}
    for r in rows:
        t = by_table.setdefault(r["table"], {"specs": 0, "first_s": 0.0, "second_s": 0.0})
        t["specs"] += 1
        t["first_s"] += r["first_s"]
        t["second_s"] += r["second_s"]
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows, "by_table": by_table,
           "wall_s": time.perf_counter() - started}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "oracle_cost.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{doc['gpu']}, torch {doc['torch']}, {doc['wall_s']:.0f} s")
    print("slowest first checks:")
    for r in sorted(rows, key=lambda r: -r["first_s"])[:8]:
        print(f"  {r['first_s']:7.3f} s  {r['table']} {json.dumps(r['spec'])}")
    print(f"{'table':18s} {'specs':>5s} {'first s':>8s} {'second s':>8s}")
    for table, t in by_table.items():
        print(f"{table:18s} {t['specs']:5d} {t['first_s']:8.3f} {t['second_s']:8.3f}")
    total = (sum(t["first_s"] for t in by_table.values()), sum(t["second_s"] for t in by_table.values()))
    print(f"{'all':18s} {len(rows):5d} {total[0]:8.3f} {total[1]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
