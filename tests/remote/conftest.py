"""Shared fixtures of the remote tests: an isolated working directory and ledger, remote.yaml writers, one local Ray
cluster for the module that needs it, and hand-built rows."""

from __future__ import annotations

import os

import pytest

from kprof.ledger import KeyMaker, Ledger, ShapeCodec
from kprof.ledger.build import measured
from kprof.ledger.events import Method, Stats
from kprof.method import effective_entry
from kprof.runners.registry import lookup

BUDGET = "0.05"  # seconds of timing per spec: the workers measure for real, briefly


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """A scratch cwd (remote.yaml and ./profile.db land there), KPROF_DB in it, a short timing budget."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KPROF_DB", str(tmp_path / "profile.db"))
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", BUDGET)
    monkeypatch.delenv("KPROF_TARGET_CI", raising=False)


@pytest.fixture
def db(tmp_path) -> str:
    return str(tmp_path / "profile.db")


@pytest.fixture
def remote_yaml(tmp_path):
    """Writes remote.yaml in the cwd from its text."""
    def write(text: str) -> str:
        path = tmp_path / "remote.yaml"
        path.write_text(text)
        return str(path)

    return write


def hand_row(db: str, spec: dict, gpu: str, time_ms: float = 0.5) -> bytes:
    """Appends a measured row for the torch-cpu single_gemm spec, made by hand (no parent); its event id."""
    entry = effective_entry(lookup("single_gemm", "torch-cpu"))
    prov = KeyMaker(entry.table, entry.backend, gpu, entry.contract, ShapeCodec(entry.args)).provenance(spec)
    stats = Stats(n=5, median=time_ms, p10=time_ms, p90=time_ms, mean=time_ms, stdev=0.0, cv=0.0, min=time_ms,
                  max=time_ms, samples=[time_ms] * 5)
    event = measured(prov, {"time_ms": time_ms, "tflops": 1.0, "memory_bandwidth_gbps": 2.0, "energy_j": None},
                     stats, Method(timer="cpu", l2="warm"))
    with Ledger.open(db) as ledger:
        return ledger.append([event]).added[0]


def view_root(db: str, gpu: str) -> str | None:
    if not os.path.exists(db):
        return None
    entry = effective_entry(lookup("single_gemm", "torch-cpu"))
    with Ledger.open(db, readonly=True) as ledger:
        root, _rows = ledger.view(entry.table, entry.backend, gpu, entry.contract, entry.args).query([])
    return root.hex()


class Helpers:
    """What the remote tests share, as the `h` fixture."""

    hand_row = staticmethod(hand_row)
    view_root = staticmethod(view_root)


@pytest.fixture
def h() -> type[Helpers]:
    return Helpers


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for the module; remotes with address "local" join it instead of starting
    their own; its workers inherit the short timing budget. Shut down at the end."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KPROF_TIME_BUDGET_S", BUDGET)
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
