"""Collectives through their CPU twin, gloo: `kprof run <collective> --backend gloo` end to end at world sizes 2, 4
and 8 (ranks as real processes, results checked by each rank's oracle, bandwidths as nccl-tests defines them), the
rows queryable, the entries listed, bad specs refused, a rank that dies failing only its spec, and the busbw plot.

The rank group of a world size is kept across specs and runs of one process (kprof.runners._ranks), so the tests
go by world size: 2 (the dead rank first, then the four tables), 4, then 8. A group of 8 gloo ranks costs 8 torch
imports: the slowest part of this file.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import msgspec
import pytest

from kprof import artifacts
from kprof.cli import main
from kprof.runners import _ranks, comm
from kprof.runners._case import WrongResult
from kprof.runners.registry import entries, lookup

TABLES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}
SMALL, LARGE = 1024, 4 << 20  # multiples of 8 ranks x 4 bytes


def _specs(n: int) -> list[dict]:
    return [{"message_size_bytes": SMALL, "dtype": "bf16", "world_size": n},
            {"message_size_bytes": LARGE, "dtype": "fp32", "world_size": n}]


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """One ledger for the module: the snapshot test reads back the rows of every world size."""
    return str(tmp_path_factory.mktemp("comm") / "profile.db")


@pytest.fixture(scope="module", autouse=True)
def _stop_ranks():
    yield
    _ranks.shutdown()


def _run(capsys, table: str, specs: list[dict], db: str, tmp_path, *extra, rc: int = 0) -> dict:
    path = tmp_path / f"{table}-specs.json"
    path.write_text(json.dumps({"specs": specs}))
    code = main(["run", table, "--backend", "gloo", "--specs", str(path), "--db", db, "--json", *extra])
    out = capsys.readouterr().out
    assert code == rc, out
    return json.loads(out)


# ---- the registry ------------------------------------------------------------------------------------------------

def test_kprof_list_shows_the_collectives(capsys):
    assert main(["list", "--json"]) == 0
    docs = {(d["table"], d["backend"]): d for d in json.loads(capsys.readouterr().out)["entries"]}
    for table in TABLES:
        for backend, device, gpus, env in (("nccl", "cuda", "world_size", "cuda_env"), ("gloo", "cpu", 1, "default_env")):
            d = docs[(table, backend)]
            assert (d["metric_family"], d["device"], d["gpus"], d["subprocess_env"]) == ("comm", device, gpus, env)
            assert d["args"] == ["message_size_bytes", "dtype", "world_size"]
            assert "nccl-tests" in d["contract"]["layout"]
            assert d["contract"]["profiler_revision"] == (2 if table == "all_to_all" else 1)
    assert main(["list"]) == 0
    assert "all_to_all" in capsys.readouterr().out
    assert {e.table for e in entries() if e.metric_family == "comm"} == set(TABLES)


@pytest.mark.parametrize("table", TABLES)
def test_a_collectives_algorithm_names_the_function_its_ranks_call(table):
    """all_to_all said torch.distributed.all_to_all, a list-of-tensors call its ranks never made (they call
    all_to_all_single), on gloo and on nccl alike: revision 2 of that table names the call; the other tables keep
    the names, and revision 1, of their first release."""
    import torch

    spec = msgspec.convert({"message_size_bytes": SMALL, "dtype": "fp32", "world_size": 2},
                           comm.COLLECTIVES[table].args)
    used = comm.rank_buffers(table, spec, 0, torch.device("cpu")).used.removeprefix("torch.distributed.")
    for backend in ("gloo", "nccl"):
        contract = lookup(table, backend).contract
        assert used in re.findall(r"\w+", contract.algorithm)
        assert contract.profiler_revision == (2 if table == "all_to_all" else 1)


@pytest.mark.parametrize("table, spec, field", [
    ("all_reduce", {"message_size_bytes": 1023, "dtype": "bf16", "world_size": 2}, "message_size_bytes"),
    ("all_gather", {"message_size_bytes": 1000, "dtype": "fp32", "world_size": 8}, "message_size_bytes"),
    ("all_to_all", {"message_size_bytes": 1024, "dtype": "fp32", "world_size": 0}, "world_size"),
    ("reduce_scatter", {"message_size_bytes": 0, "dtype": "fp32", "world_size": 2}, "message_size_bytes"),
    ("all_reduce", {"message_size_bytes": 1024, "dtype": "int8", "world_size": 2}, "dtype"),
    ("all_reduce", {"message_size_bytes": 1024, "dtype": "fp32", "world_size": 2, "ranks": 2}, "ranks"),
])
def test_bad_specs_are_refused_naming_the_field(table, spec, field, tmp_path, capsys):
    db = str(tmp_path / "p.db")
    code = main(["run", table, "--backend", "gloo", "--spec", json.dumps(spec), "--db", db])
    err = capsys.readouterr().err
    assert code == 2 and f'"{field}"' in err and "spec 0" in err, err
    assert not os.path.exists(db)  # nothing written


def test_a_cuda_method_asked_of_gloo_is_refused_saying_how_gloo_times(tmp_path, capsys):
    """The refusal said gloo times "eager calls back to back", as a CPU kernel is timed; a gloo rank times one op after
    a barrier across the ranks, its input rewritten before it."""
    spec = json.dumps({"message_size_bytes": SMALL, "dtype": "fp32", "world_size": 2})
    assert main(["run", "all_reduce", "--backend", "gloo", "--spec", spec, "--db", str(tmp_path / "p.db"),
                 "--l2", "cold"]) == 2
    err = capsys.readouterr().err
    assert "gloo is timed by wall clock (cpu-wall, L2 warm, eager calls, each op after a barrier across the ranks)" \
        in err and "back to back" not in err, err
    assert not (tmp_path / "p.db").exists()


def test_split_collectives_need_whole_parts_per_rank():
    ok = {"message_size_bytes": 96, "dtype": "fp16", "world_size": 3}
    msgspec.convert(ok, comm.AllReduceArgs)
    msgspec.convert(ok, comm.AllGatherArgs)  # 96 = 3 ranks x 16 fp16 elements
    with pytest.raises(msgspec.ValidationError, match="3 x 4 = 12 bytes"):
        msgspec.convert({**ok, "dtype": "fp32", "message_size_bytes": 100}, comm.ReduceScatterArgs)
    msgspec.convert({**ok, "message_size_bytes": 98}, comm.AllReduceArgs)  # all_reduce does not split


# ---- the oracle, without processes -------------------------------------------------------------------------------

@pytest.mark.parametrize("n, dtype", [(4, "fp32"), (8, "bf16"), (23, "fp16")])  # the last two: exact sums, at the edge
@pytest.mark.parametrize("table", TABLES)
def test_each_rank_oracle_accepts_the_collective_and_rejects_a_wrong_one(table, n, dtype, monkeypatch):
    """Rank 1 of n, with torch.distributed's call replaced by a stand-in that computes what the other ranks would
    have sent (correct) or gets the chunk order or the sum wrong (rank 0's part missing: 1/36 of a bf16 sum over 8
    ranks, under a rounding tolerance, caught because such sums are exact)."""
    import torch
    import torch.distributed as dist

    from kprof.runners._args import DTYPE_BYTES

    rank, c = 1, 6  # c: elements per rank's part
    spec = msgspec.convert({"message_size_bytes": DTYPE_BYTES[dtype] * n * c, "dtype": dtype, "world_size": n},
                           comm.COLLECTIVES[table].args)
    ranks_in = [torch.tensor([(r + 1) * ((i % 7) + 1) for i in range(n * c)], dtype=torch.float32) for r in range(n)]

    def right(*args):
        if table == "all_reduce":
            args[0].copy_(sum(ranks_in))
        elif table == "all_gather":
            out, inp = args
            out.copy_(torch.cat([ranks_in[r][r * c:(r + 1) * c] for r in range(n)]))
            assert torch.equal(inp, ranks_in[rank][rank * c:(rank + 1) * c])
        elif table == "reduce_scatter":
            args[0].copy_(sum(ranks_in)[rank * c:(rank + 1) * c])
        else:
            args[0].copy_(torch.cat([ranks_in[j][rank * c:(rank + 1) * c] for j in range(n)]))

    def wrong(*args):
        right(*args)
        if table in ("all_reduce", "reduce_scatter"):
            args[0].sub_(ranks_in[0][:args[0].numel()])  # rank 0's part missing
        else:
            args[0].copy_(args[0].view(n, -1).flip(0).reshape(-1))  # chunks in reverse rank order

    name = next(f for f in comm.COLLECTIVES[table].calls if hasattr(dist, f))
    monkeypatch.setattr(dist, name, right)
    comm.rank_buffers(table, spec, rank, torch.device("cpu")).check()
    monkeypatch.setattr(dist, name, wrong)
    with pytest.raises(WrongResult, match=f"{table} .*rank 1, element"):
        comm.rank_buffers(table, spec, rank, torch.device("cpu")).check()


# ---- gloo end to end ---------------------------------------------------------------------------------------------

def test_a_rank_that_dies_fails_its_spec_and_the_next_spec_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_ranks, "EXIT_RANK_FOR_TESTS", 1)  # one-shot: rank 1 exits on receiving the next spec
    doc = _run(capsys, "all_reduce", _specs(2), str(tmp_path / "p.db"), tmp_path, rc=1)
    dead, alive = doc["results"]
    assert dead["status"] == "error" and alive["status"] == "ok"
    message = dead["error"]["message"]
    assert "rank 1 of 2" in message and "exited with code 3" in message, message
    assert _ranks.EXIT_RANK_FOR_TESTS is None
    # The message names the rank's log, kept where it says (the group's other files are removed).
    log = re.search(r"rank 1's log (\S+) (is empty|ends: )", message).group(1)
    assert os.path.basename(log) == "rank1.log" and os.path.isfile(log), message
    assert sorted(os.listdir(os.path.dirname(log))) == ["rank0.log", "rank1.log"]
    assert os.path.basename(os.path.dirname(log)).startswith("kprof-rank-logs-gloo2-")  # out of the swept ones
    shutil.rmtree(os.path.dirname(log))


def test_a_gloo_row_carries_the_hosts_load_and_says_when_it_passed_the_cores(monkeypatch):
    """A gloo row is a CPU row, timed by the wall clock, and `run` said of a loaded host's rows "their notes say
    host_busy" while their notes held no load at all: they carry host_load_1m, and host_busy past the cores."""
    from kprof.runners.registry import lookup
    from kprof.runners.worker import measure_specs

    monkeypatch.setattr(_ranks.os, "cpu_count", lambda: 2)
    spec = {"message_size_bytes": SMALL, "dtype": "fp32", "world_size": 2}
    for load, busy in ((0.5, False), (7.25, True)):
        monkeypatch.setattr(_ranks.os, "getloadavg", lambda load=load: (load, load, load))
        (out,) = measure_specs(lookup("all_reduce", "gloo"), [spec], "test cpu")
        notes = out.event.method.notes
        assert notes["host_load_1m"] == f"{load:.2f}", notes
        assert notes.get("host_busy") == ("load 7.25 over 2 cores: other work shared them" if busy else None)


