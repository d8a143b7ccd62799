import json

from kprof.cli import main
from kprof.ledger import Ledger
from kprof import api, synth
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


def test_the_citation_of_a_fresh_run_is_said_to_be_stored_nowhere(h, capsys, local_gpu):
    """`run --fresh --json` gives each row the id its event would have; `show` of it said only "nothing in p.db
    matches", which reads as a mistyped reference or ledger."""
    h.append("p.db", h.make_event(h.gemm(m=64), local_gpu))
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *h.spec_args(h.gemm()), "--db", "p.db", "--fresh",
                 "--json"]) == 0
    event = json.loads(capsys.readouterr().out)["results"][0]["event"]
    assert main(["show", event, "--db", "p.db"]) == 2
    assert "a `run --fresh` stores no event" in capsys.readouterr().err


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


def _shown(h, capsys, ref, db="p.db"):
    assert main(["show", ref, "--db", db]) == 0
    text = capsys.readouterr().out
    assert main(["show", ref, "--db", db, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_show_says_which_event_its_metrics_are_of_and_its_parent(h, capsys, local_gpu):
    """The metrics of a superseded event were printed as if they were the row's: the event shown is named, with
    its state (current, superseded, retracted) and its parent (in this ledger, or not)."""
    from kprof.ledger.build import retraction

    old = h.make_event(h.gemm(), local_gpu, time_ms=0.5)
    (old_id,) = h.append("p.db", old)
    (new_id,) = h.append("p.db", h.make_event(h.gemm(), local_gpu, time_ms=0.7, parent=old_id))
    text, doc = _shown(h, capsys, f"kprof.{old_id.hex()[:16]}")
    assert f"event kprof.{old_id.hex()[:16]} (seq 1, measured): superseded: the key's current event is " \
           f"kprof.{new_id.hex()[:16]}" in text and "time_ms=0.5" in text
    assert "row: ok" in text and doc["status"] == "ok" and doc["revision"] == 1
    text, doc = _shown(h, capsys, old.key.hex())
    assert f"event kprof.{new_id.hex()[:16]} (seq 2, measured): current" in text
    assert f"parent kprof.{old_id.hex()[:16]} (seq 1)" in text and doc["event"]["parent"] == old_id.hex()
    (r_id,) = h.append("p.db", retraction(new_id, old.key, "wrong host"))
    text, _doc = _shown(h, capsys, f"kprof.{new_id.hex()[:16]}")
    assert f"retracted by kprof.{r_id.hex()[:16]}: wrong host" in text
    text, _doc = _shown(h, capsys, f"kprof.{r_id.hex()[:16]}")
    assert f"(seq 3, retracted): retracts kprof.{new_id.hex()[:16]}: wrong host" in text
    (orphan,) = h.append("p.db", h.make_event(h.gemm(64), local_gpu, parent=b"\x11" * 32))
    text, _doc = _shown(h, capsys, f"kprof.{orphan.hex()[:16]}")
    assert "parent kprof.1111111111111111 (not in this key's history here)" in text



def test_show_names_the_key_of_a_parent_the_ledger_holds_under_another(h, capsys, local_gpu):
    """`run` measures a stale spec under this revision's key, naming the stale row as the new row's parent; `show`
    said that parent was "not in this key's history here", which the README gives as a parent a merged segment left
    out, though the ledger holds it under its own key. It names that key and how that row was taken."""
    import msgspec

    old = h.make_event(h.gemm(), local_gpu, revision=0)
    (old_id,) = h.append("p.db", old)
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *h.spec_args(h.gemm()), "--db", "p.db",
                 "--json"]) == 0
    new = json.loads(capsys.readouterr().out)["results"][0]
    text, doc = _shown(h, capsys, new["citation"])
    assert doc["event"]["parent"] == old_id.hex() and doc["key"] != old.key.hex()
    assert (f"parent kprof.{old_id.hex()[:16]} (of key {old.key.hex()[:16]} here: profiler revision 0, timing "
            f"{old.provenance.timing})") in text
    assert doc["parent_elsewhere"] == {"key": old.key.hex(), "provenance": msgspec.structs.asdict(old.provenance)}
    text, doc = _shown(h, capsys, f"kprof.{old_id.hex()[:16]}")  # no parent: nothing elsewhere
    assert doc["parent_elsewhere"] is None


