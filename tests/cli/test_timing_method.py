"""The timing method of CUDA rows comes from --timer / --l2 / --cuda-graph / --power, else KPROF_TIMER / KPROF_L2 /
KPROF_CUDA_GRAPH / KPROF_POWER, and is part of the key; reading the rows of a GPU needs no GPU (only --gpu-name)."""

import json
import os

import pytest

from kprof import api
from kprof.api import effective_entry
from kprof.cli import main
from kprof.errors import UsageError
from kprof.ledger import Ledger
from kprof.runners.registry import lookup

H200 = "NVIDIA H200"


@pytest.fixture(autouse=True)
def _no_method_in_the_environment(monkeypatch):
    """Each test sets the variables it means: an inherited KPROF_TIMER would pick another key."""
    for name in ("KPROF_TIMER", "KPROF_L2", "KPROF_CUDA_GRAPH", "KPROF_POWER", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KPROF_POOL", "off")  # the worker is replaced in this process (tests/runners/test_pool.py: the pool)


@pytest.mark.parametrize("env, timing", [
    ({}, "cupti;l2=cold;eager"),
    ({"KPROF_TIMER": "events"}, "events;l2=cold;eager"),
    ({"KPROF_CUDA_GRAPH": "1"}, "cupti;l2=cold;graph"),
    ({"KPROF_L2": "warm", "KPROF_TIMER": "EVENTS"}, "events;l2=warm;eager"),
    ({"KPROF_POWER": "sustained"}, "cupti;l2=cold;eager"),
    ({"KPROF_POWER": " Loaded", "KPROF_CUDA_GRAPH": "1"}, "cupti;l2=cold;graph;power=loaded"),
])
def test_cuda_timing_method_from_the_environment(monkeypatch, env, timing):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert effective_entry(lookup("single_gemm", "torch")).contract.timing == timing
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert effective_entry(lookup("single_gemm", "torch-cpu")).contract.timing == "cpu-wall;l2=warm;eager;threads=3"


def test_cpu_rows_of_another_thread_count_are_not_this_ones(capsys, monkeypatch):
    """A torch-cpu row names the torch threads it was measured with in its key: a row measured on 1 thread is not
    the answer for 2 threads (it read `ok` there, with the 1-thread time), and the row records the count it ran."""
    from kprof.cli import main

    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.05")
    spec = ["--spec", json.dumps({"m": 8, "n": 8, "k": 8, "dtype": "fp32"})]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *spec, "--db", "t.db", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["provenance"]["timing"] == "cpu-wall;l2=warm;eager;threads=1"
    assert main(["show", row["citation"], "--db", "t.db", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["event"]["environment"]["clocks"]["threads"] == 1.0
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["query", "single_gemm", "--backend", "torch-cpu", *spec, "--db", "t.db", "--json"]) == 0
    assert [r["status"] for r in json.loads(capsys.readouterr().out)["results"]] == ["stale"]
    assert main(["audit", "--remeasure", "1", "--db", "t.db"]) == 0  # not re-measured on 2 threads
    assert "under the timing method asked for (torch-cpu: on 2 torch thread(s)" in capsys.readouterr().err
    monkeypatch.setenv("MKL_NUM_THREADS", "1")  # torch reads it over OMP_NUM_THREADS
    assert main(["query", "single_gemm", "--backend", "torch-cpu", *spec, "--db", "t.db", "--json"]) == 0
    assert [r["status"] for r in json.loads(capsys.readouterr().out)["results"]] == ["ok"]


def test_cpu_rows_are_timed_on_the_threads_their_key_names_and_the_callers_are_kept(monkeypatch):
    import torch

    from kprof.runners.worker import measure_specs
    from kprof.measure.stats import StopRule

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    entry = effective_entry(lookup("single_gemm", "torch-cpu"))
    had = torch.get_num_threads()
    from kprof.measure.cpu_timer import time_cpu as real

    seen = []
    monkeypatch.setattr("kprof.measure.cpu_timer.time_cpu", lambda fn, rule: (seen.append(torch.get_num_threads()),
                                                                              real(fn, rule))[1])
    torch.set_num_threads(2)
    try:
        out = list(measure_specs(entry, [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], "cpu",
                                 rule=StopRule(budget_s=0.01)))
        assert seen == [1] and torch.get_num_threads() == 2
        assert out[0].event.environment.clocks["threads"] == 1.0
    finally:
        torch.set_num_threads(had)


def test_cpu_threads_default_to_the_physical_cores_the_process_may_use(monkeypatch):
    """torch's default is one thread per physical core: two SMT siblings count once."""
    from kprof import method

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    method._cores_among.cache_clear()  # counted by affinity set: forget any count of this set
    monkeypatch.setattr(method, "_core_of", lambda cpu: {0: "0,2", 2: "0,2", 1: "1,3", 3: "1,3", 5: "5"}[cpu])
    assert method.cpu_threads() == 3
    monkeypatch.setattr(method, "_core_of", lambda cpu: None)  # topology not said: every CPU
    method._cores_among.cache_clear()  # the same set, another topology (a host's topology does not change)
    assert method.cpu_threads() == 5


def test_cpu_threads_count_the_cores_once_per_affinity(monkeypatch):
    """Every torch-cpu lookup asks for the thread count: the cores were counted again on each (~30 us a lookup on a
    128-CPU host); they are counted once per affinity set, and a changed affinity or variable is still seen."""
    from kprof import method

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    method._cores_among.cache_clear()
    asked, cpus = [], {0, 1, 2, 3}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    monkeypatch.setattr(method, "_core_of", lambda cpu: (asked.append(cpu), str(cpu % 2))[1])
    assert method.cpu_threads() == 2 and method.cpu_threads() == 2 and sorted(asked) == [0, 1, 2, 3]
    cpus -= {1, 3}  # the process moved to one core's two siblings
    assert method.cpu_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert method.cpu_threads() == 7


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_bad_thread_count_names_itself(capsys, monkeypatch, value):
    from kprof.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    spec = ["--spec", json.dumps({"m": 8, "n": 8, "k": 8, "dtype": "fp32"})]
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *spec, "--db", "t.db"]) == 2
    assert f"OMP_NUM_THREADS={value!r} is not a number of threads" in capsys.readouterr().err
    assert not os.path.exists("t.db")


