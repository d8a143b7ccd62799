import pytest

from kprof.ledger import Ledger


@pytest.fixture
def ledger_path(tmp_path):
    return str(tmp_path / "profile.db")


@pytest.fixture
def ledger(ledger_path):
    led = Ledger.open(ledger_path)
    yield led
    led.close()