def test_a_gloo_rows_environment_names_the_threads_its_ranks_ran_on(monkeypatch):
    """A gloo row's environment said `threads` = the calling process's torch threads (every core), beside notes that
    say each rank runs on one: it names the ranks' one thread."""
    import torch

    from kprof.runners.registry import lookup
    from kprof.runners.worker import measure_specs

    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # what cpu_environment reads in this process
    spec = {"message_size_bytes": SMALL, "dtype": "fp32", "world_size": 2}
    (out,) = measure_specs(lookup("all_gather", "gloo"), [spec], "test cpu")
    assert out.event.environment.clocks["threads"] == 1.0, out.event.environment
    assert out.event.method.notes["ranks_on"] == "2 CPU processes, 1 torch thread each"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, lambda: SystemExit(143)])
def test_ctrl_c_that_ends_the_ranks_too_stops_the_run(interrupt, monkeypatch):
    """Ctrl-C at a terminal (SIGINT to the process group; a SIGTERM to it likewise) ends the ranks as it interrupts
    the run: asking the dead ranks to free their buffers raised a rank's death in the interrupt's place, so the spec
    was stored as a crash and the run went on with fresh ranks. The interrupt stops the run."""
    import signal

    from kprof.runners.registry import lookup
    from kprof.runners.worker import measure_specs

    ask = _ranks.RankGroup.ask

    def interrupted(self, message, what):
        if message[0] != "batch":
            return ask(self, message, what)
        for p in self.procs:  # the terminal's SIGINT reaches every rank ...
            os.kill(p.pid, signal.SIGINT)
        raise interrupt()  # ... and the run itself, waiting for their answers (they are still ending)

    monkeypatch.setattr(_ranks.RankGroup, "ask", interrupted)
    spec = {"message_size_bytes": SMALL, "dtype": "fp32", "world_size": 2}
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        list(measure_specs(lookup("all_gather", "gloo"), [spec, spec], "test cpu"))
    _ranks.shutdown()