def test_show_gives_the_rows_status_stale_failed_retracted(h, capsys, local_gpu):
    """`query` said stale or failed; `show` of the same citation did not say so."""
    from kprof.ledger.build import retraction

    (stale,) = h.append("p.db", h.make_event(h.gemm(32), local_gpu, revision=0))
    (fail,) = h.append("p.db", h.make_event(h.gemm(48), local_gpu, kind="failed"))
    text, doc = _shown(h, capsys, f"kprof.{stale.hex()[:16]}")
    assert doc["status"] == "stale" and doc["revision"] == 1
    assert "row: stale (profiler revision 0; this kprof measures single_gemm/torch-cpu at revision 1;" in text
    (newer,) = h.append("p.db", h.make_event(h.gemm(64), local_gpu, revision=2))
    text, doc = _shown(h, capsys, f"kprof.{newer.hex()[:16]}")  # query reads it as missing: show said "ok"
    assert doc["status"] == "missing" and "row: missing (profiler revision 2, newer than this kprof's 1: its query " \
                                           "reads it as missing" in text
    text, doc = _shown(h, capsys, f"kprof.{fail.hex()[:16]}")
    assert doc["status"] == "failed" and "row: failed" in text and "error: crash: segfault in the kernel" in text
    key = bytes.fromhex(doc["key"])
    h.append("p.db", retraction(fail, key, "flaky host"))
    text, doc = _shown(h, capsys, key.hex())
    assert doc["status"] == "missing" and doc["current"] is None and doc["event"] is None
    assert "row: missing (every measurement of this key is retracted" in text
    (old_fail,) = h.append("p.db", h.make_event(h.gemm(80), local_gpu, kind="failed", revision=0))
    text, doc = _shown(h, capsys, f"kprof.{old_fail.hex()[:16]}")  # show said stale; query says missing
    assert doc["status"] == "missing" and "row: missing (profiler revision 0, older than this kprof's 1: its query " \
                                           "reads it as missing" in text
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(80)), "--db", "p.db", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "missing"


def test_show_reads_a_row_of_another_timing_as_stale_as_query_does(h, capsys, local_gpu, monkeypatch):
    """A torch-cpu row timed on 1 thread read `stale` in a query on 2 threads, while `show` of its citation said
    `row: ok` (it compared profiler revisions only); on 1 thread both read it as ok."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (one,) = h.append("p.db", h.make_event(h.gemm(32), local_gpu))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    text, doc = _shown(h, capsys, f"kprof.{one.hex()[:16]}")
    assert doc["status"] == "stale" and doc["timing"].endswith(";threads=2"), doc["timing"]
    assert ("row: stale (timed cpu-wall;l2=warm;eager;threads=1; a query of this process reads "
            "single_gemm/torch-cpu rows timed cpu-wall;l2=warm;eager;threads=2") in text
    assert "OMP_NUM_THREADS with MKL_NUM_THREADS unset)" in text  # MKL's count wins where both are set
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(32)), "--db", "p.db", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "stale"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    text, doc = _shown(h, capsys, f"kprof.{one.hex()[:16]}")
    assert doc["status"] == "ok" and "row: ok" in text


def test_show_of_a_failed_row_of_another_timing_says_query_reads_it_as_missing(h, capsys, local_gpu, monkeypatch):
    """A torch-cpu row that failed on 1 thread reads `missing` in a query on 2 threads (a failure is no measurement to
    read as stale), while `show` of its citation said only `row: failed`: it says the query reads it as missing, and
    why; on 1 thread both read it as failed."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (one,) = h.append("p.db", h.make_event(h.gemm(32), local_gpu, kind="failed"))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["query", h.GEMM, "--backend", h.CPU, *h.spec_args(h.gemm(32)), "--db", "p.db", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "missing"
    text, doc = _shown(h, capsys, f"kprof.{one.hex()[:16]}")
    assert doc["status"] == "missing"  # as the query reads it (the README's word for show's status)
    assert ("row: missing (failed, timed cpu-wall;l2=warm;eager;threads=1; a query of this process reads "
            "single_gemm/torch-cpu rows timed cpu-wall;l2=warm;eager;threads=2, and reads it as missing") in text
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    text, doc = _shown(h, capsys, f"kprof.{one.hex()[:16]}")
    assert doc["status"] == "failed" and "row: failed\n" in text


