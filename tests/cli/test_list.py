import json
import os

import msgspec
import pytest

from kprof.cli import main
from kprof.runners.registry import entries


def _list_json(capsys) -> dict:
    assert main(["list", "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out)


def test_list_json_shows_every_registered_pair(capsys):
    doc = _list_json(capsys)
    registered = entries()
    assert doc["count"] == len(registered) == len(doc["entries"])
    assert [(d["table"], d["backend"]) for d in doc["entries"]] == [(e.table, e.backend) for e in registered]
    # the torch-cpu catalog holds at least these families
    pairs = {(d["table"], d["backend"]) for d in doc["entries"]}
    for table in ("single_gemm", "rms_norm", "silu_mul", "attention_prefill", "attention_decode"):
        assert (table, "torch-cpu") in pairs


@pytest.mark.parametrize("entry", entries(), ids=lambda e: f"{e.table}/{e.backend}")
def test_list_json_entry_fields(entry, capsys):
    doc = _list_json(capsys)
    d = next(d for d in doc["entries"] if (d["table"], d["backend"]) == (entry.table, entry.backend))
    assert d["kernel_kind"] == entry.kernel_kind
    # args: the KernelArgs field names in declaration order (the axis order of curve.json)
    assert d["args"] == list(entry.args.__struct_fields__)
    assert d["metric_family"] == entry.metric_family in ("compute", "comm")
    assert d["subprocess_env"] == entry.subprocess_env and d["subprocess_env"]
    assert d["get_fn"] == f"kprof.perf_api.get_{entry.table}"
    assert d["count_fn"] == f"kprof.perf_api.count_{entry.table}"
    assert d["contract"] == msgspec.structs.asdict(entry.contract)
    assert set(d["contract"]) >= {"algorithm", "layout", "numerics", "timing", "profiler_revision"}
    # the read functions named there exist
    import kprof.perf_api as perf_api

    assert callable(getattr(perf_api, d["get_fn"].rsplit(".", 1)[1]))
    assert callable(getattr(perf_api, d["count_fn"].rsplit(".", 1)[1]))


def test_list_gemm_args_in_declaration_order(capsys):
    doc = _list_json(capsys)
    gemm = next(d for d in doc["entries"] if (d["table"], d["backend"]) == ("single_gemm", "torch-cpu"))
    assert gemm["args"] == ["m", "n", "k", "dtype"]
    prefill = next(d for d in doc["entries"] if d["table"] == "attention_prefill")
    assert prefill["args"] == ["batch", "seq_len", "num_heads", "num_kv_heads", "head_dim", "causal", "dtype"]


def test_list_human_table_shows_every_pair(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for e in entries():
        assert e.table in out and e.backend in out and e.kernel_kind in out
        assert f"kprof.perf_api.get_{e.table}" in out and f"kprof.perf_api.count_{e.table}" in out
        # the args cell may wrap over two lines; every field name is there, in declaration order
        words = [w.strip(",") for w in out.split() if w.strip(",") in e.args.__struct_fields__]
        fields = list(e.args.__struct_fields__)
        assert any(words[i:i + len(fields)] == fields for i in range(len(words)))
    assert "compute" in out and "default_env" in out


def test_list_writes_no_db(tmp_path, capsys):
    assert main(["list", "--json"]) == 0
    assert list(tmp_path.iterdir()) == []  # cwd is tmp_path: no ./profile.db appeared


@pytest.mark.parametrize("width", [40, 80])
def test_a_narrow_terminal_cuts_no_table_or_backend_name(capsys, monkeypatch, width):
    """At 80 columns `kprof list` printed `all_ga…` and `torch-…`: the names every other verb takes were cut."""
    import sys

    from rich.console import Console

    monkeypatch.setattr("kprof.cli.list_.console", lambda: Console(file=sys.stdout, width=width, soft_wrap=True))
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    cells = [[c.strip() for c in line.split("│")[1:3]] for line in out.splitlines() if line.startswith("│")]
    for e in entries():
        assert [e.table, e.backend] in cells


def test_a_field_with_a_default_is_listed_with_it(capsys, monkeypatch):
    """A spec may leave out a field with a default (its key holds the default): `list` says which, and the value."""
    import sys
    from typing import Literal

    from rich.console import Console

    from kprof.ledger.events import Contract
    from kprof.runners._args import KernelArgs, Size
    from kprof.runners.registry import REGISTRY, Entry

    class Args(KernelArgs, frozen=True):
        n: Size
        act: Literal["ok", "fail"] = "ok"
        scale: float = 1.0

    contract = Contract(algorithm="a", layout="l", numerics="n", timing="t", profiler_revision=1)
    entries()  # the catalog loaded first: a registry holding only this entry would not load it
    monkeypatch.setitem(REGISTRY, ("mine", "cpu"), Entry("mine", "cpu", Args, "test", "compute", contract, "m:R"))
    mine = next(d for d in _list_json(capsys)["entries"] if d["table"] == "mine")
    assert (mine["args"], mine["defaults"]) == (["n", "act", "scale"], {"act": "ok", "scale": 1.0})
    assert all(d["defaults"] == {} for d in _list_json(capsys)["entries"] if d["table"] != "mine")
    monkeypatch.setattr("kprof.cli.list_.console", lambda: Console(file=sys.stdout, width=400))
    assert main(["list"]) == 0
    assert '│ n, act="ok", scale=1.0 ' in capsys.readouterr().out


def test_environments_name_an_address_space_limit_that_keeps_torch_from_importing(tmp_path):
    """Under `ulimit -v` too small for torch's libraries, `list --environments` told to reinstall a CUDA build of
    torch; it names the limit and its fix."""
    import subprocess
    import sys

    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (150 << 20,) * 2); from kprof.cli import "
            "main; sys.exit(main(['list', '--environments']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    said = next(line for line in proc.stdout.splitlines() if "torch does not import" in line)
    assert "ulimit -v allows this process 153600 KiB; raise the limit" in said and "reinstall" not in said, said