def test_specs_of_one_world_size_share_a_rank_group_whatever_their_order(monkeypatch, tmp_path):
    """Specs alternating world sizes 2 and 3 were measured in the order given: each started a fresh rank group (a
    torch import per rank), four starts for four specs. They are measured a world size at a time; the rows come back in
    the order asked."""
    from kprof import api

    started = []
    group = _ranks.RankGroup

    def counted(backend, n):
        started.append(n)
        return group(backend, n)

    _ranks.shutdown()
    monkeypatch.setattr(_ranks, "RankGroup", counted)
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    specs = [{"message_size_bytes": 24 * (i + 1), "dtype": "fp32", "world_size": 2 + i % 2} for i in range(4)]
    res = api.run("all_gather", "gloo", specs, db=str(tmp_path / "p.db"))
    assert [r["spec"] for r in res.results] == specs and all(r["status"] == "ok" for r in res.results), res.results
    assert started == [2, 3]
    _ranks.shutdown()


def test_a_group_interrupted_mid_step_is_not_asked_again(monkeypatch):
    """Ctrl-C that reaches only the calling process (a notebook's interrupt) while the ranks ran a batch: their answers
    stayed in flight, and the next spec of that world size read them as its own, a stale batch as the spec's check
    and the check's answer as a batch (TypeError, a crash row), every later spec off by one. The group is killed."""
    from kprof.runners.registry import lookup
    from kprof.runners.worker import measure_specs

    gather = _ranks.RankGroup._gather

    def interrupted(self, timeout, what, knob):
        if what.startswith("a batch"):
            monkeypatch.setattr(_ranks.RankGroup, "_gather", gather)  # once
            raise KeyboardInterrupt
        return gather(self, timeout, what, knob)

    monkeypatch.setattr(_ranks.RankGroup, "_gather", interrupted)
    spec = {"message_size_bytes": SMALL, "dtype": "fp32", "world_size": 2}
    entry = lookup("all_reduce", "gloo")
    with pytest.raises(KeyboardInterrupt):
        list(measure_specs(entry, [spec], "test cpu"))
    group = _ranks._group
    assert not group.procs and not os.path.exists(group.dir)  # killed, its directory removed
    (out,) = measure_specs(entry, [spec], "test cpu")
    assert out.event.metrics["time_ms"] > 0, out.event
    _ranks.shutdown()


