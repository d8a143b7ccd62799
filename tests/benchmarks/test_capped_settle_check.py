"""capped_settle_check.py on CPU: the spec set and its selection, the fifths of a row's samples, the per-settle summary,
the timeline capture and the pass loop with its GPU parts stood in for."""

import importlib.util
import json
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
_spec = importlib.util.spec_from_file_location("capped_settle_check",
                                               pathlib.Path(__file__).with_name("capped_settle_check.py"))
cs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cs)


def test_the_specs_are_protocol_checks_prefill_gemms():
    specs = cs.prefill_specs()
    assert len(specs) == 16 and {s["m"] for s in specs} == {2048, 4096, 8192}
    assert {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"} in specs


def test_fifths_are_means_of_each_fifth_in_call_order():
    assert cs.fifths([1.0] * 5 + [2.0] * 5) == [1.0, 1.0, 1.5, 2.0, 2.0]
    assert cs.fifths([3.0, 1.0]) == [3.0, 1.0]  # fewer samples than fifths: the non-empty ones


def test_summary_spreads_per_settle_over_complete_specs():
    spec_a, spec_b = {"m": 1}, {"m": 2}
    rows = [{"spec": spec_a, "settle_s": 0.04, "time_ms": t, "drift": d, "timed_sm_mhz": [1500.0, 1700.0],
             "wall_s": 1.0} for t, d in ((1.0, 0.01), (1.02, -0.02), (0.99, 0.0), (1.01, 0.0))]
    rows += [{"spec": spec_b, "settle_s": 0.04, "time_ms": 2.0, "wall_s": 1.0}] * 3  # one pass short: left out
    rows += [{"spec": spec_b, "settle_s": 0.04, "error": "x", "wall_s": 0.5}]
    out = cs.summary(rows, [0.04], 4)["0.04"]
    assert out["specs"] == 1 and out["failed"] == 1
    assert out["spread_max"] == pytest.approx(0.03 / 1.005)  # (max - min) / median of the four
    assert out["drift_max_abs"] == 0.02 and out["first_batch_mhz_median"] == 1500.0
    assert out["last_batch_mhz_median"] == 1700.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_main_without_a_gpu_exits_2(tmp_path, capsys):
    assert cs.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_capture_keeps_the_capped_loops_timeline_and_restores_what_it_wrapped():
    """Capture wraps the sampling loop's block_means: the last call's timeline, relative to its start, is the row's;
    leaving restores the loop's own function."""
    from kprof.measure import _sampling

    inner = _sampling.block_means
    with cs.Capture() as capture:
        assert _sampling.block_means is not inner
        timeline = [(10.05, 2.0, 2), (10.12, 3.0, 3)]
        assert _sampling.block_means(timeline, 0.1, 10.0) == [1.0]  # the first block ends past 0.1 s
    assert _sampling.block_means is inner
    assert cs.relative_timeline(capture.timeline) == [[0.05, 2.0, 2], [0.12, 3.0, 3]]
    assert cs.relative_timeline(None) is None


def test_shapes_select_gemms_in_order_and_refuse_an_unknown_one(tmp_path, capsys):
    specs = cs.prefill_specs()
    assert cs.select(specs, None) == specs
    picked = cs.select(specs, "8192x8192x8192, 2048X28672x4096")
    assert [cs.shape_name(s) for s in picked] == ["2048x28672x4096", "8192x8192x8192"]
    with pytest.raises(ValueError, match="1x2x3 is not one of the prefill GEMMs"):
        cs.select(specs, "8192x8192x8192,1x2x3")
    with pytest.raises(ValueError, match="no shape"):
        cs.select(specs, ",")
    assert cs.main(["--out", str(tmp_path), "--shapes", "1x2x3"]) == 2  # refused before any GPU is looked for
    assert "1x2x3" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_main_runs_four_passes_and_writes_after_each(tmp_path, monkeypatch, capsys):
    """The pass loop on CPU, its GPU parts stood in for: every selected spec once per pass and settle, in the
    plan's order (the third pass reversed), the JSON rewritten after every pass, the table printed last."""
    import _variants

    from kprof.measure import device_name
    from kprof.runners import worker

    monkeypatch.setattr(_variants, "cuda", lambda name: object())
    monkeypatch.setattr(device_name, "local_gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(worker, "prepare_device", lambda entry, key: None)
    heated, written = [], []
    monkeypatch.setattr(cs, "heat", heated.append)
    real_dump = cs.json.dump

    def dump(doc, f, **kw):
        written.append(len(doc["rows"]))
        real_dump(doc, f, **kw)

    monkeypatch.setattr(cs.json, "dump", dump)

    def one_row(entry, gpu_key, device, spec, settle_s, capture, keep_samples=False):
        return {"spec": spec, "settle_s": settle_s, "time_ms": float(spec["m"]), "wall_s": 0.1, "drift": 0.0,
                "timed_sm_mhz": [1700.0]}

    monkeypatch.setattr(cs, "one_row", one_row)
    shapes = "8192x8192x8192,2048x28672x4096"
    assert cs.main(["--out", str(tmp_path), "--settles", "0.04", "--idle-s", "0", "--load-s", "1.5",
                    "--shapes", shapes]) == 0
    doc = json.loads((tmp_path / "capped_settle_check.json").read_text())
    assert written == [2, 4, 6, 8] and heated == [1.5]
    assert [cs.shape_name(r["spec"]) for r in doc["rows"] if r["pass"] == "reversed"] == \
        ["8192x8192x8192", "2048x28672x4096"]
    assert doc["summary"]["0.04"]["specs"] == 2 and doc["summary"]["0.04"]["spread_max"] == 0.0
    assert "| 0.04 | 2 (0 failed)" in capsys.readouterr().out
