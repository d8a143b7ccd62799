"""Seconds read from the environment (kprof.settings.env_seconds): defaults, bad values named, and 0 where it means off."""

import os

import pytest

from kprof.errors import UsageError
from kprof.settings import env_seconds
from kprof.measure._state import StateReading
from kprof.runners.cuda_device import CAPPED_MAX_SAMPLE_S, CAPPED_SAMPLE_S, ENERGY_S, CudaDevice, capped_sample_s, energy_window_s


def test_env_seconds(monkeypatch):
    monkeypatch.delenv("KPROF_X_S", raising=False)
    assert env_seconds("KPROF_X_S", 3.0) == 3.0
    monkeypatch.setenv("KPROF_X_S", "")
    assert env_seconds("KPROF_X_S", 3.0) == 3.0
    monkeypatch.setenv("KPROF_X_S", "0.5")
    assert env_seconds("KPROF_X_S", 3.0) == 0.5
    for bad in ("0", "-1", "soon", "nan", "inf", "1e300", "604801"):  # past a week: a wait's select overflows by 1e10
        monkeypatch.setenv("KPROF_X_S", bad)
        with pytest.raises(UsageError, match=r"KPROF_X_S=.* is not a number of seconds > 0 and at most 604800 "
                                             r"\(a week\); e.g. KPROF_X_S=3"):
            env_seconds("KPROF_X_S", 3.0)
    monkeypatch.setenv("KPROF_X_S", "604800")
    assert env_seconds("KPROF_X_S", 3.0) == 604800.0
    monkeypatch.setenv("KPROF_X_S", "0")
    assert env_seconds("KPROF_X_S", 3.0, zero_ok=True) == 0.0
    monkeypatch.setenv("KPROF_X_S", "-0.1")
    with pytest.raises(UsageError, match="is not a number of seconds >= 0"):
        env_seconds("KPROF_X_S", 3.0, zero_ok=True)


def test_the_energy_window_may_be_turned_off(monkeypatch):
    monkeypatch.delenv("KPROF_ENERGY_S", raising=False)
    assert energy_window_s() == ENERGY_S
    monkeypatch.setenv("KPROF_ENERGY_S", "0")
    assert energy_window_s() == 0.0
    monkeypatch.setenv("KPROF_ENERGY_S", "lots")
    with pytest.raises(UsageError, match="KPROF_ENERGY_S='lots'"):
        energy_window_s()


def test_a_capped_rows_sampled_time_comes_from_the_environment(monkeypatch):
    """KPROF_CAPPED_SAMPLE_S and KPROF_CAPPED_MAX_SAMPLE_S set the least and the most timed work a power-capped row
    averages over (defaults 0.5 and 3 s); the device's state protocol takes them, and a kernel its settle finds at
    the cap must then be sampled at least the least. A maximum below the minimum is the minimum."""
    monkeypatch.delenv("KPROF_CAPPED_SAMPLE_S", raising=False)
    monkeypatch.delenv("KPROF_CAPPED_MAX_SAMPLE_S", raising=False)
    assert capped_sample_s() == (CAPPED_SAMPLE_S, CAPPED_MAX_SAMPLE_S) == (0.5, 3.0)
    monkeypatch.setenv("KPROF_CAPPED_SAMPLE_S", "0")
    with pytest.raises(UsageError, match="KPROF_CAPPED_SAMPLE_S='0' is not a number of seconds > 0"):
        capped_sample_s()
    monkeypatch.setenv("KPROF_CAPPED_SAMPLE_S", "4")
    assert capped_sample_s() == (4.0, 4.0)
    monkeypatch.setenv("KPROF_CAPPED_MAX_SAMPLE_S", "never")
    with pytest.raises(UsageError, match="KPROF_CAPPED_MAX_SAMPLE_S='never'"):
        capped_sample_s()
    monkeypatch.setenv("KPROF_CAPPED_SAMPLE_S", "2")
    monkeypatch.setenv("KPROF_CAPPED_MAX_SAMPLE_S", "5")
    d = object.__new__(CudaDevice)  # the protocol's settings only: no CUDA device behind it
    d._probe, d.state_errors, d.power = (lambda: StateReading(1650.0, 699.0, 61.0, 0)), {}, "sustained"
    d.env, d.capped_sample_s = type("Env", (), {"power_limit_w": 700.0})(), capped_sample_s()
    state = d._state(start=False, settled=True)  # right after an energy window: the short settle
    assert (state.capped_sample_s, state.capped_max_sample_s, state.min_sample_s) == (2.0, 5.0, 0.0)
    state.settle(lambda seconds: None)
    assert state.capped and state.min_sample_s == 2.0 and state.estimator == "mean"
    assert state.notes["capped_sample_s"] == "2.00" and state.notes["capped_max_sample_s"] == "5.00"


