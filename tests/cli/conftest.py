"""Shared fixtures of the CLI tests: a fast CPU timer, an isolated working directory, and hand-built rows."""

from __future__ import annotations

import hashlib
import json
import os

import msgspec
import pytest

from kprof.ledger import KeyMaker, Ledger, ShapeCodec
from kprof.ledger.build import failed, measured
from kprof.ledger.events import Method, Stats
from kprof.measure.env import cpu_model
from kprof.method import effective_entry
from kprof.runners.registry import lookup

GEMM = "single_gemm"
CPU = "torch-cpu"
METRICS = {"time_ms", "tflops", "memory_bandwidth_gbps", "energy_j"}
RESULT_FIELDS = {"spec", "status", "key", "event", "citation", "metrics", "stats", "provenance", "measured_at"}
QUERY_FIELDS = {"table", "backend", "gpu_name", "db", "mode", "count", "missing_count", "view_root", "results"}
COUNT_FIELDS = {"table", "backend", "gpu_name", "db", "count", "missing_count", "missing"}


@pytest.fixture(autouse=True)
def _fast_and_isolated(monkeypatch, tmp_path):
    """A short timing budget per spec, no inherited $KPROF_DB or $COLUMNS, and a scratch cwd (./profile.db lands
    there)."""
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.05")
    monkeypatch.delenv("KPROF_TARGET_CI", raising=False)
    monkeypatch.delenv("KPROF_DB", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)  # an exported one lays tables out at its width off a terminal
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def local_gpu() -> str:
    """The GPU key of torch-cpu rows on this machine."""
    return cpu_model()


def gemm(m=32, n=32, k=32, dtype="fp32") -> dict:
    return {"m": m, "n": n, "k": k, "dtype": dtype}


def spec_args(*specs: dict) -> list[str]:
    out = []
    for s in specs:
        out += ["--spec", msgspec.json.encode(s).decode()]
    return out


def digest(path) -> str | None:
    """sha256 of a file, or None when it does not exist (to show a command wrote nothing)."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def make_event(spec: dict, gpu: str, *, table: str = GEMM, backend: str = CPU, revision: int | None = None,
               kind: str = "measured", time_ms: float = 0.5, parent: bytes | None = None):
    """A measured or failed event of the registry entry's contract (optionally at another profiler revision)."""
    entry = effective_entry(lookup(table, backend))  # a torch-cpu row's key names this process's thread count
    contract = entry.contract
    if revision is not None:
        contract = msgspec.structs.replace(contract, profiler_revision=revision)
    prov = KeyMaker(table, backend, gpu, contract, ShapeCodec(entry.args)).provenance(spec)
    if kind == "failed":
        return failed(prov, "crash", "segfault in the kernel", parent=parent)
    stats = Stats(n=5, median=time_ms, p10=time_ms, p90=time_ms, mean=time_ms, stdev=0.0, cv=0.0, min=time_ms,
                  max=time_ms, samples=[time_ms] * 5)
    metrics = {"time_ms": time_ms, "tflops": 1.0, "memory_bandwidth_gbps": 2.0, "energy_j": None}
    return measured(prov, metrics, stats, Method(timer="cpu", l2="warm"), parent=parent)


def append(db, *events) -> list[bytes]:
    led = Ledger.open(db)
    try:
        return led.append(list(events)).added
    finally:
        led.close()


def read_json(capsys, verb: str, db, *specs: dict, extra=(), table: str = GEMM) -> dict:
    """Runs a read verb (query, count-missing) with --json in-process; it must exit 0."""
    from kprof.cli import main

    rc = main([verb, table, "--backend", CPU, *spec_args(*specs), "--db", db, "--json", *extra])
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out)


class Helpers:
    """What the CLI tests share, handed out as the `h` fixture (conftest modules are not imported by tests)."""

    GEMM, CPU, METRICS = GEMM, CPU, METRICS
    RESULT_FIELDS, QUERY_FIELDS, COUNT_FIELDS = RESULT_FIELDS, QUERY_FIELDS, COUNT_FIELDS
    gemm = staticmethod(gemm)
    spec_args = staticmethod(spec_args)
    digest = staticmethod(digest)
    make_event = staticmethod(make_event)
    append = staticmethod(append)
    read_json = staticmethod(read_json)


@pytest.fixture
def h() -> type[Helpers]:
    return Helpers
