"""Every KPROF_* variable a run reads, table-driven: a bad value is refused before anything is measured or written
(exit 2, naming the variable), and the README documents every variable the package reads."""

import pathlib
import re
import sys

import pytest

from kprof.errors import UsageError

ROOT = pathlib.Path(__file__).parent.parent.parent

# (variable, bad values): each refused by the check every run makes first, on any backend.
SECONDS = ("abc", "-1", "nan", "inf", "1e400", "1e300")
BAD = [
    ("KPROF_SPEC_TIMEOUT_S", SECONDS + ("0", "1e-9", "0.5")),
    ("KPROF_WORKER_START_S", SECONDS + ("0", "0.000001", "9")),
    ("KPROF_RANK_START_S", SECONDS + ("0", "1e-9", "9")),
    ("KPROF_RANK_STEP_S", SECONDS + ("0", "1e-9", "0.5")),
    ("KPROF_ENERGY_S", SECONDS + ("1e-9", "0.1")),
    ("KPROF_CAPPED_SAMPLE_S", SECONDS + ("0",)),
    ("KPROF_CAPPED_MAX_SAMPLE_S", SECONDS + ("0",)),
    ("KPROF_TIME_BUDGET_S", SECONDS + ("0",)),
    ("KPROF_TARGET_CI", ("abc", "0", "1", "-0.1", "nan", "inf", "1e300")),
    ("KPROF_CPU_WORKERS", ("abc", "0", "-1", "1.5", "nan", "100000", "\u00b2")),
    ("KPROF_POOL", ("maybe", "1")),
    ("KPROF_PROFILE_GPUS", ("a", "-1", "0,0", ",")),
    ("KPROF_SKIP_ENV_CHECK", ("yes", "true", "2")),
    ("KPROF_TIMER", ("bogus",)),
    ("KPROF_L2", ("hot",)),
    ("KPROF_CUDA_GRAPH", ("yes", "2")),
    ("KPROF_POWER", ("max",)),
]


@pytest.mark.parametrize("name,bad", [(n, b) for n, values in BAD for b in values])
def test_a_bad_value_is_refused_before_a_cpu_run_writes(name, bad, tmp_path, monkeypatch):
    from kprof import api

    monkeypatch.setenv(name, bad)
    db = tmp_path / "p.db"
    with pytest.raises(UsageError, match=re.escape(name)):
        api.run("single_gemm", "torch-cpu", [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], db=str(db))
    assert not any(tmp_path.iterdir())


# (variable, a positive value too small for anything to finish in it, the least accepted, the default): 1e-9 timed
# out every spec and 0.000001 dropped every worker, each with a message that named neither the value nor the fix.
TOO_SMALL = [("KPROF_SPEC_TIMEOUT_S", "1e-9", "1", "900"), ("KPROF_WORKER_START_S", "0.000001", "10", "600"),
             ("KPROF_RANK_START_S", "0.5", "10", "300"), ("KPROF_RANK_STEP_S", "0.01", "1", "300"),
             ("KPROF_ENERGY_S", "0.05", "0.2", "0.25")]


