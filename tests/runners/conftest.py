import pytest


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    """A short timing budget per spec for the CPU timer."""
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.05")
    monkeypatch.delenv("KPROF_TARGET_CI", raising=False)
