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


@pytest.fixture
def refused(capsys):
    """refused(argv, *needles): `kprof argv` exits 2 with nothing on stdout, no traceback, and every needle in its
    stderr, which it returns."""
    from kprof.cli import main

    def check(argv, *needles) -> str:
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 2, (code, captured.err)
        assert captured.out == "" and "Traceback" not in captured.err
        for needle in needles:
            assert needle in captured.err, (needle, captured.err)
        return captured.err

    return check