@pytest.mark.parametrize("name,tiny,least,default", TOO_SMALL)
def test_a_positive_value_too_small_to_use_names_the_value_the_bound_and_the_fix(name, tiny, least, default,
                                                                                 monkeypatch, capsys, tmp_path):
    from kprof.cli import main

    monkeypatch.setenv(name, tiny)
    db = tmp_path / "p.db"
    assert main(["run", "single_gemm", "--backend", "torch-cpu", "--spec", '{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}',
                 "--db", str(db)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {name}={tiny!r} is below {least} s, the least kprof accepts: "), line
    assert line.endswith(f"set {'0 to turn it off, or ' if name == 'KPROF_ENERGY_S' else ''}{least} or more "
                         f"(default {default}), or unset it"), line
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv(name, least)  # the bound itself is taken
    from kprof.runners.fill import check_settings

    check_settings()


def test_the_readme_documents_every_variable_the_package_reads():
    read = set()
    for path in (ROOT / "kprof").rglob("*.py"):
        read |= set(re.findall(r"\bKPROF_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    missing = sorted(name for name in read if name not in readme)
    assert not missing, f"variables kprof reads that README.md does not name: {missing}"


@pytest.mark.parametrize("value", [".kernels", "..x", "kprof, .kernels"])
def test_a_relative_runners_module_is_refused_by_name(value, monkeypatch):
    from kprof.runners import registry

    monkeypatch.setenv("KPROF_RUNNERS", value)
    with pytest.raises(UsageError, match=r"KPROF_RUNNERS names module '\.+[a-z]+', a relative name; give its full "):
        registry._load_plugins()


@pytest.mark.parametrize("body, said", [
    ("import json\nraise RuntimeError('no weights here')\n",
     r"raised RuntimeError when imported \(no weights here\) at .*broken_plugin\.py:2; fix the module"),
    ("def f(:\n", r"raised SyntaxError when imported \(.*\) at .*broken_plugin\.py:1; fix the module")])
def test_a_runners_module_that_fails_is_named_with_where_and_read_again(body, said, tmp_path, monkeypatch):
    """A KPROF_RUNNERS module whose own code raised (not an ImportError) ended every verb, `kprof list` too, in a
    traceback; and in a Python session the next lookup went on without the module's tables ("unknown table")."""
    from kprof.runners import registry

    (tmp_path / "broken_plugin.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KPROF_RUNNERS", "broken_plugin")
    monkeypatch.setattr("kprof.runners.registry.REGISTRY", {})
    for _ in range(2):  # the second lookup fails as the first did
        with pytest.raises(UsageError, match=f"KPROF_RUNNERS module 'broken_plugin' {said}"):
            registry.lookup("single_gemm", "torch-cpu")


def test_an_unknown_table_says_how_a_table_of_ones_own_becomes_known(monkeypatch):
    """A table registered in a Python session without KPROF_RUNNERS (or a verb run without it) read only "unknown
    table 'my_softmax'" from the worker that measures it, where the caller had it registered: the message says that a
    table of one's own is known where KPROF_RUNNERS names its module, which is all a worker imports."""
    from kprof.runners import registry

    monkeypatch.delenv("KPROF_RUNNERS", raising=False)
    with pytest.raises(UsageError, match=r"unknown table 'my_softmax'; known tables: .*single_gemm \(see `kprof "
                                         r"list`\); a table of one's own runners is known where KPROF_RUNNERS "
                                         r"names the module that registers it \(a worker process imports only "
                                         r"those\)"):
        registry.lookup("my_softmax", "torch-cpu")


@pytest.mark.parametrize("name,raw", [("KPROF_TIMER", " NSYS "), ("KPROF_L2", "Hot"), ("KPROF_POWER", "MAX\t")])
def test_a_bad_method_variable_is_quoted_as_set(name, raw, monkeypatch):
    """The message quotes the value as the user set it, not as kprof folded it (' NSYS ' read as 'nsys')."""
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    monkeypatch.setenv(name, raw)
    with pytest.raises(UsageError, match=re.escape(f"{name}={raw!r} is not one of ") + r".*, or unset it$"):
        effective_entry(lookup("single_gemm", "torch"))


@pytest.mark.parametrize("name,raw,read", [("KPROF_POOL", " ", "auto"), ("KPROF_POOL", " On ", "on"),
                                           ("KPROF_POOL", "OFF", "off"), ("KPROF_CPU_WORKERS", " ", 1),
                                           ("KPROF_CPU_WORKERS", " 1\n", 1)])
def test_pool_settings_read_blank_and_spacing_as_the_others_do(name, raw, read, monkeypatch):
    """Blank is unset and surrounding spaces (and, for a word, case) do not matter, as for KPROF_TIMER and the
    seconds: KPROF_POOL=' ' and KPROF_CPU_WORKERS=' 1' were refused while KPROF_TIMER=' ' was the default."""
    from kprof.runners.devices import cpu_workers, pool_mode

    monkeypatch.setenv(name, raw)
    assert (pool_mode if name == "KPROF_POOL" else cpu_workers)() == read


_PLUGIN = """import msgspec
from kprof.runners.registry import lookup, register
register(msgspec.structs.replace(lookup("single_gemm", "torch-cpu"), table="late_gemm", runner="late_plugin:Runner"))
"""


@pytest.mark.parametrize("first", ["", "late_plugin, no_such_plugin"])
def test_a_runners_module_named_after_the_first_lookup_is_imported(first, tmp_path, monkeypatch):
    """A long-lived process (a notebook) that set KPROF_RUNNERS after its first lookup, or corrected it after a name
    in it failed to import: the variable was read once, so its module's tables stayed `unknown table` for the life of
    the process, though the variable named them."""
    from kprof.runners import registry

    (tmp_path / "late_plugin.py").write_text(_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_plugin", raising=False)  # (another case's)
    monkeypatch.setattr("kprof.runners.registry.REGISTRY", {})
    monkeypatch.setenv("KPROF_RUNNERS", first)
    try:
        registry.lookup("single_gemm", "torch-cpu")
    except UsageError as exc:
        assert "'no_such_plugin', which does not import" in str(exc)
    monkeypatch.setenv("KPROF_RUNNERS", "late_plugin")
    assert registry.lookup("late_gemm", "torch-cpu").runner == "late_plugin:Runner"
