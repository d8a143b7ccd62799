"""The timing method of CUDA rows comes from KPROF_TIMER / KPROF_L2 / KPROF_CUDA_GRAPH and is part of the key;
reading the rows of a GPU needs no GPU (only --gpu-name)."""

import json

import pytest

from kprof.api import effective_entry
from kprof.cli import main
from kprof.errors import UsageError
from kprof.runners.registry import lookup

H200 = "NVIDIA H200"


@pytest.mark.parametrize("env, timing", [
    ({}, "cupti;l2=cold;eager"),
    ({"KPROF_TIMER": "events"}, "events;l2=cold;eager"),
    ({"KPROF_CUDA_GRAPH": "1"}, "cupti;l2=cold;graph"),
    ({"KPROF_L2": "warm", "KPROF_TIMER": "EVENTS"}, "events;l2=warm;eager"),
])
def test_cuda_timing_method_from_the_environment(monkeypatch, env, timing):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert effective_entry(lookup("single_gemm", "torch")).contract.timing == timing
    assert effective_entry(lookup("single_gemm", "torch-cpu")).contract.timing == "cpu-wall;l2=warm;eager"


def test_a_bad_timing_variable_names_itself(monkeypatch):
    monkeypatch.setenv("KPROF_TIMER", "nsys")
    with pytest.raises(UsageError, match="KPROF_TIMER='nsys' is not one of cupti, events"):
        effective_entry(lookup("rms_norm", "torch"))


def test_rows_of_one_timer_are_missing_under_another(h, capsys, monkeypatch):
    spec = {"tokens": 4, "hidden": 64, "dtype": "bf16"}
    h.append("p.db", h.make_event(spec, H200, table="rms_norm", backend="torch"))
    args = ["count-missing", "rms_norm", "--backend", "torch", *h.spec_args(spec), "--gpu-name", H200,
            "--db", "p.db", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["missing_count"] == 0
    monkeypatch.setenv("KPROF_TIMER", "events")
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["missing_count"] == 1


def test_gpu_rows_without_a_gpu_need_gpu_name(h, capsys, monkeypatch):
    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [])
    spec = {"tokens": 4, "hidden": 64, "dtype": "bf16"}
    assert main(["query", "rms_norm", "--backend", "torch", *h.spec_args(spec), "--db", "p.db"]) == 2
    assert "none is visible here; pass --gpu-name" in capsys.readouterr().err


def test_a_device_that_cannot_measure_is_refused_before_the_ledger_is_created(h, capsys, monkeypatch, tmp_path):
    """A CUDA run on a machine whose GPU cannot be used (here: CUPTI missing) exits 2 and writes nothing."""
    import kprof.runners.worker as worker

    def refuse(entry, gpu_key, environment=None):
        raise UsageError("CUPTI is not usable here (ImportError: no cupti); set KPROF_TIMER=events")

    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [H200])
    monkeypatch.setattr(worker, "_CudaDevice", refuse)
    spec = {"tokens": 4, "hidden": 64, "dtype": "bf16"}
    assert main(["run", "rms_norm", "--backend", "torch", *h.spec_args(spec), "--db", "p.db"]) == 2
    assert "CUPTI is not usable here" in capsys.readouterr().err
    assert not (tmp_path / "p.db").exists()
