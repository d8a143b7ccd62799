"""Where the output cannot go: a reader that left (`| head -1`), a full disk (/dev/full), a closed descriptor (`>&-`).
No traceback in any case: one line and exit 2 for a failed answer, nothing and exit 141 for a reader gone, and a lost
note on stderr never changes a verb's outcome."""

import contextlib
import errno
import io
import json
import os
import shlex
import subprocess
import sys

import pytest

import kprof.cli as main_mod
from kprof.cli import main

GEMM = {"m": 32, "n": 32, "k": 32, "dtype": "fp32"}
SCRIPT = "import sys; from kprof.cli import main; sys.exit(main(sys.argv[1:]))"


def _query(db, *extra):
    return ["query", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps(GEMM), "--db", db, *extra]


@pytest.fixture
def db(tmp_path, h, local_gpu):
    path = str(tmp_path / "profile.db")
    h.append(path, h.make_event(GEMM, local_gpu))
    return path


def _kprof(argv, *, shell_redirect="", **kwargs) -> subprocess.CompletedProcess:
    """kprof as a real process; `shell_redirect` (e.g. `>&-`) is applied to it by sh."""
    cmd = [sys.executable, "-c", SCRIPT, *argv]
    if shell_redirect:
        cmd = ["sh", "-c", f'exec "$@" {shell_redirect}', "sh", *cmd]
    return subprocess.run(cmd, timeout=120, env=dict(os.environ), **kwargs)


@pytest.mark.parametrize("extra", [(), ("--json",)])
def test_a_reader_that_left_ends_the_verb_quietly_with_141(db, extra):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails with EPIPE
    try:
        done = _kprof(_query(db, *extra), stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.parametrize("program", [["-m", "kprof"], ["-m", "launcher", "kernel-profile"]])
def test_the_program_whose_reader_left_ends_by_sigpipe_as_a_shell_tool_does(db, program):
    """It exited 141, which a shell reads as SIGPIPE's but xargs, make and find -exec take for a failure and go on
    past (`xargs -n1 kprof show | head -1` ran every show left); it ends by SIGPIPE, once its exit handlers ran."""
    import signal

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, *program, *_query(db)], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (-signal.SIGPIPE, "")