def test_every_id_and_key_show_prints_can_be_recomputed_from_it(h, capsys, local_gpu):
    """An auditor recomputes each event id from `show --json`: blake3 of the tagged canonical bytes it prints
    (`canonical`), which decode to the fields it prints; and the key from the provenance printed. The fields alone
    could not give the id back: make_event leaves Method.budget_s out of the bytes, and the JSON prints it (0.0)."""
    import msgspec
    from blake3 import blake3

    from kprof.ledger.build import retraction
    from kprof.ledger.events import Event, Provenance

    (first,) = h.append("p.db", h.make_event(h.gemm(), local_gpu))
    (fail,) = h.append("p.db", h.make_event(h.gemm(), local_gpu, kind="failed", parent=first))
    key = h.make_event(h.gemm(), local_gpu).key
    h.append("p.db", retraction(fail, key, "flaky host"))
    _text, doc = _shown(h, capsys, key.hex())
    assert [e["type"] for e in doc["history"]] == ["measured", "failed", "retracted"]
    for e in doc["history"]:
        data = bytes.fromhex(e["canonical"])
        assert blake3(b"kprof/event/v1\x00" + data).hexdigest() == e["event"]
        shown = {k: v for k, v in e.items() if k not in ("seq", "event", "citation", "current", "canonical")}
        assert api._builtins(msgspec.msgpack.decode(data, type=Event)) == shown  # the fields are those bytes'
        if "provenance" in e:
            prov = msgspec.msgpack.encode(msgspec.convert(e["provenance"], Provenance))
            assert blake3(b"kprof/key/v1\x00" + prov).hexdigest() == e["key"] == key.hex()
    measured = doc["history"][0]
    assert measured["method"]["budget_s"] == 0.0 and b"budget_s" not in bytes.fromhex(measured["canonical"])


def test_a_reference_longer_than_an_id_is_refused_as_such(h, capsys, local_gpu):
    """An id or key has 64 hex digits: a longer reference (a pasted id with a stray digit) was "nothing in the
    ledger matches; check the --db", sending the auditor to the wrong place."""
    (eid,) = h.append("p.db", h.make_event(h.gemm(), local_gpu))
    assert main(["show", eid.hex(), "--db", "p.db"]) == 0
    capsys.readouterr()
    assert main(["show", eid.hex() + "0", "--db", "p.db"]) == 2
    err = capsys.readouterr().err
    assert "is not a citation, event id or key" in err and "8 to 64 hex digits" in err


def test_show_lists_the_metrics_in_the_order_query_does(h, capsys, local_gpu):
    """show printed the stored, key-sorted metrics (energy_j, memory_bandwidth_gbps, tflops, time_ms) where query
    lists the family's order (time_ms first); both now list them as the contract does."""
    (eid,) = h.append("p.db", h.make_event(h.gemm(), local_gpu))
    text, doc = _shown(h, capsys, f"kprof.{eid.hex()[:16]}")
    order = ["time_ms", "tflops", "memory_bandwidth_gbps", "energy_j"]
    assert list(doc["event"]["metrics"]) == order and list(doc["history"][0]["metrics"]) == order
    assert "metrics: time_ms=0.5, tflops=1.0, memory_bandwidth_gbps=2.0, energy_j=None" in text
    assert h.read_json(capsys, "query", "p.db", h.gemm())["results"][0]["metrics"] == doc["event"]["metrics"]