def test_openmps_nested_thread_count_takes_its_first_level(monkeypatch):
    """OMP_NUM_THREADS="4,2" (OpenMP's nested form, whose first level torch takes) was refused, and with it every
    verb that resolves a torch-cpu entry (audit --remeasure on a GPU machine too)."""
    from kprof.method import cpu_threads

    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    assert cpu_threads() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "4,x")
    with pytest.raises(UsageError, match="OMP_NUM_THREADS='4,x' is not a number of threads"):
        cpu_threads()


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
    import kprof.runners.cuda_device as cuda_device

    def refuse(entry, gpu_key, environment=None):
        raise UsageError("CUPTI is not usable here (ImportError: no cupti); set KPROF_TIMER=events")

    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [H200])
    monkeypatch.setattr(cuda_device, "CudaDevice", refuse)
    monkeypatch.setenv("KPROF_SKIP_ENV_CHECK", "1")  # this machine's torch has no CUDA: the device's own refusal
    spec = {"tokens": 4, "hidden": 64, "dtype": "bf16"}
    assert main(["run", "rms_norm", "--backend", "torch", *h.spec_args(spec), "--db", "p.db"]) == 2
    assert "CUPTI is not usable here" in capsys.readouterr().err
    assert not (tmp_path / "p.db").exists()


# --- explicit method flags -------------------------------------------------------------------------------

NORM = {"tokens": 4, "hidden": 64, "dtype": "bf16"}
SELECTORS = {"cupti;l2=cold;eager": [], "events;l2=cold;eager": ["--timer", "events"],
             "cupti;l2=warm;eager": ["--l2", "warm"], "cupti;l2=cold;graph": ["--cuda-graph"],
             "cupti;l2=cold;eager;power=loaded": ["--power", "loaded"]}


def _event_under(spec, gpu, table="rms_norm", backend="torch", time_ms=0.5, **method):
    """A measured row keyed under the timing method that the explicit arguments select."""
    from kprof.ledger import KeyMaker, ShapeCodec
    from kprof.ledger.build import measured
    from kprof.ledger.events import Method, Stats
    from kprof.runners.catalog import parse_timing

    entry = effective_entry(lookup(table, backend), **method)  # the power state is in the key (the contract)
    prov = KeyMaker(table, backend, gpu, entry.contract, ShapeCodec(entry.args)).provenance(spec)
    timer, l2, graph = parse_timing(entry.contract.timing)
    stats = Stats(n=5, median=time_ms, p10=time_ms, p90=time_ms, mean=time_ms, stdev=0.0, cv=0.0, min=time_ms,
                  max=time_ms, samples=[time_ms] * 5)
    metrics = {"time_ms": time_ms, "tflops": 1.0, "memory_bandwidth_gbps": 2.0, "energy_j": None}
    return measured(prov, metrics, stats, Method(timer=timer, l2=l2, graph=graph))


def _read(capsys, h, verb, *flags, table="rms_norm", spec=NORM, backend="torch"):
    rc = main([verb, table, "--backend", backend, *h.spec_args(spec), "--gpu-name", H200, "--db", "p.db",
               "--json", *flags])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


