"""The catalog on CPU: every (table, backend) and its contract, the Case's inputs/call contract for every
runner that builds on CPU, and the CPU-runnable parts of the CUDA runners (MoE grouped GEMM, fp8 scaled
GEMM, forced SDPA backends, memcpy)."""

import enum
import os
import re

import msgspec
import pytest
import torch
import torch.nn.functional as F

from kprof.ledger.events import Contract, Measured
from kprof.runners import gemm, moe
from kprof.runners._case import Unsupported, WrongResult, seed_of
from kprof.runners.catalog import CPU_TIMING, GPU_TIMING, parse_timing, timing_power, timing_string
from kprof.runners.registry import entries, lookup
from kprof.runners.worker import classify, measure_specs

ATTENTION = {"torch-cpu", "torch", "torch-flash", "torch-efficient", "torch-cudnn", "torch-math"}
BACKENDS = {
    "single_gemm": {"torch-cpu", "torch"},
    "rms_norm": {"torch-cpu", "torch"},
    "silu_mul": {"torch-cpu", "torch"},
    "attention_prefill": ATTENTION,
    "attention_decode": ATTENTION,
    "moe_grouped_gemm": {"torch-cpu", "torch", "torch-loop"},
    "memcpy": {"torch-cpu", "torch"},
    # collectives (their entries and runs: test_comm.py)
    **{t: {"nccl", "gloo"} for t in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")},
}
COMPUTE = [e for e in entries() if e.metric_family == "compute"]
SMALL = {
    "single_gemm": {"m": 32, "n": 48, "k": 64, "dtype": "bf16"},
    "rms_norm": {"tokens": 8, "hidden": 64, "dtype": "bf16"},
    "silu_mul": {"tokens": 8, "hidden": 64, "dtype": "bf16"},
    "attention_prefill": {"batch": 2, "seq_len": 16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                          "causal": True, "dtype": "bf16"},
    "attention_decode": {"batch": 2, "kv_len": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                         "dtype": "bf16"},
    "moe_grouped_gemm": {"tokens": 24, "experts": 6, "topk": 2, "hidden": 32, "intermediate": 40, "dtype": "bf16"},
    "memcpy": {"bytes": 3 * 1_048_573 + 5},  # three pattern periods and a remainder
}
# The first release's torch-cpu contracts: their keys change only with a revision of their own (revision, if not 1).
FIRST_CPU_CONTRACTS = {
    "single_gemm": ("torch.matmul", "a[m,k] row-major, b[k,n] row-major, c[m,n] row-major"),
    "rms_norm": ("torch.nn.functional.rms_norm", "x[tokens,hidden] contiguous, w[hidden]"),
    "silu_mul": ("silu(x[:, :h]) * x[:, h:]", "x[tokens,2*hidden] contiguous"),
    "attention_prefill": ("torch sdpa (auto backend)",
                          "q [batch,heads,seq,head_dim], k/v [batch,kv_heads,seq,head_dim] contiguous", 2),
    "attention_decode": ("torch sdpa (auto backend)",
                         "q [batch,heads,1,head_dim], k/v [batch,kv_heads,kv_len,head_dim] contiguous"),
}


def _build(entry, device="cpu", runner=None, **over):
    spec = msgspec.convert({**SMALL[entry.table], **over}, entry.args)
    return (runner or entry.load_runner())().build(spec, device)


# ---- registry and contracts ----------------------------------------------------------------------------

def test_every_table_and_backend_is_registered():
    got = {}
    for e in entries():
        got.setdefault(e.table, set()).add(e.backend)
    assert got == BACKENDS


def test_a_plugin_cannot_take_a_registered_table_and_backend(monkeypatch):
    """A KPROF_RUNNERS module registering single_gemm/torch-cpu replaced the built-in runner without a word (its rows
    then shared the built-in's keys), and a second plugin's my_softmax/torch-cpu the first's: refused, naming both
    runners. The same runner again (its module imported once more) is not a clash."""
    from kprof.errors import UsageError
    from kprof.runners.registry import REGISTRY, register

    monkeypatch.setattr("kprof.runners.registry.REGISTRY", dict(REGISTRY))
    gemm_entry = lookup("single_gemm", "torch-cpu")
    with pytest.raises(UsageError, match="table 'single_gemm' backend 'torch-cpu' is registered twice, by runner "
                                         "'kprof.runners.gemm:SingleGemm' and by 'mine:Gemm'; give one of them"):
        register(msgspec.structs.replace(gemm_entry, runner="mine:Gemm"))
    assert lookup("single_gemm", "torch-cpu") is gemm_entry
    mine = msgspec.structs.replace(gemm_entry, table="my_gemm", runner="mine:Gemm")
    assert register(mine) is mine and register(msgspec.structs.replace(mine)) is not None
    with pytest.raises(UsageError, match="'my_gemm' backend 'torch-cpu' is registered twice, by runner 'mine:Gemm' "):
        register(msgspec.structs.replace(mine, runner="theirs:Gemm"))


def test_a_plugin_field_a_row_cannot_hold_is_refused_at_registration(monkeypatch):
    """A field `bias: int | None = None` was measured, then the ledger refused the run's every row ("does not fit
    the event schema ... build events with kprof.ledger.build", exit 2): a shape holds bool, int, float or str. So is a
    field perf_api's read functions take as a keyword of their own, and a default the field refuses."""
    from kprof.errors import UsageError
    from kprof.runners import registry
    from kprof.runners._args import KernelArgs, Size
    from kprof.runners.registry import REGISTRY, register

    class Args(KernelArgs, frozen=True):
        n: Size
        bias: int | None = None

    monkeypatch.setattr("kprof.runners.registry.REGISTRY", dict(REGISTRY))
    entry = msgspec.structs.replace(lookup("single_gemm", "torch-cpu"), table="mine", args=Args, runner="m:R")
    with pytest.raises(UsageError, match=r"table 'mine': field 'bias' of Args is int \| None; a spec field is a "
                                         r"bool, int, float or str"):
        register(entry)
    class Choice(enum.Enum):
        A = "a"

    class Chosen(KernelArgs, frozen=True):
        n: Size
        choice: Choice = Choice.A

    with pytest.raises(UsageError, match=r"field 'choice' of Chosen is Choice; .*: a Literal for a set of choices "
                                         r"\(not an Enum\), a default of the type for an optional value"):
        register(msgspec.structs.replace(entry, args=Chosen))

    class Power(KernelArgs, frozen=True):  # perf_api.get_mine(power=...) is the timing method's
        n: Size
        power: int

    with pytest.raises(UsageError, match=r"table 'mine': field 'power' of Power is a keyword of "
                                         r"kprof.perf_api.get_mine and count_mine \(as are backend, gpu_key, "):
        register(msgspec.structs.replace(entry, args=Power))

    class Zero(KernelArgs, frozen=True):
        n: Size = 0

    with pytest.raises(UsageError, match=r"table 'mine': field 'n' of Zero defaults to 0, a value the field refuses "
                                         r"\(Expected `int` >= 1\); give it a default it takes"):
        register(msgspec.structs.replace(entry, args=Zero))
    with pytest.raises(UsageError, match=r"args is <class 'dict'>, not a KernelArgs Struct"):
        register(msgspec.structs.replace(entry, args=dict))
    assert ("mine", "torch-cpu") not in registry.REGISTRY


@pytest.mark.parametrize("runner, said", [
    ("kprof.runners.norm:Nope", "and module 'kprof.runners.norm' has no 'Nope'; fix the name"),
    ("kprof.runners.nothere:RmsNorm",
     r"whose module does not import \(No module named 'kprof.runners.nothere'\); fix "),
    ("kprof.runners.norm.RmsNorm", r"name it as 'module:Class' \(e.g. 'mypkg.kernels:Softmax'\)"),
    ("kprof.runners.norm:EPS", r"which is not a class with a build\(spec, device\) method; name the runner's class"),
    ("runner_needing_args:Needs", r"cannot be made with no arguments \(.*missing 1 required positional argument: "
                                  r"'size'\); kprof calls Needs\(\) and then its build\(spec, device\)")])
def test_a_runner_that_does_not_load_is_named_not_a_traceback(runner, said, tmp_path, monkeypatch):
    """A plugin's mistyped runner string ran into an AttributeError or ModuleNotFoundError traceback from inside the
    worker (exit 1): a usage error (exit 2) naming the entry, the runner and the fix."""
    from kprof import api
    from kprof.errors import UsageError
    from kprof.runners.registry import REGISTRY

    (tmp_path / "runner_needing_args.py").write_text("class Needs:\n    def __init__(self, size):\n        pass\n\n"
                                                     "    def build(self, spec, device):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = msgspec.structs.replace(lookup("rms_norm", "torch-cpu"), table="my_norm", runner=runner)
    with pytest.raises(UsageError, match=f"table 'my_norm' backend 'torch-cpu'.* runner '{runner}'.*{said}"):
        entry.make_runner()
    monkeypatch.setattr("kprof.runners.registry.REGISTRY", {**REGISTRY, ("my_norm", "torch-cpu"): entry})
    with pytest.raises(UsageError, match=said):
        api.run("my_norm", "torch-cpu", [SMALL["rms_norm"]], db=str(tmp_path / "p.db"))


@pytest.mark.parametrize("table, backend, said", [
    ("my-norm", "torch-cpu", r"table 'my-norm' cannot name its read functions kprof.perf_api.get_<table> and "
                             r"count_<table>; use letters, digits and _ \(e.g. 'my_norm'\)"),
    ("", "torch-cpu", r"table '' cannot name its read functions .* \(e.g. 'my_kernel'\)"),
    ("my_norm", "", r"table 'my_norm': backend '' is not a name --backend can take; use letters, digits, _, - and ."),
    ("my_norm", "cpu two", r"backend 'cpu two' is not a name --backend can take")])
def test_a_plugin_table_or_backend_no_verb_can_name_is_refused(table, backend, said, monkeypatch):
    """A plugin registered a table "my-norm" (its kprof.perf_api.get_my-norm no caller can write), an empty one, or an
    empty backend, and every verb took them: refused when registered, with a name that would do."""
    from kprof.errors import UsageError
    from kprof.runners.registry import REGISTRY, register

    monkeypatch.setattr("kprof.runners.registry.REGISTRY", dict(REGISTRY))
    with pytest.raises(UsageError, match=said):
        register(msgspec.structs.replace(lookup("rms_norm", "torch-cpu"), table=table, backend=backend, runner="m:R"))


@pytest.mark.parametrize("over, said", [
    ({"metric_family": "bogus"}, r"Invalid enum value 'bogus' - at `Entry.metric_family`"),
    ({"device": "tpu"}, r"Invalid enum value 'tpu' - at `Entry.device`"),
    ({"contract": None}, r"Expected `object`, got `null` - at `Entry.contract`"),
    ({"contract": Contract(profiler_revision="2")},
     r"Expected `int`, got `str` - at `Entry.contract.profiler_revision`")])
def test_a_plugin_entry_of_values_it_cannot_hold_is_refused(over, said, monkeypatch):
    """msgspec checks no field when a Struct is made: an Entry with metric_family "bogus" or contract None was
    registered, and `kprof list` or the run of its table ended in a KeyError or AttributeError traceback."""
    from kprof.errors import UsageError
    from kprof.runners.registry import REGISTRY, register

    monkeypatch.setattr("kprof.runners.registry.REGISTRY", dict(REGISTRY))
    entry = msgspec.structs.replace(lookup("rms_norm", "torch-cpu"), table="my_norm", runner="m:R", **over)
    with pytest.raises(UsageError, match=f"the Entry of table 'my_norm' backend 'torch-cpu' does not fit: {said}; "):
        register(entry)


@pytest.mark.parametrize("entry", COMPUTE, ids=lambda e: f"{e.table}/{e.backend}")
def test_entry_device_timing_and_runner(entry):
    assert entry.device == ("cpu" if entry.backend == "torch-cpu" else "cuda")
    assert entry.contract.timing == (CPU_TIMING if entry.device == "cpu" else GPU_TIMING)
    assert entry.contract.algorithm and entry.contract.layout and entry.contract.numerics
    assert entry.metric_family == "compute" and entry.gpus == 1
    assert callable(entry.load_runner()().build)  # importable without a GPU


def test_first_cpu_contracts_are_unchanged():
    for table, (algorithm, layout, *revision) in FIRST_CPU_CONTRACTS.items():
        contract = lookup(table, "torch-cpu").contract
        assert msgspec.structs.asdict(contract) == {
            "algorithm": algorithm, "layout": layout, "numerics": "dtype=spec; fp32 accumulate",
            "timing": "cpu-wall;l2=warm;eager", "profiler_revision": revision[0] if revision else 1}


@pytest.mark.parametrize("backend", ["torch-cpu", "torch", "torch-flash"])
@pytest.mark.parametrize("table", ["attention_prefill", "attention_decode"])
def test_an_attention_layout_names_the_shapes_its_gqa_case_holds(table, backend):
    """The layout string's q, k and v dims are the built tensors' shapes: under GQA k and v hold num_kv_heads heads
    (the prefill layouts, CPU and CUDA, said q/k/v [batch,heads,seq,head_dim]); the CUDA runner builds on the CPU
    here, its tensors' shapes being the device's."""
    entry = lookup(table, backend)
    spec = msgspec.convert({**SMALL[table], "num_heads": 8, "num_kv_heads": 2}, entry.args)
    dims = {"batch": spec.batch, "heads": 8, "kv_heads": 2, "head_dim": spec.head_dim, "1": 1,
            "seq": getattr(spec, "seq_len", None), "kv_len": getattr(spec, "kv_len", None)}
    said = {name: tuple(dims[d] for d in shape.split(","))
            for names, shape in re.findall(r"([a-z/]+) \[([^\]]+)\]", entry.contract.layout) for name in names.split("/")
            if name in "qkv"}  # the CUDA layouts also name the packed projection output they are views of
    q, k, v = entry.load_runner()().build(spec, "cpu").inputs
    assert said == {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape)}


def test_the_power_state_is_named_only_when_loaded():
    assert timing_string("cupti", "cold", False, "sustained") == GPU_TIMING == "cupti;l2=cold;eager"
    loaded = timing_string("cupti", "cold", False, "loaded")
    assert loaded == "cupti;l2=cold;eager;power=loaded" and timing_power(loaded) == "loaded"
    assert parse_timing(loaded) == ("cupti", "cold", False) and timing_power(GPU_TIMING) == "sustained"
    with pytest.raises(ValueError, match="power 'hot'"):
        timing_string("cupti", "cold", False, "hot")


def test_timing_strings():
    assert CPU_TIMING == "cpu-wall;l2=warm;eager" == timing_string("cpu-wall", "warm", False)
    assert GPU_TIMING == "cupti;l2=cold;eager"
    assert timing_string("events", "cold", True) == "events;l2=cold;graph"
    assert timing_string("cupti", "warm", True) == "cupti;l2=warm;graph"
    for timer, l2, graph in (("events", "cold", True), ("cupti", "warm", False), ("cpu-wall", "warm", False)):
        assert parse_timing(timing_string(timer, l2, graph)) == (timer, l2, graph)
    with pytest.raises(ValueError, match="timer"):
        timing_string("wall", "cold", False)
    with pytest.raises(ValueError, match="l2"):
        timing_string("events", "hot", False)


def test_gpu_contracts_say_what_runs():
    gemm_ = lookup("single_gemm", "torch").contract
    assert "torch._scaled_mm" in gemm_.algorithm and "column-major" in gemm_.layout
    for word in ("scale_a", "scale_b", "fp32", "bf16 out", "per-tensor", "use_fast_accum=False"):
        assert word in gemm_.numerics
    assert lookup("moe_grouped_gemm", "torch").contract.algorithm == "torch._grouped_mm"
    assert lookup("moe_grouped_gemm", "torch-loop").contract.algorithm == "per-expert matmul loop"
    assert lookup("moe_grouped_gemm", "torch-cpu").contract.algorithm == "per-expert matmul loop"
    for forced in ("flash", "efficient", "cudnn", "math"):
        for table in ("attention_prefill", "attention_decode"):
            entry = lookup(table, f"torch-{forced}")
            assert forced in entry.contract.algorithm and entry.runner.endswith(forced.capitalize())
    # one key space per (table, backend): no two entries of a table share a contract
    for table in BACKENDS:
        contracts = [lookup(table, b).contract for b in BACKENDS[table]]
        assert len(set(msgspec.json.encode(c) for c in contracts)) == len(contracts)


def test_new_args_validate():
    with pytest.raises(msgspec.ValidationError, match="topk"):
        msgspec.convert({**SMALL["moe_grouped_gemm"], "topk": 7}, moe.MoeGroupedGemmArgs)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"bytes": 0}, lookup("memcpy", "torch").args)
    assert list(lookup("memcpy", "torch").args.__struct_fields__) == ["bytes"]
    assert list(moe.MoeGroupedGemmArgs.__struct_fields__) == ["tokens", "experts", "topk", "hidden", "intermediate",
                                                              "dtype"]