def test_a_rank_directory_left_by_a_killed_run_is_removed_by_the_next_group(monkeypatch, tmp_path):
    """A run killed while its ranks were up (SIGKILL, the OOM killer: no cleanup runs) left its `kprof-ranks-*`
    directory (the FileStore, the ranks' logs) in the temporary directory for good. A group's directory is held while
    its process lives, and the next group's start removes one that no live process holds."""
    import tempfile
    import time

    from kprof import _scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = tmp_path / "kprof-ranks-gloo2-killed"
    left.mkdir()
    (left / "rank0.log").write_text("a rank of a run killed with SIGKILL")
    old = time.time() - 2 * _scratch.SETTLE_S
    os.utime(left, (old, old))
    group = _ranks.RankGroup("gloo", 2)
    try:
        assert not left.exists()
        assert os.path.basename(group.dir).startswith("kprof-ranks-gloo2-") and os.path.isdir(group.dir)
    finally:
        group.close()
    assert os.listdir(tmp_path) == []


def test_an_nccl_worker_on_a_gpu_of_another_model_names_the_gpu_setting(monkeypatch):
    """KPROF_PROFILE_GPUS naming A100s on a host whose device 0 (the key's) is an H200: an nccl worker refused with
    only "omit --gpu-name", a flag the run was never given, and the same through the Python API. It is refused as a
    CUDA row's device refuses it, naming the GPU settings and the keyword or flag."""
    import torch

    from kprof.errors import SettingError
    from kprof.runners._comm_device import CommDevice
    from kprof.runners.registry import lookup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SettingError, match="differs from CUDA device 0 .*A100.*KPROF_PROFILE_GPUS") as exc:
        CommDevice(lookup("all_reduce", "nccl"), "NVIDIA H200", lambda: pytest.fail("no environment is read"))
    assert str(exc.value).endswith("or omit gpu_name=") and exc.value.cli.endswith("or omit --gpu-name")


