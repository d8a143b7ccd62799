"""The measure diagnostic: the pure pieces on recorded (synthetic) windows, the window's recipe on a fake GPU, the
writers and plots, the verb's refusals, and `kprof show kmeasure.<hex>`. No GPU needed: the CUDA parts are faked
at their seams (torch, the CUPTI session, NVML), so the CPU run goes through the same code."""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import json
import math
import os
import pathlib
import random
import re
import stat
import subprocess
import sys
import time
import types

import msgspec
import pytest
from blake3 import blake3

from kprof.cli import main
from kprof.errors import IntegrityError, UsageError
from kprof.measure import _diagnostic_window, diagnostic
from kprof.measure._attribution import TimerError
from kprof.measure._diagnostic_telemetry import energy_summary, telemetry_summary, throttle_time
from kprof.measure.diagnostic import Window, check_window_args, drift, launch_stats, segment, summarize_window
from kprof.measure.diagnostic_files import find_artifact, write_outputs
from kprof.measure.nvml import TelemetrySample

ROOT = pathlib.Path(__file__).resolve().parents[2]
SWEEP, WARM, GEMM = "reduce_kernel<int, sum>", "bitwise_or_kernel<uint8>", "nvjet_sm90_tst_256x128_64x4"
GEMM_SPEC = {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"}
T0 = 5_000_000_000


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KPROF_DB", raising=False)


# ---- a recorded window: a power-capped GEMM, cold L2 ----------------------------------------------------------

def gemm_kernels(n: int = 300, seed: int = 0) -> list[tuple]:
    """CUPTI kernel tuples of n cold launches (sweep, activation rewrite, GEMM), the GEMM slowing 4 % over the window
    as a power cap takes hold, shuffled as CUPTI's buffers may deliver them."""
    rng = random.Random(seed)
    t = T0 + 20_000
    out = [("earlier_kernel", T0 - 50_000, T0 - 40_000, 0)]  # before the window's zero: not the window's
    for i in range(n):
        for name, dur in ((SWEEP, 30_000), (WARM, 2_000)):
            out.append((name, t, t + dur, 0))
            t += dur + 1_000
        d = int(1_600_000 * (1 + 0.04 * i / n) + rng.gauss(0, 4_000))
        out.append((GEMM, t, t + d, 0))
        t += d + 5_000
    rng.shuffle(out)
    return out


def telemetry(span: float, hz: float = 20.0, gap: tuple[float, float] | None = None) -> list[TelemetrySample]:
    """Readings from just before the window to its end: idle at first, then the power cap; the SM clock falls from
    1980 to 1580 MHz; the energy counter steps 70 J every 0.1 s (700 W). `gap`: no readings in (a, b)."""
    out = []
    energy = 9_000_000
    for j in range(int(span * hz) + 2):
        t = j / hz - 0.01
        if gap and gap[0] < t < gap[1]:
            continue
        if j and round(t * 1000) % 100 < round(1000 / hz):  # a step each 0.1 s
            energy += 70_000
        reasons = 0x1 if t < 0 else (0x4 if t >= 0.3 * span else 0x0)
        out.append(TelemetrySample(t, 1980 - 400 * max(t, 0) / span, 3201.0, 699.0, 60 + 5 * t / span, 100.0, reasons,
                                   energy, 0.4))
    return out


def recorded_window(n: int = 300, samples: list[TelemetrySample] | None = None, hz: float = 20.0) -> Window:
    launches, busy, last = segment(gemm_kernels(n), (SWEEP, WARM), (GEMM,), T0)
    span = last / 1e9
    samples = telemetry(span, hz) if samples is None else samples
    e_first, e_last = samples[0].energy_mj, samples[-1].energy_mj
    return Window(launches, span, busy, samples, hz, {}, (0.0, e_first, span, e_last), (GEMM,), (SWEEP, WARM),
                  {"timer": "cupti", "invocations_per_replay": "1"})


HEADER = {"kind": "kprof measure", "table": "single_gemm", "backend": "torch", "spec": GEMM_SPEC,
          "gpu_name": "Fake GPU", "mode": {"l2": "cold", "graph": False, "invocations_per_replay": 1,
                                           "duration_s": 0.5, "telemetry_hz": 20.0},
          "device": {"power_limit_w": 700.0, "gpu_name": "Fake GPU"}}


# ---- segment ---------------------------------------------------------------------------------------------------

def test_segment_gives_each_launch_its_gemm_time_and_the_idle_before_it():
    kernels = gemm_kernels(50)
    launches, busy, last = segment(kernels, (SWEEP, WARM), (GEMM,), T0)
    ordered = sorted((k for k in kernels if k[1] >= T0), key=lambda k: k[1])
    gemms = [k for k in ordered if k[0] == GEMM]
    assert len(launches.duration) == 50
    assert list(launches.duration) == [k[2] - k[1] for k in gemms]
    assert list(launches.start) == [k[1] - T0 for k in gemms]
    assert list(launches.end) == [k[2] - T0 for k in gemms]
    assert launches.idle_before[0] == 0 and set(launches.idle_before[1:]) == {7_000}  # sweep and rewrite excluded
    assert busy == sum(k[2] - k[1] for k in ordered) and last == gemms[-1][2] - T0


def test_segment_sums_a_compound_call_and_honours_the_kernel_filter():
    t, kernels = T0, []
    for _ in range(4):
        for name, d in (("gemv_splitK", 8_000), ("splitKreduce_kernel", 1_500)):
            kernels.append((name, t, t + d, 0))
            t += d + 200
    launches, _busy, _last = segment(kernels, (), ("gemv_splitK", "splitKreduce_kernel"), T0)
    assert list(launches.duration) == [9_500] * 4
    assert list(launches.idle_before) == [0, 200, 200, 200]
    only, _b, _l = segment(kernels, (), ("gemv_splitK", "splitKreduce_kernel"), T0, re.compile("reduce"))
    assert list(only.duration) == [1_500] * 4
    with pytest.raises(TimerError, match="matches none"):
        segment(kernels, (), ("gemv_splitK", "splitKreduce_kernel"), T0, re.compile("nothing"))


def test_segment_refuses_a_launch_sequence_that_changed_mid_window():
    kernels = gemm_kernels(10)
    changed = [(("other_gemm",) + k[1:]) if k[0] == GEMM and k[1] == max(x[1] for x in kernels if x[0] == GEMM)
               else k for k in kernels]
    with pytest.raises(TimerError, match=r"launch 9 of the window ran .*other_gemm"):
        segment(changed, (SWEEP, WARM), (GEMM,), T0)
    with pytest.raises(TimerError, match="not a whole number of launches"):
        segment(kernels[:-1] if kernels[-1][1] >= T0 else kernels[1:], (SWEEP, WARM), (GEMM,), T0)


# ---- statistics ------------------------------------------------------------------------------------------------

def test_launch_stats_of_known_values():
    s = launch_stats([float(x) for x in range(1, 101)])
    assert s["n"] == 100 and s["median"] == 50.5 and s["min"] == 1 and s["max"] == 100
    assert s["p10"] == pytest.approx(10.9) and s["p90"] == pytest.approx(90.1)
    assert s["stdev"] == pytest.approx(29.011491975882016) and s["cv"] == pytest.approx(29.011491975882016 / 50.5)
    assert launch_stats([])["median"] is None


def test_drift_reads_a_linear_slowdown():
    times = [i / 1000 for i in range(10_000)]  # 10 s
    values = [100 + 0.5 * t for t in times]  # +0.5 µs/s from 100 µs
    d = drift(times, values)
    assert d["slope_per_s"] == pytest.approx(0.5, rel=1e-3)
    assert d["first_median"] == pytest.approx(100.25, abs=0.01) and d["last_median"] == pytest.approx(104.75, abs=0.01)
    assert d["pct"] == pytest.approx(100 * (104.75 / 100.25 - 1), abs=0.02)
    assert d["slope_pct_per_s"] == pytest.approx(100 * 0.5 / 102.5, rel=1e-3)
    flat = drift(times, [7.0] * len(times))
    assert flat["pct"] == 0 and flat["slope_per_s"] == pytest.approx(0.0, abs=1e-12)


def test_telemetry_coverage_counts_rate_and_gaps():
    span = 10.0
    full = telemetry_summary(telemetry(span), span, 20.0)
    assert full["achieved_hz"] == pytest.approx(20.0, rel=1e-6) and full["gaps"]["count"] == 0
    assert full["coverage_pct"] == pytest.approx(100.0)
    gappy = telemetry_summary(telemetry(span, gap=(4.0, 5.0)), span, 20.0)
    assert gappy["gaps"]["count"] == 1 and gappy["gaps"]["max_s"] == pytest.approx(1.05, abs=1e-6)
    assert gappy["coverage_pct"] == pytest.approx(100 * (1 - 1.0 / span), abs=0.01)
    assert gappy["sm_mhz"]["first"] > 1940 and gappy["sm_mhz"]["last"] < 1620
    assert telemetry_summary([], span, 0.0) == {"off": True}


def test_throttle_time_holds_each_reading_until_the_next():
    span = 10.0
    t = throttle_time(telemetry(span), span)
    assert t["power_cap"]["s"] == pytest.approx(7.0, abs=0.051)  # from 0.3 x span on
    assert t["none"]["s"] + t["idle"]["s"] == pytest.approx(3.0, abs=0.051)
    assert sum(v["s"] for v in t.values()) == pytest.approx(span)
    assert t["power_cap"]["pct"] == pytest.approx(70.0, abs=0.6)


def test_energy_per_launch_from_the_counter_at_the_window_ends():
    samples = telemetry(10.0)
    e = energy_summary((0.0, 1_000_000, 10.0, 8_000_000), 5000, samples)
    assert e["joules"] == 7000 and e["j_per_launch"] == pytest.approx(1.4) and e["power_w"] == pytest.approx(700)
    assert e["counter_step_s"] == pytest.approx(0.1, abs=1e-6)
    assert e["rel_uncertainty_max"] == pytest.approx(0.01)
    assert energy_summary(None, 10, [], "no counter on this GPU")["error"] == "no counter on this GPU"


@pytest.mark.parametrize("end_mj, why", [(1_000_000, "did not advance over the 10.00 s window"),
                                          (999_000, "went back over the 10.00 s window, from 1000000 to 999000 mJ")])
def test_a_counter_that_did_not_advance_gives_no_energy(end_mj, why):
    """A stuck counter read 0 J and 0 W a launch (one that went back, negative joules), as if measured."""
    e = energy_summary((0.0, 1_000_000, 10.0, end_mj), 5000, telemetry(10.0))
    assert e["joules"] is None and e["j_per_launch"] is None and e["power_w"] is None
    assert why in e["error"]


def test_a_window_shorter_than_the_counters_step_is_not_called_a_broken_counter():
    """A healthy counter steps about every 0.1 s: a --duration-s 0.05 window that saw no step read "NVML's counter is
    not working on this GPU", a wrong cause; it says the window is too short for the counter and how long to make it."""
    e = energy_summary((0.0, 1_000_000, 0.05, 1_000_000), 50, telemetry(0.05))
    assert e["joules"] is None and "not working" not in e["error"]
    assert "did not step over the 0.05 s window" in e["error"] and "--duration-s" in e["error"]


def test_window_args_are_checked():
    assert check_window_args(10, 20) == (10.0, 20.0)
    assert check_window_args(1.5, 0, allow_off=True) == (1.5, 0.0)
    for bad in (0, -1, math.nan, math.inf, 4000, True, "10"):
        with pytest.raises(UsageError, match="^duration_s=") as exc:  # a Python caller's keyword; the verb's flag
            check_window_args(bad, 20)
        assert exc.value.cli.startswith("--duration-s ") and "e.g. --duration-s 10" in exc.value.cli
    for bad in (0, -5, 2000, math.nan):
        with pytest.raises(UsageError, match="^telemetry_hz=") as exc:
            check_window_args(10, bad)
        assert exc.value.cli.startswith("--telemetry-hz ")
    with pytest.raises(UsageError) as exc:  # shown as given: 0, not the 0.0 the flag's float converter made of it
        check_window_args(0.0, 20)
    assert exc.value.cli.startswith("--duration-s 0 is not a window length") and str(exc.value).startswith("duration_s=0 ")
    with pytest.raises(UsageError, match=r"^duration_s='10' is not a number; pass e\.g\. duration_s=10$"):
        check_window_args("10", 20)
    np = pytest.importorskip("numpy")  # np.int64(5) was "not a number"; np.bool_ is no number either
    assert check_window_args(np.int64(5), np.float32(2.5)) == (5.0, 2.5)
    with pytest.raises(UsageError, match="is not a number"):
        check_window_args(np.bool_(True), 20)


# ---- summary and files -----------------------------------------------------------------------------------------

def test_summary_of_a_recorded_window():
    w = recorded_window()
    ledger = {"compared": True, "time_ms": 1.63, "citation": "kprof.0123456789abcdef", "method": "cupti;l2=cold;eager"}
    s = summarize_window(w, HEADER, ledger)
    assert s["format"] == diagnostic.FORMAT and s["window"]["launches"] == 300
    assert s["window"]["prefix_kernels"] == [SWEEP, WARM] and s["window"]["kernels"] == [GEMM]
    assert 1600 < s["launch_us"]["median"] < 1670
    assert s["drift"]["pct"] == pytest.approx(3.6, abs=0.8)  # the 4 % slowdown, first vs last 10 %
    assert s["drift"]["slope_pct_per_s"] > 0
    assert 95 < s["gpu"]["busy_pct"] <= 100 and s["gpu"]["timed_pct"] < s["gpu"]["busy_pct"]
    capped_from = min(x.t for x in w.samples if x.reasons == 0x4)  # held to the window's end
    assert s["throttle"]["power_cap"]["pct"] == pytest.approx(100 * (1 - capped_from / w.span_s))
    assert s["energy"]["j_per_launch"] == pytest.approx(s["energy"]["joules"] / 300)
    assert s["ledger"]["window_over_row"] == pytest.approx(s["launch_us"]["median"] / 1630)
    assert s["ledger"]["row_inside_window_p10_p90"] is True
    assert summarize_window(w, HEADER)["ledger"]["compared"] is False


def test_write_outputs_writes_read_only_artifacts_with_citations():
    w = recorded_window()
    s = write_outputs("out", w, summarize_window(w, HEADER))
    names = sorted(os.listdir("out"))
    assert names == ["durations.png", "runtimes.csv", "summary.json", "telemetry.csv", "telemetry.png"]
    for name in names:
        assert stat.S_IMODE(os.stat(os.path.join("out", name)).st_mode) == 0o444
    on_disk = json.loads(pathlib.Path("out/summary.json").read_text())
    assert set(on_disk["artifacts"]) == {"runtimes.csv", "telemetry.csv", "durations.png", "telemetry.png"}
    for name, a in on_disk["artifacts"].items():
        data = pathlib.Path("out", name).read_bytes()
        assert a["blake3"] == blake3(data).hexdigest() and a["citation"] == "kmeasure." + a["blake3"][:16]
        assert a["bytes"] == len(data)
    assert s["summary_citation"] == "kmeasure." + blake3(pathlib.Path("out/summary.json").read_bytes()).hexdigest()[:16]
    assert pathlib.Path("out/durations.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert on_disk["plots"] == {"durations.png": "written", "telemetry.png": "written"}
    rows = pathlib.Path("out/runtimes.csv").read_text().splitlines()
    assert rows[0] == "launch,start_ns,end_ns,duration_ns,idle_before_ns" and len(rows) == 301
    first = [int(x) for x in rows[1].split(",")]
    assert first == [0, w.launches.start[0], w.launches.end[0], w.launches.duration[0], 0]
    tel = pathlib.Path("out/telemetry.csv").read_text().splitlines()
    assert tel[0] == "t_s,sm_mhz,mem_mhz,power_w,temp_c,util_pct,reasons,reason_labels,energy_mj,read_ms"
    assert len(tel) == len(w.samples) + 1
    assert tel[1].split(",")[6:8] == ["0x1", "idle"] and tel[-1].split(",")[6:8] == ["0x4", "power_cap"]
    with pytest.raises(UsageError, match="already holds a measure output"):
        write_outputs("out", w, summarize_window(w, HEADER))


def test_without_matplotlib_the_plots_are_skipped_and_the_rest_written(monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    w = recorded_window()
    s = write_outputs("out", w, summarize_window(w, HEADER))
    assert "matplotlib is not importable" in s["plots"]["skipped"]
    assert sorted(os.listdir("out")) == ["runtimes.csv", "summary.json", "telemetry.csv"]
    assert set(json.loads(pathlib.Path("out/summary.json").read_text())["artifacts"]) == {"runtimes.csv",
                                                                                          "telemetry.csv"}


def test_telemetry_png_says_which_readings_nvml_did_not_give(monkeypatch):
    """A GPU whose NVML reports no power, SM clock or clock-event reasons drew empty panels (an SM clock axis of
    -0.04 to 0.04 MHz) with nothing saying why, and no throttle band where summary.json counted 100 % "unread"."""
    pytest.importorskip("matplotlib")
    from kprof.measure import _diagnostic_plots as plots

    w = recorded_window(50)
    unread = [s._replace(power_w=None, sm_mhz=None, reasons=None) for s in w.samples]
    w = w._replace(samples=unread, telemetry_errors={"power_w": "NVML_ERROR_NOT_SUPPORTED"})
    figures = []
    monkeypatch.setattr(plots, "_png", lambda plt, fig: figures.append(fig) or b"png")
    summary = summarize_window(w, HEADER)
    plots.render(w, summary)
    texts = [t.get_text() for ax in figures[1].axes for t in ax.texts]
    assert "NVML gave no power_w reading\npower_w: NVML_ERROR_NOT_SUPPORTED" in texts
    assert "NVML gave no sm_mhz reading" in texts and not any("temp_c" in t for t in texts)
    assert summary["throttle"] == {"unread": {"s": pytest.approx(w.span_s), "pct": pytest.approx(100.0)}}
    assert set(plots._held_reasons(sorted(unread, key=lambda s: s.t), w.span_s)) == {"unread"}


def test_a_window_with_telemetry_off_and_no_energy_counter():
    launches, busy, last = segment(gemm_kernels(20), (SWEEP, WARM), (GEMM,), T0)
    w = Window(launches, last / 1e9, busy, [], 0.0, {"energy": "no counter"}, None, (GEMM,), (SWEEP, WARM), {})
    s = write_outputs("off", w, summarize_window(w, HEADER))
    assert s["telemetry"] == {"off": True} and s["throttle"] == {}
    assert s["energy"]["j_per_launch"] is None and s["energy"]["error"] == "no counter"
    assert pathlib.Path("off/telemetry.csv").read_text().count("\n") == 1


# ---- the window's recipe on a fake GPU -------------------------------------------------------------------------

class FakeGpu:
    """One stream: a launch enqueues a kernel right after the last one (a CUPTI-like ns clock); a graph capture
    records launches and a replay enqueues them."""

    def __init__(self):
        self.clock = T0
        self.kernels: list[tuple] = []
        self.capture = None

    def launch(self, name: str, ns: int) -> None:
        if self.capture is not None:
            self.capture.append((name, ns))
            return
        start = self.clock + 700
        self.kernels.append((name, start, start + ns, 0))
        self.clock = start + ns

    def torch(self):
        gpu = self

        class Graph:
            def __init__(self):
                self.nodes = []

            def replay(self):
                for name, ns in self.nodes:
                    gpu.launch(name, ns)

        @contextlib.contextmanager
        def graph(g):
            gpu.capture = g.nodes
            yield
            gpu.capture = None

        class Event:
            def record(self):
                pass

            def synchronize(self):
                pass

        class Stream:
            def wait_stream(self, other):
                pass

        cuda = types.SimpleNamespace(synchronize=lambda *a: None, Event=Event, Stream=Stream, CUDAGraph=Graph,
                                     graph=graph, current_stream=lambda: Stream(),
                                     stream=lambda s: contextlib.nullcontext())
        return types.SimpleNamespace(cuda=cuda, uint8="uint8")


class FakeSession:
    def __init__(self, gpu: FakeGpu):
        self.gpu = gpu
        self.disabled = []
        kinds = types.SimpleNamespace(RUNTIME=1, DRIVER=2, EXTERNAL_CORRELATION=3)
        self.cupti = types.SimpleNamespace(ActivityKind=kinds, activity_disable=self.disabled.append)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def timestamp(self) -> int:
        self.gpu.clock += 10
        return self.gpu.clock

    def collect(self):
        out, self.gpu.kernels = self.gpu.kernels, []
        return out, []


@pytest.fixture
def fake_gpu(monkeypatch):
    gpu = FakeGpu()
    monkeypatch.setitem(sys.modules, "torch", gpu.torch())
    session = FakeSession(gpu)
    monkeypatch.setattr("kprof.measure._cupti.Session", lambda: session)
    monkeypatch.setattr("kprof.measure._l2.flusher", lambda index: (lambda: gpu.launch(SWEEP, 30_000), 123 << 20))
    ticks = iter(range(10**9))
    monkeypatch.setattr("kprof.measure._nvml_access._nvml_reading",
                        lambda index, errors: lambda: (1755.0, 3201.0, 450.0, 55.0, 100.0, 0x4))
    monkeypatch.setattr("kprof.measure._nvml_access._energy_counter", lambda index: lambda: 1_000 * next(ticks))
    gpu.session = session
    return gpu


def _case(gpu, name=GEMM, ns=1_600_000, warm=(0,), nbytes=1e6):
    tensor = types.SimpleNamespace(dim=lambda: 2, is_floating_point=lambda: False,
                                   bitwise_or_=lambda v: gpu.launch(WARM, 2_000))
    return types.SimpleNamespace(fn=lambda: gpu.launch(name, ns), inputs=(tensor,), warm=warm, refresh=None,
                                 bytes=nbytes, kernel_filter=None)


def test_record_window_cold_eager_on_a_fake_gpu(fake_gpu):
    w = _diagnostic_window.record_window(_case(fake_gpu), duration_s=0.05, telemetry_hz=200.0)
    assert fake_gpu.session.disabled == [1, 2, 3]  # the window traces kernels only
    assert w.prefix == (SWEEP, WARM) and w.kernels == (GEMM,)
    n = len(w.launches.duration)
    assert n == int(w.notes["iterations"]) and n > 10
    assert set(w.launches.duration) == {1_600_000}
    assert set(w.launches.idle_before[1:]) == {3 * 700}  # before the sweep, the rewrite and the GEMM each
    assert w.busy_ns == n * (30_000 + 2_000 + 1_600_000)
    assert w.notes["l2"] == "read-sweep" and w.notes["invocations_per_replay"] == "1"
    from kprof.runners.cuda_device import MAX_COPIES  # the note said four, the count before revision 4

    assert f"up to {MAX_COPIES} placements" in w.notes["weights"]
    assert len(w.samples) >= 3 and w.samples[0].t <= 0.001 and w.samples[0].energy_mj is not None
    assert w.samples[0].reasons == 0x4 and w.telemetry_errors == {}
    assert w.energy is not None and w.energy[3] > w.energy[1]


def test_an_energy_counter_that_fails_partway_leaves_the_window_without_energy(fake_gpu, monkeypatch):
    """NVML's refusal at the window's end (an Unknown Error) escaped record_window: the window was lost and
    `kprof measure` ended with a traceback."""
    import threading

    pynvml = pytest.importorskip("pynvml")
    ends = []  # the window's readings at its ends (this thread's): the first answers, every read after it fails

    def counter():
        if threading.current_thread() is threading.main_thread():
            ends.append(1)
        if len(ends) > 1 or ends and threading.current_thread() is not threading.main_thread():
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return 1_000_000

    monkeypatch.setattr("kprof.measure._nvml_access._energy_counter", lambda index: counter)
    w = _diagnostic_window.record_window(_case(fake_gpu), duration_s=0.05, telemetry_hz=200.0)
    assert w.energy is None and "Unknown Error" in w.telemetry_errors["energy"]
    assert len(w.launches.duration) > 10 and "sampler" not in w.telemetry_errors  # telemetry sampled on


def test_record_window_warm_graph_unrolls_small_kernels(fake_gpu):
    w = _diagnostic_window.record_window(_case(fake_gpu, "rms_norm_kernel", 3_000), duration_s=0.03,
                                         telemetry_hz=0.0, clear_l2=False, graph=True)
    unroll = int(w.notes["invocations_per_replay"])
    assert unroll == 34  # ceil(100 µs / 3 µs)
    assert w.prefix == () and w.kernels == ("rms_norm_kernel",)
    assert len(w.launches.duration) == int(w.notes["iterations"]) * unroll
    assert w.samples == [] and w.telemetry_hz == 0.0
    cold = _diagnostic_window.record_window(_case(fake_gpu, "rms_norm_kernel", 3_000), duration_s=0.01,
                                            telemetry_hz=0.0, clear_l2=True, graph=True)
    assert cold.notes["invocations_per_replay"] == "1" and cold.prefix == (SWEEP, WARM)


def test_record_window_refuses_a_window_too_long_to_hold_before_it_starts(fake_gpu):
    """CUPTI's records stay in memory until the window ends: an hour of a fast kernel (one launch every few µs on
    this fake GPU's host loop, three records each) would hold billions. Refused at once, naming a length that fits."""
    from kprof.errors import SettingError

    t = time.perf_counter()
    with pytest.raises(SettingError, match=r"^duration_s=3600 of this kernel would record about [\d,]+ CUPTI kernel "
                                           r"records .* over the 10,000,000 a window holds in memory; use duration_s=\d+ "
                                           r"or less") as exc:
        _diagnostic_window.record_window(_case(fake_gpu), duration_s=3600.0, telemetry_hz=0.0)
    assert exc.value.cli.startswith("--duration-s 3600 of this kernel") and time.perf_counter() - t < 60
    longest = int(exc.value.cli.rsplit("--duration-s ", 1)[1].split()[0])
    w = _diagnostic_window.record_window(_case(fake_gpu), duration_s=0.02, telemetry_hz=0.0)  # a short one runs
    assert len(w.launches.duration) > 0 and 0.02 < longest < 3600


def test_check_records_bounds():
    _diagnostic_window._check_records(10.0, 10e-6, 3)  # 3M records: kept
    with pytest.raises(UsageError, match=r"about 40,000,000 CUPTI kernel records \(a launch every 1\.0 µs, 4 "
                                         r"kernels each\).*use duration_s=2 or less"):
        _diagnostic_window._check_records(10.0, 1e-6, 4)


def test_record_window_refuses_a_callable_whose_kernels_change(fake_gpu):
    names = iter(["a", "b", "a", "b", "a", "b", "a", "b"])
    case = _case(fake_gpu)
    case.fn = lambda: fake_gpu.launch(next(names, "a"), 1000)
    with pytest.raises(TimerError, match="launch sequence changed between warm-up launches"):
        _diagnostic_window.record_window(case, duration_s=0.01, telemetry_hz=0.0, clear_l2=False)


# ---- the verb ----------------------------------------------------------------------------------------------------

def _files(root=".") -> list[str]:
    return sorted(str(p.relative_to(root)) for p in pathlib.Path(root).rglob("*"))


def _measure(*extra, spec=GEMM_SPEC, table="single_gemm", backend="torch") -> list[str]:
    return ["measure", table, "--backend", backend, "--spec", json.dumps(spec), *extra]


@pytest.fixture
def gpu_here(monkeypatch):
    """A GPU named "Fake GPU" is visible, the environment check passes, and the window is the recorded one."""
    monkeypatch.setattr("kprof.measure.device_name.local_gpu_name", lambda: "Fake GPU")
    monkeypatch.setattr("kprof.runners.environments.require", lambda entry, **kw: None)
    calls = []

    def record(entry, canonical, gpu_key, duration_s, hz, clear_l2, graph):
        calls.append((entry.table, canonical, gpu_key, duration_s, hz, clear_l2, graph))
        return recorded_window(), {"power_limit_w": 700.0, "gpu_name": gpu_key}

    monkeypatch.setattr("kprof.runners.diagnose.record", record)
    return calls


@pytest.mark.parametrize("argv, needle", [
    (_measure("--duration-s", "0"), "--duration-s 0 is not a window length"),
    (_measure("--duration-s", "-3"), "--duration-s -3 is not a window length"),
    (_measure("--duration-s", "nan"), "--duration-s 'nan' is not a number; pass a decimal number"),
    (_measure("--telemetry-hz", "0"), "--telemetry-hz 0 is not a sampling rate"),
    (_measure("--telemetry-hz", "5000"), "is not a sampling rate"),
    (_measure("--spec", json.dumps(GEMM_SPEC)), "exactly one spec and 2 --spec were given"),
    (_measure(spec=[GEMM_SPEC, {**GEMM_SPEC, "m": 1}]), "was given a batch of 2"),
    (_measure(spec=[]), "the spec is an empty list; pass one JSON object of single_gemm's KernelArgs {m, n, k, dtype}"),
    (_measure(spec={**GEMM_SPEC, "backend": "torch"}), "backend"),
    (_measure(spec=None), "the spec must be a JSON object of single_gemm's KernelArgs, not null; pass one object of "
                          "{m, n, k, dtype}"),
    (_measure(backend="torch-cpu"), "timed by wall clock on the CPU, not by CUPTI"),
    (_measure("--gpu-name", "NVIDIA B200"), "--gpu-name 'NVIDIA B200' differs from the GPU this would measure on"),
    (_measure("--db", ""), "--db '' is empty"),
])
def test_bad_input_is_refused_with_nothing_written(argv, needle, capsys, gpu_here, tmp_path, refused):
    refused(argv, needle)
    assert _files(tmp_path) == [] and gpu_here == []


def test_a_file_given_to_spec_is_not_sent_to_a_specs_flag_measure_lacks(capsys, gpu_here, tmp_path, refused):
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(GEMM_SPEC))
    refused(["measure", "single_gemm", "--backend", "torch", "--spec", str(path), "--output-dir", str(tmp_path / "o")],
            f"--spec {path}: that is a file, and --spec takes one spec as JSON text; give the spec itself, e.g. --spec "
            f"\"$(cat {path})\"")
    assert _files(tmp_path) == ["specs.json"] and gpu_here == []


def test_a_comm_table_is_refused(monkeypatch, capsys, gpu_here, tmp_path, refused):
    from kprof.runners import registry

    comm = msgspec.structs.replace(registry.lookup("single_gemm", "torch"), table="all_reduce", backend="nccl",
                                   metric_family="comm", gpus=2)
    monkeypatch.setitem(registry.REGISTRY, ("all_reduce", "nccl"), comm)
    refused(_measure(table="all_reduce", backend="nccl"), "all_reduce/nccl is a communication table")
    assert _files(tmp_path) == []


def test_without_a_gpu_it_says_so_and_writes_nothing(monkeypatch, capsys, tmp_path, refused):
    monkeypatch.setattr("kprof.measure.device_name.local_gpu_name", lambda: None)
    for extra in ([], ["--gpu-name", "NVIDIA H200"]):
        refused(_measure(*extra), "on a CUDA GPU and none is visible here")
    assert _files(tmp_path) == []


def test_a_gpu_that_cuda_visible_devices_hides_is_not_said_to_be_absent(monkeypatch, capsys, tmp_path, refused):
    """CUDA_VISIBLE_DEVICES="" on a GPU machine read "none is visible here (no NVIDIA driver or device)"."""
    from kprof.measure import device_name

    monkeypatch.setattr(device_name, "_proc_gpus", lambda root=None: [])  # the driver answers through nvidia-smi
    monkeypatch.setattr(device_name, "_smi_gpus", lambda: [("NVIDIA H200", "GPU-1234")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    err = refused(_measure(), "CUDA_VISIBLE_DEVICES='' leaves none of this machine's visible; set it to the GPU")
    assert "no NVIDIA driver" not in err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr("kprof.runners.environments.require", lambda entry, **kw: pytest.fail("got past the GPU"))
    monkeypatch.setattr(device_name, "_smi_gpus", lambda: [])
    refused(_measure(), "none is visible here (no NVIDIA driver or device)")
    assert _files(tmp_path) == []


def test_without_cupti_it_does_not_offer_another_timer(monkeypatch, capsys, tmp_path, refused):
    """On a GPU without cupti-python, measure repeated the environment check's advice "KPROF_TIMER=events times
    without it": measure records with CUPTI whatever KPROF_TIMER says, so following it changed nothing."""
    from kprof.runners import environments

    installed = environments._installed
    monkeypatch.setattr("kprof.measure.device_name.local_gpu_name", lambda: "Fake GPU")
    monkeypatch.setattr(environments, "_installed", lambda name: None if name == "cupti-python" else installed(name)
                        or "99")
    monkeypatch.setattr(environments, "_cuda_difference", lambda env, specifier: None)
    err = refused(_measure(), "cuda_env needs cupti-python>=12 and cupti-python is not installed: pip install "
                              "'cupti-python>=12'")
    assert "KPROF_TIMER" not in err
    assert _files(tmp_path) == []


def test_an_output_dir_holding_an_output_is_refused_before_any_work(capsys, gpu_here, tmp_path, refused):
    assert main(_measure("--output-dir", "w", "--json")) == 0
    capsys.readouterr()
    before = _files(tmp_path)
    refused(_measure("--output-dir", "w"), "already holds a measure output")
    assert _files(tmp_path) == before and len(gpu_here) == 1


def test_an_output_dir_name_too_long_for_the_file_system_is_refused_before_the_window(capsys, gpu_here, tmp_path,
                                                                                        refused):
    """A 300-byte directory name passed the check: the window was recorded, then its files could not be written."""
    refused(_measure("--output-dir", "x" * 300), "is 300 bytes, longer than the 255 a name may have")
    assert _files(tmp_path) == [] and gpu_here == []


def test_a_write_killed_among_its_renames_is_taken_back_by_the_next_check(tmp_path):
    """A measure SIGKILLed while it renamed its files into --output-dir left the staging folder (with the files not
    yet renamed) and part of an output, which refused the same command again for good ("already holds a measure
    output"). The next check removes both, as a run's snapshot check does; a staging folder a live writer holds,
    and an empty one, are let be."""
    import fcntl

    out = tmp_path / "m"
    out.mkdir()
    killed = out / (diagnostic.STAGING + "killed")
    killed.mkdir()
    (killed / "summary.json").write_text("{}")  # not yet renamed
    (out / "runtimes.csv").write_text("launch\n")  # renamed before the kill
    (out / "notes.txt").write_text("the user's")  # not the writer's: kept
    live = out / (diagnostic.STAGING + "live")
    live.mkdir()
    (live / "runtimes.csv").write_text("launch\n")
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    empty = out / (diagnostic.STAGING + "empty")
    empty.mkdir()
    try:
        diagnostic.check_output_dir(str(out))
    finally:
        os.close(held)
    assert sorted(os.listdir(out)) == sorted([live.name, empty.name, "notes.txt"])


def test_an_interrupted_or_failed_write_leaves_no_part_of_an_output(monkeypatch, capsys, gpu_here):
    """The files were written one by one into --output-dir: Ctrl-C while the plots rendered left runtimes.csv and
    telemetry.csv there (the verb said "nothing was left half-written") and the same command was then refused as
    holding an output; a full disk at summary.json was a traceback, with the same leftovers."""
    from kprof.measure import _diagnostic_plots, diagnostic_files

    render, write_once = _diagnostic_plots.render, diagnostic_files.write_once

    def interrupted(window, summary):
        raise KeyboardInterrupt

    monkeypatch.setattr(_diagnostic_plots, "render", interrupted)
    assert main(_measure("--output-dir", "w")) == 130
    assert "nothing was left half-written" in capsys.readouterr().err
    assert os.listdir("w") == []
    monkeypatch.setattr(_diagnostic_plots, "render", render)

    def disk_full(path, data):
        if path.endswith("summary.json"):
            raise OSError(28, "No space left on device", path)
        write_once(path, data)

    monkeypatch.setattr(diagnostic_files, "write_once", disk_full)
    assert main(_measure("--output-dir", "w")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the measure output in --output-dir w: No space left on device "
                          "(w/summary.json); nothing of it was written") and "Traceback" not in err
    assert os.listdir("w") == []
    monkeypatch.setattr(diagnostic_files, "write_once", write_once)
    assert main(_measure("--output-dir", "w")) == 0  # the same command, once the disk has room
    assert sorted(os.listdir("w")) == ["durations.png", "runtimes.csv", "summary.json", "telemetry.csv",
                                       "telemetry.png"]


def _row(db: str, time_ms: float, gpu="Fake GPU") -> None:
    from kprof.ledger import KeyMaker, Ledger, ShapeCodec
    from kprof.ledger.build import measured
    from kprof.ledger.events import Method, Stats
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    entry = effective_entry(lookup("single_gemm", "torch"), timer="cupti", l2="cold", cuda_graph=False,
                            power="sustained")
    prov = KeyMaker(entry.table, entry.backend, gpu, entry.contract, ShapeCodec(entry.args)).provenance(GEMM_SPEC)
    stats = Stats(n=50, median=time_ms, p10=time_ms * 0.99, p90=time_ms * 1.01, mean=time_ms, stdev=0.0, cv=0.0)
    event = measured(prov, {"time_ms": time_ms, "tflops": 1.0, "memory_bandwidth_gbps": 1.0, "energy_j": 1.0}, stats,
                     Method(timer="cupti", l2="cold"))
    led = Ledger.open(db)
    try:
        led.append([event])
    finally:
        led.close()


def test_measure_writes_the_outputs_and_compares_with_the_ledger_row_read_only(capsys, gpu_here, tmp_path):
    _row("profile.db", 1.63)
    db_before = blake3(pathlib.Path("profile.db").read_bytes()).hexdigest()
    assert main(_measure("--json", "--duration-s", "0.5", "--telemetry-hz", "20")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert gpu_here == [("single_gemm", GEMM_SPEC, "Fake GPU", 0.5, 20.0, True, False)]
    assert doc["output_dir"] == "measure_single_gemm_torch" and doc["gpu_name"] == "Fake GPU"
    s = doc["summary"]
    assert s["ledger"]["compared"] is True and s["ledger"]["same_method"] is True
    assert s["ledger"]["time_ms"] == 1.63 and s["ledger"]["method"] == "cupti;l2=cold;eager"
    assert s["ledger"]["window_over_row"] == pytest.approx(s["launch_us"]["median"] / 1630)
    assert s["mode"] == {"l2": "cold", "graph": False, "invocations_per_replay": 1, "duration_s": 0.5,
                         "telemetry_hz": 20.0}
    assert blake3(pathlib.Path("profile.db").read_bytes()).hexdigest() == db_before  # never written
    for name, f in doc["files"].items():
        assert os.path.isfile(f["path"]) and f["citation"].startswith("kmeasure.")
    # the same window, warm and graph: compared with the default row, which is not its method
    assert main(_measure("--output-dir", "w2", "--no-clear-l2", "--cuda-graph", "--json")) == 0
    s2 = json.loads(capsys.readouterr().out)["summary"]
    assert gpu_here[-1][-2:] == (False, True)
    assert s2["ledger"]["compared"] is True and s2["ledger"]["same_method"] is False
    assert s2["mode"]["l2"] == "warm" and s2["mode"]["graph"] is True
    # the text said the ratio to a row of another method as if the two were alike
    assert main(_measure("--output-dir", "w3", "--no-clear-l2")) == 0
    said = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "(cupti;l2=cold;eager, not this window's method: not comparable as equals); window median / row" in said
    assert main(_measure("--output-dir", "w4")) == 0
    assert "not this window's method" not in capsys.readouterr().out


def test_the_text_says_why_a_reading_is_missing(capsys, gpu_here, monkeypatch):
    """Where NVML refused the power and energy readings, the verb's table showed "-" for power and energy per launch
    with no reason: summary.json's telemetry_errors held it, the text did not."""
    def record(entry, canonical, gpu_key, duration_s, hz, clear_l2, graph):
        w = recorded_window(50)
        samples = [s._replace(power_w=None, energy_mj=None) for s in w.samples]
        return w._replace(samples=samples, energy=None, telemetry_errors={
            "power_w": "NVML_ERROR_NOT_SUPPORTED", "energy": "nvmlDeviceGetTotalEnergyConsumption: Not Supported"}), {}

    monkeypatch.setattr("kprof.runners.diagnose.record", record)
    assert main(_measure("--output-dir", "w")) == 0
    said = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "energy per launch (mJ) - (nvmlDeviceGetTotalEnergyConsumption: Not Supported)" in said
    assert "NVML could not read power_w: NVML_ERROR_NOT_SUPPORTED; energy:" in said


def test_measure_without_a_ledger_says_nothing_was_compared(capsys, gpu_here):
    assert main(_measure("--db", "elsewhere.db")) == 0
    out = capsys.readouterr().out
    assert "no ledger at elsewhere.db" in out and "kmeasure." in out and "median" in out
    assert not os.path.exists("elsewhere.db")


def test_the_python_api_takes_telemetry_off_and_the_launcher_the_verb(gpu_here, capsys):
    from kprof.cli.measure import diagnose

    doc = diagnose("single_gemm", "torch", GEMM_SPEC, output_dir="api", telemetry_hz=0)
    assert doc["summary"]["mode"]["telemetry_hz"] == 0.0 and gpu_here[-1][4] == 0.0
    p = subprocess.run([sys.executable, "-m", "launcher", "kernel-profile", "measure", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--no-clear-l2" in p.stdout and "--telemetry-hz" in p.stdout


@pytest.mark.parametrize("kwargs, needle", [
    ({"clear_l2": "no"}, "clear_l2='no' is not a bool"),
    ({"clear_l2": None}, "clear_l2=None is not a bool"),
    ({"cuda_graph": 1}, "cuda_graph=1 is not a bool"),
    ({"gpu_name": 5}, "gpu_name=5 is not a GPU key"),
    ({"output_dir": 5}, "output_dir=5 is not a path"),
    ({"output_dir": "a\0b"}, "output_dir='a\\x00b' is not a path"),
])
def test_the_python_api_refuses_a_flag_of_the_wrong_type_before_the_window(gpu_here, tmp_path, kwargs, needle):
    """A truthy clear_l2="no" measured a cold window and cuda_graph=1 wrote `"graph": 1`; gpu_name=5, output_dir=5 and
    a NUL byte in output_dir were tracebacks."""
    from kprof.cli.measure import diagnose

    with pytest.raises(UsageError) as err:
        diagnose("single_gemm", "torch", GEMM_SPEC, **kwargs)
    assert needle in str(err.value)
    assert _files(tmp_path) == [] and gpu_here == []


# ---- kprof show kmeasure.<hex> -----------------------------------------------------------------------------------

def _output(path="out") -> dict:
    w = recorded_window()
    return write_outputs(path, w, summarize_window(w, HEADER))


def test_show_resolves_every_artifact_citation(capsys):
    s = _output("measure_single_gemm_torch")
    cites = {n: a["citation"] for n, a in s["artifacts"].items()} | {"summary.json": s["summary_citation"]}
    for name, cite in cites.items():
        assert main(["show", cite, "--json"]) == 0  # found under ./measure_*/ without --dir
        doc = json.loads(capsys.readouterr().out)
        assert doc["artifact"] == name and doc["path"] == os.path.join("measure_single_gemm_torch", name)
        assert doc["resolved_as"] == "measure-artifact" and doc["table"] == "single_gemm" and doc["spec"] == GEMM_SPEC
    assert main(["show", cites["durations.png"][:17], "--dir", "measure_single_gemm_torch"]) == 0  # 8 hex digits
    out = capsys.readouterr().out
    assert "measure_single_gemm_torch/durations.png" in out and "plot: each launch's kernel time" in out


def test_show_refuses_unknown_ambiguous_and_changed_artifacts(capsys, tmp_path, refused):
    s = _output("a")
    refused(["show", "kmeasure.0000000000000000", "--dir", "a"],
            "no measure output in a or the directories directly in it lists")
    refused(["show", "kmeasure.0000000000000000", "--dir", "nosuch"], "--dir nosuch: no such directory")
    refused(["show", "kmeasure.0000000000000000", "--dir", "a/summary.json"], "--dir a/summary.json: not a directory")
    refused(["show", "kmeasure.0000000000000000", "--dir", ""], "--dir '': no such directory")  # read `--dir :`
    refused(["show", "kmeasure.0000000000000000", "--dir", "my runs"], "--dir 'my runs': no such directory")
    refused(["show", "kmeasure.xyz"], "is not a measure citation")
    refused(["show", "kprof.0123456789abcdef", "--dir", "a"], "--dir is where kmeasure")
    _output("b")  # the same recording: identical bytes, two paths, which more hex digits cannot tell apart
    cite = s["artifacts"]["runtimes.csv"]["citation"]
    refused(["show", cite, "--dir", "a", "--dir", "b"], f"{cite!r} names the same bytes in a/runtimes.csv, "
            "b/runtimes.csv: no more hex digits tell them apart; pass --dir with the directory of the one to show")
    path = tmp_path / "a" / "runtimes.csv"
    path.chmod(0o644)
    path.write_text(path.read_text().replace(",0\n", ",1\n", 1))
    assert main(["show", cite, "--dir", "a"]) == 3
    assert "was changed after it was written" in capsys.readouterr().err
    with pytest.raises(IntegrityError):
        find_artifact(cite, ["a"])


def test_show_passes_over_a_summary_json_it_cannot_read(capsys, refused):
    """show reads every ./*/summary.json: a dangling link or a folder of that name in any directory beside the
    output was a traceback (FileNotFoundError, IsADirectoryError) whatever the citation."""
    s = _output("measure_single_gemm_torch")
    os.makedirs("other/summary.json")
    os.makedirs("linked")
    os.symlink("gone.json", "linked/summary.json")
    assert main(["show", s["summary_citation"]]) == 0
    assert "measure_single_gemm_torch/summary.json" in capsys.readouterr().out
    refused(["show", "kmeasure.0000000000000000"], "(could not read linked/summary.json: No such file or directory; "
            "other/summary.json: Is a directory)")


def test_show_passes_over_a_pipe_or_a_device_named_summary_json(capsys, refused):
    """A pipe named summary.json in a directory beside the output hung show (its read waits for a writer), and a link
    to /dev/zero named so read until memory ran out: each is named as not a regular file, unread."""
    s = _output("measure_single_gemm_torch")
    os.makedirs("piped")
    os.mkfifo("piped/summary.json")
    os.makedirs("zeros")
    os.symlink("/dev/zero", "zeros/summary.json")
    p = subprocess.run([sys.executable, "-m", "kprof", "show", s["summary_citation"]], capture_output=True, text=True,
                       timeout=60)  # a subprocess: where the pipe is read, it never returns
    assert p.returncode == 0 and "measure_single_gemm_torch/summary.json" in p.stdout, p.stderr
    refused(["show", "kmeasure.0000000000000000"], "(could not read piped/summary.json: not a regular file; "
            "zeros/summary.json: not a regular file)")


def test_show_without_dir_looks_one_level_down_as_its_help_says(capsys, refused, monkeypatch):
    """The help said `Default: ./measure_*/ and the current directory` where any directory directly in it is
    searched, and the README said its subdirectories, where one two levels down is not."""
    s = _output("runs/gemm")
    cite = s["summary_citation"]
    refused(["show", cite], "no measure output in . or the directories directly in it lists", "pass --dir")
    monkeypatch.chdir("runs")
    assert main(["show", cite]) == 0 and "gemm/summary.json" in capsys.readouterr().out
    assert main(["show", "--help"]) == 0
    said = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "Default: the current directory and the directories directly in it." in said


def test_show_without_dir_looks_one_level_down_beside_an_output_of_its_own(capsys):
    """A current directory holding an output (`measure --output-dir .`) hid the outputs in the directories directly
    in it: their citations were refused with "no measure output in . or the directories directly in it lists"."""
    w = recorded_window(n=200)
    here = write_outputs(".", w, summarize_window(w, HEADER))
    below = _output("measure_single_gemm_torch")
    for cite, path in ((below["artifacts"]["runtimes.csv"]["citation"], "measure_single_gemm_torch/runtimes.csv"),
                       (here["artifacts"]["runtimes.csv"]["citation"], "runtimes.csv")):
        assert main(["show", cite, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["path"] == path


def test_show_of_a_measure_citation_imports_no_torch(tmp_path):
    s = _output("measure_x")
    code = ("import sys; from kprof.cli import main; rc = main(['show', sys.argv[1], '--json']); "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cupti', 'pynvml', 'matplotlib')]; "
            "sys.exit(rc or (9 if heavy else 0))")
    p = subprocess.run([sys.executable, "-c", code, s["summary_citation"]], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr


# ---- the GPU benchmark's report, on recorded outputs --------------------------------------------------------------

def test_the_benchmark_tables_and_archives_recorded_outputs(tmp_path):
    spec = importlib.util.spec_from_file_location("measure_check", ROOT / "tests" / "benchmarks" / "measure_check.py")
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    work = tmp_path / "work"
    work.mkdir()
    results = []
    for name in ("overhead-off-1", "overhead-on-1"):
        s = _output(str(work / name))
        results.append({"name": name, "output_dir": str(work / name), "summary": s, "wall_s": 1.0})
    on_csv = work / "overhead-on-1" / "runtimes.csv"  # the telemetry window 10 % slower: column 3 in ns
    head, *lines = on_csv.read_text().splitlines()
    slower = [line.split(",") for line in lines]
    for cells in slower:
        cells[3] = str(round(int(cells[3]) * 1.1))
    on_csv.write_text("\n".join([head, *(",".join(c) for c in slower)]) + "\n")
    o = mc.overhead(results)
    assert o["pct"] == pytest.approx(10.0, abs=0.1) and o["median_on_us"] > o["median_off_us"]
    assert o["ok"] == (10.0 <= mc.OVERHEAD_LIMIT_PCT) and o["launches_on"] == o["launches_off"] == 300
    rows = [mc.row_of(r) for r in results] + [mc.row_of({"name": "gemm-cold", "error": "UsageError: no GPU",
                                                         "wall_s": 0.1})]
    text = mc.table(rows)
    capped = results[0]["summary"]["throttle"]["power_cap"]["pct"]
    assert text.splitlines()[0].startswith("window (l2/launch)") and f"power_cap:{capped:.0f}" in text
    assert text.splitlines()[-1].split()[:2] == ["gemm-cold", "FAILED:"]
    out = tmp_path / "out"
    out.mkdir()
    assert mc.archive(str(work), str(out)) == ["measure_check.tar.gz"]
    import tarfile

    with tarfile.open(out / "measure_check.tar.gz") as tar:
        assert "measure_check/overhead-on-1/runtimes.csv" in tar.getnames()


def test_show_passes_over_a_summary_json_that_is_not_one_of_ours(capsys, refused):
    """A summary.json in any directory beside the output nested a million deep was a RecursionError traceback
    whatever the citation, and one whose artifact matched but whose mode was not a mapping an AttributeError: each
    is passed over as not one of ours."""
    s = _output("measure_single_gemm_torch")
    os.makedirs("deep")
    pathlib.Path("deep/summary.json").write_text("[" * 1_000_000 + "]" * 1_000_000)
    os.makedirs("odd")
    pathlib.Path("odd/x.bin").write_bytes(b"")
    empty = blake3(b"").hexdigest()
    pathlib.Path("odd/summary.json").write_text(json.dumps({"artifacts": {"x.bin": {"blake3": empty}}, "mode": [1]}))
    assert main(["show", s["summary_citation"]]) == 0
    assert "measure_single_gemm_torch/summary.json" in capsys.readouterr().out
    refused(["show", "kmeasure." + empty[:16]], "no measure output in . or the directories directly in it lists")