def test_show_says_how_many_samples_why_sampling_stopped_and_that_the_host_was_busy(h, capsys, local_gpu):
    """The README says `kprof show` gives a row's stop_reason; its text gave the metrics alone, so a 64x256x256 GEMM
    stored at 41 ms (24 samples at load 4 on 2 cores) showed no sign why: only --json held the samples and host_busy."""
    import msgspec

    from kprof.ledger.events import Method

    event = h.make_event(h.gemm(), local_gpu, time_ms=40.97)
    busy = "load 4.08 over 2 cores: other work shared them"
    event = msgspec.structs.replace(event, method=Method(timer="cpu", l2="warm", stop_reason="budget",
                                                         notes={"host_busy": busy}))
    (eid,) = h.append("p.db", event)
    text, _doc = _shown(h, capsys, f"kprof.{eid.hex()[:16]}")
    assert "samples: n=5, median 40.97 ms (p10 40.97, p90 40.97), cv 0; stop_reason=budget" in text
    assert f"host_busy: {busy}" in text
    (quiet,) = h.append("p.db", h.make_event(h.gemm(64), local_gpu))
    text, _doc = _shown(h, capsys, f"kprof.{quiet.hex()[:16]}")
    assert "samples: n=5" in text and "host_busy" not in text


def test_show_prints_how_a_row_was_timed_and_its_notes(h, capsys, local_gpu):
    """README has `kprof show` give a row's method, and a collective's `rank_min_median_ms` (its NCCL version,
    GPUs, topology) is in its notes: the text printed neither, only `--json` did."""
    import msgspec

    event = h.make_event(h.gemm(), local_gpu)
    method = msgspec.structs.replace(event.method, stop_reason="budget", notes={"rank_min_median_ms": "0.25"})
    (eid,) = h.append("p.db", msgspec.structs.replace(event, method=method))
    text, doc = _shown(h, capsys, f"kprof.{eid.hex()[:16]}")
    line = next(line for line in text.splitlines() if line.startswith("method: "))
    assert "timer=cpu" in line and line.endswith("; notes: rank_min_median_ms=0.25")
    assert "stop_reason=budget" in text
    assert doc["event"]["method"]["notes"] == {"rank_min_median_ms": "0.25"}


def test_show_says_when_a_row_keeps_fewer_samples_than_its_statistics_are_of(h, capsys, local_gpu):
    """A row keeps at most 512 samples, evenly spaced in time, its statistics of all of them: a GEMM of 828 samples
    showed `n=828` and --json 512 samples, whose median (0.039424 ms) was not the row's (0.039474 ms), with no word
    that the samples were a subset."""
    import msgspec

    from kprof.measure.stats import summarize

    samples = [0.03 + (i % 97) * 1e-4 for i in range(828)]
    event = h.make_event(h.gemm(), local_gpu)
    event = msgspec.structs.replace(event, stats=msgspec.convert(msgspec.to_builtins(summarize(samples)),
                                                                 type(event.stats)))
    (eid,) = h.append("p.db", event)
    text, doc = _shown(h, capsys, f"kprof.{eid.hex()[:16]}")
    assert doc["event"]["stats"]["n"] == 828 and len(doc["event"]["stats"]["samples"]) == 512
    assert "samples: n=828 (512 kept, evenly spaced in time; the statistics are of all 828), median" in text
    (whole,) = h.append("p.db", h.make_event(h.gemm(64), local_gpu))
    text, _doc = _shown(h, capsys, f"kprof.{whole.hex()[:16]}")
    assert "samples: n=5, median" in text