def test_aliases_of_one_setting_that_differ_are_refused(monkeypatch):
    from kprof.settings import env_alias

    for name in ("KPROF_X", "OLD_X"):
        monkeypatch.delenv(name, raising=False)
    assert env_alias("KPROF_X", "OLD_X") is None
    monkeypatch.setenv("OLD_X", "0,1")
    assert env_alias("KPROF_X", "OLD_X") == "OLD_X"
    monkeypatch.setenv("KPROF_X", "0, 1")  # the same value, spaced otherwise
    assert env_alias("KPROF_X", "OLD_X") == "KPROF_X"
    monkeypatch.setenv("KPROF_X", "0")
    with pytest.raises(UsageError, match="KPROF_X='0' and OLD_X='0,1' are the same setting and differ; unset OLD_X"):
        env_alias("KPROF_X", "OLD_X")


def test_a_capped_rows_least_above_its_most_is_refused_when_both_are_set(monkeypatch):
    monkeypatch.setenv("KPROF_CAPPED_SAMPLE_S", "5")
    monkeypatch.setenv("KPROF_CAPPED_MAX_SAMPLE_S", "1")
    with pytest.raises(UsageError, match="KPROF_CAPPED_SAMPLE_S='5' is above KPROF_CAPPED_MAX_SAMPLE_S='1'"):
        capped_sample_s()
    monkeypatch.delenv("KPROF_CAPPED_MAX_SAMPLE_S")
    assert capped_sample_s() == (5.0, 5.0)  # above the default maximum: that is the minimum, as documented


def test_a_cuda_backend_without_a_gpu_names_its_tables_cpu_backend(monkeypatch):
    """The CUDA device's own check: all_reduce's CPU backend is gloo, single_gemm's torch-cpu."""
    import torch

    from kprof.runners.registry import lookup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for table, backend, twin in (("all_reduce", "nccl", "gloo"), ("single_gemm", "torch", "torch-cpu")):
        with pytest.raises(UsageError, match=f"backend {backend} measures on a CUDA GPU .*; run on a GPU machine, or "
                                             f"use backend {twin}$"):
            CudaDevice(lookup(table, backend), "NVIDIA H200", None)


def test_settings_given_over_the_environment_are_read_in_this_thread_only(monkeypatch):
    """A remote run checks its tasks' env_vars by reading the settings with them given over this machine's; the check
    patched os.environ for the whole process, where another thread reading a setting meanwhile saw the remote value."""
    import threading

    from kprof import settings
    from kprof.method import check_method_env

    monkeypatch.setenv("KPROF_ENERGY_S", "0.5")
    monkeypatch.delenv("KPROF_TIMER", raising=False)
    inside, seen = threading.Event(), {}

    def other_thread():
        inside.wait(5)
        seen["energy"], seen["timer"] = energy_window_s(), settings.environ().get("KPROF_TIMER")

    thread = threading.Thread(target=other_thread)
    thread.start()
    with settings.given({"KPROF_ENERGY_S": "2", "KPROF_TIMER": "bogus"}):
        assert energy_window_s() == 2.0
        inside.set()
        thread.join(5)
        with pytest.raises(UsageError, match="KPROF_TIMER='bogus' is not one of cupti, events"):
            check_method_env()
        assert os.environ["KPROF_ENERGY_S"] == "0.5" and "KPROF_TIMER" not in os.environ
    assert seen == {"energy": 0.5, "timer": None}
    assert energy_window_s() == 0.5 and settings.environ() is os.environ
