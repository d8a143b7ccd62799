"""Every read is verified: a ledger damaged anywhere (one flipped bit at a page-sized stride over the whole file and
at random offsets, or a truncation) gives each reader exactly the answer it gave before the damage, or an
IntegrityError (exit 3) with a one-line message; never another answer, never an uncaught exception.

Each damaged copy is read in a forked child (a damaged mapping may fault: the child's death is then the finding,
not the test run's), through `kprof.cli.main` in-process (`query --json`, `count-missing --json`, `show
<citation> --json`) and the Python API (`View.get_many`, `View.missing`, `View.get`)."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import sys
import traceback

import lmdb
import msgspec
import pytest

from kprof import api
from kprof.errors import IntegrityError
from kprof.ledger import KeyMaker, Ledger, ShapeCodec, _codec
from kprof.ledger.build import failed, measured, retraction
from kprof.ledger.events import Method, Stats
from kprof.method import effective_entry
from kprof.runners.registry import lookup

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="reads each damaged copy in a forked child")

TABLE, BACKEND, GPU = "single_gemm", "torch-cpu", "Sweep CPU"
SEED = 17
RANDOM_FLIPS = 60
PAGE = 4096


def _spec(i: int) -> dict:
    return {"m": 16 * (i + 1), "n": 64, "k": 32, "dtype": "fp32"}


SPECS = [_spec(i) for i in range(44)]  # rows 0-39 written (see _build), 40-43 never measured


def _event(i: int, *, time_ms: float | None = None, kind: str = "measured", parent=None):
    entry = effective_entry(lookup(TABLE, BACKEND))
    prov = KeyMaker(TABLE, BACKEND, GPU, entry.contract, ShapeCodec(entry.args)).provenance(_spec(i))
    if kind == "failed":
        return failed(prov, "crash", f"segfault in spec {i}", parent=parent)
    t = time_ms if time_ms is not None else 0.5 + i * 0.25
    stats = Stats(n=5, median=t, p10=t * 0.99, p90=t * 1.01, mean=t, stdev=t / 100, cv=0.01, min=t * 0.98,
                  max=t * 1.02, samples=[t * 0.98, t * 0.99, t, t * 1.01, t * 1.02])
    metrics = {"time_ms": t, "tflops": 1.0 / t, "memory_bandwidth_gbps": 2.0 * t, "energy_j": None}
    return measured(prov, metrics, stats, Method(timer="cpu", l2="warm"), parent=parent)


def _build(path: str) -> str:
    """A few dozen rows in several appends: measured, failed, re-measured and retracted ones. Returns the
    citation of one ok row."""
    with Ledger.open(path) as ledger:
        ledger.append([_event(i) for i in range(0, 20)])
        ledger.append([_event(i) for i in range(20, 34)] + [_event(i, kind="failed") for i in range(34, 38)])
        first = [_event(i) for i in (38, 39)]
        ledger.append(first)
        view = api.view(ledger, TABLE, BACKEND, GPU)
        ledger.append([_event(5, time_ms=9.5, parent=view.get(**_spec(5)).event_id), _event(6, kind="failed")])
        ledger.append([retraction(_codec.event_id(_codec.encode(first[1])), first[1].key, "bad run")])
        return api.view(ledger, TABLE, BACKEND, GPU).get(**_spec(5)).citation


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of kprof.cli.main in this process."""
    from kprof.cli import main

    out, err = io.TextIOWrapper(io.BytesIO(), write_through=True), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        rc = main(argv)
    finally:
        sys.stdout, sys.stderr = saved
    return rc, out.buffer.getvalue().decode(), err.getvalue()


def _api(path: str, op: str):
    """("ok", answer) or ("integrity", message) of one Python API read."""
    try:
        with Ledger.open(path, readonly=True) as ledger:
            view = api.view(ledger, TABLE, BACKEND, GPU)
            if op == "get_many":
                answer = [[r.status, r.key.hex(), r.event_id and r.event_id.hex(), msgspec.to_builtins(r.summary)]
                          for r in view.get_many(SPECS)]
            elif op == "missing":
                answer = view.missing(SPECS)
            else:
                row = view.get(**_spec(5))
                answer = row and [row.event_id.hex(), msgspec.to_builtins(row.summary)]
        return "ok", answer
    except IntegrityError as exc:
        return "integrity", str(exc)


