"""Deterministic synthetic events, for tests, fixtures and benchmarks of the ledger itself.

They are shaped like real GEMM rows (a realistic payload size: metrics, 16 raw samples, environment)
but are labelled `backend="synthetic"` so they can never be mistaken for measurements (a benchmark of the
CLI may file them under a real backend in a throwaway ledger, to time the verbs at scale).
"""

from __future__ import annotations

import random
from typing import Iterator

import msgspec

from .ledger.build import measured
from .ledger.events import Contract, Environment, Method, Origin, Provenance, Stats

__all__ = ["SynthArgs", "CONTRACT", "TABLE", "BACKEND", "GPU", "spec", "event", "events", "view"]

TABLE, BACKEND, GPU = "single_gemm", "synthetic", "Synthetic GPU"
CONTRACT = Contract(algorithm="synthetic", layout="row_major", numerics="bf16", timing="synthetic", profiler_revision=1)
_ENV = Environment(gpu_name=GPU, gpu_uuid="GPU-00000000-0000-0000-0000-000000000000", driver="0", cuda="0",
                   torch="0", python="3", kprof="0.1.0", host="synth")


class SynthArgs(msgspec.Struct, frozen=True):
    m: int
    n: int
    k: int
    dtype: str


def spec(i: int) -> dict:
    """The i-th spec of an unbounded, collision-free sequence."""
    return {"m": i + 1, "n": 128 * (1 + i % 64), "k": 4096, "dtype": ("bf16", "fp16")[i % 2]}


def event(i: int, *, revision: int = 1, gpu: str = GPU, seed: int = 0, contract: Contract = CONTRACT,
          backend: str = BACKEND):
    rng = random.Random(i * 1_000_003 + seed)
    base = 0.01 + (i % 997) * 1e-3
    samples = sorted(base * (1 + rng.gauss(0, 0.01)) for _ in range(16))
    med = samples[8]
    prov = Provenance(table=TABLE, backend=backend, gpu_key=gpu, algorithm=contract.algorithm,
                      layout=contract.layout, numerics=contract.numerics, timing=contract.timing,
                      profiler_revision=revision, shape=spec(i))
    flops = 2.0 * prov.shape["m"] * prov.shape["n"] * prov.shape["k"]
    stats = Stats(n=16, median=med, p10=samples[1], p90=samples[14], mean=sum(samples) / 16,
                  stdev=(samples[14] - samples[1]) / 2.56, cv=0.01, min=samples[0], max=samples[-1], samples=samples)
    return measured(prov, {"time_ms": med, "tflops": flops / med / 1e9, "memory_bandwidth_gbps": 1000.0,
                           "energy_j": None}, stats, Method(timer="synthetic", l2="cold", warmup=3),
                    environment=_ENV, origin=Origin(ledger_id="synthetic", run_id=f"run-{seed}"),
                    measured_at=1.7e9 + i + seed)


def events(start: int, stop: int, **kw) -> Iterator:
    for i in range(start, stop):
        yield event(i, **kw)


def view(ledger, revision: int = 1, gpu: str = GPU):
    contract = msgspec.structs.replace(CONTRACT, profiler_revision=revision)
    return ledger.view(TABLE, BACKEND, gpu, contract=contract, args_type=SynthArgs)
