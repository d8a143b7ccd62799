"""The measure diagnostic on one GPU: the issue's windows and the sampler's overhead, in one call.

    python tests/benchmarks/measure_check.py --out DIR [--duration-s 10] [--overhead-s 2] [--only NAME ...] [--no-rows]

1. Rows to compare with: the GEMM and the rms_norm measured once by `run` (in this process) into a scratch ledger,
   which every window then reads (read-only) for its summary's `ledger` comparison.
2. Windows of --duration-s each (names as in the table):
   gemm-cold    single_gemm 8192x8192x8192 bf16, default (cold L2 per launch, eager)
   gemm-warm    the same, --no-clear-l2 (back to back: the power-capped clock drift)
   gemm-graph   the same, --cuda-graph (cold L2, one replay per launch)
   rms-eager    rms_norm 1x4096 bf16, --no-clear-l2, eager (host dispatch leaves the GPU idle between launches)
   rms-graph    the same, --no-clear-l2 --cuda-graph (a replay holds many launches: no idle gaps)
3. Telemetry overhead: rms_norm (default mode) windows of --overhead-s, telemetry off / 20 Hz / 20 Hz / off; the
   median launch time with telemetry must be within 1 % of the median without (telemetry off is the Python API's
   telemetry_hz=0, which the CLI refuses).

Writes every output directory into DIR/measure_check.tar.gz (split into measure_check.tar.gz.partN of at most 15 MiB
when larger: `cat measure_check.tar.gz.part* > measure_check.tar.gz`) and every summary into DIR/measure_check.json;
prints the citations, then a short table last. Exit 1 when a window failed or the overhead is over 1 %.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tarfile
import tempfile
import time
import traceback

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

GEMM = ("single_gemm", "torch", {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"})
RMS = ("rms_norm", "torch", {"tokens": 1, "hidden": 4096, "dtype": "bf16"})
WINDOWS = {  # name -> (kernel, clear_l2, cuda_graph)
    "gemm-cold": (GEMM, True, False),
    "gemm-warm": (GEMM, False, False),
    "gemm-graph": (GEMM, True, True),
    "rms-eager": (RMS, False, False),
    "rms-graph": (RMS, False, True),
}
OVERHEAD = [("overhead-off-1", 0.0), ("overhead-on-1", 20.0), ("overhead-on-2", 20.0), ("overhead-off-2", 0.0)]
OVERHEAD_LIMIT_PCT = 1.0
PART_BYTES = 15 << 20
MAX_PARTS = 4  # 4 x 15 MiB and the JSON stay under the 64 MiB that comes back from the device


def _rows(db: str) -> dict:
    """The comparison rows: each kernel in the method of its windows (cold eager; rms_norm also warm eager)."""
    from kprof import api

    out = {}
    for (table, backend, spec), l2 in ((GEMM, "cold"), (RMS, "cold"), (RMS, "warm")):
        t = time.perf_counter()
        res = api.run(table, backend, [spec], db=db, mode="jit", l2=l2, timer="cupti", cuda_graph=False)
        r = res.results[0]
        out[f"{table}/{l2}"] = {"status": r["status"], "time_ms": (r["metrics"] or {}).get("time_ms"),
                                "citation": r["citation"], "wall_s": round(time.perf_counter() - t, 2)}
    return out


def _window(name: str, kernel, clear_l2: bool, graph: bool, work: str, db: str, duration_s: float,
            hz: float = 20.0) -> dict:
    from kprof.cli.measure import diagnose

    table, backend, spec = kernel
    t = time.perf_counter()
    try:
        doc = diagnose(table, backend, spec, output_dir=os.path.join(work, name), duration_s=duration_s,
                       telemetry_hz=hz, clear_l2=clear_l2, cuda_graph=graph, db=db,
                       command=f"measure_check {name}")
    except Exception as e:  # noqa: BLE001 - one failed window must not stop the others
        return {"name": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                "wall_s": round(time.perf_counter() - t, 2)}
    return {"name": name, "wall_s": round(time.perf_counter() - t, 2), "output_dir": doc["output_dir"],
            "files": doc["files"], "summary": doc["summary"]}


def row_of(result: dict) -> list[str]:
    """One table row of a window's result: mode, launches, median µs, p10/p90, drift %, mean W, SM MHz first/last,
    throttled % by reason, J/launch, GPU idle %, ledger ratio, wall s."""
    if "error" in result:
        return [result["name"], "FAILED: " + result["error"][:100]] + [""] * 10
    s = result["summary"]
    st, dr, tel, en, gpu, led = s["launch_us"], s["drift"], s["telemetry"], s["energy"], s["gpu"], s["ledger"]
    mode = f"{s['mode']['l2']}/{'graph' if s['mode']['graph'] else 'eager'}"
    if s["mode"].get("invocations_per_replay", 1) > 1:
        mode += f"x{s['mode']['invocations_per_replay']}"

    def f(v, spec=".4g"):
        return "-" if v is None else format(v, spec)

    if tel.get("off"):
        watts, clocks, throttled = f(en.get("power_w"), ".0f") + "*", "-", "telemetry off"
    else:
        watts = f(tel["power_w"]["mean"], ".0f")
        clocks = f"{f(tel['sm_mhz']['first'], '.0f')}/{f(tel['sm_mhz']['last'], '.0f')}"
        throttled = " ".join(f"{k}:{v['pct']:.0f}" for k, v in s["throttle"].items() if v["pct"] >= 0.5) or "-"
    idle = 100 - gpu["busy_pct"] if gpu["busy_pct"] is not None else None
    return [f"{result['name']} ({mode})", str(s["window"]["launches"]), f(st["median"]),
            f"{f(st['p10'])}/{f(st['p90'])}", f(dr["pct"], "+.2f"), watts, clocks, throttled,
            f(en.get("j_per_launch"), ".3g"), f(idle, ".1f"),
            f(led.get("window_over_row"), ".3f") if led.get("compared") else "-", f(result["wall_s"], ".1f")]


HEADER = ["window (l2/launch)", "launches", "median us", "p10/p90 us", "drift %", "mean W", "SM MHz 1st/last",
          "throttled % by reason", "J/launch", "idle %", "win/row", "wall s"]


def table(rows: list[list[str]]) -> str:
    rows = [HEADER] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def overhead(results: list[dict]) -> dict:
    """Median launch time with telemetry against without, from the overhead windows' runtimes.csv."""
    times = {"on": [], "off": []}
    for r in results:
        if "error" in r:
            return {"error": f"{r['name']} failed: {r['error']}"}
        path = os.path.join(r["output_dir"], "runtimes.csv")
        with open(path) as fh:
            next(fh)
            key = "off" if "-off-" in r["name"] else "on"
            times[key] += [int(line.split(",")[3]) / 1e3 for line in fh]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    pct = 100 * (on / off - 1)
    return {"median_off_us": off, "median_on_us": on, "pct": pct, "launches_off": len(times["off"]),
            "launches_on": len(times["on"]), "limit_pct": OVERHEAD_LIMIT_PCT, "ok": abs(pct) <= OVERHEAD_LIMIT_PCT}