def _reads(path: str, cite: str) -> dict:
    specs = ["--specs", os.path.join(os.path.dirname(path), "specs.json")]
    common = ["--backend", BACKEND, "--gpu-name", GPU, "--db", path, "--json"]
    cli = {"query": ["query", TABLE, *common, *specs], "count-missing": ["count-missing", TABLE, *common, *specs],
           "show": ["show", cite, "--db", path, "--json"]}
    # each copy has its own path: named alike in every answer, so answers of two copies compare
    reads = {op: [part.replace(path, "<db>") if type(part) is str else part for part in _cli(argv)]
             for op, argv in cli.items()}
    return reads | {op: list(_api(path, op)) for op in ("get_many", "missing", "get")}


def _in_child(path: str, cite: str) -> dict:
    """_reads(path) in a forked child: its answers, or {"crash": how it ended}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        try:
            doc = {"reads": _reads(path, cite)}
        except BaseException:
            doc = {"crash": traceback.format_exc()}
        os.write(w, json.dumps(doc).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _pid, status = os.waitpid(pid, 0)
    if not data:
        return {"crash": f"child ended with status {status} and no answer"}
    return json.loads(data)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    path = str(d / "built.db")
    cite = _build(path)
    (d / "specs.json").write_text(json.dumps(SPECS))
    clean = str(d / "base.db")
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=16)
    env.copy(clean, compact=True)  # both meta pages name one state: a flip there cannot roll back to an older one
    env.close()
    return clean, cite, _in_child(clean, cite)


def _damaged_copy(base_path: str, name: str, flip: int | None = None, size: int | None = None) -> str:
    path = os.path.join(os.path.dirname(base_path), name)
    shutil.copyfile(base_path, path)
    with open(path, "r+b") as f:
        if flip is not None:
            offset, bit = flip
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
        if size is not None:
            f.truncate(size)
    return path


def _check(reads: dict, want: dict, where: str) -> int:
    """Each read's answer equals the undamaged one, or is an integrity error; the count of the latter."""
    refused = 0
    for op, got in reads.items():
        if got == want[op]:
            continue
        if op in ("query", "count-missing", "show"):
            rc, out, err = got
            assert rc == 3 and out == "" and "kprof audit" in err and err.count("\n") <= 1, (where, op, got)
        else:
            assert got[0] == "integrity" and "kprof audit" in got[1], (where, op, got)
        refused += 1
    return refused


def test_the_undamaged_ledger_answers_every_read(base):
    _path, cite, want = base
    assert "crash" not in want, want.get("crash")
    reads = want["reads"]
    assert all(r[0] == 0 for op, r in reads.items() if op in ("query", "count-missing", "show"))
    doc = json.loads(reads["query"][1])
    assert [r["status"] for r in doc["results"]].count("ok") == 34  # 40 written; 34-37 and 6 failed, 39 retracted
    assert json.loads(reads["count-missing"][1])["missing_count"] == 10
    assert json.loads(reads["show"][1])["event"]["citation"] == cite


def test_every_damage_gives_the_same_answer_or_an_integrity_error(base):
    path, cite, want = base
    size = os.path.getsize(path)
    rng = random.Random(SEED)
    flips = [(offset + (offset // PAGE * 389) % PAGE, rng.randrange(8)) for offset in range(0, size, PAGE)]
    flips = [(min(o, size - 1), b) for o, b in flips]
    flips += [(rng.randrange(size), rng.randrange(8)) for _ in range(RANDOM_FLIPS)]
    truncations = sorted({size // 2, size - PAGE, size - 1, PAGE * 3, rng.randrange(PAGE, size)})
    refused = 0
    cases = [(f"flip {o}:{b}", dict(flip=(o, b))) for o, b in flips]
    cases += [(f"truncate {n}", dict(size=n)) for n in truncations]
    for n, (where, damage) in enumerate(cases):
        copy = _damaged_copy(path, f"damaged-{n}.db", **damage)
        got = _in_child(copy, cite)
        assert "crash" not in got, (where, got["crash"])
        refused += _check(got["reads"], want["reads"], where)
        os.remove(copy)
        if os.path.exists(copy + "-lock"):
            os.remove(copy + "-lock")
    assert refused > 0  # the sweep reached data the reads use