@pytest.mark.parametrize("kwargs, timing", [  # the environment alone: events;l2=cold;graph
    ({"timer": "cupti", "l2": "warm", "cuda_graph": False}, "cupti;l2=warm;eager"),
    ({"timer": " CUPTI "}, "cupti;l2=cold;graph"),
    ({"l2": "warm"}, "events;l2=warm;graph"),
    ({"cuda_graph": False}, "events;l2=cold;eager"),
    ({"timer": "cupti", "cuda_graph": False}, "cupti;l2=cold;eager"),
])
def test_explicit_arguments_beat_the_environment_one_setting_at_a_time(monkeypatch, kwargs, timing):
    monkeypatch.setenv("KPROF_TIMER", "events")
    monkeypatch.setenv("KPROF_L2", "cold")
    monkeypatch.setenv("KPROF_CUDA_GRAPH", "1")
    assert effective_entry(lookup("rms_norm", "torch"), **kwargs).contract.timing == timing


@pytest.mark.parametrize("written", list(SELECTORS))
def test_a_row_written_under_one_method_is_missing_under_every_other(h, capsys, written):
    from kprof.runners.catalog import parse_timing, timing_power

    timer, l2, graph = parse_timing(written)
    h.append("p.db", _event_under(NORM, H200, timer=timer, l2=l2, cuda_graph=graph, power=timing_power(written)))
    for timing, flags in SELECTORS.items():
        missing = _read(capsys, h, "count-missing", *flags)["missing_count"]
        doc = _read(capsys, h, "query", *flags)
        row = doc["results"][0]
        if timing == written:
            assert (missing, row["status"], row["provenance"]["timing"]) == (0, "ok", written)
        else:  # only a row of another method exists: not this method's row (stale counts as missing)
            assert (missing, doc["missing_count"]) == (1, 1) and row["status"] in ("missing", "stale"), timing


def test_query_keys_differ_by_method(h, capsys):
    Ledger.open("p.db").close()  # an empty ledger: the keys of rows it does not hold
    keys = {timing: _read(capsys, h, "query", *flags)["results"][0]["key"] for timing, flags in SELECTORS.items()}
    assert len(set(keys.values())) == len(SELECTORS)


@pytest.mark.parametrize("written", ["sustained", "loaded"])
def test_a_row_of_one_power_state_is_missing_under_the_other(h, capsys, monkeypatch, written):
    """A row timed after heavy GEMMs (loaded, as in a prefill) is not the row of the kernel back to back
    (sustained, the default, as in decode), and the reverse; --power beats $KPROF_POWER either way."""
    h.append("p.db", _event_under(NORM, H200, power=written))
    other = {"sustained": "loaded", "loaded": "sustained"}[written]
    default = [] if written == "sustained" else ["--power", "loaded"]  # what reads the row with no variable set
    assert _read(capsys, h, "count-missing", *default)["missing_count"] == 0
    for flags in (["--power", written], ["--power", written.upper()]):
        row = _read(capsys, h, "query", *flags)["results"][0]
        assert (row["status"], row["provenance"]["timing"]) == ("ok", _TIMING[written])
    assert _read(capsys, h, "count-missing", "--power", other)["missing_count"] == 1
    assert _read(capsys, h, "query", "--power", other)["results"][0]["status"] in ("missing", "stale")
    monkeypatch.setenv("KPROF_POWER", other)  # the variable picks the other state ...
    assert _read(capsys, h, "count-missing")["missing_count"] == 1
    assert _read(capsys, h, "count-missing", "--power", written)["missing_count"] == 0  # ... the flag beats it
    monkeypatch.setenv("KPROF_POWER", written)
    assert _read(capsys, h, "count-missing")["missing_count"] == 0
    assert _read(capsys, h, "count-missing", "--power", other)["missing_count"] == 1


_TIMING = {"sustained": "cupti;l2=cold;eager", "loaded": "cupti;l2=cold;eager;power=loaded"}


@pytest.mark.parametrize("kwargs, timing", [  # the environment alone: cupti;l2=cold;eager;power=loaded
    ({}, "cupti;l2=cold;eager;power=loaded"),
    ({"power": "sustained"}, "cupti;l2=cold;eager"),
    ({"power": " SUSTAINED "}, "cupti;l2=cold;eager"),
    ({"power": "loaded", "timer": "events"}, "events;l2=cold;eager;power=loaded"),
])
def test_the_power_argument_beats_the_environment(monkeypatch, kwargs, timing):
    monkeypatch.setenv("KPROF_POWER", "loaded")
    assert effective_entry(lookup("rms_norm", "torch"), **kwargs).contract.timing == timing
    monkeypatch.setenv("KPROF_POWER", "idle")  # a value no backend takes is named, even under an explicit state
    with pytest.raises(UsageError, match="KPROF_POWER='idle' is not one of sustained, loaded"):
        effective_entry(lookup("rms_norm", "torch"), **kwargs)