def test_a_gloo_spec_past_the_hosts_memory_is_an_oom_row_before_any_rank_starts(monkeypatch, tmp_path, capsys):
    """Every gloo rank is a process of this host: the ranks' buffers together (1 TiB a rank's message, 8 ranks)
    past its memory are an `oom` row, as a CPU GEMM's are, not a rank killed mid-allocation (`crash`)."""
    _ranks.shutdown()
    monkeypatch.setattr(_ranks, "RankGroup", lambda *a: pytest.fail("a rank group was started"))
    spec = {"message_size_bytes": 1 << 40, "dtype": "fp32", "world_size": 8}
    assert comm.AllToAll().held_bytes(comm.AllToAllArgs(**spec)) == (3 << 40) * 8 + comm.RANK_PROCESS_BYTES * 8
    doc = _run(capsys, "all_to_all", [spec], str(tmp_path / "p.db"), tmp_path, rc=1)
    (row,) = doc["results"]
    assert row["status"] == "error" and row["error"]["kind"] == "oom", row
    assert "out of memory before building" in row["error"]["message"]


def test_a_gloo_group_whose_rank_processes_exceed_the_hosts_memory_is_an_oom_row(monkeypatch, tmp_path, capsys):
    """Each gloo rank is an interpreter with torch (~230 MB): 1,000 ranks of a 4 KiB message were started on a host of
    23 GiB, and the OOM killer ended the run itself (exit 137, no row, the rank directory left in the temporary
    directory). The processes count with the buffers: an `oom` row, the run's other specs measured."""
    _ranks.shutdown()
    monkeypatch.setattr(_ranks, "RankGroup", lambda *a: pytest.fail("a rank group was started"))
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (16 << 30) // 4096}  # a host of 16 GiB, whatever runs the test
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name] if name in pages else real(name))
    spec = {"message_size_bytes": 4096, "dtype": "fp32", "world_size": 1000}
    doc = _run(capsys, "all_reduce", [spec], str(tmp_path / "p.db"), tmp_path, rc=1)
    (row,) = doc["results"]
    assert row["status"] == "error" and row["error"]["kind"] == "oom", row
    assert "each rank's interpreter with torch" in row["error"]["message"] and "16.0 GiB" in row["error"]["message"]