def test_show_of_a_key_whose_history_names_a_seq_missing_from_the_log_names_the_log(ledger_path, capsys):
    """A damaged log (the entry of one of the key's events gone): exit 3 naming the key, the seq and the log, not
    an internal TypeError said of the `events` sub-database."""
    from kprof.ledger._reducer import pack_seq

    led = _ledger(ledger_path)
    key = synth.event(0).key
    first = led.resolve(key.hex()).history[0][1]
    led.write(lambda txn: txn.delete(pack_seq(1), db=led.dbs["log"]))
    led.close()
    for ref in (key.hex()[:16], f"kprof.{first.hex()[:16]}"):
        assert main(["show", ref, "--db", ledger_path, "--json"]) == 3
        captured = capsys.readouterr()
        assert captured.out == "" and "Traceback" not in captured.err and "TypeError" not in captured.err
        assert f"the history of key {key.hex()} names seq 1, which is not in the log" in captured.err




def test_show_of_an_event_its_keys_history_does_not_hold_is_damage_not_a_retracted_row(ledger_path, capsys):
    """A history entry a damaged page hides (LMDB finds no entry): show said the key's every measurement was
    retracted (status `retracted`, exit 0) while query read its current row ok. The event asked for, and the current
    row, must be in the key's history: else exit 3 naming the key and the event."""
    led = _ledger(ledger_path)
    key = synth.event(0).key
    history = led.resolve(key.hex()).history
    led.write(lambda txn: txn.delete(key, db=led.dbs["history"]))
    led.close()
    for eid in (history[0][1], history[-1][1]):  # an earlier event, and the current one
        assert main(["show", f"kprof.{eid.hex()[:16]}", "--db", ledger_path, "--json"]) == 3
        captured = capsys.readouterr()
        assert captured.out == "" and "Traceback" not in captured.err
        assert f"the history of key {key.hex()} lacks its event" in captured.err


