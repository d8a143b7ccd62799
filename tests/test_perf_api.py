"""kprof.perf_api: a GPU key the ledger has never held rows of raises, naming the ones it holds; counts still count."""

import pytest

from kprof import perf_api
from kprof.errors import UnknownGpuKeyError
from kprof.ledger import KeyMaker, Ledger, ShapeCodec
from kprof.ledger.build import measured
from kprof.ledger.events import Method, Stats
from kprof.runners.registry import lookup

SPEC = {"m": 32, "n": 32, "k": 32, "dtype": "fp32"}


@pytest.fixture
def db(tmp_path):
    entry = lookup("single_gemm", "torch-cpu")
    keys = KeyMaker(entry.table, entry.backend, "Known CPU", entry.contract, ShapeCodec(entry.args))
    stats = Stats(n=3, median=0.1, p10=0.1, p90=0.1, mean=0.1, stdev=0.0, cv=0.0, min=0.1, max=0.1)
    metrics = {"time_ms": 0.1, "tflops": 1.0, "memory_bandwidth_gbps": 1.0, "energy_j": None}
    path = str(tmp_path / "profile.db")
    with Ledger.open(path) as led:
        led.append([measured(keys.provenance(SPEC), metrics, stats, Method(timer="cpu"))])
    yield path
    perf_api.close_all()


def test_get_under_an_unknown_gpu_key_names_the_known_ones(db):
    with pytest.raises(UnknownGpuKeyError, match="no single_gemm/torch-cpu rows for GPU key 'AMD EPYC': it holds "
                                                 r"single_gemm/torch-cpu rows for GPU key 'Known CPU' \(1 row\)"):
        perf_api.get_single_gemm(backend="torch-cpu", gpu_key="AMD EPYC", db=db, **SPEC)


def test_get_under_a_known_gpu_key_is_the_row_or_none(db):
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **SPEC).metrics["time_ms"] == 0.1
    assert perf_api.get_single_gemm(backend="torch-cpu", gpu_key="Known CPU", db=db, **{**SPEC, "m": 64}) is None


def test_count_under_an_unknown_gpu_key_counts_every_spec_missing(db):
    specs = [SPEC, {**SPEC, "m": 64}]
    assert perf_api.count_single_gemm(specs, backend="torch-cpu", gpu_key="AMD EPYC", db=db) == 2
    assert perf_api.count_single_gemm(specs, backend="torch-cpu", gpu_key="Known CPU", db=db) == 1