def test_a_flag_beats_the_environment(h, capsys, monkeypatch):
    h.append("p.db", _event_under(NORM, H200))  # the default method: cupti, cold, eager
    monkeypatch.setenv("KPROF_TIMER", "events")
    monkeypatch.setenv("KPROF_CUDA_GRAPH", "1")
    assert _read(capsys, h, "count-missing")["missing_count"] == 1  # the environment picks events + graph
    assert _read(capsys, h, "count-missing", "--timer", "cupti")["missing_count"] == 1  # graph still from env
    assert _read(capsys, h, "count-missing", "--timer", "cupti", "--no-cuda-graph")["missing_count"] == 0
    monkeypatch.setenv("KPROF_L2", "warm")  # a valid value is overridden by its flag
    explicit = ["--timer", "cupti", "--no-cuda-graph", "--l2", "cold"]
    assert _read(capsys, h, "count-missing", *explicit)["missing_count"] == 0
    assert _read(capsys, h, "query", *explicit)["missing_count"] == 0  # the ceilings are read the same way
    # a value no backend takes is named even under its flag, as on the CPU: the next command without it would fail
    monkeypatch.setenv("KPROF_L2", "lukewarm")
    for flags in (explicit, ["--timer", "cupti", "--no-cuda-graph"]):
        assert main(["count-missing", "rms_norm", "--backend", "torch", *h.spec_args(NORM), "--gpu-name", H200,
                     *flags, "--db", "p.db"]) == 2
        assert "KPROF_L2='lukewarm' is not one of cold, warm" in capsys.readouterr().err


def test_the_api_passes_the_method_through(h):
    from kprof import api

    h.append("p.db", _event_under(NORM, H200, timer="events"))
    assert api.count_missing("rms_norm", "torch", [NORM], gpu_name=H200, db="p.db").missing_count == 1
    assert api.count_missing("rms_norm", "torch", [NORM], gpu_name=H200, db="p.db", timer="events").missing_count == 0
    row = api.query("rms_norm", "torch", [NORM], gpu_name=H200, db="p.db", timer="events").results[0]
    assert row["status"] == "ok" and row["provenance"]["timing"] == "events;l2=cold;eager"
    with pytest.raises(UsageError, match="^cuda_graph='0' is not a bool; pass cuda_graph=True or cuda_graph=False"):
        api.query("rms_norm", "torch", [NORM], gpu_name=H200, db="p.db", cuda_graph="0")
    h.append("p.db", _event_under(NORM, H200, power="loaded"))
    assert api.count_missing("rms_norm", "torch", [NORM], gpu_name=H200, db="p.db", power="loaded").missing_count == 0
    row = api.query("rms_norm", "torch", [NORM], gpu_name=H200, db="p.db", power="loaded").results[0]
    assert row["status"] == "ok" and row["provenance"]["timing"] == "cupti;l2=cold;eager;power=loaded"
    with pytest.raises(UsageError, match="^power='prefill' is not one of sustained, loaded; e.g. power='sustained'"):
        api.count_missing("rms_norm", "torch", [NORM], gpu_name=H200, db="p.db", power="prefill")


def test_one_mistake_is_said_in_flags_to_the_verbs_and_in_keywords_to_python(tmp_path, monkeypatch, capsys, h):
    """The verbs and the Python API share the method checks; each caller reads the names it typed."""
    monkeypatch.chdir(tmp_path)
    h.append("p.db", _event_under(NORM, H200))
    for typed, python, cli in (
            (dict(timer="nsys"), "timer='nsys' is not one of cupti, events; e.g. timer='cupti'",
             "--timer 'nsys' is not one of cupti, events; e.g. --timer cupti"),
            (dict(cuda_graph="yes"), "cuda_graph='yes' is not a bool; pass cuda_graph=True or cuda_graph=False",
             None),
            (dict(gpu_name=" "), "gpu_name is empty; pass the GPU key, e.g. gpu_name='NVIDIA H200'",
             "--gpu-name is empty; pass the GPU key, e.g. --gpu-name 'NVIDIA H200'")):
        args = {"gpu_name": H200, **typed}
        with pytest.raises(UsageError) as caught:
            api.count_missing("rms_norm", "torch", [NORM], db="p.db", **args)
        assert str(caught.value).startswith(python) and "--" not in str(caught.value)
        if cli is None:  # a switch on the command line: no value to mistype
            continue
        flag, value = next(iter(typed.items()))
        argv = ["count-missing", "rms_norm", "--backend", "torch", *h.spec_args(NORM), "--db", "p.db",
                "--gpu-name", H200] + ([f"--{flag.replace('_', '-')}", value] if flag != "gpu_name" else [])
        if flag == "gpu_name":
            argv[argv.index("--gpu-name") + 1] = value
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert cli in err and "=" not in err.split(";")[0], err