@pytest.mark.parametrize("table, over, field, fix", [
    ("attention_prefill", {"num_heads": 6, "num_kv_heads": 4}, "num_kv_heads", "use a divisor of 6, e.g. 2"),
    ("attention_decode", {"num_heads": 4, "num_kv_heads": 8}, "num_kv_heads", "use a divisor of 4, e.g. 4"),
    ("moe_grouped_gemm", {"experts": 6, "topk": 7}, "topk", "use a topk of at most 6"),
])
def test_a_rule_across_fields_names_its_field_and_fix(table, over, field, fix):
    """A rule across fields said "num_heads (6) must be a multiple of num_kv_heads (4); fix the values": no field on
    the error and no fix."""
    from kprof.errors import SpecError
    from kprof.specs import validate

    with pytest.raises(SpecError) as caught:
        validate(lookup(table, "torch-cpu").args, [{**SMALL[table], **over}], table)
    assert caught.value.field == field and caught.value.value == over[field]
    assert str(caught.value).startswith(f'spec 0: field "{field}" = {over[field]} ') and str(caught.value).endswith(fix)


# ---- Case: fn() == call(*inputs), also on clones of the inputs -----------------------------------------

def _cpu_cases():
    for e in entries():
        if e.backend == "torch-cpu":
            yield f"{e.table}/torch-cpu", e, None
    for forced in ("math", "flash"):  # SDPA runs both on CPU too: the forcing code runs for real
        for table in ("attention_prefill", "attention_decode"):
            yield f"{table}/torch-{forced}", lookup(table, f"torch-{forced}"), None
    yield "moe_grouped_gemm/torch (grouped_mm on CPU)", lookup("moe_grouped_gemm", "torch"), "grouped"


