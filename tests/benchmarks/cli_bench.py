#!/usr/bin/env python
"""Whole-process wall time of `kprof list --json` and of `kprof count-missing` on a 10,000-spec file
against a 1,000,000-event ledger (target: ≤ 0.5 s each), with `kprof query` beside them (as JSON, and as the
table a user reads, printed to a pipe).

    python tests/benchmarks/cli_bench.py [--events 1000000] [--workdir DIR] [--runs 7]

The ledger holds synthetic single_gemm rows filed under backend torch-cpu and this machine's CPU model
(so the real verbs read them), built once in --workdir and reused. Half the 10,000 specs are present.
Each command runs --runs times after one warm-up, as a fresh process; min / median / max are printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time

import msgspec

N_SPECS = 10_000


def _chunk(bounds):
    from kprof.ledger import _codec
    from kprof import synth
    from kprof.measure.env import cpu_model
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    contract = effective_entry(lookup("single_gemm", "torch-cpu")).contract  # as the verbs read: its thread count
    gpu = cpu_model()
    return [_codec.encode(synth.event(i, gpu=gpu, contract=contract, backend="torch-cpu"))
            for i in range(*bounds)]


def build(path: str, n: int) -> None:
    from kprof.ledger import Ledger, _codec

    ledger = Ledger.open(path)
    if ledger.last_seq >= n:
        ledger.close()
        return
    step = 10_000
    with mp.get_context("fork").Pool(2) as pool:
        for blobs in pool.imap(_chunk, [(a, min(a + step, n)) for a in range(ledger.last_seq, n, step)]):
            ledger.append([_codec.event_decoder.decode(b) for b in blobs])
    ledger.close()


def timed(cmd: list[str], runs: int) -> list[float]:
    subprocess.run(cmd, check=False, capture_output=True)  # warm-up (page cache, bytecode)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True)
        out.append(time.perf_counter() - t)
        if proc.returncode != 0:
            raise SystemExit(f"{cmd} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return out


def main() -> None:
    from kprof import synth

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kprof-cli-bench"))
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    db = os.path.join(args.workdir, "profile.db")
    t = time.perf_counter()
    build(db, args.events)
    print(f"ledger: {args.events:,} events ready in {time.perf_counter() - t:.1f} s", flush=True)
    rnd = random.Random(7)
    specs = [synth.spec(i) for i in rnd.sample(range(args.events), N_SPECS // 2)]
    specs += [synth.spec(i) for i in rnd.sample(range(args.events, 2 * args.events), N_SPECS // 2)]
    rnd.shuffle(specs)
    spec_file = os.path.join(args.workdir, "specs.json")
    with open(spec_file, "wb") as f:
        f.write(msgspec.json.encode(specs))
    kprof = [sys.executable, "-m", "kprof"]
    check = subprocess.run(kprof + ["count-missing", "single_gemm", "--backend", "torch-cpu", "--specs", spec_file,
                                    "--db", db, "--json"], capture_output=True, check=True)
    missing = json.loads(check.stdout)["missing_count"]
    assert missing == N_SPECS // 2, missing
    cases = {
        "kprof list --json": kprof + ["list", "--json"],
        f"kprof count-missing ({N_SPECS:,} specs, 1M ledger)": kprof + [
            "count-missing", "single_gemm", "--backend", "torch-cpu", "--specs", spec_file, "--db", db, "--json"],
        f"kprof query --json ({N_SPECS:,} specs, 1M ledger)": kprof + [
            "query", "single_gemm", "--backend", "torch-cpu", "--specs", spec_file, "--db", db, "--json"],
        f"kprof query, table to a pipe ({N_SPECS:,} specs, 1M ledger)": kprof + [
            "query", "single_gemm", "--backend", "torch-cpu", "--specs", spec_file, "--db", db],
        "python -c pass (interpreter floor)": [sys.executable, "-c", "pass"],
    }
    rows = []
    for name, cmd in cases.items():
        xs = timed(cmd, args.runs)
        rows.append((name, min(xs), statistics.median(xs), max(xs)))
        print(f"{name}: median {statistics.median(xs):.3f} s", flush=True)
    print()
    print(f"{'whole-process wall time, ' + str(args.runs) + ' runs':58s} {'min':>7s} {'median':>7s} {'max':>7s}")
    for name, lo, med, hi in rows:
        print(f"{name:58s} {lo:7.3f} {med:7.3f} {hi:7.3f}")


if __name__ == "__main__":
    main()