def archive(work: str, out: str, stem: str = "measure_check.tar.gz", drop_over: int | None = None) -> list[str]:
    """work's directories as one tar.gz in `out` (or parts of PART_BYTES); runtimes.csv files larger than
    `drop_over` bytes are left out when the whole would need more than MAX_PARTS parts."""
    buf = io.BytesIO()
    left_out = []
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name in sorted(os.listdir(work)):
            path = os.path.join(work, name)
            if not os.path.isdir(path):
                continue
            for f in sorted(os.listdir(path)):
                full = os.path.join(path, f)
                if drop_over is not None and f == "runtimes.csv" and os.path.getsize(full) > drop_over:
                    left_out.append(os.path.join(name, f))
                    continue
                tar.add(full, arcname=os.path.join("measure_check", name, f))
    data = buf.getvalue()
    parts = -(-len(data) // PART_BYTES)
    if parts > MAX_PARTS and drop_over is None:
        return archive(work, out, stem, drop_over=20 << 20)
    written = []
    if parts <= 1:
        with open(os.path.join(out, stem), "wb") as fh:
            fh.write(data)
        written.append(stem)
    else:
        for i in range(parts):
            name = f"{stem}.part{i}"
            with open(os.path.join(out, name), "wb") as fh:
                fh.write(data[i * PART_BYTES:(i + 1) * PART_BYTES])
            written.append(name)
    return written + [f"left out: {p}" for p in left_out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--overhead-s", type=float, default=2.0)
    p.add_argument("--only", nargs="*", default=None, help=f"windows to run, of {', '.join(WINDOWS)}, overhead")
    p.add_argument("--no-rows", action="store_true", help="skip the comparison rows")
    args = p.parse_args(argv)
    os.environ.setdefault("KPROF_POOL", "off")  # rows measured in this process: no worker to start
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="measure_check_")
    db = os.path.join(work, "rows.db")
    chosen = args.only if args.only is not None else [*WINDOWS, "overhead"]
    unknown = [n for n in chosen if n not in WINDOWS and n != "overhead"]
    if unknown:
        p.error(f"unknown window(s) {unknown}")
    report: dict = {"duration_s": args.duration_s, "overhead_s": args.overhead_s}
    if not args.no_rows:
        try:
            report["rows"] = _rows(db)
        except Exception as e:  # noqa: BLE001 - the windows still run, without a row to compare
            report["rows"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(f"rows: {json.dumps(report.get('rows'))}", flush=True)
    results = []
    for name in [n for n in WINDOWS if n in chosen]:
        kernel, clear_l2, graph = WINDOWS[name]
        results.append(_window(name, kernel, clear_l2, graph, work, db, args.duration_s))
        print(f"{name}: {results[-1].get('error') or 'ok'} in {results[-1]['wall_s']} s", flush=True)
    over = []
    if "overhead" in chosen:
        for name, hz in OVERHEAD:
            over.append(_window(name, RMS, True, False, work, db, args.overhead_s, hz=hz))
            print(f"{name}: {over[-1].get('error') or 'ok'} in {over[-1]['wall_s']} s", flush=True)
        report["overhead"] = overhead(over)
    report["windows"] = [{k: v for k, v in r.items()} for r in results + over]
    report["archive"] = archive(work, args.out)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    with open(os.path.join(args.out, "measure_check.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    print("\ncitations (kprof show kmeasure.<hex> --dir <extracted window dir>):")
    for r in results + over:
        if "files" in r:
            print(f"  {r['name']}: summary {r['files']['summary.json']['citation']}, " + ", ".join(
                f"{n} {f['citation']}" for n, f in r["files"].items() if n != "summary.json"))
    print(f"archive: {', '.join(report['archive'])} (work dir {work})")
    print(f"total wall {report['wall_s']} s")
    if "overhead" in report:
        o = report["overhead"]
        if "error" in o:
            print(f"telemetry overhead: {o['error']}")
        else:
            print(f"telemetry overhead: median {o['median_on_us']:.4f} us with 20 Hz vs {o['median_off_us']:.4f} us "
                  f"without ({o['launches_on']} / {o['launches_off']} launches): {o['pct']:+.3f} % "
                  f"(limit {OVERHEAD_LIMIT_PCT} %): {'PASS' if o['ok'] else 'FAIL'}")
    print()
    print(table([row_of(r) for r in results + over]))
    failed = any("error" in r for r in results + over) or not report.get("overhead", {}).get("ok", True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
