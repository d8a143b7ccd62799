"""Seconds read from the environment (kprof.runners._settings): defaults, bad values named, and 0 where it means off."""

import pytest

from kprof.errors import UsageError
from kprof.runners._settings import env_seconds
from kprof.runners.cuda_device import ENERGY_S, energy_window_s


def test_env_seconds(monkeypatch):
    monkeypatch.delenv("KPROF_X_S", raising=False)
    assert env_seconds("KPROF_X_S", 3.0) == 3.0
    monkeypatch.setenv("KPROF_X_S", "")
    assert env_seconds("KPROF_X_S", 3.0) == 3.0
    monkeypatch.setenv("KPROF_X_S", "0.5")
    assert env_seconds("KPROF_X_S", 3.0) == 0.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("KPROF_X_S", bad)
        with pytest.raises(UsageError, match=r"KPROF_X_S=.* is not a number of seconds > 0; e.g. KPROF_X_S=3"):
            env_seconds("KPROF_X_S", 3.0)
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