def test_a_shell_still_reads_141_of_the_program_a_reader_left(db):
    """What a shell reads is still 141, and `set -e`, `||` and `$?` see it as before."""
    read, write = os.pipe()
    os.close(read)
    cmd = " ".join(map(shlex.quote, [sys.executable, "-m", "kprof", *_query(db)]))
    try:
        done = subprocess.run(["sh", "-c", f'{cmd}; echo "rc=$?" >&2'], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == "rc=141\n"


def test_help_to_a_reader_that_left_is_quiet_too():
    read, write = os.pipe()
    os.close(read)
    try:
        done = _kprof(["query", "--help"], stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [("--json",), (), ("scopes",), ("--help",)])
def test_a_full_stdout_is_one_error_line_and_exit_2(db, argv):
    argv = ["scopes", "--db", db] if argv == ("scopes",) else _query(db, *argv)
    with open("/dev/full", "w") as full:
        done = _kprof(argv, stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("error: could not write the output to stdout (No space left on device); ")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_closed_stdout_is_as_dev_null(db):
    done = _kprof(_query(db), shell_redirect=">&-", stderr=subprocess.PIPE, text=True)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_closed_stderr_loses_the_notes_not_the_outcome(db, tmp_path):
    # a note on stderr (no row under this GPU key) and a usage error's line: neither can be written
    noted = _kprof(_query(db, "--gpu-name", "Other GPU", "--json"), shell_redirect="2>&-", capture_output=False,
                   stdout=subprocess.PIPE, text=True)
    assert noted.returncode == 0 and json.loads(noted.stdout)["missing_count"] == 1
    refused = _kprof(["query", "single_gemm", "--backend", "nope", "--spec", json.dumps(GEMM), "--db", db],
                     shell_redirect="2>&-", stdout=subprocess.PIPE, text=True)
    assert refused.returncode == 2
    # a run stores its rows and prints its devices line to stderr: closed, the run still succeeds
    ran = _kprof(["run", "single_gemm", "--backend", "torch-cpu", "--spec", json.dumps({**GEMM, "m": 8}), "--db", db],
                 shell_redirect="2>&-", stdout=subprocess.PIPE, text=True)
    assert ran.returncode == 0 and "1 of 1 ok" in ran.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stderr_keeps_the_exit_code(db):
    with open("/dev/full", "w") as full:
        done = _kprof(["query", "single_gemm", "--backend", "nope", "--spec", json.dumps(GEMM), "--db", db],
                      stdout=subprocess.PIPE, stderr=full)
    assert done.returncode == 2


class _Failing(io.StringIO):
    def __init__(self, code):
        super().__init__()
        self.code = code
        self.buffer = self

    def write(self, data):
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize(("code", "rc"), [(errno.ENOSPC, 2), (errno.EIO, 2), (errno.EPIPE, 141)])
@pytest.mark.parametrize("extra", [(), ("--json",)])
def test_in_process_a_failed_write_of_stdout_is_an_exit_code_not_a_traceback(db, capsys, monkeypatch, code, rc,
                                                                              extra):
    monkeypatch.setattr(sys, "stdout", _Failing(code))
    assert main(_query(db, *extra)) == rc
    err = capsys.readouterr().err
    assert err == "" if rc == 141 else err.startswith(f"error: could not write the output to stdout "
                                                      f"({os.strerror(code)}); ")


@pytest.mark.parametrize("program", [False, True])
def test_a_failed_stdout_is_pointed_at_dev_null_only_where_kprof_is_the_process(db, monkeypatch, program):
    """A process calling main() (a service, a notebook) whose stdout failed once (a reader gone) had that descriptor
    pointed at os.devnull for good: everything it wrote after was lost. Only where main() is the process (its last
    flush at exit would fail again) is it."""
    read, write = os.pipe()
    os.close(read)  # every write fails with EPIPE
    stream = open(write, "w", closefd=False)
    try:
        monkeypatch.setattr(sys, "stdout", stream)
        assert main(_query(db, "--json"), program=program) == 141
        assert os.path.samestat(os.fstat(write), os.stat(os.devnull)) is program
    finally:
        with contextlib.suppress(OSError):
            stream.close()
        os.close(write)
        main_mod._ending.clear()  # (a program's exit code, which its exit handler would end the process by)


@pytest.mark.parametrize("columns", ["0", "abc", "-3", "²"])  # ²: a digit to isdigit(), not to int()
def test_a_columns_setting_that_is_no_width_is_set_aside(capsys, monkeypatch, columns):
    """COLUMNS=0 made rich print nothing (on a terminal every answer and error line was lost) and the help a
    ValueError traceback."""
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["--help"]) == 0
    assert "Usage: kprof COMMAND" in capsys.readouterr().out
    assert os.environ["COLUMNS"] == columns  # put back


@pytest.mark.parametrize("columns", ["1", "99999999999"])
def test_a_columns_setting_no_help_can_be_laid_out_in_is_set_aside(columns):
    """COLUMNS=1 (or 2) made a verb's help wrap forever, and COLUMNS=99999999999 was a MemoryError traceback: a width
    outside 20 to 10,000 is set aside as one that is no width is."""
    env = dict(os.environ, COLUMNS=columns)
    p = subprocess.run([sys.executable, "-m", "kprof", "query", "--help"], env=env, capture_output=True, text=True,
                       timeout=60)  # a subprocess: at COLUMNS=1 it never returned
    assert p.returncode == 0 and "Usage: kprof query" in p.stdout and p.stderr == "", p.stderr


def test_off_a_terminal_a_columns_setting_lays_the_table_out_that_wide(db, capsys, monkeypatch):
    """Off a terminal (a pipe, a log) the table was laid out 200 wide whatever COLUMNS said, while the help followed
    it: `COLUMNS=60 kprof query ... | cat` printed 112 columns."""
    monkeypatch.setenv("COLUMNS", "60")
    assert main(_query(db)) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert max(map(len, table)) <= 60 and "not shown at 60 columns: tflops, memory_bandwidth_gbps" in out, out
    monkeypatch.delenv("COLUMNS")
    assert main(_query(db)) == 0  # no COLUMNS: room for every column, as before
    assert "not shown" not in capsys.readouterr().out


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_on_a_terminal_columns_0_still_prints_the_error_line(db):
    import pty

    main_fd, term = pty.openpty()
    try:
        env = dict(os.environ, COLUMNS="0")
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "query", "single_gemm", "--backend", "nope", "--spec",
                                 json.dumps(GEMM), "--db", db], stdin=term, stdout=term, stderr=term, env=env)
        os.close(term)
        out = b""
        while True:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # the terminal's other end closed
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=120) == 2
    finally:
        os.close(main_fd)
    assert "table 'single_gemm' has no backend 'nope'" in out.decode()