BAD = [(["--timer", "nsys"], "--timer 'nsys' is not one of cupti, events; e.g. --timer cupti"),
       (["--l2", "hot"], "--l2 'hot' is not one of cold, warm; e.g. --l2 cold"),
       (["--power", "prefill"], "--power 'prefill' is not one of sustained, loaded; e.g. --power sustained")]


@pytest.mark.parametrize("flags, message", BAD)
@pytest.mark.parametrize("verb", ["run", "query", "count-missing", "calibrate"])
def test_a_bad_flag_value_is_named_and_nothing_is_written(h, capsys, monkeypatch, tmp_path, verb, flags, message):
    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [H200])
    table = [] if verb == "calibrate" else ["rms_norm", *h.spec_args(NORM)]
    assert main([verb, *table, "--backend", "torch", "--db", "p.db", *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "$KPROF_" in captured.err
    assert captured.out == ""
    assert not (tmp_path / "p.db").exists()


@pytest.mark.parametrize("flags, message", BAD)
def test_a_bad_flag_value_refuses_remeasure(h, capsys, flags, message):
    h.append("p.db", _event_under(NORM, H200))
    before = h.digest("p.db")
    assert main(["audit", "--remeasure", "1", "--db", "p.db", *flags]) == 2
    assert message in capsys.readouterr().err
    assert h.digest("p.db") == before


@pytest.mark.parametrize("flags, shown", [
    (["--timer", "events"], "--timer events"), (["--timer", "cupti"], "--timer cupti"),
    (["--l2", "cold"], "--l2 cold"), (["--cuda-graph"], "--cuda-graph"),
    (["--power", "loaded"], "--power loaded"), (["--power", "LOADED", "--l2", "warm"], "--power loaded"),
    # a value no backend takes gets the CPU's reason too (suggesting a CUDA value would only be refused next), but
    # is not said to apply to CUDA backends: it applies to none
    (["--timer", "cpu-wall"], "--timer cpu-wall is not one of cupti, events on any backend"),
    (["--l2", "bogus"], "--l2 bogus is not one of cold, warm on any backend"),
    (["--power", "hot"], "--power hot is not one of sustained, loaded on any backend"),
    # an empty or blank value (`--timer=`, or blank) is named as such, not as a flag with nothing after it
    (["--timer="], "--timer '' is not one of cupti, events on any backend"),
    (["--timer", ""], "--timer '' is not one of cupti, events on any backend"),
    (["--l2", " "], "--l2 '' is not one of cold, warm on any backend"),
    (["--power", ""], "--power '' is not one of sustained, loaded on any backend"),
])
@pytest.mark.parametrize("verb", ["run", "query", "count-missing", "calibrate"])
def test_a_cpu_backend_refuses_a_cuda_method(h, capsys, tmp_path, verb, flags, shown):
    table = [] if verb == "calibrate" else [h.GEMM, *h.spec_args(h.gemm())]
    assert main([verb, *table, "--backend", h.CPU, "--db", "p.db", *flags]) == 2
    err = capsys.readouterr().err
    said = shown if " on any backend" in shown else f"{shown} applies to CUDA backends"
    assert f"{said}; torch-cpu is timed by wall clock (cpu-wall" in err
    assert not (tmp_path / "p.db").exists()


def test_a_cpu_backend_accepts_its_own_method_and_ignores_the_environment(h, capsys, monkeypatch, local_gpu):
    h.append("p.db", h.make_event(h.gemm(), local_gpu))
    monkeypatch.setenv("KPROF_TIMER", "events")  # a CUDA method: not applied to a CPU entry
    monkeypatch.setenv("KPROF_POWER", "loaded")  # nor this: a CPU row has one power state
    for flags in ([], ["--l2", "warm"], ["--no-cuda-graph"], ["--l2", "WARM", "--no-cuda-graph"],
                  ["--power", "sustained"], ["--power", "Sustained", "--l2", "warm"]):
        doc = h.read_json(capsys, "query", "p.db", h.gemm(), extra=flags)
        assert doc["missing_count"] == 0, flags


@pytest.mark.parametrize("name, value", [("KPROF_TIMER", "nsys"), ("KPROF_L2", "hot"), ("KPROF_CUDA_GRAPH", "2"),
                                         ("KPROF_POWER", "max")])
def test_a_method_setting_wrong_on_every_backend_is_refused_on_the_cpu_too(h, capsys, monkeypatch, local_gpu, name,
                                                                          value, refused):
    """Not applied to a CPU entry, but a typo there would surface only on the next GPU run: named at once."""
    h.append("p.db", h.make_event(h.gemm(), local_gpu))
    monkeypatch.setenv(name, value)
    for verb in ("query", "count-missing", "run"):
        refused([verb, h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm()), "--db", "p.db"], f"{name}={value!r} is "
                f"not one of")


@pytest.mark.parametrize("backend, spec, gpu", [("torch-cpu", {"dtype": "fp32"}, []),
                                               ("torch", {"dtype": "bf16"}, ["--gpu-name", "NVIDIA H200"])])
def test_a_wrong_method_setting_is_refused_even_where_a_flag_overrides_it(h, capsys, monkeypatch, refused, backend,
                                                                          spec, gpu):
    """The same on every backend: a flag does not hide a typo in the environment that the next command would hit."""
    monkeypatch.setenv("KPROF_L2", "bogus")
    refused(["count-missing", h.GEMM, "--backend", backend, *h.spec_args(h.gemm(**spec)), "--db", "p.db", "--l2",
             "warm", *gpu], "KPROF_L2='bogus' is not one of cold, warm")


@pytest.mark.parametrize("flags, named", [(["--timer", "events"], "--timer"), (["--l2", "warm"], "--l2"),
                                          (["--cuda-graph"], "--cuda-graph"), (["--no-cuda-graph"], "--no-cuda-graph"),
                                          (["--power", "loaded"], "--power"), (["--power", "sustained"], "--power")])
def test_audit_refuses_a_method_flag_without_remeasure(h, capsys, flags, named):
    h.append("p.db", _event_under(NORM, H200))
    assert main(["audit", "--db", "p.db", "--json", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{named} applies to `kprof audit --remeasure N` only" in captured.err
    assert main(["audit", "--db", "p.db", "--json"]) == 0  # the same ledger audits clean without the flag


def test_remeasure_with_a_cuda_method_needs_a_gpu(h, capsys, monkeypatch, local_gpu):
    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [])
    h.append("p.db", h.make_event(h.gemm(), local_gpu))
    assert main(["audit", "--remeasure", "1", "--db", "p.db", "--no-cuda-graph", "--timer", "events"]) == 2
    assert "--timer events --no-cuda-graph re-measures CUDA rows and no CUDA GPU is visible" in capsys.readouterr().err


def test_remeasure_measures_the_cuda_rows_of_the_method_given(h, capsys, monkeypatch, local_gpu):
    """The flag picks the rows (CPU rows and rows of other methods are left out) and the method they are
    measured with: the entry handed to the worker carries it."""
    import kprof.runners.worker as worker
    from kprof.runners.worker import Outcome

    seen = []

    def fake_measure(entry, specs, gpu_key, **kw):
        seen.append((entry.backend, entry.contract.timing, gpu_key))
        for i, spec in enumerate(specs):
            yield Outcome(i, _event_under(spec, gpu_key, time_ms=0.5, timer="events"), 0.0, 0.0)

    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [H200])
    monkeypatch.setattr(worker, "measure_specs", fake_measure)
    h.append("p.db", h.make_event(h.gemm(), local_gpu), _event_under(NORM, H200),
             _event_under(NORM, H200, timer="events"))
    assert main(["audit", "--remeasure", "5", "--db", "p.db", "--json", "--timer", "events"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["candidates"], doc["checked"], doc["drifted"], doc["gpu_keys"]) == (1, 1, 0, [H200])
    assert seen == [("torch", "events;l2=cold;eager", H200)]


def test_a_query_reads_the_ceilings_of_its_own_method(h, capsys):
    """`query --json` cites the ceilings measured under the same timing method as the rows it reports."""
    from kprof.calibrate import CEILING_SPECS

    gemm = {"m": 64, "n": 64, "k": 64, "dtype": "bf16"}
    events = [_event_under(gemm, H200, table="single_gemm", timer="events")]
    events += [_event_under(spec, H200, table=table, timer="events") for table, spec, _m in CEILING_SPECS["cuda"]]
    h.append("p.db", *events)
    row = _read(capsys, h, "query", "--timer", "events", table="single_gemm", spec=gemm)["results"][0]
    assert row["status"] == "ok" and set(row["ceiling"]["citations"]) == {"tflops", "memory_bandwidth_gbps"}
    assert row["ceiling"]["fraction"]["tflops"] == 1.0


def test_run_stores_its_rows_under_the_method_given(h, capsys, monkeypatch):
    """`run --timer events --l2 warm` hands the worker an entry of that method, and its row lands under that key
    (the worker is replaced: this machine has no GPU; the GPU path is tests/runners/test_gpu_run.py)."""
    import kprof.runners.worker as worker
    from kprof.runners.worker import Outcome

    seen = []

    def fake_measure(entry, specs, gpu_key, **kw):
        seen.append(entry.contract.timing)
        timer, l2, _mode = entry.contract.timing.split(";")
        for i, spec in enumerate(specs):
            yield Outcome(i, _event_under(spec, gpu_key, timer=timer, l2=l2.removeprefix("l2=")), 0.0, 0.0)

    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [H200])
    monkeypatch.setattr(worker, "prepare_device", lambda entry, gpu_key, environment=None: None)
    monkeypatch.setattr(worker, "measure_specs", fake_measure)
    monkeypatch.setenv("KPROF_L2", "cold")  # the flag beats it
    doc = _read(capsys, h, "run", "--timer", "events", "--l2", "warm")
    assert (doc["missing_count"], doc["results"][0]["provenance"]["timing"]) == (0, "events;l2=warm;eager")
    assert seen == ["events;l2=warm;eager"]
    assert _read(capsys, h, "count-missing", "--timer", "events", "--l2", "warm")["missing_count"] == 0
    assert _read(capsys, h, "count-missing", "--timer", "events")["missing_count"] == 1


def _fake_worker(monkeypatch, seen: list):
    """A CUDA device and a worker that store each spec's row under the timing of the entry handed to them."""
    import kprof.runners.worker as worker
    from kprof.runners.catalog import parse_timing, timing_power
    from kprof.runners.worker import Outcome

    def fake_measure(entry, specs, gpu_key, **kw):
        seen.append((entry.table, entry.contract.timing))
        timer, l2, graph = parse_timing(entry.contract.timing)
        method = dict(timer=timer, l2=l2, cuda_graph=graph, power=timing_power(entry.contract.timing))
        for i, spec in enumerate(specs):
            yield Outcome(i, _event_under(spec, gpu_key, table=entry.table, **method), 0.0, 0.0)

    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [H200])
    monkeypatch.setattr(worker, "prepare_device", lambda entry, gpu_key, environment=None: None)
    monkeypatch.setattr(worker, "measure_specs", fake_measure)


