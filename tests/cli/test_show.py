import json

from kprof.cli import main
from kprof.ledger import Ledger
from kprof import synth
from kprof.ledger.build import failed


def _ledger(path):
    led = Ledger.open(path)
    led.append([synth.event(0, seed=1)])
    led.append([synth.event(0, seed=2), failed(synth.event(0).provenance, "oom", "CUDA out of memory")])
    return led


def test_show_by_citation_gives_provenance_metrics_and_history(ledger_path, capsys):
    led = _ledger(ledger_path)
    row = synth.view(led).get_many([synth.spec(0)])[0]
    assert row.status == "failed"
    good = led.resolve(row.key.hex()).history[1]
    led.close()
    assert main(["show", f"kprof.{good[1].hex()[:16]}", "--db", ledger_path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["resolved_as"] == "event" and doc["event"]["event"] == good[1].hex()
    assert doc["event"]["provenance"]["table"] == "single_gemm"
    assert doc["event"]["metrics"]["time_ms"] == synth.event(0, seed=2).metrics["time_ms"]
    assert [h["type"] for h in doc["history"]] == ["measured", "measured", "failed"]
    assert [h["current"] for h in doc["history"]] == [False, False, True]
    assert doc["key"] == row.key.hex()


def test_show_by_key_prefix_renders_a_table(ledger_path, capsys):
    led = _ledger(ledger_path)
    key = synth.event(0).key.hex()
    led.close()
    assert main(["show", key[:10], "--db", ledger_path]) == 0
    out = capsys.readouterr().out
    assert f"key {key}" in out and "oom: CUDA out of memory" in out and "(current)" in out


def test_show_unknown_reference_exits_2(ledger_path, capsys):
    _ledger(ledger_path).close()
    assert main(["show", "kprof.deadbeefdeadbeef", "--db", ledger_path]) == 2
    assert "nothing in" in capsys.readouterr().err


def test_the_history_shows_whole_citations_on_an_80_column_terminal(ledger_path, capsys, monkeypatch):
    """`kprof.d479a616c32…` could not be copied back into `kprof show`."""
    import io

    from rich.console import Console

    from kprof.cli import show

    led = _ledger(ledger_path)
    key = synth.event(0).key.hex()
    led.close()
    assert main(["show", key, "--db", ledger_path, "--json"]) == 0
    citations = [h["citation"] for h in json.loads(capsys.readouterr().out)["history"]]
    buf = io.StringIO()
    monkeypatch.setattr(show, "console", lambda: Console(file=buf, width=80, highlight=False, soft_wrap=True))
    assert main(["show", key, "--db", ledger_path]) == 0
    out = buf.getvalue()
    assert "…" not in out and len(citations) == 3 and all(c in out for c in citations)