def test_show_of_a_history_entry_holding_a_negative_seq_is_damage_not_a_traceback(ledger_path, capsys):
    """A damaged history value that still decodes, a seq below 0 in it: show crashed with OverflowError (packing the
    seq as a log key), exit 1 and a traceback. It is an IntegrityError naming `history` (exit 3)."""
    from kprof.ledger import _codec
    from kprof.ledger._reducer import HistoryEntry, history_entry

    led = _ledger(ledger_path)
    key = synth.event(0).key
    with led.read() as txn:
        entry = history_entry(key, txn.get(key, db=led.dbs["history"]))
    damaged = _codec.encode(HistoryEntry(entry.status, [-entry.seqs[0], *entry.seqs[1:]]))
    led.write(lambda txn: txn.put(key, damaged, db=led.dbs["history"]))
    led.close()
    assert main(["show", key.hex()[:16], "--db", ledger_path, "--json"]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert "reading sub-database `history` failed (OverflowError" in captured.err


def test_control_characters_in_stored_values_are_printed_as_escapes(ledger_path, capsys):
    """A merged segment's notes, metric names and messages reached the terminal as they were: an escape sequence in
    one cleared the screen, retitled the window or recoloured what followed. Printed escaped."""
    import msgspec

    esc = "\x1b[2J\x1b]0;owned\x07\x9b31m\u202e"
    row = synth.event(0)
    row = msgspec.structs.replace(row, metrics={**row.metrics, "time_ms" + esc: 1.0},
                                  method=msgspec.structs.replace(row.method, notes={"why" + esc: "v" + esc}))
    with Ledger.open(ledger_path) as led:
        led.append([row, failed(synth.event(1).provenance, "crash", "boom" + esc)])
    for key in (row.key, synth.event(1).key):
        assert main(["show", key.hex(), "--db", ledger_path]) == 0
        out = capsys.readouterr().out
        assert not any(c in out for c in "\x1b\x07\x9b\u202e") and "\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e" in out
    assert "error: crash: boom\\x1b[2J" in out


def test_a_key_of_a_long_history_shows_its_latest_events_and_counts_the_rest(ledger_path, capsys):
    """A key of 20,000 events (merged from elsewhere) laid out one table row each: `show` took 44 s, and minutes more
    for more. The latest TABLE_ROWS show, a line counts the earlier ones, and --json has them all."""
    import msgspec

    from kprof.cli._render import TABLE_ROWS
    from kprof.ledger import _codec

    events, parent = [], None
    for seed in range(TABLE_ROWS + 10):
        events.append(msgspec.structs.replace(synth.event(0, seed=seed), parent=parent))
        parent = _codec.event_id(_codec.encode(events[-1]))
    with Ledger.open(ledger_path) as led:
        led.append(events)
    key = synth.event(0).key.hex()
    assert main(["show", key, "--db", ledger_path]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == TABLE_ROWS and f"│ {TABLE_ROWS + 10} " in rows[-1] and "(current)" in rows[-1]
    assert "... and 10 earlier event(s) of this key, seq 1 to 10; use --json for all" in out
    assert main(["show", key, "--db", ledger_path, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["history"]) == TABLE_ROWS + 10


def test_show_reads_a_retracted_key_as_missing_as_query_does(h, capsys, local_gpu):
    """`show` gave a key whose every event is retracted the status `retracted`, a value no row status has, where the
    README gives it as the key's row status as `query` reads it: query reads the spec as missing."""
    from kprof.api import show
    from kprof.ledger.build import retraction

    event = h.make_event(h.gemm(96), local_gpu)
    (eid,) = h.append("p.db", event)
    h.append("p.db", retraction(eid, event.key, "flaky host"))
    text, doc = _shown(h, capsys, event.key.hex())
    assert doc["status"] == "missing" == show(event.key.hex(), db="p.db")["status"]
    assert "row: missing (every measurement of this key is retracted; query reads it as missing)" in text
    assert h.read_json(capsys, "query", "p.db", h.gemm(96))["results"][0]["status"] == "missing"


def test_show_reads_a_row_of_another_algorithm_as_query_does(h, capsys, local_gpu):
    """A row of this revision and timing but another algorithm (a runner's, changed since) read `stale` (measured) or
    `missing` (failed) in a query, while `show` gave it the status ok or failed."""
    import msgspec

    from kprof.api import show
    from kprof.ledger import KeyMaker, ShapeCodec
    from kprof.ledger.build import failed, measured
    from kprof.ledger.events import Method, Stats
    from kprof.method import effective_entry
    from kprof.runners.registry import lookup

    entry = effective_entry(lookup(h.GEMM, h.CPU))
    keys = KeyMaker(h.GEMM, h.CPU, local_gpu, msgspec.structs.replace(entry.contract, algorithm="torch.mm (older)"),
                    ShapeCodec(entry.args))
    stats = Stats(n=1, median=1.0, p10=1.0, p90=1.0, mean=1.0, stdev=0.0, cv=0.0, min=1.0, max=1.0, samples=[1.0])
    good = measured(keys.provenance(h.gemm(32)), {"time_ms": 1.0, "tflops": 1.0, "memory_bandwidth_gbps": 1.0,
                                                   "energy_j": None}, stats, Method(timer="cpu", l2="warm"))
    bad = failed(keys.provenance(h.gemm(48)), "crash", "segfault in the kernel")
    h.append("p.db", good, bad)
    read = h.read_json(capsys, "query", "p.db", h.gemm(32), h.gemm(48))["results"]
    assert [r["status"] for r in read] == ["stale", "missing"]
    for event, status in ((good, "stale"), (bad, "missing")):
        text, doc = _shown(h, capsys, event.key.hex())
        assert doc["status"] == status == show(event.key.hex(), db="p.db")["status"]
        assert f"row: {status} ({event.__class__.__name__.lower()}, of an algorithm, layout or numerics other" in text