def test_run_and_calibrate_store_their_rows_under_the_power_state_given(h, capsys, monkeypatch):
    """`run --power loaded` hands the worker a loaded entry (it runs heavy GEMMs before each sweep) and its row
    lands under the loaded key, beside, not over, the sustained row of the same spec; calibrate likewise."""
    seen: list = []
    _fake_worker(monkeypatch, seen)
    monkeypatch.setenv("KPROF_POWER", "sustained")  # the flag beats it
    doc = _read(capsys, h, "run", "--power", "loaded")
    assert (doc["missing_count"], doc["results"][0]["provenance"]["timing"]) == (0, _TIMING["loaded"])
    assert seen == [("rms_norm", _TIMING["loaded"])]
    assert _read(capsys, h, "count-missing")["missing_count"] == 1  # the sustained row is still to be measured
    assert _read(capsys, h, "run")["results"][0]["provenance"]["timing"] == _TIMING["sustained"]
    assert seen[-1] == ("rms_norm", _TIMING["sustained"])
    keys = {p: _read(capsys, h, "query", "--power", p)["results"][0]["key"] for p in ("loaded", "sustained")}
    assert keys["loaded"] != keys["sustained"]

    seen.clear()
    rc = main(["calibrate", "--backend", "torch", "--db", "c.db", "--power", "loaded", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and seen and {timing for _table, timing in seen} == {_TIMING["loaded"]}
    assert {c["metric"] for c in out["ceilings"]} == {"tflops", "memory_bandwidth_gbps"}
    assert {r["provenance"]["timing"] for r in out["rows"]} == {_TIMING["loaded"]}


def test_remeasure_measures_the_rows_of_the_power_state_given(h, capsys, monkeypatch, local_gpu):
    """`audit --remeasure --power loaded` re-measures only loaded rows, and loaded: the worker heats the GPU."""
    seen: list = []
    _fake_worker(monkeypatch, seen)
    h.append("p.db", h.make_event(h.gemm(), local_gpu), _event_under(NORM, H200),
             _event_under(NORM, H200, power="loaded"), _event_under(NORM, H200, timer="events", power="loaded"))
    assert main(["audit", "--remeasure", "5", "--db", "p.db", "--json", "--power", "loaded"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["candidates"], doc["checked"], doc["drifted"], doc["gpu_keys"]) == (1, 1, 0, [H200])
    assert seen == [("rms_norm", _TIMING["loaded"])]
    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [])
    assert main(["audit", "--remeasure", "1", "--db", "p.db", "--power", "loaded"]) == 2
    assert "--power loaded re-measures CUDA rows and no CUDA GPU is visible" in capsys.readouterr().err


def test_a_setting_error_keeps_both_wordings_across_processes():
    import pickle

    from kprof.errors import SettingError

    exc = pickle.loads(pickle.dumps(SettingError("timer='x' is bad", cli="--timer 'x' is bad")))
    assert (type(exc), str(exc), exc.cli, exc.exit_code) == (SettingError, "timer='x' is bad", "--timer 'x' is bad", 2)
    assert SettingError("only one").cli == "only one"


def test_calibrate_reads_back_the_ceilings_of_the_method_given_when_every_row_errored(h, monkeypatch):
    """The ceilings were read under the timing found on the first row with a provenance: where every row errored
    (no idle GPU, say) none had one, and `calibrate --timer events` reported the cupti ceilings as its own."""
    from kprof import calibrate as cal
    from kprof.api import QueryResult

    h.append("p.db", *[_event_under(x, H200, table=t) for s in cal.CEILING_SETS["cuda"] for t, x in s.members])
    assert {c.metric for c in cal.ceilings("torch", H200, db="p.db")} == {"tflops", "memory_bandwidth_gbps"}

    def all_errored(table, backend, specs, **kw):
        docs = [{"spec": s, "status": "error", "error": {"kind": "crash", "message": "need 1 idle GPU(s), found 0"},
                 "provenance": None} for s in specs]
        return QueryResult(table, backend, H200, "p.db", "jit", len(docs), len(docs), "", docs)

    monkeypatch.setattr("kprof.measure.device_name.visible_gpus", lambda *a, **k: [H200])
    monkeypatch.setattr(api, "run", all_errored)
    results, found = cal.calibrate("torch", db="p.db", timer="events")
    assert found == [] and not cal.complete("torch", results, found)
    _results, found = cal.calibrate("torch", db="p.db")  # the default method's ceilings are still read back
    assert {c.metric for c in found} == {"tflops", "memory_bandwidth_gbps"}


def test_cpu_threads_read_the_cpu_topology_once(monkeypatch):
    """Every torch-cpu lookup (perf_api's get_<table>, each call) asks for the thread count: the topology was read again
    each time, a file per logical CPU (on a 128-CPU host, 128 opens a lookup)."""
    from kprof import method

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    getattr(method._core_of, "cache_clear", lambda: None)()  # read afresh here
    method._cores_among.cache_clear()
    opened = []
    monkeypatch.setattr(method, "open", lambda *a, **kw: (opened.append(a[0]), open(*a, **kw))[1], raising=False)
    first = method.cpu_threads()
    assert method.cpu_threads() == first and len(opened) == len(os.sched_getaffinity(0))


AR = {"message_size_bytes": 1024, "dtype": "bf16", "world_size": 2}


@pytest.mark.parametrize("verb", ["query", "count-missing"])
def test_a_collective_refuses_a_graph_or_loaded_method_as_its_run_does(h, capsys, monkeypatch, verb):
    """A collective on GPUs is timed eagerly and sustained only (its run refuses a graph or the loaded power state,
    exit 2), while `query`/`count-missing --cuda-graph` read it under a method no run can store and answered
    `missing`, exit 0, as the Python API did: each refuses it now, naming the flag, or the variable that set it."""
    h.append("p.db", _event_under(AR, H200, table="all_reduce", backend="nccl"))
    read = [verb, "all_reduce", "--backend", "nccl", *h.spec_args(AR), "--db", "p.db", "--gpu-name", H200, "--json"]
    for flags, said in ((["--cuda-graph"], "--cuda-graph does not apply: all_reduce/nccl times each collective "
                                           "eagerly"), (["--power", "loaded"], "--power loaded does not apply")):
        assert main([*read, *flags]) == 2
        captured = capsys.readouterr()
        assert said in captured.err and captured.out == ""
    monkeypatch.setenv("KPROF_CUDA_GRAPH", "1")
    assert main(read) == 2
    assert "KPROF_CUDA_GRAPH=1 does not apply" in capsys.readouterr().err
    assert main([*read, "--no-cuda-graph", "--timer", "events"]) == 0  # a flag that applies beats the variable
    assert json.loads(capsys.readouterr().out)["missing_count"] == 1
    monkeypatch.delenv("KPROF_CUDA_GRAPH")
    assert main(read) == 0 and json.loads(capsys.readouterr().out)["missing_count"] == 0
    with pytest.raises(UsageError, match="cuda_graph=True does not apply"):
        api.query("all_reduce", "nccl", [AR], gpu_name=H200, db="p.db", cuda_graph=True)


def test_remeasure_with_a_graph_draws_no_collective_and_still_measures(h, capsys, monkeypatch, local_gpu):
    """`audit --remeasure --cuda-graph` (or under KPROF_CUDA_GRAPH=1) leaves the collectives out, none of whose rows
    can be graph-timed, and re-measures the rows of that method."""
    seen: list = []
    _fake_worker(monkeypatch, seen)
    h.append("p.db", _event_under(NORM, H200, cuda_graph=True), _event_under(AR, H200, table="all_reduce",
                                                                             backend="nccl"))
    assert main(["audit", "--remeasure", "5", "--db", "p.db", "--json", "--cuda-graph"]) == 0
    assert json.loads(capsys.readouterr().out)["candidates"] == 1
    monkeypatch.setenv("KPROF_CUDA_GRAPH", "1")
    assert main(["audit", "--remeasure", "5", "--db", "p.db", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["candidates"] == 1
