#!/usr/bin/env python
"""How fast are segments exported and merged? One process on the CPU, against sqlite3 doing the same import.

Builds a ledger of --events synthetic events (A) and another of --events other events (B), exports B to a
segment, and merges it into A (every event id and key recomputed, conflicts checked, then written a batch of
kprof.merge.merge.BATCH events per transaction), timing the export and the merge, and the merge's peak RSS, its
anonymous memory at the end and its CPU seconds (a child process per phase; on a shared machine, CPU seconds vary
less than wall seconds). Peak RSS counts the ledger file's pages the process mapped in as well: a merge of N events
of random ids into N others touches nearly every page of the file. The baseline imports the
same events' bytes into a sqlite3 table keyed by event id (one transaction, `executemany`), in the same run.

    python tests/benchmarks/merge_bench.py [--events 1000000] [--workdir DIR] [--out DIR]

Targets (issue 18): merge >= 100,000 events/s with peak RSS <= 1.5 GiB on the 2-core machine. Writes
merge_bench.json under --out and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

BATCH = 10_000


def _build(path: str, start: int, n: int) -> float:
    from kprof.ledger import Ledger
    from kprof import synth

    t = time.perf_counter()
    with Ledger.open(path) as led:
        led.append_batches(list(synth.events(i, min(i + BATCH, start + n))) for i in range(start, start + n, BATCH))
    return time.perf_counter() - t


def _phase(argv: list[str]) -> dict:
    """Runs one phase in a fresh child process; returns its JSON (seconds and peak RSS)."""
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{argv[1]} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _memory() -> dict:
    """At the end of the phase: the process's own (anonymous) memory and the ledger file's pages it has mapped
    (page cache, shared with every reader), MiB, from /proc where the OS has it."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("RssAnon", "RssFile"):
                    out[name.lower() + "_mib"] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def _child(args) -> int:
    from kprof.merge.export import export
    from kprof.merge.merge import merge

    t = time.perf_counter()
    if args.child == "export":
        header = export(args.db, args.segment)
        doc = {"events": header.events}
    else:
        result = merge([args.segment], args.db)
        doc = {"added": result.added, "existing": result.existing}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    doc.update(seconds=time.perf_counter() - t, cpu_s=usage.ru_utime + usage.ru_stime,
               peak_rss_mib=usage.ru_maxrss / 1024, **_memory())
    print(json.dumps(doc))
    return 0


def _sqlite(segment_path: str, work: str) -> float:
    from kprof.ledger import _codec
    from kprof.merge import segment

    path = os.path.join(work, "import.sqlite")
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    con.execute("CREATE TABLE events (id BLOB PRIMARY KEY, data BLOB) WITHOUT ROWID")
    t = time.perf_counter()
    batch = []
    with con:
        for data in segment.read(segment_path):
            batch.append((_codec.event_id(data), data))
            if len(batch) == BATCH:
                con.executemany("INSERT OR IGNORE INTO events VALUES (?, ?)", batch)
                batch = []
        con.executemany("INSERT OR IGNORE INTO events VALUES (?, ?)", batch)
    con.close()
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--child", choices=("export", "merge"), help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--segment", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    n = args.events
    work = args.workdir or tempfile.mkdtemp(prefix="kprof-merge-bench-")
    os.makedirs(work, exist_ok=True)
    a, b, seg = (os.path.join(work, x) for x in ("a.db", "b.db", "b.kseg"))
    for x in (a, b, seg):
        for y in (x, x + "-lock"):
            if os.path.exists(y):
                os.unlink(y)
    try:
        build_a = _build(a, 0, n)
        build_b = _build(b, 10 * n, n)
        print(f"built two ledgers of {n:,} events in {build_a:.1f} s and {build_b:.1f} s", file=sys.stderr)
        ex = _phase(["--child", "export", "--db", b, "--segment", seg])
        size = os.path.getsize(seg)
        mg = _phase(["--child", "merge", "--db", a, "--segment", seg])
        sq = _sqlite(seg, work)
        from kprof.ledger import Ledger

        with Ledger.open(a, readonly=True) as led:
            total = led.last_seq
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    doc = {"events": n, "segment_bytes": size, "export": ex, "merge": mg, "sqlite_import_s": sq, "ledger_after": total,
           "export_per_s": n / ex["seconds"], "merge_per_s": n / mg["seconds"], "sqlite_per_s": n / sq}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "merge_bench.json"), "w") as f:
        json.dump(doc, f, indent=1)
    ok = mg["added"] == n and total == 2 * n
    rows = [("export events/s", f"{doc['export_per_s']:,.0f}", "(reference)", "—"),
            ("merge events/s (checked, then written)", f"{doc['merge_per_s']:,.0f}", "≥ 100,000",
             "PASS" if doc["merge_per_s"] >= 100_000 else "FAIL"),
            ("merge peak RSS (the ledger's mapped pages too)", f"{mg['peak_rss_mib']:,.0f} MiB", "≤ 1,536 MiB",
             "PASS" if mg["peak_rss_mib"] <= 1536 else "FAIL"),
            ("merge anonymous memory at the end", f"{mg.get('rssanon_mib', 0):,.0f} MiB", "(reference)", "—"),
            ("sqlite3 import of the same bytes, events/s", f"{doc['sqlite_per_s']:,.0f}", "(baseline)", "—"),
            ("merge / sqlite3", f"{doc['merge_per_s'] / doc['sqlite_per_s']:.2f}x", "(reference)", "—"),
            ("segment bytes per event", f"{size / n:,.0f} B", "(reference)", "—"),
            ("every event merged, ledger holds 2N", "yes" if ok else "NO", "yes", "PASS" if ok else "FAIL")]
    print(f"merge benchmark: N={n:,} events merged into a ledger of N others")
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':{width}s}  {'kprof':>14s}  {'target':>12s}  verdict")
    for name, value, target, verdict in rows:
        print(f"{name:{width}s}  {value:>14s}  {target:>12s}  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