def _check_rows(doc: dict, table: str, n: int) -> None:
    small, large = doc["results"]
    for r in (small, large):
        m = r["metrics"]
        assert r["status"] == "ok", r
        assert m["message_size_bytes"] == r["spec"]["message_size_bytes"]
        assert m["time_ms"] > 0 and m["algbw_gbps"] > 0 and m["busbw_gbps"] > 0 and m["energy_j"] is None
        assert m["algbw_gbps"] == pytest.approx(m["message_size_bytes"] / (m["time_ms"] / 1e3) / 1e9, rel=1e-12)
        assert m["busbw_gbps"] / m["algbw_gbps"] == pytest.approx(FACTOR[table](n), rel=1e-12)
        assert r["stats"]["n"] >= 3 and r["stats"]["median"] == m["time_ms"]
    # (Which size is faster is a timing, for comm_check.py: with 8 ranks on 2 cores a 1 KiB message's fastest
    # iteration was seen slower than a 4 MiB one's, the scheduler's wait dominating both.)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_gloo_collectives_end_to_end(n, db, tmp_path, capsys):
    for table in TABLES:
        doc = _run(capsys, table, _specs(n), db, tmp_path)
        _check_rows(doc, table, n)
        # stored, and read back as they were measured
        assert main(["query", table, "--backend", "gloo", "--spec", json.dumps(_specs(n)[1]), "--db", db, "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["results"][0]
        assert row["status"] == "ok" and row["citation"] == doc["results"][1]["citation"]
        assert main(["show", row["citation"], "--db", db, "--json"]) == 0
        notes = json.loads(capsys.readouterr().out)["event"]["method"]["notes"]
        assert notes["ranks"] == str(n) and notes["algorithm_used"].startswith("torch.distributed.")
        assert notes["bus_factor"] == comm.COLLECTIVES[table].bus


def test_snapshot_plots_busbw_against_size_per_world_size(db, tmp_path, capsys):
    """The rows of all three world sizes are stored: run (jit) reads them, and its snapshot plots them."""
    out = tmp_path / "snap"
    specs = _specs(2) + _specs(4) + _specs(8)
    doc = _run(capsys, "all_reduce", specs, db, tmp_path, "--output-dir", str(out))
    assert doc["missing_count"] == 0 and all(r["status"] == "ok" for r in doc["results"])
    assert sorted(os.listdir(out)) == ["curve.json", "curve.png", "job.meta.json", "request.json", "results.json"]
    curve = json.loads((out / "curve.json").read_text())
    assert curve["axes"] == ["message_size_bytes", "dtype", "world_size"]
    x, metric, series = artifacts.plot_series(curve)
    assert (x, metric) == ("message_size_bytes", "busbw_gbps")
    assert sorted(series) == [f"world_size={n}, dtype={d}" for n in (2, 4, 8) for d in ("bf16", "fp32")]
    by = {(r["spec"]["world_size"], r["spec"]["message_size_bytes"]): r["metrics"]["busbw_gbps"]
          for r in doc["results"]}
    assert series["world_size=8, dtype=fp32"] == [(LARGE, by[(8, LARGE)])]
    assert (out / "curve.png").read_bytes()[:4] == b"\x89PNG"


# ---- nccl on a GPU host (pytest -m gpu) ----------------------------------------------------------------------------

def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() == 0, reason="needs a CUDA GPU")
def test_nccl_rows_on_the_pool(tmp_path, capsys):
    """The nccl path through the pool: world_size 2 where two GPUs are usable, else 1 (all_reduce on one rank does no
    GPU work in NCCL: unsupported there). Rows name the NCCL version, the GPUs and their topology."""
    n = 2 if _cuda_count() >= 2 else 1
    db = str(tmp_path / "p.db")
    for table in TABLES:
        spec = {"message_size_bytes": 1 << 20, "dtype": "bf16", "world_size": n}
        doc = _run_nccl(capsys, table, spec, db)
        r = doc["results"][0]
        if n == 1 and table == "all_reduce":
            assert r["status"] == "error" and r["error"]["kind"] == "unsupported", r
            continue
        assert r["status"] == "ok", r
        assert r["metrics"]["busbw_gbps"] == pytest.approx(r["metrics"]["algbw_gbps"] * FACTOR[table](n), rel=1e-12)
        assert main(["show", r["citation"], "--db", db, "--json"]) == 0
        event = json.loads(capsys.readouterr().out)["event"]
        notes = event["method"]["notes"]
        assert notes["nccl_version"] and notes["gpus"].count("cuda:") == n and "active NVLinks" in notes["topology"]
        assert event["method"]["timer"] in ("cupti", "events") and len(event["environment"]["gpu_uuid"].split(",")) == n


def _run_nccl(capsys, table, spec, db) -> dict:
    main(["run", table, "--backend", "nccl", "--spec", json.dumps(spec), "--db", db, "--json"])
    return json.loads(capsys.readouterr().out)


def test_curve_points_keep_the_spec_size_not_the_metric_copy():
    """A comm row's metrics repeat message_size_bytes as a float: curve.json's points took it (4096.0) in place of the
    spec's axis value (4096), so a point no longer matched its spec."""
    specs = [{"message_size_bytes": s, "dtype": "fp32", "world_size": 2} for s in (SMALL, LARGE)]
    result = {"table": "all_reduce", "backend": "gloo", "gpu_name": "cpu", "results": [
        {"spec": s, "status": "ok", "citation": f"kprof.{i:016x}",
         "metrics": {"time_ms": 1.0, "algbw_gbps": 1.0, "busbw_gbps": 1.0,
                     "message_size_bytes": float(s["message_size_bytes"]), "energy_j": None}}
        for i, s in enumerate(specs)]}
    curve = artifacts.curve(result, ["message_size_bytes", "dtype", "world_size"])
    sizes = [p["message_size_bytes"] for p in curve["points"]]
    assert sizes == [SMALL, LARGE] and all(type(v) is int for v in sizes)
    assert json.loads(msgspec.json.encode(curve))["points"][0]["message_size_bytes"] == SMALL
    assert artifacts.plot_series(curve)[2] == {"all": [(SMALL, 1.0), (LARGE, 1.0)]}


def test_a_snapshot_of_one_collective_spec_draws_no_curve():
    """curve.png is drawn where a spec field varies: a run of one collective spec drew a one-point busbw plot (a
    compute run of one spec draws none)."""
    spec = {"message_size_bytes": SMALL, "dtype": "fp32", "world_size": 2}
    result = {"table": "all_reduce", "backend": "gloo", "gpu_name": "cpu", "results": [
        {"spec": spec, "status": "ok", "citation": "kprof.0000000000000000",
         "metrics": {"time_ms": 1.0, "algbw_gbps": 1.0, "busbw_gbps": 1.0,
                     "message_size_bytes": float(SMALL), "energy_j": None}}]}
    curve = artifacts.curve(result, ["message_size_bytes", "dtype", "world_size"])
    assert curve["axes"] == [] and artifacts.plot_series(curve)[2] == {}
