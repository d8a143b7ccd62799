"""capped_stop_replay.py on CPU: rules replayed on synthetic capped timelines, cut where the loop would stop."""

import importlib.util
import json
import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
_spec = importlib.util.spec_from_file_location("capped_stop_replay",
                                               pathlib.Path(__file__).with_name("capped_stop_replay.py"))
cr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cr)


def timeline(values_ms, batch_s=0.02, per_batch=10):
    """One batch per value, each of `per_batch` samples at that value, ending every batch_s seconds."""
    return [[round((i + 1) * batch_s, 6), v * per_batch, per_batch] for i, v in enumerate(values_ms)]


def test_a_fixed_rule_stops_at_the_first_batch_past_its_time():
    tl = timeline([1.0] * 50 + [2.0] * 100)  # 1 ms for the first second, then 2 ms
    mean, secs = cr.replay(tl, cr.Rule("fixed 1 s", 1.0, 1.0))
    assert secs == 1.0 and mean == 1.0
    mean, secs = cr.replay(tl, cr.Rule("fixed 3 s", 3.0, 3.0))
    assert secs == 3.0 and mean == pytest.approx((50 + 200) / 150)


def test_the_block_rule_stops_at_its_minimum_on_a_flat_series_and_runs_on_a_noisy_one():
    rule = cr.Rule("blocks", 0.5, 3.0)
    assert cr.replay(timeline([1.0] * 150), rule)[1] <= 0.6  # five blocks (float ends may make one a batch longer)
    rng = random.Random(1)
    noisy = [1.0 + rng.gauss(0, 0.2) for _ in range(150)]
    assert cr.replay(timeline(noisy), rule)[1] > 0.5


def test_the_correction_waits_longer_on_a_correlated_series():
    rng = random.Random(2)
    x, values = 0.0, []
    for _ in range(150):  # AR(1) with rho 0.97 per 20 ms batch: block means of 0.1 s still correlate
        x = 0.97 * x + rng.gauss(0, 0.004)
        values.append(1.0 + x)
    plain = cr.replay(timeline(values), cr.Rule("plain", 0.5, 3.0))[1]
    corrected = cr.replay(timeline(values), cr.Rule("corrected", 0.5, 3.0, corrected=True))[1]
    assert plain < 3.0 and corrected > plain


def test_evaluate_spreads_over_passes_and_errors_against_the_full_series():
    rows = [{"spec": {"m": 1}, "timeline": timeline([1.0] * 50 + [v] * 100)} for v in (1.0, 1.3)]
    rows.append({"spec": {"m": 1}, "time_ms": 1.0})  # not capped: no timeline, left out
    out = cr.evaluate(rows, [cr.Rule("fixed 1 s", 1.0, 1.0), cr.Rule("fixed 3 s", 3.0, 3.0)])
    one, three = out["fixed 1 s"], out["fixed 3 s"]
    assert one["rows"] == 2 and one["spread_max"] == 0.0  # both passes read 1.0 in their first second
    assert one["error_max"] == pytest.approx(1 - 1 / 1.2) and one["missed_target"] == 0.5
    assert three["error_max"] == 0.0 and three["spread_max"] == pytest.approx(0.2 / 1.1)
    assert three["seconds_mean"] == 3.0


def test_main_refuses_a_result_without_timelines(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [{"spec": {"m": 1}, "time_ms": 1.0}]}))
    assert cr.main([str(path), "--out", str(tmp_path)]) == 2
    assert "--keep-samples" in capsys.readouterr().err
    assert cr.main([str(tmp_path / "absent.json")]) == 2


def test_main_writes_its_table(tmp_path, capsys):
    rng = random.Random(5)
    rows = [{"spec": {"m": m}, "timeline": timeline([1.0 + rng.gauss(0, 0.05) for _ in range(150)])}
            for m in (1, 2) for _ in range(4)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows}))
    assert cr.main([str(path), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lag-1 autocorrelation" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(cr.RULES)  # header, its rule line, one row per rule
    assert [line.split(" | ")[0][2:] for line in table[2:]] == [rule.name for rule in cr.RULES]
    reference = table[2].split(" | ")
    assert reference[5:8] == ["0.00 %"] * 3 and reference[1] != "0.00 %"  # its own mean; spread over 4 passes
    doc = json.loads((tmp_path / "capped_stop_replay.json").read_text())
    assert len(doc["lag1_autocorrelation"]) == 8 and doc["result"]["fixed 3 s (reference)"]["error_max"] == 0.0


def test_lag1_autocorrelation_and_the_widened_interval():
    assert cr.lag1_autocorrelation([1.0, 2.0]) == 0.0 and cr.lag1_autocorrelation([3.0] * 6) == 0.0
    assert cr.lag1_autocorrelation([1.0, -1.0] * 10) == pytest.approx(-0.95)  # alternating: -(n - 1) / n
    assert cr.lag1_autocorrelation([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.25)  # (.75 - .25 + .75) / 5
    plain = cr.mean_halfwidth([1.0, 2.0, 3.0, 4.0])
    assert cr.corrected_halfwidth([1.0, 2.0, 3.0, 4.0]) == pytest.approx(plain * (1.25 / 0.75) ** 0.5)
    alternating = [1.0, 2.0] * 5
    assert cr.corrected_halfwidth(alternating) == cr.mean_halfwidth(alternating)  # never narrower


def test_results_of_two_machine_starts_pool_rows_but_spread_within_each(tmp_path, capsys):
    """The same spec in two files is two specs for the spread (passes belong to one file); a .gz file reads too."""
    import gzip

    def doc(level):
        return {"rows": [{"spec": {"m": 1}, "timeline": timeline([level] * 150)} for _ in range(4)]}

    a, b = tmp_path / "a.json", tmp_path / "b.json.gz"
    a.write_text(json.dumps(doc(1.0)))
    with gzip.open(b, "wt") as f:
        json.dump(doc(1.1), f)  # 10 % apart from a: pooled by spec alone, the spread would be 10 %
    assert cr.main([str(a), str(b), "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "capped_stop_replay.json").read_text())["result"]["fixed 3 s (reference)"]
    assert out["rows"] == 8 and out["specs"] == 2 and out["spread_max"] == 0.0
    capsys.readouterr()
    assert cr.main([str(a), str(tmp_path / "absent.json")]) == 2
