#!/usr/bin/env python
"""kprof ledger vs. stdlib sqlite3: ingest, lookups, audit, disk and memory, in one run.

    python tests/benchmarks/ledger_bench.py                       # 1M events, 100k lookups
    python tests/benchmarks/ledger_bench.py --events 100000 --out /tmp/bench

Phases (each printed as it finishes; the summary table comes last):

1. The N synthetic events (`kprof.synth`) and their canonical bytes are generated once, untimed,
   in a 2-process pool. Both stores get the very same events, bytes and keys.
2. kprof ingest: `Ledger.append_batches` over the batches (each batch is one LMDB write txn holding its events,
   the log and every view). Events are decoded untimed, ten batches at a time.
3. SQLite ingest of the same events, done as well as we know how: WAL, synchronous=NORMAL, 8 KiB pages,
   wal_autocheckpoint=10000, 1 GiB page cache, BLOB primary keys WITHOUT ROWID, one transaction and
   one `executemany` per table per batch, rows sorted by primary key. Per event it computes what a real ingest must: the canonical bytes, the
   event id (blake3 of them), the summary bytes (`summary_of` + `_codec.encode`, the same bytes kprof
   stores) and the shape id for the scope index. It takes the key from the event (kprof re-derives and
   verifies it) and keeps no scope root accumulator (kprof does).
4. Lookups of Q specs, half present, half missing, shuffled with a fixed seed, in child processes (one
   for kprof, one for SQLite) so each reports the peak RSS of its own lookup phase. Best of --repeat:
   `View.get_many`, `View.missing`, the py-lmdb ceiling (precomputed keys, a bare `txn.get` loop; also
   a `cursor.get` loop over the keys sorted, the access pattern a sorted bulk lookup can use), and
   the SQLite equivalents (same key hashing, keys sorted, `WHERE key IN (...)` in chunks of the best
   size found, mmap reads, summaries decoded with msgspec for found rows; `missing` without decoding).
   Each timed repetition asks for a fresh spec set (the same sets for both stores), so no answer comes
   from a memo of an earlier call. Then the repeated lookups of a simulator's loop: the first set asked
   again, best of --repeat (kprof answers them from its memo, `kprof.ledger._memo`; SQLite looks them up
   again). Before each child its store's file is read through once, untimed, so each starts with it in the
   page cache.
5. `audit(path)` on the N-event ledger.
6. Bytes on disk per event (LMDB file / N; SQLite db + wal / N).

`--out DIR` writes every figure (and per-table sizes) to DIR/ledger_bench.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

GEN_CHUNK = 5_000
CHUNK_CANDIDATES = (100, 250, 500, 1000, 2000, 5000)


def _say(msg: str) -> None:
    print(msg, flush=True)


# ---- 1. synthetic events -------------------------------------------------------------------------
def _gen_chunk(bounds: tuple[int, int]) -> list[bytes]:
    from kprof.ledger import _codec
    from kprof import synth

    a, b = bounds
    return [_codec.encode(synth.event(i)) for i in range(a, b)]


def pregenerate(n: int, procs: int) -> list[bytes]:
    bounds = [(a, min(a + GEN_CHUNK, n)) for a in range(0, n, GEN_CHUNK)]
    if procs <= 1 or n <= GEN_CHUNK:
        return [blob for bd in bounds for blob in _gen_chunk(bd)]
    out: list[bytes] = []
    with mp.get_context("spawn").Pool(procs) as pool:
        for part in pool.imap(_gen_chunk, bounds):
            out.extend(part)
    return out


GROUP = 10  # batches decoded at a time, untimed (decoded events take ~3 KB each: 1M at once would be 3 GB)


def _groups(blobs: list[bytes], batch: int):
    """Lists of GROUP (bytes, decoded events) batches. Decoding is the caller's business: it happens here,
    between the timed parts."""
    from kprof.ledger import _codec

    decode = _codec.event_decoder.decode
    step = batch * GROUP
    for a in range(0, len(blobs), step):
        yield [(blobs[b:b + batch], [decode(x) for x in blobs[b:b + batch]])
               for b in range(a, min(a + step, len(blobs)), batch)]


# ---- 2. kprof ingest -----------------------------------------------------------------------------
def ingest_kprof(path: str, blobs: list[bytes], batch: int) -> dict:
    from kprof.ledger import Ledger

    ledger = Ledger.open(path)
    spent = 0.0
    try:
        for group in _groups(blobs, batch):
            batches = [events for _part, events in group]
            t = time.perf_counter()
            results = ledger.append_batches(batches)
            spent += time.perf_counter() - t
            for result, events in zip(results, batches, strict=True):
                if len(result.added) != len(events):
                    raise SystemExit(f"kprof append added {len(result.added)} of {len(events)} fresh events")
        last_seq = ledger.last_seq
    finally:
        ledger.close()
    if last_seq != len(blobs):
        raise SystemExit(f"kprof ledger ends at seq {last_seq}, expected {len(blobs)}")
    return {"seconds": spent, "events_per_s": len(blobs) / spent}


# ---- 3. SQLite ingest ----------------------------------------------------------------------------
SQLITE_SCHEMA = """
CREATE TABLE events (id BLOB PRIMARY KEY, data BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE log (seq INTEGER PRIMARY KEY, id BLOB NOT NULL);
CREATE TABLE current (key BLOB PRIMARY KEY, kind TEXT NOT NULL, event_id BLOB NOT NULL,
                      summary BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE history (key BLOB NOT NULL, seq INTEGER NOT NULL, event_id BLOB NOT NULL,
                      PRIMARY KEY (key, seq)) WITHOUT ROWID;
CREATE TABLE scope_index (scope BLOB NOT NULL, shape BLOB NOT NULL, key BLOB NOT NULL,
                          PRIMARY KEY (scope, shape, key)) WITHOUT ROWID;
"""


def _sqlite_connect(path: str, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
        con.execute("PRAGMA mmap_size=17179869184")  # read pages in place, as LMDB does: no read() per miss
    else:
        con = sqlite3.connect(path, isolation_level=None)
        con.execute("PRAGMA page_size=8192")  # before the first table: ~15% faster ingest than 4096 at 500k
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("PRAGMA wal_autocheckpoint=10000")  # fewer, larger checkpoints
        con.execute("PRAGMA cache_size=-1048576")  # 1 GiB page cache for ingest
        con.execute("PRAGMA temp_store=MEMORY")
    return con


def ingest_sqlite(path: str, blobs: list[bytes], batch: int) -> dict:
    from kprof.ledger import _codec
    from kprof.ledger.events import Measured, summary_of

    encode, event_id, shape_id, scope_id = _codec.encode, _codec.event_id, _codec.shape_id, _codec.scope_id
    con = _sqlite_connect(path)
    con.executescript(SQLITE_SCHEMA)
    scopes: dict[tuple, bytes] = {}
    seq = 0
    spent = 0.0
    for part, events in (pair for group in _groups(blobs, batch) for pair in group):
        if encode(events[0]) != part[0]:  # untimed: the bytes stored are the pre-generated ones
            raise SystemExit("canonical bytes differ between generation and ingest")
        t = time.perf_counter()
        ev_rows, log_rows, cur_rows, hist_rows, idx_rows = [], [], [], [], []
        for event in events:
            data = encode(event)
            eid = event_id(data)
            seq += 1
            key = event.key
            prov = event.provenance
            names = (prov.table, prov.backend, prov.gpu_key)
            sid = scopes.get(names)
            if sid is None:
                sid = scopes[names] = scope_id(*names)
            ev_rows.append((eid, data))
            log_rows.append((seq, eid))
            cur_rows.append((key, "m" if type(event) is Measured else "f", eid, encode(summary_of(event))))
            hist_rows.append((key, seq, eid))
            idx_rows.append((sid, shape_id(encode(prov.shape)), key))
        ev_rows.sort()
        cur_rows.sort()
        hist_rows.sort()
        idx_rows.sort()
        con.execute("BEGIN")
        con.executemany("INSERT OR IGNORE INTO events VALUES (?, ?)", ev_rows)
        con.executemany("INSERT INTO log VALUES (?, ?)", log_rows)
        con.executemany("INSERT OR REPLACE INTO current VALUES (?, ?, ?, ?)", cur_rows)
        con.executemany("INSERT INTO history VALUES (?, ?, ?)", hist_rows)
        con.executemany("INSERT OR IGNORE INTO scope_index VALUES (?, ?, ?)", idx_rows)
        con.execute("COMMIT")
        spent += time.perf_counter() - t
    (count,) = con.execute("SELECT COUNT(*) FROM events").fetchone()
    con.close()
    if count != len(blobs):
        raise SystemExit(f"sqlite holds {count} events, expected {len(blobs)}")
    return {"seconds": spent, "events_per_s": len(blobs) / spent}


# ---- 4. lookups (child processes) ----------------------------------------------------------------
def lookup_specs(n: int, q: int, seed: int) -> tuple[list[dict], int]:
    """Q specs: half present (indices < n), half missing (indices >= n), shuffled. Returns (specs, present)."""
    from kprof import synth

    rng = random.Random(seed)
    half = q // 2
    present = rng.sample(range(n), half) if half <= n else [rng.randrange(n) for _ in range(half)]
    absent = [n + j for j in rng.sample(range(4 * q), q - half)]
    order = present + absent
    rng.shuffle(order)
    # Built in list order, as a caller's loop or a JSON parse builds them: shuffling built dicts would
    # scatter them in memory, which no real spec list is, and costs every reader cache misses.
    specs = [synth.spec(i) for i in order]
    return specs, half


def _best(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        out = None
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), times, out


def _best_fresh(fn, n: int, q: int, seed: int, repeat: int, check):
    """Best of `repeat` timings of fn(specs), each on a fresh spec set (seeds seed+1, seed+2, ...: the same sets
    for both stores), generated untimed: no answer can come from a memo of an earlier call. check(specs, out, present)
    validates each answer."""
    times = []
    for r in range(repeat):
        specs, present = lookup_specs(n, q, seed + 1 + r)
        t = time.perf_counter()
        out = fn(specs)
        times.append(time.perf_counter() - t)
        check(specs, out, present)
        del out, specs
    return min(times), times


def _status_mib(pid: int | str, field: str) -> float | None:
    """A memory field of /proc/PID/status, MiB; None where the file does not list it."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    return None


def _peak_rss_mib(pid: int | None = None) -> float:
    """Peak RSS of this process (or of pid), MiB. On Linux ru_maxrss carries over fork + exec (a child
    started by a big parent reports at least the parent's peak), so VmHWM, the peak of the process's own
    address space, is read instead where /proc has it."""
    try:
        peak = _status_mib(pid or "self", "VmHWM")
    except OSError:
        peak = None
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def lookup_kprof(path: str, n: int, q: int, seed: int, repeat: int) -> dict:
    from kprof.ledger import Ledger
    from kprof import synth

    specs, present = lookup_specs(n, q, seed)
    ledger = Ledger.open(path, readonly=True)
    try:
        view = synth.view(ledger)

        def rows_ok(specs, rows, present):
            ok = sum(1 for r in rows if r.status == "ok")
            if ok != present or len(rows) != len(specs):
                raise SystemExit(f"kprof get_many found {ok} ok rows of {len(rows)}, expected {present} of {q}")

        def todo_ok(specs, todo, present):
            if len(todo) != len(specs) - present:
                raise SystemExit(f"kprof missing returned {len(todo)} specs, expected {q - present}")

        # The first full-size lookups of the process, then fresh spec sets (no answer from the memo), then the
        # first set asked again, as a simulator's loop does (answered from the memo).
        first_g, _t, rows = _best(lambda: view.get_many(specs), 1)
        rows_ok(specs, rows, present)
        first_m, _t, todo = _best(lambda: view.missing(specs), 1)
        todo_ok(specs, todo, present)
        del rows, todo
        best_g, times_g = _best_fresh(view.get_many, n, q, seed, repeat, rows_ok)
        best_m, times_m = _best_fresh(view.missing, n, q, seed, repeat, todo_ok)
        best_rg, times_rg, rows = _best(lambda: view.get_many(specs), repeat)
        rows_ok(specs, rows, present)
        best_rm, times_rm, todo = _best(lambda: view.missing(specs), repeat)
        todo_ok(specs, todo, present)
        del rows, todo
        memo_specs = ledger.memo.specs
        lookup_hwm = _peak_rss_mib()  # the lookups' peak, before the raw py-lmdb loops below (which map pages too)
        # after the lookups, the memo still holding its answers: the process's own memory, and the ledger file's
        # pages mapped in (page cache, shared with every reader of the file), apart
        lookup_anon, lookup_file = _status_mib("self", "RssAnon"), _status_mib("self", "RssFile")

        keys = [view.keys.key(s, i) for i, s in enumerate(specs)]
        with ledger.read() as txn:
            get, cur = txn.get, ledger.dbs["current"]

            def ceiling():
                found = 0
                for k in keys:
                    if get(k, db=cur) is not None:
                        found += 1
                return found

            best_c, times_c, found = _best(ceiling, repeat)
            if found != present:
                raise SystemExit(f"py-lmdb ceiling found {found}, expected {present}")
            ordered = sorted(keys)
            cget = txn.cursor(cur).get

            def sorted_ceiling():
                found = 0
                for k in ordered:
                    if cget(k) is not None:
                        found += 1
                return found

            best_s, times_s, found = _best(sorted_ceiling, repeat)
            if found != present:
                raise SystemExit(f"py-lmdb sorted ceiling found {found}, expected {present}")
    finally:
        ledger.close()
    return {
        "get_many_per_s": q / best_g, "get_many_times": times_g,
        "missing_per_s": q / best_m, "missing_times": times_m,
        "first_get_many_per_s": q / first_g, "first_missing_per_s": q / first_m,
        "repeated_get_many_per_s": q / best_rg, "repeated_get_many_times": times_rg,
        "repeated_missing_per_s": q / best_rm, "repeated_missing_times": times_rm, "memo_specs": memo_specs,
        "lookup_peak_rss_mib": lookup_hwm, "lookup_anon_mib": lookup_anon, "lookup_file_mib": lookup_file,
        "ceiling_per_s": q / best_c, "ceiling_times": times_c,
        "sorted_ceiling_per_s": q / best_s, "sorted_ceiling_times": times_s,
        "peak_rss_mib": _peak_rss_mib(),
        # at the end: the ledger file's pages mapped in (page cache, shared) and the process's own memory
        "rss_file_mib": _status_mib("self", "RssFile"), "rss_anon_mib": _status_mib("self", "RssAnon"),
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _select_in(con, columns: str, ordered: list[bytes], chunk: int):
    """Rows of `current` for the sorted keys, by `WHERE key IN (...)` statements of `chunk` keys (neighbouring
    keys per statement: fewer B-tree pages touched each)."""
    def sql(n):
        return f"SELECT {columns} FROM current WHERE key IN (" + ",".join("?" * n) + ")"

    full, execute = sql(chunk), con.execute
    for a in range(0, len(ordered), chunk):
        part = ordered[a:a + chunk]
        yield from execute(full if len(part) == chunk else sql(len(part)), part)


def _sqlite_get_many(con, keyof, decode, specs, chunk):
    keys = [keyof(s, i) for i, s in enumerate(specs)]
    found = {key: (kind, eid, summary)
             for key, kind, eid, summary in _select_in(con, "key, kind, event_id, summary", sorted(keys), chunk)}
    out = []
    append = out.append
    for spec, key in zip(specs, keys):
        r = found.get(key)
        if r is None:
            append((spec, "missing", key, None, None))
        else:
            append((spec, "ok" if r[0] == "m" else "failed", key, r[1], decode(r[2])))
    return out


def _sqlite_missing(con, keyof, specs, chunk):
    keys = [keyof(s, i) for i, s in enumerate(specs)]
    ok = {key for key, kind in _select_in(con, "key, kind", sorted(keys), chunk) if kind == "m"}
    return [spec for spec, key in zip(specs, keys) if key not in ok]


def lookup_sqlite(path: str, n: int, q: int, seed: int, repeat: int) -> dict:
    import msgspec

    from kprof.ledger import KeyMaker, ShapeCodec
    from kprof import synth
    from kprof.ledger.events import Summary

    specs, present = lookup_specs(n, q, seed)
    keys = KeyMaker(synth.TABLE, synth.BACKEND, synth.GPU, synth.CONTRACT, ShapeCodec(synth.SynthArgs))
    keyof, decode = keys.key, msgspec.msgpack.Decoder(Summary).decode
    con = _sqlite_connect(path, readonly=True)
    limit = con.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    # Pick the chunk size on a sample, then time the full set with it.
    sample = specs[: min(len(specs), 20_000)]
    sweep = {}
    for chunk in (c for c in CHUNK_CANDIDATES if c <= limit):
        _sqlite_get_many(con, keyof, decode, sample, chunk)
        sweep[chunk] = len(sample) / _best(lambda: _sqlite_get_many(con, keyof, decode, sample, chunk), 2)[0]
    chunk = max(sweep, key=sweep.get)
    first = specs
    _sqlite_get_many(con, keyof, decode, specs, chunk)  # full-size warm-up, as kprof's
    _sqlite_missing(con, keyof, specs, chunk)

    def rows_ok(specs, rows, present):
        ok = sum(1 for r in rows if r[1] == "ok")
        if ok != present or len(rows) != len(specs):
            raise SystemExit(f"sqlite get_many found {ok} ok rows of {len(rows)}, expected {present} of {q}")

    def todo_ok(specs, todo, present):
        if len(todo) != len(specs) - present:
            raise SystemExit(f"sqlite missing returned {len(todo)} specs, expected {q - present}")

    del specs
    best_g, times_g = _best_fresh(lambda specs: _sqlite_get_many(con, keyof, decode, specs, chunk), n, q, seed,
                                  repeat, rows_ok)
    best_m, times_m = _best_fresh(lambda specs: _sqlite_missing(con, keyof, specs, chunk), n, q, seed, repeat,
                                  todo_ok)
    best_rg, times_rg, rows = _best(lambda: _sqlite_get_many(con, keyof, decode, first, chunk), repeat)
    rows_ok(first, rows, present)
    best_rm, times_rm, todo = _best(lambda: _sqlite_missing(con, keyof, first, chunk), repeat)
    todo_ok(first, todo, present)
    con.close()
    return {
        "chunk": chunk, "chunk_sweep_per_s": sweep,
        "get_many_per_s": q / best_g, "get_many_times": times_g,
        "missing_per_s": q / best_m, "missing_times": times_m,
        "repeated_get_many_per_s": q / best_rg, "repeated_get_many_times": times_rg,
        "repeated_missing_per_s": q / best_rm, "repeated_missing_times": times_rm,
        "peak_rss_mib": _peak_rss_mib(),
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def warm_files(*paths: str) -> float:
    """Reads the files through once (untimed for the lookups), so a lookup child starts with its store in the page
    cache, as a long-lived reader's is. On the 2-core VM the page cache keeps ~3.3 GB: after both ingests, much of
    the first-written LMDB file had been evicted by the SQLite one, and kprof's child read it from disk while
    SQLite's found its own file cached. Returns the seconds the reads took."""
    t = time.perf_counter()
    for path in paths:
        if os.path.exists(path):
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 24):
                    pass
    return time.perf_counter() - t


def run_lookup_child(which: str, path: str, args) -> dict:
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        warmed = warm_files(path, path + "-wal")
        cmd = [sys.executable, os.path.abspath(__file__), "--lookup-only", which, "--db", path,
               "--events", str(args.events), "--queries", str(args.queries), "--seed", str(args.seed),
               "--repeat", str(args.repeat), "--result", result]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{which} lookup child failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        with open(result) as f:
            return {**json.load(f), "file_warm_s": warmed}
    finally:
        os.unlink(result)


# ---- 5./6. audit, sizes --------------------------------------------------------------------------
def lmdb_tables(path: str) -> dict:
    import lmdb

    from kprof.ledger.store import DBS

    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=len(DBS) + 4)
    out = {}
    try:
        psize = env.stat()["psize"]
        with env.begin() as txn:
            for name in DBS:
                st = txn.stat(env.open_db(name.encode(), txn=txn, create=False))
                pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
                out[name] = {"entries": st["entries"], "bytes": pages * psize, "depth": st["depth"],
                             "overflow_pages": st["overflow_pages"]}
        out["_used_bytes"] = (env.info()["last_pgno"] + 1) * psize
    finally:
        env.close()
    return out


def sqlite_tables(path: str) -> dict:
    con = sqlite3.connect(path)
    try:
        rows = con.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall()
        return {name: {"bytes": size} for name, size in rows}
    except sqlite3.Error:
        return {}
    finally:
        con.close()


def file_size(*paths: str) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.exists(p))


# ---- 8. the table --------------------------------------------------------------------------------
def _fmt(v, kind: str) -> str:
    if v is None:
        return "—"
    if kind == "rate":
        return f"{v:,.0f}/s"
    if kind == "s":
        return f"{v:,.2f} s"
    if kind == "B":
        return f"{v:,.0f} B"
    if kind == "MiB":
        return f"{v:,.0f} MiB"
    return str(v)


def build_table(fig: dict) -> list[tuple[str, str, str, str, str, str]]:
    k, s = fig["kprof"], fig["sqlite"]

    def ratio(a, b):
        return None if a is None or b in (None, 0) else a / b

    def verdict(ok):
        return "—" if ok is None else ("PASS" if ok else "FAIL")

    rows = []
    r = ratio(k["ingest_per_s"], s["ingest_per_s"])
    rows.append(("ingest events/s", _fmt(k["ingest_per_s"], "rate"), _fmt(s["ingest_per_s"], "rate"),
                 f"{r:.2f}x", "≥ 1.5x sqlite", verdict(r >= 1.5)))
    r = ratio(k["get_many_per_s"], s["get_many_per_s"])
    rows.append(("get_many specs/s", _fmt(k["get_many_per_s"], "rate"), _fmt(s["get_many_per_s"], "rate"),
                 f"{r:.2f}x", "≥ 2x sqlite", verdict(r >= 2)))
    r = ratio(k["missing_per_s"], s["missing_per_s"])
    rows.append(("missing specs/s", _fmt(k["missing_per_s"], "rate"), _fmt(s["missing_per_s"], "rate"),
                 f"{r:.2f}x", "≥ 3x sqlite", verdict(r >= 3)))
    for op in ("get_many", "missing"):
        r = ratio(k[f"repeated_{op}_per_s"], s[f"repeated_{op}_per_s"])
        rows.append((f"repeated {op} specs/s", _fmt(k[f"repeated_{op}_per_s"], "rate"),
                     _fmt(s[f"repeated_{op}_per_s"], "rate"), f"{r:.2f}x", "≥ 1,000,000/s",
                     verdict(k[f"repeated_{op}_per_s"] >= 1_000_000)))
    rows.append(("first get_many of a process", _fmt(k["first_get_many_per_s"], "rate"), "—", "—",
                 "(reference)", "—"))
    rows.append(("first missing of a process", _fmt(k["first_missing_per_s"], "rate"), "—", "—",
                 "(reference)", "—"))
    r = ratio(k["get_many_per_s"], k["ceiling_per_s"])
    rows.append(("py-lmdb ceiling gets/s", _fmt(k["ceiling_per_s"], "rate"), "—",
                 f"get_many at {r:.0%}", "(reference)", "—"))
    r = ratio(k["get_many_per_s"], k["sorted_ceiling_per_s"])
    rows.append(("py-lmdb sorted cursor gets/s", _fmt(k["sorted_ceiling_per_s"], "rate"), "—",
                 f"get_many at {r:.0%}", "(reference)", "—"))
    a = k.get("audit_s")
    rows.append(("audit seconds", _fmt(a, "s"), "—", "—", "≤ 60 s", verdict(None if a is None else a <= 60)))
    r = ratio(k["bytes_per_event"], s["bytes_per_event"])
    rows.append(("bytes on disk / event", _fmt(k["bytes_per_event"], "B"), _fmt(s["bytes_per_event"], "B"),
                 f"{r:.2f}x", "(lower is better)", "—"))
    rss = k["lookup_peak_rss_mib"]
    r = ratio(rss, s["lookup_peak_rss_mib"])
    rows.append(("lookup peak RSS (file pages too)", _fmt(rss, "MiB"), _fmt(s["lookup_peak_rss_mib"], "MiB"),
                 f"{r:.2f}x", "(reference)", "—"))
    anon = k.get("lookup_anon_mib")
    rows.append(("lookup anonymous memory", _fmt(anon, "MiB"), "—", "—", "≤ 400 MiB",
                 verdict(None if anon is None else anon <= 400)))
    rows.append(("lookup file pages mapped", _fmt(k.get("lookup_file_mib"), "MiB"), "—", "—", "(reference)", "—"))
    return rows


def render_table(rows, title: str) -> str:
    head = ("figure", "kprof", "sqlite", "ratio kprof/sqlite", "target", "verdict")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells):
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) if i < 3 else c.ljust(w)
                          for i, (c, w) in enumerate(zip(cells, widths)))

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([title, line(head), sep, *(line(r) for r in rows)])


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=1_000_000, help="N events to ingest (default 1,000,000)")
    p.add_argument("--queries", type=int, default=100_000, help="Q specs per lookup (half present; default 100,000)")
    p.add_argument("--batch", type=int, default=10_000, help="events per append / transaction (default 10,000)")
    p.add_argument("--out", help="directory for ledger_bench.json with every figure")
    p.add_argument("--workdir", help="directory for the databases (default: a temporary one, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the databases in --workdir")
    p.add_argument("--skip-audit", action="store_true", help="do not time audit()")
    p.add_argument("--procs", type=int, default=2, help="processes generating events (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="lookup timings take the best of this many (default 3)")
    p.add_argument("--seed", type=int, default=20240611, help="seed of the lookup set")
    p.add_argument("--lookup-only", choices=("kprof", "sqlite"), help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.events < 1 or args.queries < 2 or args.batch < 1:
        p.error("--events, --batch must be ≥ 1 and --queries ≥ 2")
    return args


def child_main(args) -> int:
    fn = lookup_sqlite if args.lookup_only == "sqlite" else lookup_kprof
    out = fn(args.db, args.events, args.queries, args.seed, args.repeat)
    with open(args.result, "w") as f:
        json.dump(out, f)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lookup_only:
        return child_main(args)

    import lmdb
    import msgspec

    n = args.events
    tmp = None
    if args.workdir:
        workdir = args.workdir
        os.makedirs(workdir, exist_ok=True)
    else:
        workdir = tmp = tempfile.mkdtemp(prefix="kprof-bench-")
    lmdb_path = os.path.join(workdir, "bench-ledger.db")
    sqlite_path = os.path.join(workdir, "bench-sqlite.db")
    created = [lmdb_path, lmdb_path + "-lock", sqlite_path, sqlite_path + "-wal", sqlite_path + "-shm"]
    for p in created:
        if os.path.exists(p):
            os.unlink(p)
    import kprof

    fig: dict = {"config": {"kprof": kprof.__version__, "events": n, "queries": args.queries, "batch": args.batch, "repeat": args.repeat,
                            "seed": args.seed, "python": platform.python_version(), "lmdb": lmdb.__version__,
                            "msgspec": msgspec.__version__, "sqlite": sqlite3.sqlite_version,
                            "cpus": os.cpu_count(),
                            "workdir": "a temporary directory" if tmp else "the --workdir given"},
                 "kprof": {}, "sqlite": {}}
    try:
        _say(f"workdir {workdir}; N={n:,} Q={args.queries:,} batch={args.batch:,}")
        t = time.perf_counter()
        blobs = pregenerate(n, args.procs)
        fig["config"]["generate_s"] = time.perf_counter() - t
        fig["config"]["event_bytes_mean"] = sum(map(len, blobs)) / n
        _say(f"generated {n:,} events in {fig['config']['generate_s']:.1f} s "
             f"({fig['config']['event_bytes_mean']:.0f} B each)")

        ing = ingest_kprof(lmdb_path, blobs, args.batch)
        fig["kprof"]["ingest_per_s"], fig["kprof"]["ingest_s"] = ing["events_per_s"], ing["seconds"]
        _say(f"kprof  ingest: {ing['seconds']:.1f} s, {ing['events_per_s']:,.0f} events/s")
        ing = ingest_sqlite(sqlite_path, blobs, args.batch)
        fig["sqlite"]["ingest_per_s"], fig["sqlite"]["ingest_s"] = ing["events_per_s"], ing["seconds"]
        _say(f"sqlite ingest: {ing['seconds']:.1f} s, {ing['events_per_s']:,.0f} events/s")
        del blobs

        fig["kprof"]["bytes_per_event"] = file_size(lmdb_path) / n
        fig["sqlite"]["bytes_per_event"] = file_size(sqlite_path, sqlite_path + "-wal") / n
        fig["kprof"]["tables"] = lmdb_tables(lmdb_path)
        fig["sqlite"]["tables"] = sqlite_tables(sqlite_path)
        _say(f"disk: kprof {fig['kprof']['bytes_per_event']:.0f} B/event, "
             f"sqlite {fig['sqlite']['bytes_per_event']:.0f} B/event")

        k = run_lookup_child("kprof", lmdb_path, args)
        fig["kprof"].update(k)
        _say(f"kprof  lookups: get_many {k['get_many_per_s']:,.0f}/s, missing {k['missing_per_s']:,.0f}/s, "
             f"py-lmdb ceiling {k['ceiling_per_s']:,.0f}/s (sorted cursor {k['sorted_ceiling_per_s']:,.0f}/s), "
             f"repeated get_many {k['repeated_get_many_per_s']:,.0f}/s, missing {k['repeated_missing_per_s']:,.0f}/s, "
             f"lookup peak RSS {k['lookup_peak_rss_mib']:.0f} MiB")
        s = run_lookup_child("sqlite", sqlite_path, args)
        fig["sqlite"].update(s)
        fig["sqlite"]["lookup_peak_rss_mib"] = s["peak_rss_mib"]
        _say(f"sqlite lookups (chunk {s['chunk']}): get_many {s['get_many_per_s']:,.0f}/s, "
             f"missing {s['missing_per_s']:,.0f}/s, repeated get_many {s['repeated_get_many_per_s']:,.0f}/s, "
             f"missing {s['repeated_missing_per_s']:,.0f}/s, peak RSS {s['peak_rss_mib']:.0f} MiB")

        if not args.skip_audit:
            from kprof.ledger.audit import audit

            t = time.perf_counter()
            report = audit(lmdb_path)
            fig["kprof"]["audit_wall_s"] = time.perf_counter() - t
            fig["kprof"]["audit_s"] = report.seconds
            fig["kprof"]["audit_ok"] = report.ok
            if not report.ok:
                raise SystemExit("audit found problems: " + "; ".join(report.findings[:5]))
            _say(f"audit: {report.seconds:.1f} s, {report.events:,} events, ok")
        else:
            fig["kprof"]["audit_s"] = None

        rows = build_table(fig)
        fig["table"] = [dict(zip(("figure", "kprof", "sqlite", "ratio", "target", "verdict"), r)) for r in rows]
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "ledger_bench.json"), "w") as f:
                json.dump(fig, f, indent=2, default=str)
        _say("")
        _say(render_table(rows, f"kprof ledger benchmark: N={n:,} events, Q={args.queries:,} lookups, "
                                f"batch {args.batch:,}"))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not args.keep:
            for p in created:
                if os.path.exists(p):
                    os.unlink(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
