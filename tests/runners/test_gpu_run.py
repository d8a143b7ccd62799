"""`run` on a CUDA backend end to end: rows with CUPTI time, energy, environment and throttle; the events
timer and CUDA-graph replay as keys of their own. Marked gpu: skipped without CUDA."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = {"tokens": 256, "hidden": 4096, "dtype": "bf16"}


def _event(db, result):
    from kprof.ledger import Ledger

    with Ledger.open(db, readonly=True) as ledger:
        return ledger.event(bytes.fromhex(result.results[0]["event"]))


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("KPROF_ENERGY_S", "0.3")
    for name in ("KPROF_TIMER", "KPROF_L2", "KPROF_CUDA_GRAPH", "KPROF_POWER"):
        monkeypatch.delenv(name, raising=False)
    return str(tmp_path / "gpu.db")


def test_run_stores_a_cupti_row_with_energy_and_environment(db):
    from kprof import api

    res = api.run("rms_norm", "torch", [SPEC], db=db)
    row = res.results[0]
    assert res.exit_code == 0 and row["status"] == "ok", row
    assert row["provenance"]["timing"] == "cupti;l2=cold;eager" and row["provenance"]["gpu_key"] == res.gpu_name
    assert row["metrics"]["time_ms"] > 0 and row["metrics"]["memory_bandwidth_gbps"] > 0
    assert row["metrics"]["energy_j"] > 0
    ev = _event(db, res)
    assert ev.method.timer == "cupti" and ev.method.l2 == "cold" and not ev.method.graph
    assert ev.method.notes["kernels"] and ev.method.notes["energy_method"].startswith("nvml-energy")
    env = ev.environment
    assert env.gpu_uuid.startswith("GPU-") and env.driver and env.cupti and env.power_limit_w > 0
    assert "sm_mhz_median" in env.clocks and isinstance(env.throttle, list)


def test_events_timer_and_graph_replay_are_rows_of_their_own(db, monkeypatch):
    from kprof import api

    cupti = api.run("rms_norm", "torch", [SPEC], db=db).results[0]
    monkeypatch.setenv("KPROF_TIMER", "events")
    events = api.run("rms_norm", "torch", [SPEC], db=db).results[0]
    monkeypatch.setenv("KPROF_TIMER", "cupti")
    monkeypatch.setenv("KPROF_CUDA_GRAPH", "1")
    graph_res = api.run("rms_norm", "torch", [SPEC], db=db)
    graph = graph_res.results[0]
    assert {cupti["status"], events["status"], graph["status"]} == {"ok"}
    assert len({cupti["key"], events["key"], graph["key"]}) == 3
    assert events["provenance"]["timing"] == "events;l2=cold;eager"
    assert graph["provenance"]["timing"] == "cupti;l2=cold;graph"
    ev = _event(db, graph_res)
    notes = ev.method.notes
    assert ev.method.graph and notes["l2"] == "read-sweep"
    assert notes["placements"] == notes["input_copies"] == "16"  # one graph per weight allocation, in turn
    assert notes["estimator"] in ("copy_mean", "mean")
    # the same kernel: graph replay and eager launches agree on its time within 10%
    assert graph["metrics"]["time_ms"] == pytest.approx(cupti["metrics"]["time_ms"], rel=0.10)