CPU_CASES = list(_cpu_cases())


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    """torch._grouped_mm has a CPU implementation (a loop): lift the runner's CUDA-only guard to test the
    runner's inputs, offsets and oracle on CPU."""
    monkeypatch.setattr(moe, "_require_grouped_mm", lambda *a: None)


@pytest.mark.parametrize("name, entry, how", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_case_inputs_and_call_reproduce_fn(name, entry, how, request):
    if how == "grouped":
        request.getfixturevalue("grouped_on_cpu")
    case = _build(entry)
    case.check()
    assert case.call is not None and case.inputs and all(isinstance(t, torch.Tensor) for t in case.inputs)
    assert case.fn.func is case.call and all(a is b for a, b in zip(case.fn.args, case.inputs, strict=True))
    out = case.fn().clone()
    assert torch.equal(case.call(*case.inputs), out)
    clones = [t.clone() for t in case.inputs]
    assert [c.stride() for c in clones] == [t.stride() for t in case.inputs]  # clone keeps layouts
    assert torch.equal(case.call(*clones), out)
    assert case.algorithm and case.bytes > 0


def test_every_runner_class_is_covered_on_cpu():
    covered = {e.runner for _, e, _ in CPU_CASES}
    gpu_only = {e.runner for e in COMPUTE} - covered
    # what stays: forced SDPA backends that do not run on CPU, tested on a GPU (test_gpu_catalog.py)
    assert gpu_only == {f"kprof.runners.attention:Attention{kind}{b}" for kind in ("Prefill", "Decode")
                        for b in ("Efficient", "Cudnn")}


# ---- forced SDPA backends ------------------------------------------------------------------------------

def _sdp_flags():
    return [torch._C._get_flash_sdp_enabled(), torch._C._get_mem_efficient_sdp_enabled(),
            torch._C._get_math_sdp_enabled(), torch._C._get_cudnn_sdp_enabled()]


@pytest.mark.parametrize("forced", ["math", "flash"])
def test_forced_sdpa_backend_runs_only_inside_the_call(forced, monkeypatch):
    before = _sdp_flags()
    case = _build(lookup("attention_prefill", f"torch-{forced}"))
    assert case.algorithm == forced == case.notes["sdpa_backend"]
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(_sdp_flags())
        return real(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    case.fn()
    assert _sdp_flags() == before  # restored after the call
    only = {"flash": [True, False, False, False], "math": [False, False, True, False]}[forced]
    assert seen == [only]


def test_forced_sdpa_flags_are_restored_when_the_call_raises(monkeypatch):
    before = _sdp_flags()
    case = _build(lookup("attention_decode", "torch-math"))

    def boom(*a, **kw):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(F, "scaled_dot_product_attention", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        case.fn()
    assert _sdp_flags() == before


@pytest.mark.parametrize("forced", ["efficient", "cudnn"])
def test_forced_sdpa_backend_that_cannot_run_is_unsupported(forced):
    before = _sdp_flags()
    with pytest.raises(Unsupported, match="forced SDPA backend cannot run") as info:
        _build(lookup("attention_prefill", f"torch-{forced}"))
    assert classify(info.value) == "unsupported" and _sdp_flags() == before


def test_forced_math_refuses_reduced_precision_math(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", lambda: True)
    with pytest.raises(Unsupported, match="fp16/bf16"):
        _build(lookup("attention_prefill", "torch-math"))


# ---- single_gemm fp8 (torch._scaled_mm, which also has a CPU kernel) -----------------------------------

def _fp8_case(m=32, n=48, k=64):
    spec = msgspec.convert({"m": m, "n": n, "k": k, "dtype": "fp8_e4m3"}, gemm.SingleGemmArgs)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g) / k ** 0.5
    return gemm._fp8_case(spec, "cpu", a, b, torch.arange(min(m, 64)))


def test_fp8_case_contract(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    case = _fp8_case()
    case.check()
    a8, b8, scale_a, scale_b = case.inputs
    assert a8.dtype == b8.dtype == torch.float8_e4m3fn and scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.numel() == scale_b.numel() == 1  # per-tensor
    assert a8.stride() == (64, 1) and b8.shape == (64, 48) and b8.stride() == (1, 64)  # B column-major
    assert a8.float().abs().max() == 448.0  # amax maps to the e4m3 maximum
    assert case.fn().dtype == torch.bfloat16 and case.algorithm == "torch._scaled_mm"
    assert case.flops == 2 * 32 * 48 * 64 and case.bytes == 32 * 64 + 64 * 48 + 2 * 32 * 48 + 8


def test_fp8_check_rejects_a_wrong_scale(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    case = _fp8_case()
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, scale_a, scale_b, **kw: real(a, b, scale_a, scale_a, **kw))
    with pytest.raises(WrongResult, match="relative error"):
        case.check()


@pytest.mark.parametrize("cap, shape, match", [((8, 0), (32, 48, 64), "compute capability"),
                                               ((9, 0), (32, 40, 64), "divisible by 16"),
                                               ((9, 0), (32, 48, 72), "divisible by 16")])
def test_fp8_unsupported(cap, shape, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    with pytest.raises(Unsupported, match=match):
        _fp8_case(*shape)


def test_changed_cublas_settings_are_refused(monkeypatch):
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    with pytest.raises(Unsupported, match="float32_matmul_precision"):
        gemm.require_default_cuda_matmul()


# ---- moe_grouped_gemm ----------------------------------------------------------------------------------

def _moe_spec(**over):
    return msgspec.convert({**SMALL["moe_grouped_gemm"], **over}, moe.MoeGroupedGemmArgs)


def test_router_is_deterministic_uneven_and_grouped():
    spec = _moe_spec(tokens=512, experts=16, topk=4)
    token, expert, counts = moe.route(spec, torch.Generator().manual_seed(7))
    token2, expert2, counts2 = moe.route(spec, torch.Generator().manual_seed(7))
    assert torch.equal(token, token2) and torch.equal(expert, expert2) and torch.equal(counts, counts2)
    assert counts.sum() == len(token) == 512 * 4 and torch.equal(torch.bincount(token), torch.full((512,), 4))
    assert torch.all(expert[1:] >= expert[:-1])  # grouped by expert
    assert counts.max() >= 2 * counts.min()  # uneven loads, as real routers give
    for t in (0, 100, 511):  # each token's experts are distinct
        assert len(set(expert[token == t].tolist())) == 4


def test_moe_counts_flops_and_bytes():
    spec = _moe_spec()
    case = moe.MoeExpertLoop().build(spec, "cpu")
    _t, _e, counts = moe.route(spec, torch.Generator().manual_seed(seed_of(spec)))
    active = int((counts > 0).sum())
    rows = 24 * 2
    assert case.flops == 2 * rows * 32 * 40
    assert case.bytes == 2 * (rows * 32 + active * 32 * 40 + rows * 40)
    assert case.notes["active_experts"] == str(active) and case.algorithm == "per-expert matmul loop"


def test_moe_grouped_and_loop_agree_and_offsets_are_cumulative_ends(grouped_on_cpu):
    spec = _moe_spec()
    grouped, loop = moe.MoeGroupedMm().build(spec, "cpu"), moe.MoeExpertLoop().build(spec, "cpu")
    assert grouped.algorithm == "torch._grouped_mm"
    x, w_t, offs = grouped.inputs
    _t, _e, counts = moe.route(spec, torch.Generator().manual_seed(seed_of(spec)))
    assert offs.dtype == torch.int32 and torch.equal(offs, counts.cumsum(0).int()) and offs[-1] == x.shape[0]
    assert w_t.shape == (6, 32, 40) and w_t.stride()[1] == 1  # [experts, hidden, intermediate], column-major
    assert torch.equal(grouped.fn(), loop.fn())


def test_grouped_rows_rotate_over_routings_and_the_oracle_checks_the_first(grouped_on_cpu):
    """The torch (grouped) row rotates over draws of the routing: each refresh copies the next draw's routed rows
    and group ends into the live inputs in place (the addresses a CUDA graph captured stay valid); the check
    runs on the first draw, the one the loop backends keep."""
    spec = _moe_spec()
    case, loop = moe.MoeGroupedMm().build(spec, "cpu"), moe.MoeExpertLoop().build(spec, "cpu")
    n = moe.draws_for(spec)
    assert n == moe.MAX_DRAWS and case.notes["routings"] == str(n) and loop.notes["routings"] == "1"
    x, _w, offs = case.inputs
    ptrs, first = (x.data_ptr(), offs.data_ptr()), offs.clone()
    case.check()
    assert torch.equal(case.fn(), loop.fn())  # draw 0: the loop backend's routing
    seen = set()
    for _ in range(n):
        case.refresh()
        assert (x.data_ptr(), offs.data_ptr()) == ptrs and int(offs[-1]) == x.shape[0]
        seen.add(tuple(offs.tolist()))
    assert torch.equal(offs, first) and len(seen) > n // 2  # back to draw 0 after n; the draws differ
    lo, hi = map(int, case.notes["active_experts_range"].split("-"))
    assert lo <= float(case.notes["active_experts_mean"]) <= hi <= spec.experts
    rebuilt = moe.MoeGroupedMm().build(spec, "cpu")  # deterministic per spec
    rebuilt.refresh()
    case.refresh()
    assert torch.equal(rebuilt.inputs[2], case.inputs[2]) and torch.equal(rebuilt.inputs[0], case.inputs[0])


def test_large_batches_draw_fewer_routings_within_the_byte_budget():
    assert moe.draws_for(_moe_spec(tokens=2048, topk=2, hidden=14336)) == max(1, (1 << 30) // (4096 * 14336 * 2))
    assert moe.draws_for(_moe_spec(tokens=1 << 16, experts=8, topk=8, hidden=8192)) == 1


def test_moe_oracle_catches_rows_shifted_within_a_group(monkeypatch):
    case = moe.MoeExpertLoop().build(_moe_spec(), "cpu")
    case.check()
    real = torch.matmul

    def shifted(a, b, out=None):
        res = real(a, b).roll(1, 0)
        return out.copy_(res) if out is not None else res

    monkeypatch.setattr(torch, "matmul", shifted)
    with pytest.raises(WrongResult):
        case.check()


def test_grouped_mm_is_unsupported_on_cpu():
    with pytest.raises(Unsupported, match="CUDA only; use backend torch-cpu"):
        moe.MoeGroupedMm().build(_moe_spec(), "cpu")


@pytest.mark.parametrize("cap, match", [((8, 0), "sm90/sm100 only"), ((12, 0), "sm90/sm100 only")])
def test_grouped_mm_refuses_rather_than_fall_back(cap, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    with pytest.raises(Unsupported, match=match):
        moe._require_grouped_mm("cuda", True)


@pytest.mark.parametrize("over, field, fix", [({"dtype": "fp16"}, "dtype", "use dtype bf16, or backend torch-loop"),
                                              ({"hidden": 36}, "hidden", "use a multiple of 8 (e.g. 40)")])
def test_grouped_mm_specs_it_cannot_run_are_refused_before_anything_is_written(over, field, fix, tmp_path):
    """An fp16 or unaligned spec of the torch backend was stored as an `unsupported` row (exit 1), though no GPU runs
    it: refused at validation (exit 2, the field and its fix named, nothing written), as fp8 on torch-cpu is; the
    loop backend takes them."""
    from kprof import api
    from kprof.errors import SpecError

    spec = {**SMALL["moe_grouped_gemm"], **over}
    with pytest.raises(SpecError, match=f'field "{field}" = .*torch._grouped_mm.*; {re.escape(fix)}') as info:
        api.run("moe_grouped_gemm", "torch", [spec], gpu_name="NVIDIA H200", db=str(tmp_path / "x.db"))
    assert info.value.field == field and os.listdir(tmp_path) == []
    msgspec.convert(spec, lookup("moe_grouped_gemm", "torch-loop").args)  # the loop backend takes it


@pytest.mark.parametrize("cap", [(9, 0), (10, 0)])
def test_grouped_mm_accepts_bf16_on_sm90_and_sm100(cap, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    moe._require_grouped_mm("cuda", True)


def test_moe_measures_on_cpu():
    entry = lookup("moe_grouped_gemm", "torch-cpu")
    (out,) = measure_specs(entry, [SMALL["moe_grouped_gemm"]], "test cpu")
    assert type(out.event) is Measured
    assert out.event.metrics["tflops"] > 0 and out.event.metrics["memory_bandwidth_gbps"] > 0


# ---- memcpy --------------------------------------------------------------------------------------------

def test_memcpy_case():
    case = _build(lookup("memcpy", "torch-cpu"))
    dst, src = case.inputs
    n = SMALL["memcpy"]["bytes"]
    assert dst.dtype == src.dtype == torch.uint8 and dst.numel() == src.numel() == n
    assert dst.data_ptr() != src.data_ptr() and not torch.equal(dst, src)  # built different
    assert int((src == 0).sum()) == 0  # never zeros
    assert case.flops == 0 and case.bytes == 2 * n
    case.check()
    assert case.fn() is dst and torch.equal(dst, src)


def test_memcpy_check_catches_a_copy_that_does_nothing(monkeypatch):
    case = _build(lookup("memcpy", "torch-cpu"))
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: self)
    with pytest.raises(WrongResult, match="differs from the source"):
        case.check()


def test_memcpy_check_catches_one_wrong_byte(monkeypatch):
    case = _build(lookup("memcpy", "torch-cpu"))
    real = torch.Tensor.copy_

    def off_by_one(self, src, non_blocking=False):
        real(self, src)
        self[-1] ^= 1
        return self

    monkeypatch.setattr(torch.Tensor, "copy_", off_by_one)
    with pytest.raises(WrongResult, match="1 of"):
        case.check()


def test_memcpy_of_one_byte_and_a_null_tflops_row():
    entry = lookup("memcpy", "torch-cpu")
    _build(entry, bytes=1).check()
    ok, = measure_specs(entry, [{"bytes": 1 << 20}], "test cpu")
    assert type(ok.event) is Measured
    assert ok.event.metrics["tflops"] is None and ok.event.metrics["memory_bandwidth_gbps"] > 0