CHATTY = '''
from kprof.ledger.events import Contract
from kprof.runners._args import KernelArgs, Size
from kprof.runners._case import Case, bind
from kprof.runners.registry import Entry, register

print("chatty: imported")


class ChattyArgs(KernelArgs, frozen=True):
    n: Size


class Chatty:
    def build(self, spec, device):
        import torch

        print("chatty: building")
        x = torch.arange(spec.n, dtype=torch.float32, device=device) + 1.0

        def call(x):
            return x * 2.0

        return Case(bind(call, (x,)), lambda: None, flops=float(spec.n), bytes=8.0 * spec.n, inputs=(x,), call=call)


register(Entry("chatty", "torch-cpu", ChattyArgs, "elementwise", "compute",
               Contract(algorithm="x * 2", layout="x[n]", numerics="fp32", timing="", profiler_revision=1),
               runner="chatty_runner:Chatty", device="cpu"))
'''


@pytest.mark.parametrize("verb", [["list"], ["list", "--environments"], ["query"], ["count-missing"],
                                  ["audit", "--remeasure", "1"]])
def test_json_stdout_holds_the_document_alone_whatever_a_runner_prints(tmp_path, verb):
    """A KPROF_RUNNERS module that prints when imported, or a runner that prints while it builds, wrote into the
    --json document of every verb but `run`: `list`, `query`, `count-missing` (the import) and `audit --remeasure`
    (the build too). What anything else prints goes to stderr."""
    (tmp_path / "chatty_runner.py").write_text(CHATTY)
    env = dict(os.environ, KPROF_RUNNERS="chatty_runner",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    db, spec = str(tmp_path / "chatty.db"), ["chatty", "--backend", "torch-cpu", "--spec", '{"n": 64}']
    ran = subprocess.run([sys.executable, "-c", SCRIPT, "run", *spec, "--db", db], env=env, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    argv = [*verb, *spec, "--db", db] if verb[0] in ("query", "count-missing") else \
        [*verb, "--db", db, "--seed", "1"] if verb[0] == "audit" else verb
    done = subprocess.run([sys.executable, "-c", SCRIPT, *argv, "--json"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode in (0, 1), done.stderr
    json.loads(done.stdout)  # the document alone
    assert "chatty: imported" in done.stderr
    if verb[0] == "audit":
        assert "chatty: building" in done.stderr


def test_json_to_a_text_stream_without_bytes_is_written_as_its_text(db):
    """`kprof.cli.main([... "--json"])` under contextlib.redirect_stdout(io.StringIO()) (or a notebook's stdout, a
    text stream with no .buffer) was an AttributeError traceback: the document is written as text, whole."""
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(_query(db, "--json")) == 0
    assert json.loads(out.getvalue())["results"][0]["spec"] == GEMM
