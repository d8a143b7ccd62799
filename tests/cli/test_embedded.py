"""kprof.cli.main called again and again in one long-lived process (a notebook, a simulator service, a test harness):
each call leaves the process as it found it (signal handlers, module state)."""

import signal

from kprof.cli import main


def test_a_handler_set_from_c_is_left_as_it_is(monkeypatch, capsys):
    """An interpreter embedded in a C program whose SIGTERM handler was set from C (signal.getsignal gives None):
    main() raised TypeError putting None back after the verb ran, and left its own SIGTERM handler installed."""
    real = signal.getsignal
    before = real(signal.SIGTERM)
    monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGTERM else real(s))
    assert main(["list"]) == 0
    assert "single_gemm" in capsys.readouterr().out
    assert real(signal.SIGTERM) == before
