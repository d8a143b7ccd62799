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


def test_verbs_run_from_threads_at_once_leave_the_streams_as_they_were(monkeypatch, capsys):
    """Two threads of a service each calling main(): one verb began while the other ran and ended after it, and put
    back the streams it had found, the other verb's wrappers: sys.stdout and sys.stderr stayed kprof's for good (a
    later failed write of the program's own raised kprof's OutputError, or its stderr went silent)."""
    import sys
    import threading

    import kprof.cli as cli

    first_in, first_out = threading.Event(), threading.Event()

    def verb(argv):
        if argv == ["first"]:
            first_in.set()
            first_out.wait(0.3)  # the second begins meanwhile, where verbs may overlap
        else:
            first_out.wait(5)  # and ends after the first
        return 0

    monkeypatch.setattr(cli, "app", verb)
    before = sys.stdout, sys.stderr

    def first():
        main(["first"])
        first_out.set()

    def second():
        first_in.wait(5)
        main(["second"])

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (sys.stdout, sys.stderr) == before


def test_a_process_forked_while_a_verb_runs_in_another_thread_runs_its_own(monkeypatch):
    """A harness that forks while one of its threads is inside main(): the child inherited the verb's lock held by a
    thread it does not have, and its own main() waited for good."""
    import os
    import threading

    import kprof.cli as cli

    inside, release = threading.Event(), threading.Event()

    def verb(argv):
        if argv == ["hold"]:
            inside.set()
            release.wait(10)
        return 0

    monkeypatch.setattr(cli, "app", verb)
    holder = threading.Thread(target=main, args=(["hold"],))
    holder.start()
    inside.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: its verb, or exit 99 after 5 s waiting for the lock
        threading.Timer(5, os._exit, args=(99,)).start()
        os._exit(main(["child"]))
    _pid, status = os.waitpid(pid, 0)
    release.set()
    holder.join()
    assert os.waitstatus_to_exitcode(status) == 0


class _Writer:
    """A service's stream that only writes (a logger's adapter): no isatty, fileno or encoding."""

    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)
        return len(text)

    def flush(self):
        pass


def test_streams_that_only_write_take_a_verbs_output(monkeypatch):
    """sys.stdout and sys.stderr set to a writer without isatty: every verb that printed a table or an error line, and
    every run, raised AttributeError ('_Writer' object has no attribute 'isatty') instead of writing it."""
    import sys

    out, err = _Writer(), _Writer()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["list"]) == 0
    assert main(["scopes", "--db", "none.db"]) == 2
    assert "single_gemm" in "".join(out.parts) and "no ledger at none.db" in "".join(err.parts)
    spec = '{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}'  # a run's progress, off a terminal: its lines
    assert main(["run", "single_gemm", "--backend", "torch-cpu", "--spec", spec, "--fresh"]) == 0
    assert "measuring 1 spec(s)" in "".join(err.parts)


def test_no_python_streams_at_all_is_no_traceback(monkeypatch):
    """An embedded interpreter (or pythonw) without sys.stdout or sys.stderr (None) while descriptors 1 and 2 are
    open: every verb raised AttributeError ('NoneType' object has no attribute 'write'); it runs, showing nothing, and
    the streams stay None."""
    import sys

    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "stderr", None)
    assert main(["list"]) == 0
    assert main(["scopes", "--db", "none.db"]) == 2
    assert main(["list", "--json"]) == 0
    assert sys.stdout is None and sys.stderr is None


def test_arguments_may_be_paths_or_bytes(tmp_path, capsys):
    """A harness passing `--db tmp_path / "p.db"` (a pathlib.Path, as subprocess takes): main() raised AttributeError
    ('PosixPath' object has no attribute 'encode'); a path or bytes is its text, and a str alone one argument (it was
    read as a list of characters: `Unknown command "s"`)."""
    assert main(["scopes", "--db", tmp_path / "none.db"]) == 2
    assert f"no ledger at {tmp_path / 'none.db'}" in capsys.readouterr().err
    assert main([b"scopes", b"--db", bytes(tmp_path / "none.db")]) == 2
    assert f"no ledger at {tmp_path / 'none.db'}" in capsys.readouterr().err
    assert main("list") == 0
    assert "single_gemm" in capsys.readouterr().out


def test_a_streams_error_handler_is_put_back(monkeypatch):
    """On a stream that is not UTF-8 (PYTHONIOENCODING=ascii) a verb shows what it cannot encode as escapes: that
    handler stayed on the caller's sys.stdout after main() returned, so its own print of `é` no longer raised."""
    import io
    import sys

    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict") for _ in range(2))
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["scopes", "--db", "n\u00e9.db"]) == 2
    err.seek(0)
    assert "no ledger at n\\xe9.db" in err.read()
    assert (out.errors, err.errors) == ("strict", "strict")


def test_the_sigbus_handler_found_is_put_back_with_its_flags(capsys):
    """Each verb installs a SIGBUS handler (one line, exit 3) and put back the one it found with libc `signal`, which
    takes the function alone: faulthandler's handler (pytest's here) came back without SA_ONSTACK and SA_NODEFER, and
    a handler taking siginfo, or a Go runtime's (which refuses one without SA_ONSTACK), would have been broken. The
    whole `struct sigaction` is put back, byte for byte."""
    import ctypes
    import faulthandler
    import sys

    import pytest

    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        pytest.skip("the layout of struct sigaction read here is 64-bit Linux's")
    libc = ctypes.CDLL(None)

    def action() -> tuple[bytes, bytes, int]:
        """(handler, the signals blocked while it runs, flags): what the kernel holds (glibc fills the rest of its
        1024-bit sa_mask with whatever its stack held)."""
        found = ctypes.create_string_buffer(1024)
        assert libc.sigaction(signal.SIGBUS, None, found) == 0
        return found.raw[:8], found.raw[8:16], int.from_bytes(found.raw[136:140], sys.byteorder)

    enabled = faulthandler.is_enabled()  # (pytest enables it)
    if not enabled:  # a handler of flags libc `signal` does not set (SA_ONSTACK, SA_NODEFER)
        faulthandler.enable(sys.__stderr__)
    try:
        before = action()
        assert main(["list"]) == 0
        assert "single_gemm" in capsys.readouterr().out
        assert action() == before and before[2] & 0x08000000  # SA_ONSTACK, as faulthandler set it
    finally:
        if not enabled:
            faulthandler.disable()
