"""kprof.errors: every error survives pickling with its message and fields, as it crosses from a worker process (a
simulator's lookups in a process pool, a pool worker's spec) to the process that handles it."""

import pickle

import pytest

from kprof.errors import (LedgerPathError, LedgerVersionError, MergeConflict, SettingError, SpecError,
                          UnknownGpuKeyError)


@pytest.mark.parametrize("error", [
    UnknownGpuKeyError("single_gemm", "torch-cpu", "NVIDIA H200", "profile.db", [("AMD EPYC", 8)]),
    UnknownGpuKeyError("single_gemm", "torch", "AMD EPYC", "profile.db", [], [("single_gemm", "torch-cpu")]),
    UnknownGpuKeyError("memcpy", "torch", "AMD EPYC", "p.db", [], [("single_gemm", "torch")], {"bytes": 4096}),
    UnknownGpuKeyError("memcpy", "torch", "AMD EPYC", "p.db", [], [], {"bytes": 4096}, "events;l2=warm;graph"),
    LedgerVersionError("profile.db", 9, 4),
    MergeConflict("1 conflict; nothing merged", {"conflicts": [{"key": "ab"}]}),
    SettingError("timer='x' is bad", "--timer x is bad"),
    LedgerPathError("no ledger at p.db; pass db=...", "no ledger at p.db; pass --db"),
    SpecError('field "m" = 1.5 is a float', index=3, field="m", value=1.5),
])
def test_an_error_comes_back_from_pickling_whole(error):
    """(An UnknownGpuKeyError raised in a multiprocessing.Pool worker could not be unpickled: the pool hung, and a
    ProcessPoolExecutor called itself broken, instead of naming the GPU keys the ledger holds.)"""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)


def test_the_run_an_unknown_gpu_key_names_measures_under_the_method_looked_up():
    """The `kprof run` an unknown GPU key's error names measured under the default CUDA method whatever the lookup's
    (get_memcpy(..., timer='events')): pasted, it measured rows the lookup still did not read. It names the method's
    flags where they are not the defaults, as the ledger keys them."""
    timing = "events;l2=warm;graph;power=loaded"
    error = UnknownGpuKeyError("memcpy", "torch", "H100", "p.db", [], [], {"bytes": 1}, timing)
    assert "`kprof run memcpy --backend torch --db p.db --timer events --l2 warm --cuda-graph --power loaded --spec " \
           "'{\"bytes\": 1}'`" in str(error)
    default = UnknownGpuKeyError("memcpy", "torch", "H100", "p.db", [], [], {"bytes": 1}, "cupti;l2=cold;eager")
    assert "`kprof run memcpy --backend torch --db p.db --spec '{\"bytes\": 1}'`" in str(default)


def test_the_run_an_unknown_gpu_key_names_overrides_the_method_variables_set_here(monkeypatch):
    """A lookup that named the default method (get_memcpy(..., l2='cold', cuda_graph=False)) where KPROF_L2=warm and
    KPROF_CUDA_GRAPH=1 are set named `kprof run ...` without flags: pasted in that shell, the variables chose a warm L2
    and graphs, and the lookup still found no row. The flags whose variable is set here are named."""
    monkeypatch.setenv("KPROF_L2", "warm")
    monkeypatch.setenv("KPROF_CUDA_GRAPH", "1")
    monkeypatch.delenv("KPROF_TIMER", raising=False)
    monkeypatch.delenv("KPROF_POWER", raising=False)
    error = UnknownGpuKeyError("memcpy", "torch", "H100", "p.db", [], [], {"bytes": 1}, "cupti;l2=cold;eager")
    assert "`kprof run memcpy --backend torch --db p.db --l2 cold --no-cuda-graph --spec '{\"bytes\": 1}'`" in \
           str(error)
    cpu = UnknownGpuKeyError("memcpy", "torch-cpu", "H100", "p.db", [], [], {"bytes": 1}, "cpu-wall;l2=warm;eager")
    assert "`kprof run memcpy --backend torch-cpu --db p.db --spec" in str(cpu)  # the CPU's one method: no flags
