"""The torch-cpu runners: each oracle accepts the production callable and rejects a wrong result; inputs are
deterministic; the statistics and the CPU timer behave on synthetic samples."""

import math
import random
import time
import types
import zlib

import msgspec
import pytest
import torch
import torch.nn.functional as F

from kprof.ledger.events import Failed, Measured
from kprof.measure.cpu_timer import time_cpu
from kprof.measure.stats import StopRule, block_means, mean_halfwidth, median_halfwidth, summarize
from kprof.runners._case import TOLERANCE, Unsupported, WrongResult, check_close, seed_of
from kprof.runners.registry import entries, lookup
from kprof.runners.worker import classify, measure_specs

# A small spec (all but dtype) per table: GQA where the table has heads, shapes not all equal.
SMALL = {
    "single_gemm": {"m": 32, "n": 48, "k": 64},
    "rms_norm": {"tokens": 8, "hidden": 64},
    "silu_mul": {"tokens": 8, "hidden": 64},
    "attention_prefill": {"batch": 2, "seq_len": 16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                          "causal": True},
    "attention_decode": {"batch": 2, "kv_len": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
    "moe_grouped_gemm": {"tokens": 24, "experts": 6, "topk": 2, "hidden": 32, "intermediate": 40},
}
# The production public callable each family times; patching it sabotages the kernel but not the oracle.
CALLABLE = {
    "single_gemm": (torch, "matmul"),
    "rms_norm": (F, "rms_norm"),
    "silu_mul": (F, "silu"),
    "attention_prefill": (F, "scaled_dot_product_attention"),
    "attention_decode": (F, "scaled_dot_product_attention"),
    "moe_grouped_gemm": (torch, "matmul"),
}
# The floating-point families (a dtype axis): memcpy, which copies bytes, has its own tests in test_catalog.py.
CPU = [e for e in entries() if e.backend == "torch-cpu" and "dtype" in e.args.__struct_fields__]
IDS = [e.table for e in CPU]
# a relative error every check must reject: 5% for bf16, 1e-3 for fp32 (and 2% for fp16)
REJECT = [("bf16", 5e-2), ("fp32", 1e-3), ("fp16", 2e-2)]


def _spec(entry, dtype, **over):
    return msgspec.convert({**SMALL[entry.table], "dtype": dtype, **over}, entry.args)


def _case(entry, dtype, **over):
    spec = _spec(entry, dtype, **over)
    return spec, entry.load_runner()().build(spec, "cpu")


def test_every_cpu_entry_is_covered():
    assert CPU, "no torch-cpu entries registered"
    assert {e.table for e in CPU} <= set(SMALL) and {e.table for e in CPU} <= set(CALLABLE)
    assert {e.table for e in entries() if e.backend == "torch-cpu"} - {e.table for e in CPU} == {"memcpy"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("entry", CPU, ids=IDS)
def test_oracle_accepts_the_kernel(entry, dtype):
    _spec_, case = _case(entry, dtype)
    case.check()
    out = case.fn()
    assert out.dtype == getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    assert torch.isfinite(out.double()).all() and out.double().abs().sum() > 0  # realistic inputs, never zeros
    assert case.flops > 0 and case.bytes > 0


@pytest.mark.parametrize("dtype, rel", REJECT)
@pytest.mark.parametrize("entry", CPU, ids=IDS)
def test_sabotaged_kernel_fails_the_check(entry, dtype, rel, monkeypatch):
    _spec_, case = _case(entry, dtype)
    case.check()
    module, name = CALLABLE[entry.table]
    real = getattr(module, name)
    # in place, so a call writing into out= (the MoE expert loop) is sabotaged too
    monkeypatch.setattr(module, name, lambda *a, **kw: real(*a, **kw).mul_(1 + rel))
    with pytest.raises(WrongResult, match="relative error"):
        case.check()


@pytest.mark.parametrize("entry", CPU, ids=IDS)
def test_non_finite_result_fails_the_check(entry, monkeypatch):
    _spec_, case = _case(entry, "fp32")
    module, name = CALLABLE[entry.table]
    real = getattr(module, name)

    def broken(*a, **kw):
        out = real(*a, **kw)  # in place, as above
        out.view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(module, name, broken)
    with pytest.raises(WrongResult, match="non-finite"):
        case.check()


def _perturbed(ref64: torch.Tensor, rel: float, seed: int = 0) -> torch.Tensor:
    """ref plus noise in a random direction, with exactly `rel` relative Frobenius error."""
    noise = torch.randn(ref64.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ref64 + noise * (rel * torch.linalg.vector_norm(ref64) / torch.linalg.vector_norm(noise))


@pytest.mark.parametrize("dtype, rel", REJECT)
@pytest.mark.parametrize("entry", CPU, ids=IDS)
def test_check_close_rejects_the_error_on_each_family_output(entry, dtype, rel):
    _spec_, case = _case(entry, dtype)
    ref64 = case.fn().double()
    got = _perturbed(ref64, rel).to(case.fn().dtype)
    with pytest.raises(WrongResult):
        check_close(got, ref64, dtype, entry.table)
    # a result well inside the tolerance passes
    check_close(_perturbed(ref64, TOLERANCE[dtype] / 10).to(case.fn().dtype), ref64, dtype, entry.table)


def test_tolerances_are_ordered_by_precision():
    assert TOLERANCE["fp32"] < TOLERANCE["fp16"] < TOLERANCE["bf16"] < TOLERANCE["fp8_e4m3"]
    assert TOLERANCE["fp32"] < 1e-3 and TOLERANCE["bf16"] < 5e-2 and TOLERANCE["fp16"] < 2e-2


@pytest.mark.parametrize("entry", CPU, ids=IDS)
def test_inputs_are_deterministic(entry):
    spec, a = _case(entry, "bf16")
    _spec2, b = _case(entry, "bf16")
    assert torch.equal(a.fn(), b.fn())
    assert seed_of(spec) == zlib.crc32(msgspec.json.encode(spec))
    # another spec of the same dtype gets another seed and other inputs: one more row in the first field, so with a
    # seed that ignored the spec the first input's leading values would repeat
    first = next(iter(SMALL[entry.table]))
    other_spec, other = _case(entry, "bf16", **{first: SMALL[entry.table][first] + 1})
    assert seed_of(other_spec) != seed_of(spec)
    x, y = a.inputs[0].flatten(), other.inputs[0].flatten()
    n = min(x.numel(), y.numel())
    assert not torch.equal(x[:n], y[:n])


def test_gemm_fp8_is_refused_by_the_cpu_backend_and_unsupported_by_its_runner():
    """The CPU entry's specs refuse fp8 at validation (no failed row is stored); the runner, given the CUDA entry's
    spec on a CPU device, still says why it cannot build it."""
    from kprof.errors import SpecError
    from kprof.specs import validate

    entry = lookup("single_gemm", "torch-cpu")
    with pytest.raises(SpecError, match="'fp8_e4m3'.*use one of bf16, fp16, fp32"):
        validate(entry.args, [{"m": 16, "n": 16, "k": 16, "dtype": "fp8_e4m3"}])
    with pytest.raises(Unsupported) as info:
        entry.load_runner()().build(_spec(lookup("single_gemm", "torch"), "fp8_e4m3"), "cpu")
    assert classify(info.value) == "unsupported"


@pytest.mark.parametrize("table", ["single_gemm", "moe_grouped_gemm", "attention_prefill", "attention_decode"])
def test_fp32_matmuls_lowered_by_the_process_are_unsupported_not_stored_as_fp32(table):
    """A caller's torch.set_float32_matmul_precision("medium") (an in-process api.run) lets oneDNN compute fp32
    matmuls in bf16 on CPUs with bf16 units: the row would say fp32. The fp32 spec is refused as unsupported, naming
    the setting and its fix; a bf16 spec, which that setting does not touch, still builds. SDPA's fp32 CPU kernels
    (flash's cpublas gemm, math's matmul) take that path too: attention was measured under it."""
    entry = lookup(table, "torch-cpu")
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        with pytest.raises(Unsupported, match=r"in bf16 .*set_float32_matmul_precision\('highest'\)") as info:
            _case(entry, "fp32")
        assert classify(info.value) == "unsupported"
        _case(entry, "bf16")
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
    _case(entry, "fp32")


def test_classify():
    assert classify(WrongResult("x")) == "wrong_result"
    assert classify(NotImplementedError("x")) == "unsupported"
    assert classify(RuntimeError('"addmm" not implemented for \'Half\'')) == "unsupported"
    assert classify(MemoryError()) == "oom"
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate")) == "oom"
    # torch's CPU allocator where memory is limited (ulimit, container): a RuntimeError, not an OutOfMemoryError
    assert classify(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                 "memory: you tried to allocate 8589934592 bytes. Error code 12")) == "oom"
    assert classify(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 64 bytes.")) == "oom"
    with pytest.raises(RuntimeError) as refused:  # the allocator's own refusal, as a limited host gives it
        torch.empty(1 << 60, dtype=torch.uint8)
    assert classify(refused.value) == "oom"
    assert classify(TimeoutError()) == "timeout"
    assert classify(ValueError("boom")) == "crash"


def test_measure_specs_measures_and_records_failures():
    entry = lookup("single_gemm", "torch-cpu")
    specs = [{"m": 16, "n": 16, "k": 16, "dtype": "fp32"}, {"m": 1 << 22, "n": 1 << 22, "k": 1 << 22, "dtype": "fp32"}]
    ok, bad = list(measure_specs(entry, specs, "test cpu"))
    assert (ok.index, bad.index) == (0, 1)
    assert type(ok.event) is Measured and type(bad.event) is Failed
    assert set(ok.event.metrics) == {"time_ms", "tflops", "memory_bandwidth_gbps", "energy_j"}
    assert ok.event.metrics["energy_j"] is None and ok.event.metrics["time_ms"] == ok.event.stats.median
    assert ok.event.method.timer == "cpu" and ok.event.method.budget_s == 0.05
    assert ok.event.method.stop_reason in ("converged", "budget", "max_samples")
    assert ok.event.provenance.gpu_key == "test cpu" and ok.event.provenance.shape == specs[0]
    assert 0 < ok.timed_seconds <= ok.seconds
    assert bad.event.error_kind == "oom" and bad.timed_seconds == 0  # refused before anything is allocated


@pytest.mark.parametrize("entry", [*CPU, lookup("memcpy", "torch-cpu")], ids=[*IDS, "memcpy"])
def test_held_bytes_is_what_the_case_holds_at_least(entry):
    """The worker's memory check reads held_bytes: never more than the case's inputs and output really take (it
    must not refuse a spec that fits), and not far below (it must catch one that cannot)."""
    spec = msgspec.convert({"bytes": 4096}, entry.args) if entry.table == "memcpy" else _spec(entry, "bf16")
    runner = entry.load_runner()()
    case = runner.build(spec, "cpu")
    out = case.fn()
    tensors = {id(t): t for t in case.inputs if isinstance(t, torch.Tensor)}
    if isinstance(out, torch.Tensor) and all(out.data_ptr() != t.data_ptr() for t in tensors.values()):
        tensors[id(out)] = out
    held = sum(t.untyped_storage().nbytes() for t in tensors.values())
    assert 0.5 * held <= runner.held_bytes(spec) <= held, (runner.held_bytes(spec), held)


def test_a_spec_larger_than_memory_is_an_oom_row_before_anything_is_built(monkeypatch):
    """Past the machine's memory, a CPU allocation does not fail: the OOM killer ends the process, with no row."""
    import kprof.runners.worker as worker

    entry = lookup("single_gemm", "torch-cpu")
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 4}  # a 16 KiB machine
    monkeypatch.setattr(worker.os, "sysconf", lambda name: pages[name])
    built = []
    real = type(entry.load_runner()()).build
    monkeypatch.setattr(type(entry.load_runner()()), "build", lambda self, *a: built.append(a) or real(self, *a))
    small, large = {"m": 8, "n": 8, "k": 8, "dtype": "fp32"}, {"m": 64, "n": 64, "k": 64, "dtype": "fp32"}
    ok, oom = measure_specs(entry, [small, large], "test cpu")
    assert type(ok.event) is Measured and type(oom.event) is Failed and oom.event.error_kind == "oom"
    assert "out of memory before building" in oom.event.message and "this machine has" in oom.event.message
    assert len(built) == 1 and oom.timed_seconds == 0


@pytest.mark.parametrize("entry", [e for e in CPU if e.table != "moe_grouped_gemm"], ids=lambda e: e.table)
def test_a_spec_whose_build_passes_memory_is_an_oom_row_before_anything_is_built(entry, monkeypatch):
    """Inputs are drawn in fp32 and converted: a bf16 case's build holds 2-3x its inputs and output (a decode GEMM's
    B three times over). A spec whose inputs and output fit but whose build did not was built, and the OOM killer
    ended the run with no row."""
    import kprof.runners.worker as worker

    runner = entry.load_runner()()
    spec = _spec(entry, "bf16", **({"num_kv_heads": 4} if entry.table == "attention_prefill" else {}))  # k, v as q
    held, peak = runner.held_bytes(spec), runner.peak_bytes(spec)
    assert peak > held
    pages = {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": (held + peak) // 2}  # a machine the inputs fit, the build not
    monkeypatch.setattr(worker.os, "sysconf", lambda name: pages[name])
    built = []
    monkeypatch.setattr(type(runner), "build", lambda self, *a: built.append(a))
    (oom,) = measure_specs(entry, [spec], "test cpu")
    assert type(oom.event) is Failed and oom.event.error_kind == "oom", oom.event
    assert "building them (drawn in fp32, then converted)" in oom.event.message and not built


def test_a_wrong_kernel_is_never_timed(monkeypatch):
    entry = lookup("single_gemm", "torch-cpu")
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: real(a, b) * 1.01)
    (out,) = measure_specs(entry, [{"m": 16, "n": 16, "k": 16, "dtype": "fp32"}], "test cpu")
    assert type(out.event) is Failed and out.event.error_kind == "wrong_result"
    assert "relative error" in out.event.message and out.timed_seconds == 0


def test_a_build_that_returns_no_case_says_so(monkeypatch):
    """A plugin's build() that returned None (a missing return) failed its row as "AttributeError: 'NoneType' object
    has no attribute 'check'": the message names the runner and what build() must return."""
    entry = lookup("single_gemm", "torch-cpu")
    monkeypatch.setattr(type(entry.load_runner()()), "build", lambda self, spec, device: None)
    (out,) = measure_specs(entry, [{"m": 16, "n": 16, "k": 16, "dtype": "fp32"}], "test cpu")
    assert type(out.event) is Failed and out.event.error_kind == "crash"
    assert out.event.message == ("TypeError: runner kprof.runners.gemm:SingleGemm build() returned NoneType, not a "
                                 "kprof.runners._case.Case")


@pytest.mark.parametrize("field,value", [("flops", -1.0), ("flops", math.nan), ("bytes", math.inf), ("bytes", "12")])
def test_a_case_whose_counted_work_is_no_count_fails_its_row_untimed(field, value, monkeypatch):
    """A plugin's Case(flops=-1.0) stored an ok row of negative tflops, flops=nan one whose tflops --json printed as
    null (a metric that does not apply) and bytes=inf one of infinite bandwidth: the row fails before any timing,
    naming the runner, the field and its value."""
    entry = lookup("single_gemm", "torch-cpu")
    real = type(entry.load_runner()()).build
    monkeypatch.setattr(type(entry.load_runner()()), "build",
                        lambda self, spec, device: real(self, spec, device)._replace(**{field: value}))
    (out,) = measure_specs(entry, [{"m": 16, "n": 16, "k": 16, "dtype": "fp32"}], "test cpu")
    assert type(out.event) is Failed and out.event.error_kind == "crash" and out.timed_seconds == 0
    assert out.event.message == (f"ValueError: runner kprof.runners.gemm:SingleGemm build() counted {field}={value!r}: "
                                 f"the work of one call is a finite number >= 0 (0: not counted, its rate null)")


@pytest.mark.parametrize("notes", [{"estimator": "mean"}, {"estimator": "copy_mean", "copy_mean_ms": "1.0"}])
def test_a_case_note_the_rows_time_is_read_by_fails_its_row_untimed(notes, monkeypatch):
    """A plugin's Case(notes={"estimator": "mean"}) made its CPU row's time_ms the mean of the samples (24x the median
    of a row with one slow sample), and {"estimator": "copy_mean", ...} a time the runner wrote: refused, naming it."""
    entry = lookup("single_gemm", "torch-cpu")
    real = type(entry.load_runner()()).build
    monkeypatch.setattr(type(entry.load_runner()()), "build",
                        lambda self, spec, device: real(self, spec, device)._replace(notes=notes))
    (out,) = measure_specs(entry, [{"m": 16, "n": 16, "k": 16, "dtype": "fp32"}], "test cpu")
    assert type(out.event) is Failed and out.event.error_kind == "crash" and out.timed_seconds == 0
    assert out.event.message == ("ValueError: runner kprof.runners.gemm:SingleGemm build() gave the note "
                                 f"{sorted(notes)[0]!r}, which kprof reads the row's time by: give the runner's note "
                                 "another name")


def test_a_row_whose_time_reads_zero_fails_naming_it(monkeypatch):
    """A timer that read a call as 0 ms (the events timer clamps a negative reading at 0) failed its row as a bare
    ZeroDivisionError from the rates; the row fails naming the time read and the timer that resolves it."""
    from kprof.runners import worker

    monkeypatch.setattr(worker, "_time_ms", lambda stats, notes: 0.0)
    entry = lookup("single_gemm", "torch-cpu")
    (out,) = measure_specs(entry, [{"m": 16, "n": 16, "k": 16, "dtype": "fp32"}], "test cpu")
    assert type(out.event) is Failed and out.event.error_kind == "crash"
    assert out.event.message.startswith("ValueError: the timer read the row's time as 0.0 ms") and "cupti" in \
        out.event.message


@pytest.mark.parametrize("stop", [143, 129])
def test_a_runner_that_calls_sys_exit_fails_its_row_and_a_sigterm_still_stops_the_run(stop, monkeypatch):
    """A plugin's build() that called sys.exit(0) (or a library it calls) ended `kprof run` with exit 0, no output and
    no row: it fails its row as a crash and the others are measured. SIGTERM, which kprof.cli raises as
    SystemExit(143), still stops the run, and so does SIGHUP (129)."""
    entry = lookup("single_gemm", "torch-cpu")
    real = type(entry.load_runner()()).build

    def build(self, spec, device):
        if spec.m == 8:
            raise SystemExit(exits.pop(0))
        return real(self, spec, device)

    exits = [0, stop]
    monkeypatch.setattr(type(entry.load_runner()()), "build", build)
    specs = [{"m": 8, "n": 16, "k": 16, "dtype": "fp32"}, {"m": 16, "n": 16, "k": 16, "dtype": "fp32"}]
    gone, ok = measure_specs(entry, specs, "test cpu")
    assert type(gone.event) is Failed and gone.event.error_kind == "crash" and gone.event.message == "SystemExit: 0"
    assert type(ok.event) is Measured
    with pytest.raises(SystemExit):
        list(measure_specs(entry, specs, "test cpu"))


# ---- statistics and stopping ---------------------------------------------------------------------------

def test_summarize_constant_samples():
    s = summarize([2.0] * 20)
    assert (s.n, s.median, s.p10, s.p90, s.mean, s.min, s.max) == (20, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0)
    assert s.stdev == 0.0 and s.cv == 0.0 and s.samples == [2.0] * 20


def test_summarize_known_values():
    xs = [float(x) for x in (7, 3, 10, 1, 5, 2, 9, 4, 8, 6)]
    s = summarize(xs)
    assert s.n == 10 and s.median == 5.5 and s.mean == 5.5 and (s.min, s.max) == (1.0, 10.0)
    assert s.p10 == pytest.approx(1.9) and s.p90 == pytest.approx(9.1)
    assert s.stdev == pytest.approx(3.0276503540974917) and s.cv == pytest.approx(s.stdev / 5.5)
    assert s.samples == xs  # raw samples in arrival order


def test_summarize_single_sample_and_thinning():
    assert summarize([1.5]).stdev == 0.0
    xs = [float(i) for i in range(1000)]
    s = summarize(xs, keep=512)
    assert s.n == 1000 and len(s.samples) == 512 and s.samples[0] == 0.0 and s.samples[-1] == 999.0
    assert s.samples == sorted(s.samples)


@pytest.mark.parametrize("xs", [[1.0, math.nan, 2.0], [math.nan, 1.0, 2.0, 3.0], [1.0, 2.0, math.inf], [-5.0, 1.0, 2.0],
                                [-1.0, -2.0, -3.0], []])
def test_summarize_refuses_samples_that_are_no_duration(xs, monkeypatch):
    """A broken timer's NaN or inf failed its row as "AttributeError: 'float' object has no attribute 'numerator'"
    (statistics.stdev), and negative samples summarized with cv 0.0 beside a stdev of 3.8: each is refused, naming
    the sample, and a row timed so fails saying it."""
    with pytest.raises(ValueError, match="the timer gave .*: a row's statistics need durations, finite and >= 0"):
        summarize(xs)
    assert summarize([0.0, 0.0, 0.0]).median == 0.0  # an events timer's sample is clamped at 0: still a duration
    monkeypatch.setattr("kprof.measure.cpu_timer.time_cpu",
                        lambda fn, rule: types.SimpleNamespace(samples_ms=xs, stop_reason="budget", warmup=2, inner=1,
                                                               wall_s=0.01))
    entry = lookup("single_gemm", "torch-cpu")
    (out,) = measure_specs(entry, [{"m": 16, "n": 16, "k": 16, "dtype": "fp32"}], "test cpu")
    assert type(out.event) is Failed and out.event.error_kind == "crash"
    assert out.event.message.startswith("ValueError: the timer gave ")


def test_median_halfwidth():
    assert median_halfwidth([1.0, 1.0, 1.0, 1.0]) == math.inf  # too few samples
    assert median_halfwidth([3.0] * 50) == 0.0
    xs = [float(i) for i in range(1, 101)]
    # order statistics 40 and 60 (0-based) around a median of 50.5
    assert median_halfwidth(xs) == pytest.approx((61 - 41) / 2 / 50.5)
    assert median_halfwidth([0.0] * 10) == math.inf


def test_mean_halfwidth_is_students_t_interval():
    assert mean_halfwidth([2.0]) == math.inf and mean_halfwidth([]) == math.inf  # too few values
    assert mean_halfwidth([2.0] * 7) == 0.0
    # mean 2, stdev 1, n 4: t(3) = 3.182
    assert mean_halfwidth([1.0, 2.0, 3.0, 2.0]) == pytest.approx(3.182 * (2 / 3) ** 0.5 / 2 / 2)
    xs = [1.0 + (i % 2) for i in range(100)]  # beyond 30 degrees of freedom: 1.96
    assert mean_halfwidth(xs) == pytest.approx(1.96 * 0.50252 / 10 / 1.5, rel=1e-4)


def test_block_means_group_batches_by_wall_time():
    """Batches (end, sum, count) into blocks of at least block_s from `start`: per-call means; a last short block
    and a block of discarded batches only (count 0) are left out."""
    batches = [(1.0, 4.0, 4), (2.0, 8.0, 4), (3.0, 12.0, 4), (4.5, 0.0, 0), (6.0, 15.0, 5), (6.5, 1.0, 1)]
    assert block_means(batches, 2.5, 0.0) == [24.0 / 12, 15.0 / 5]  # [0, 3), [3, 6); [6, 6.5) is short
    assert block_means(batches, 1.2, 0.0) == [12.0 / 8, 12.0 / 4, 15.0 / 5]
    discarded = [(1.5, 6.0, 3), (3.0, 0.0, 0), (4.5, 8.0, 2), (5.0, 1.0, 1)]
    assert block_means(discarded, 1.2, 0.0) == [6.0 / 3, 8.0 / 2]  # [1.5, 3) held no kept sample
    assert block_means([], 0.1, 0.0) == []


def test_stop_rule_converges_on_constant_samples():
    rule = StopRule(target=0.005, min_samples=10, min_time_s=0.02, budget_s=1.0)
    assert rule.check([20.0] * 9, 0.5) is None  # below min_samples
    assert rule.check([20.0] * 10, 0.01) is None  # below min_time_s
    assert rule.check([20.0] * 10, 0.3) == "converged"  # 200 ms of timed work (the floor is 50 ms)
    assert rule.check([20.0] * 12, 0.3) is None  # the CI is checked every 5 samples


def test_stop_rule_work_floor():
    """A long kernel must not converge on its first few samples: 50 ms of timed work or 100 samples."""
    rule = StopRule(target=0.005, min_samples=10, min_time_s=0.02, budget_s=10.0)
    assert rule.check([1.0] * 10, 0.5) is None  # 10 ms of work in 10 samples
    assert rule.check([2.0] * 20, 0.5) is None  # 40 ms
    assert rule.check([0.1] * 95, 0.5) is None  # 9.5 ms in 95 samples
    assert rule.check([0.1] * 100, 0.5) == "converged"  # 100 samples
    assert rule.check([5.0] * 10, 0.5) == "converged"  # 50 ms of work


def test_stop_rule_budget_and_max_samples():
    noisy = [1.0, 2.0, 4.0, 8.0, 16.0] * 4
    rule = StopRule(target=0.005, budget_s=0.05, max_samples=100)
    assert rule.check(noisy, 0.04) is None
    assert rule.check(noisy, 0.05) == "budget"
    assert rule.check([1.0, 2.0], 10.0) is None  # at least 3 samples, even past the budget
    assert rule.check(noisy * 5, 0.0) == "max_samples"


def test_stop_rule_from_env(monkeypatch):
    assert StopRule.from_env().budget_s == 0.05  # the conftest's knob
    monkeypatch.setenv("KPROF_TARGET_CI", "0.02")
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.25")
    rule = StopRule.from_env()
    assert (rule.target, rule.budget_s) == (0.02, 0.25)
    monkeypatch.delenv("KPROF_TARGET_CI")
    monkeypatch.delenv("KPROF_TIME_BUDGET_S")
    assert (StopRule.from_env().target, StopRule.from_env().budget_s) == (StopRule().target, StopRule().budget_s)


def test_time_cpu_trivial_function():
    calls = []
    t = time_cpu(lambda: calls.append(None), StopRule(budget_s=0.05))
    assert t.samples_ms and all(s > 0 for s in t.samples_ms)
    assert t.stop_reason in ("converged", "budget", "max_samples")
    assert t.warmup >= 2 and t.inner > 1  # a sub-microsecond call is timed in groups
    assert len(calls) == t.warmup + t.inner * len(t.samples_ms)
    assert 0 < t.wall_s < 1.0


def test_time_cpu_stops_on_budget_when_it_cannot_converge():
    # never converges (target < 0), and never stops at the clock's resolution either: a no-op's grouped samples
    # can all read the same tick, but sleeps of random length spread over many ticks
    rng = random.Random(7)
    t = time_cpu(lambda: time.sleep(rng.random() * 2e-4), StopRule(target=-1.0, budget_s=0.03, max_samples=10 ** 9))
    assert t.stop_reason == "budget" and t.wall_s >= 0.03 and len(t.samples_ms) >= 3


def test_time_cpu_stops_at_max_samples():
    t = time_cpu(lambda: None, StopRule(target=0.0, budget_s=60.0, max_samples=7))
    assert t.stop_reason == "max_samples" and len(t.samples_ms) == 7


def test_time_cpu_measures_a_known_duration():
    t = time_cpu(lambda: time.sleep(0.002), StopRule(budget_s=0.05, min_samples=5))
    assert t.inner == 1
    assert min(t.samples_ms) >= 2.0 and summarize(t.samples_ms).median < 20.0


def test_stop_rule_stops_at_the_clock_resolution():
    """Samples quantized to a clock tick (a 2.5 µs kernel read by a 32 ns clock) stop once the median's CI
    spans a tick: more samples cannot narrow it below the tick, and the relative target is then unreachable."""
    tick = 32e-6
    xs = [2.528e-3 + tick * (i % 2) for i in range(100)]  # half on each of two ticks
    rule = StopRule(target=0.005, min_samples=10, min_time_s=0.0, budget_s=10.0)
    assert median_halfwidth(sorted(xs)) > 0.005  # the relative target alone would never be met
    assert rule.check(xs, 0.5) == "resolution"
    spread = [2.5e-3 + tick * (i % 11) for i in range(100)]  # ten ticks of spread: keep sampling
    assert rule.check(spread, 0.5) is None


def test_an_unstable_kernel_set_gets_one_more_attempt():
    from kprof.measure._attribution import TimerError, UnstableKernels
    from kprof.runners.cuda_device import twice_if_unstable

    calls = []

    def flaky():
        calls.append(None)
        if len(calls) == 1:
            raise UnstableKernels("unstable kernel set: warm-up invocation 2 launched {gemm}, but ...")
        return "timing"

    assert twice_if_unstable(flaky) == ("timing", "unstable kernel set: warm-up invocation 2 launched {gemm}, but ...")
    assert twice_if_unstable(lambda: "timing") == ("timing", None)

    def always():
        raise UnstableKernels("unstable kernel set: again")

    with pytest.raises(TimerError, match="again"):
        twice_if_unstable(always)

    calls.clear()

    def first_invocation_unseen():
        calls.append(None)
        if len(calls) == 1:
            raise UnstableKernels("CUPTI saw no kernel in the first warm-up invocation; the callable must launch ...")
        return "timing"

    assert twice_if_unstable(first_invocation_unseen) == (
        "timing", "CUPTI saw no kernel in the first warm-up invocation; the callable must launch ...")

    def dropped():
        calls.append(None)
        raise TimerError("CUPTI dropped 3 activity records")

    calls.clear()
    with pytest.raises(TimerError, match="dropped"):
        twice_if_unstable(dropped)
    assert len(calls) == 1  # only what a second attempt can clear is tried again


def test_a_cpu_row_carries_the_hosts_load_and_says_when_other_work_shared_the_cores(monkeypatch):
    """A busy host slows every sample alike (no spread shows it): the row's notes carry the load beside it."""
    import kprof.runners.worker as worker

    entry = lookup("single_gemm", "torch-cpu")
    spec = {"m": 8, "n": 8, "k": 8, "dtype": "fp32"}
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(worker.resource, "getrusage", lambda who: types.SimpleNamespace(ru_nivcsw=0))  # no preemption
    for load, busy in ((0.5, False), (7.25, True)):
        monkeypatch.setattr(worker.os, "getloadavg", lambda load=load: (load, load, load))
        (out,) = measure_specs(entry, [spec], "test cpu")
        notes = out.event.method.notes
        assert notes["host_load_1m"] == f"{load:.2f}"
        assert ("host_busy" in notes) is busy and (not busy or notes["host_busy"] == "load 7.25 over 2 cores: other "
                                                   "work shared them")


@pytest.mark.parametrize("switches, busy", [(0, False), (3, False), (100_000, True)])
def test_a_cpu_row_says_when_other_work_took_its_cores_below_the_load_average(switches, busy, monkeypatch):
    """The load average is a minute's mean: a neighbour holding one of 2 cores through a row's second read a 2-thread
    GEMM 5x slow at load 1.3, and the row carried no host_busy. The scheduler's involuntary context switches of this
    process while it was timed say it."""
    import kprof.runners.worker as worker

    entry = lookup("single_gemm", "torch-cpu")
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(worker.os, "getloadavg", lambda: (1.3, 1.3, 1.3))
    counts = iter([0, switches])
    monkeypatch.setattr(worker.resource, "getrusage", lambda who: types.SimpleNamespace(ru_nivcsw=next(counts)))
    (out,) = measure_specs(entry, [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], "test cpu")
    notes = out.event.method.notes
    assert notes["involuntary_switches"] == str(switches)
    assert ("host_busy" in notes) is busy
    assert not busy or notes["host_busy"] == (f"{switches} involuntary context switches over {out.event.stats.n} "
                                              f"samples: other work shared them")


@pytest.mark.parametrize("switches, wall_s, busy", [(44, 1.1, False), (7, 1.0, False), (215, 1.0, True),
                                                     (180, 0.39, True), (9, 0.01, False)])
def test_a_slow_cpu_row_of_a_quiet_host_is_not_called_busy(switches, wall_s, busy, monkeypatch):
    """Measured on the 2-core VM: a quiet host's 1 s row of 9 samples (a 2048^3 fp32 GEMM) took 44 involuntary
    switches, at most 40 a second, and was flagged host_busy by the rule of one switch per two samples; beside one
    busy-looping process the rows took 210-460 a second."""
    import kprof.measure.cpu_timer as cpu_timer
    import kprof.runners.worker as worker

    entry = lookup("single_gemm", "torch-cpu")
    monkeypatch.setattr(worker.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    counts = iter([0, switches])
    monkeypatch.setattr(worker.resource, "getrusage", lambda who: types.SimpleNamespace(ru_nivcsw=next(counts)))
    monkeypatch.setattr(cpu_timer, "time_cpu", lambda fn, rule: cpu_timer.Timing([118.0] * 9, "budget", 1, 1, wall_s))
    (out,) = measure_specs(entry, [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], "test cpu")
    assert ("host_busy" in out.event.method.notes) is busy, out.event.method.notes


@pytest.mark.parametrize("entry", CPU, ids=IDS)
def test_a_wrong_last_row_fails_the_check_when_the_oracle_works_in_blocks(entry, monkeypatch):
    """The oracles work in blocks (of rows, or of GEMM's k) within CHECK_ELEMENTS: a kernel wrong only in its output's
    last row (a tail bug) still fails, in whatever block holds it."""
    import kprof.runners._case as case_module
    import kprof.runners.gemm as gemm

    monkeypatch.setattr(case_module, "CHECK_ELEMENTS", 64)
    monkeypatch.setattr(gemm, "CHECK_ELEMENTS", 64)
    _spec_, case = _case(entry, "fp32")
    case.check()  # right, block by block
    module, name = CALLABLE[entry.table]
    real = getattr(module, name)

    def tail_bug(*a, **kw):
        out = real(*a, **kw)
        out.view(-1, out.shape[-1])[-1].mul_(1.5)  # in place, as above
        return out

    monkeypatch.setattr(module, name, tail_bug)
    with pytest.raises(WrongResult, match="relative error"):
        case.check()


_ORACLE_PEAK = """
import json, resource, sys
import msgspec, torch
from kprof.runners.registry import lookup
torch.set_num_threads(1)
entry = lookup(sys.argv[1], "torch-cpu")
case = entry.load_runner()().build(msgspec.convert(json.loads(sys.argv[2]), entry.args), "cpu")
case.fn()  # the kernel's own allocations, before the peak is read
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
case.check()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.parametrize("table, spec", [
    # the fp64 scores of every query were [seq_len, seq_len]: 512 MiB per pair here, 8 GiB at 32k tokens
    ("attention_prefill", {"batch": 1, "seq_len": 8192, "num_heads": 1, "num_kv_heads": 1, "head_dim": 16,
                           "causal": True, "dtype": "fp32"}),
    # the whole input in fp64, and its temporaries: 4x to 10x the input
    ("rms_norm", {"tokens": 4096, "hidden": 8192, "dtype": "bf16"}),
    ("silu_mul", {"tokens": 4096, "hidden": 4096, "dtype": "bf16"}),
    ("single_gemm", {"m": 16, "n": 10240, "k": 10240, "dtype": "fp32"}),  # B in fp64: twice B, 4x a bf16 B
])
def test_the_oracle_checks_a_large_spec_in_bounded_memory(table, spec):
    """On the CPU an allocation past the host's memory is answered by the OOM killer, with no row and no message:
    the oracle's own temporaries must not grow with the spec (the growth of a fresh process's peak resident memory
    over the build's peak, in bytes)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ORACLE_PEAK, table, msgspec.json.encode(spec).decode()],
                          capture_output=True, text=True, check=True)
    assert int(done.stdout) < 200 * 2**20, (table, int(done.stdout) / 2**20)


class _FakeClock:
    """perf_counter_ns that moves only as `call` says: each call takes `call_ns`, and the call numbered `pause_at`
    (counting from the first, warm-up included) `pause_ns` more, as a process stopped (Ctrl-Z, SIGSTOP) during it.
    `cpu` (process_time_ns) moves by the calls' work only: a stopped process runs on no CPU; `work` adds to both."""

    def __init__(self, call_ns: int, pause_at: int, pause_ns: int):
        self.now, self.calls, self.call_ns, self.pause_at, self.pause_ns = 0, 0, call_ns, pause_at, pause_ns
        self.ran = 0

    def __call__(self) -> int:
        return self.now

    def cpu(self) -> int:
        return self.ran

    def work(self, ns: int) -> None:
        self.now, self.ran = self.now + ns, self.ran + ns

    def call(self) -> None:
        self.calls += 1
        self.work(self.call_ns)
        self.now += self.pause_ns * (self.calls == self.pause_at)

    def install(self, monkeypatch) -> None:
        import kprof.measure.cpu_timer as cpu_timer

        monkeypatch.setattr(cpu_timer.time, "perf_counter_ns", self)
        monkeypatch.setattr(cpu_timer.time, "process_time_ns", self.cpu)


@pytest.mark.parametrize("call_ns, pause_ns", [(340_000, 2_040_000_000), (1_000, 2_040_000_000),
                                               (90_000_000, 500_000_000)])  # 50 calls a sample of the 1 µs copy
def test_time_cpu_sets_aside_a_sample_of_a_paused_process(call_ns, pause_ns, monkeypatch):
    """A process stopped for 2 s mid-sample read one 2,040 ms sample among 0.34 ms ones into the row's mean, stdev, cv
    and max, spent the budget at once (stop_reason budget), and said nothing; the sample is set aside, its wall time
    with it, and the row is timed on as if the process had not stopped."""
    import kprof.measure.cpu_timer as cpu_timer

    clock = _FakeClock(call_ns, pause_at=5 + 10_000_000 // call_ns, pause_ns=pause_ns)
    clock.install(monkeypatch)
    t = time_cpu(clock.call, StopRule())
    stats = summarize(t.samples_ms)
    assert stats.max == stats.min == call_ns / 1e6 and stats.cv == 0.0, stats
    assert len(t.set_aside) == 1 and t.set_aside[0] > pause_ns / 1e6 / t.inner
    assert t.stop_reason == "converged" or len(t.samples_ms) >= 10  # a 90 ms call: the budget, 10 samples or more
    assert clock.calls > clock.pause_at  # the pause fell among the samples, not the warm-up


def test_time_cpu_keeps_slow_samples_of_a_busy_host_and_a_kernel_often_slow(monkeypatch):
    """Samples a busy host preempted (53 ms among 0.19 ms ones, measured at load 3.4 on 2 cores) are the kernel's
    time on that host, which host_busy flags: kept. So are pauses past the third of a row: a kernel often that
    slow is slow."""
    import kprof.measure.cpu_timer as cpu_timer

    assert cpu_timer._paused([0.19] * 50 + [53.0], [0.19] * 51, 1) == []
    assert cpu_timer._paused([0.19] * 50 + [53.0], [0.19] * 51, 2) == [50]  # two calls of 53 ms past the median: 106 ms
    assert cpu_timer._paused([94.0] * 10 + [168.0], [94.0] * 11, 1) == []  # under 4x the median
    assert cpu_timer._paused([90.0] * 10 + [590.0], [90.0] * 11, 1) == [10]  # half a second of Ctrl-Z
    slow = iter(([False] * 9 + [True]) * 1000)  # one call in ten stopped 200 ms: a pause too often to be one
    clock = _FakeClock(1_000_000, pause_at=-1, pause_ns=0)

    def call() -> None:
        clock.call()
        clock.now += 200_000_000 * next(slow)

    clock.install(monkeypatch)
    t = time_cpu(call, StopRule(budget_s=5.0))
    assert len(t.set_aside) == 3 and max(t.samples_ms) > 200, t.set_aside


@pytest.mark.parametrize("slow_every, threads", [(5, 1), (7, 1), (7, 4)])
def test_time_cpu_keeps_a_kernel_s_own_slow_calls(slow_every, threads, monkeypatch):
    """A kernel's own slow calls (a garbage collection, an allocation's page faults: 300 ms among 50 ms calls, the
    process running through them) were set aside as pauses of the process, up to 3 a row: a row of 16 samples lost
    its 2 slow ones, or 3 of 4, and its mean, stdev and max read the kernel faster and steadier than it is. A sample is
    set aside only where the process did not run through most of its excess (its CPU time, on any number of threads,
    did not grow with it)."""
    clock = _FakeClock(50_000_000 * threads, pause_at=-1, pause_ns=0)
    slow = iter(([False] * (slow_every - 1) + [True]) * 1000)

    def call() -> None:  # `threads` threads busy through every call: the CPU time grows `threads` times the wall's
        clock.call()
        clock.now -= 50_000_000 * (threads - 1)
        if next(slow):
            clock.work(250_000_000)

    clock.install(monkeypatch)
    t = time_cpu(call, StopRule(budget_s=3.0))
    assert t.set_aside == () and max(t.samples_ms) == 300.0, (t.set_aside, t.samples_ms)


def test_a_cpu_row_names_the_samples_set_aside(monkeypatch):
    import kprof.measure.cpu_timer as cpu_timer

    entry = lookup("single_gemm", "torch-cpu")
    monkeypatch.setattr(cpu_timer, "time_cpu", lambda fn, rule: cpu_timer.Timing([0.34] * 100, "converged", 30, 1, 2.1,
                                                                                   (2040.34,)))
    (out,) = measure_specs(entry, [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], "test cpu")
    assert out.event.stats.max == 0.34
    assert out.event.method.notes["set_aside_ms"].startswith("2040.34: the process was paused"), out.event.method.notes


@pytest.mark.parametrize("first_ns, pause_ns", [(9_000_000, 0), (0, 2_040_000_000)])
def test_a_short_call_is_timed_in_groups_of_about_50_us_whatever_its_first_calls_took(first_ns, pause_ns, monkeypatch):
    """A sample's calls were sized by the warm-up's mean: a 1 µs copy whose first call took 9 ms (lazy initialization)
    was timed in groups of 5 calls, and one whose warm-up the process was stopped in, one call a sample, where the
    README says groups of about 50 µs. They are sized by the fastest warm-up call."""
    import kprof.measure.cpu_timer as cpu_timer

    clock = _FakeClock(1_000, pause_at=2, pause_ns=pause_ns)
    first = iter([first_ns])

    def call() -> None:
        clock.call()
        clock.now += next(first, 0)

    clock.install(monkeypatch)
    t = time_cpu(call, StopRule())
    assert t.inner == 50 and t.warmup < clock.calls, t


def _cpu_row_notes(monkeypatch, threads: int, load: float, switches: int) -> dict:
    """The method notes of one 8^3 torch-cpu GEMM row on `threads` torch threads, timed (a stand-in timer: 600 samples
    over 1 s) on a 2-core host of load average `load` while `switches` involuntary context switches were counted."""
    import kprof.measure.cpu_timer as cpu_timer
    import kprof.runners.worker as worker

    monkeypatch.setattr(worker.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(worker, "cpus", lambda: frozenset({0, 1}))
    counts = iter([0, switches])
    monkeypatch.setattr(worker.resource, "getrusage", lambda who: types.SimpleNamespace(ru_nivcsw=next(counts)))
    monkeypatch.setattr(cpu_timer, "time_cpu", lambda fn, rule: cpu_timer.Timing([1.5] * 600, "converged", 9, 1, 1.0))
    (out,) = measure_specs(lookup("single_gemm", "torch-cpu"), [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}],
                           "test cpu", device=worker._CpuDevice(None, threads))
    return out.event.method.notes


@pytest.mark.parametrize("threads, busy", [(8, False), (2, True)])
def test_a_cpu_row_of_more_threads_than_cpus_is_not_called_busy_for_its_own_switches(threads, busy, monkeypatch):
    """A GEMM on 8 torch threads on 2 CPUs took 1,060-1,128 involuntary switches a second, its threads taking turns
    (143-149 on 2 threads at the same load): the row read host_busy, "other work shared them", and `run` said to
    measure on a quieter host, which would change nothing. It notes `oversubscribed`; the same switches on as many
    threads as CPUs still read host_busy."""
    notes = _cpu_row_notes(monkeypatch, threads, load=0.5, switches=1100)
    assert ("host_busy" in notes) is busy and ("oversubscribed" in notes) is not busy, notes
    assert busy or notes["oversubscribed"].startswith("8 torch threads on the 2 CPU(s)")


@pytest.mark.parametrize("threads, load, busy", [(8, 5.86, False), (8, 9.0, True), (2, 5.86, True)])
def test_a_cpu_row_of_more_threads_than_cores_is_not_called_busy_for_its_own_load(threads, load, busy, monkeypatch):
    """A minute of GEMM rows on 8 torch threads on a quiet 2-core host (load 0.9) took the load to 5.9 with its own
    runnable threads: the rows read host_busy ("load 5.86 over 2 cores: other work shared them") and `run` said to
    measure on a quieter host. Each of the row's threads counts 1 in the load: it is busy where the load passes them."""
    notes = _cpu_row_notes(monkeypatch, threads, load=load, switches=10)
    assert ("host_busy" in notes) is busy, notes
    assert not busy or notes["host_busy"].startswith(f"load {load:.2f} over 2 cores"), notes


def test_a_pause_set_aside_does_not_dilute_a_cpu_row_s_switches(monkeypatch):
    """215 involuntary switches over a 1 s row read host_busy; the same row with a 2 s pause set aside read 72 a
    second over 3 s of wall time, and no longer did: the pause is no time the switches could fall in."""
    import kprof.measure.cpu_timer as cpu_timer
    import kprof.runners.worker as worker

    entry = lookup("single_gemm", "torch-cpu")
    monkeypatch.setattr(worker.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    counts = iter([0, 215])
    monkeypatch.setattr(worker.resource, "getrusage", lambda who: types.SimpleNamespace(ru_nivcsw=next(counts)))
    monkeypatch.setattr(cpu_timer, "time_cpu", lambda fn, rule: cpu_timer.Timing([0.34] * 100, "converged", 30, 1,
                                                                                   3.0, (2000.0,)))
    (out,) = measure_specs(entry, [{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}], "test cpu")
    assert "host_busy" in out.event.method.notes, out.event.method.notes


def test_time_cpu_does_not_count_a_pause_between_samples(monkeypatch):
    """A process stopped for 2 s between two samples (in the stopping rule's check, up to 40% of a short call's loop)
    read the budget spent: the row stopped at 12 samples (stop_reason budget) where it would have converged, and no
    note said why. The pause is not counted against the budget, and the row's notes give it (paused_s)."""
    import kprof.measure.cpu_timer as cpu_timer
    import kprof.runners.worker as worker

    clock = _FakeClock(340_000, pause_at=-1, pause_ns=0)

    class PausedInCheck(StopRule):
        checks = 0

        def check(self, samples, elapsed_s):
            self.checks += 1
            clock.now += 2_040_000_000 * (self.checks == 11)  # Ctrl-Z after the 11th sample, fg 2 s later
            return super().check(samples, elapsed_s)

    clock.install(monkeypatch)
    t = time_cpu(clock.call, PausedInCheck())
    assert t.stop_reason == "converged" and len(t.samples_ms) >= 100 and 2.0 < t.paused_s < 2.1, (len(t.samples_ms), t[1:])
    assert worker._set_aside(t)["paused_s"].startswith("2.040: the process was paused")
