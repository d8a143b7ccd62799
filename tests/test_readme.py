"""The README is part of the product: it opens with the two commands CI runs, and names every verb."""

import json
import pathlib
import re
import shutil
import time

import pytest

from kprof.cli import VERBS

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()


def test_readme_opens_with_exactly_two_commands():
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first is not None and README.index(first.group(0)) < README.index("\n## ")
    lines = [line for line in first.group(1).splitlines() if line.strip()]
    assert len(lines) == 2
    assert "kprof run" in lines[0] and "pytest" in lines[1]


def test_every_verb_appears_in_the_readme():
    missing = [name for name, _target, _help in VERBS if f"kprof {name}" not in README]
    assert not missing, f"verbs not shown in README.md: {missing}"


def _python_read_api_block() -> str:
    section = README[README.index("### The Python read API"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Python read API section holds one Python block"
    return blocks[0]


def test_readme_python_read_api_runs_after_the_first_command(tmp_path, monkeypatch, capsys):
    """The block runs as written where the README's first command left profile.db: torch-cpu rows of the demo
    specs, here under a GPU key no real machine has, so a key written into the README cannot pass."""
    from kprof import api, perf_api

    demo = pathlib.Path(__file__).parent.parent / "fixtures" / "specs" / "cpu_gemm_demo.json"
    (tmp_path / "fixtures" / "specs").mkdir(parents=True)
    shutil.copy(demo, tmp_path / "fixtures" / "specs" / demo.name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    monkeypatch.delenv("KPROF_DB", raising=False)
    monkeypatch.setattr("kprof.measure.env.cpu_model", lambda: "README test CPU")
    specs = json.loads(demo.read_text())["specs"]
    assert api.run("single_gemm", "torch-cpu", specs, db="profile.db").exit_code == 0
    capsys.readouterr()
    try:
        exec(compile(_python_read_api_block(), "README.md (The Python read API)", "exec"), {})
    finally:
        perf_api.close_all()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "single_gemm torch-cpu README test CPU 8"
    assert lines[1].endswith(" README test CPU") and " kprof." in lines[1]
    assert lines[-1] == "0"


def _bash_block(heading: str) -> list[str]:
    """The command lines of the first bash block under `heading`, as a reader would paste them."""
    section = README[README.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_the_tour_and_the_sharing_example_run_as_written_after_the_first_command(tmp_path):
    """Every line of "A short tour" and the first block of "Sharing rows" exits 0 where the README's first command
    left profile.db (the tour's `kprof show kprof.<16 hex>` was a placeholder bash read as a redirection, and the
    export named an H200 that a CPU machine's ledger does not hold: exit 2)."""
    import os
    import subprocess
    import sys

    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "kprof")):
        import pytest

        pytest.skip("the kprof script is not installed beside this interpreter")
    demo = pathlib.Path(__file__).parent.parent / "fixtures" / "specs" / "cpu_gemm_demo.json"
    (tmp_path / "fixtures" / "specs").mkdir(parents=True)
    shutil.copy(demo, tmp_path / "fixtures" / "specs" / demo.name)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "KPROF_TIME_BUDGET_S": "0.02"}
    env.pop("KPROF_DB", None)
    first = _bash_block("# kprof")[0]
    lines = [first[first.index("kprof run"):]] + _bash_block("## A short tour") + _bash_block("## Sharing rows")
    said = {}
    for line in lines:
        p = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (line, p.stdout[-2000:], p.stderr[-2000:])
        said[line.split()[1]] = p.stdout
    assert "row: ok" in said["show"] and "clean" in said["audit"]
    assert "merged 8 new event(s) into team.db" in said["merge"]


def test_the_readme_runner_of_ones_own_registers_and_measures(tmp_path, monkeypatch):
    """The "Your own kernels" block, saved as the module it names, registers a table whose spec may leave out its
    field with a default, measures it, and reads it back under the same key with the default given."""
    import importlib
    import sys

    from kprof import api
    from kprof.runners import registry

    section = README[README.index("## Your own kernels"):]
    block = re.search(r"```python\n(.*?)```", section[:section.index("\n## ")], re.S).group(1)
    (tmp_path / "mykern").mkdir()
    (tmp_path / "mykern" / "__init__.py").write_text("")
    (tmp_path / "mykern" / "softmax.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    registry.entries()  # the catalog first: a registry that is not empty is taken as loaded
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    try:
        importlib.import_module("mykern.softmax")
        db = str(tmp_path / "p.db")
        ran = api.run("my_softmax", "torch-cpu", [{"tokens": 8, "vocab": 64}], db=db)
        assert ran.exit_code == 0 and ran.results[0]["spec"] == {"tokens": 8, "vocab": 64, "dtype": "fp32"}
        read = api.query("my_softmax", "torch-cpu", [{"tokens": 8, "vocab": 64, "dtype": "fp32"}], db=db).results[0]
        assert (read["status"], read["key"]) == ("ok", ran.results[0]["key"])
    finally:
        for name in ("mykern.softmax", "mykern"):
            sys.modules.pop(name, None)


def _documented(phrase: str) -> list[list[str]]:
    """The field lists (`{a, b, ...}`) the README gives after `phrase`, up to the next paragraph or bullet."""
    text = " ".join(README.split())
    start = text.index(phrase)
    end = min(i for i in (text.find(" - ", start + 1), text.find(" ## ", start + 1), len(text)) if i > 0)
    return [[f.strip() for f in group.split(",")] for group in re.findall(r"`\{([^}`]*)\}`", text[start:end])]


def test_the_readme_lists_the_fields_of_audit_json_as_the_audit_prints_them(tmp_path, capsys):
    """An auditor reads `audit --json` and `audit --remeasure N --json` from the README: every field, in order."""
    from kprof import synth
    from kprof.cli import main
    from kprof.ledger import Ledger
    from kprof.remeasure import Drift, RemeasureReport

    db = str(tmp_path / "a.db")
    with Ledger.open(db) as led:
        led.append(list(synth.events(0, 3)))
    assert main(["audit", "--db", db, "--json", "--jobs", "1"]) == 0
    assert _documented("The audit's `--json`:")[0] == list(json.loads(capsys.readouterr().out))
    row = Drift("t", "b", {}, "kprof.00", 1.0, 1.0, 0.0, True)
    doc = RemeasureReport(db, [], 0.05, 1, [row], 0.0).to_json()
    report, rows = _documented("`kprof audit --remeasure N` measures")[-2:]
    assert report == list(doc) and rows == list(doc["rows"][0])


def test_the_work_formulas_name_each_table_s_spec_fields():
    """(The MoE formula read `top_k`, a field no spec has (`topk`), and attention's `heads`: a simulator computing the
    work from a spec reads the README's names as the spec's.)"""
    from kprof.runners.registry import lookup

    text = " ".join(README[README.index("The work counted:"):].split("bytes are the minimum")[0].split())
    for table, label in [("single_gemm", "GEMM"), ("attention_decode", "attention"), ("attention_prefill", "attention"),
                         ("moe_grouped_gemm", "`moe_grouped_gemm` (one projection)")]:
        formula = text[text.index(label + " ") + len(label) + 1:].split()[0].rstrip(";,")
        names = [n for n in formula.split("·") if not n.isdigit()]
        fields = set(lookup(table, "torch-cpu").args.__struct_fields__) | {"q_len", "kv_len"}
        assert names and set(names) <= fields, (table, formula)


def test_the_units_of_a_row_s_stats_are_stated_and_hold(tmp_path, monkeypatch):
    """(The read API named a Row's stats without their units: a simulator could not tell ms from s, or cv from a
    percentage.) The README states them, and a measured row's stats are so: its samples in ms, time_ms their median."""
    import statistics

    from kprof import api
    from kprof.ledger import Ledger

    assert "times in ms, as the samples are, and `cv` = stdev / mean" in " ".join(README.split())
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    db = str(tmp_path / "profile.db")
    spec = {"tokens": 512, "hidden": 1024, "dtype": "fp32"}  # ~0.1 ms or more: fewer than 512 samples, all kept
    assert api.run("rms_norm", "torch-cpu", [spec], db=db).exit_code == 0
    with Ledger.open(db, readonly=True) as ledger:
        gpu = api.scopes(db)[0].gpu_name
        row = api.view(ledger, "rms_norm", "torch-cpu", gpu).get(**spec)
        samples = ledger.event(row.event_id).stats.samples
    st = row.stats
    assert row.metrics["time_ms"] == st.median and st.n == len(samples)
    assert st.median == pytest.approx(statistics.median(samples))
    assert st.mean == pytest.approx(statistics.fmean(samples))
    assert st.cv == pytest.approx(st.stdev / st.mean) and st.stdev == pytest.approx(statistics.stdev(samples))
    assert 1e-3 < st.median < 1e3  # ms: a 512 x 1024 norm takes over a microsecond, under a second


def test_what_the_readme_says_of_a_short_cpu_call_s_grouped_samples_holds():
    """(The README said a row's stats are of its samples, never that a short CPU call's sample is the time per call of
    a group of calls: a 2 µs copy's cv, p10 and p90, of 12-call means, read as single calls' spread.) It says so, with
    the bounds the timer uses, and the timer groups a short call and not a long one."""
    from kprof.measure.cpu_timer import _GROUP_NS, time_cpu
    from kprof.measure.stats import StopRule

    text = " ".join(README.split())
    assert f"A CPU sample of a call under {_GROUP_NS // 2000} µs" in text and f"of about {_GROUP_NS // 1000} µs" in text
    assert "`calls_per_sample` in the row's notes" in text
    rule = StopRule(budget_s=0.05)
    short = time_cpu(lambda: sum(range(20)), rule)
    assert short.inner >= 2 and sorted(short.samples_ms)[len(short.samples_ms) // 2] < _GROUP_NS / 2e6  # per call
    assert time_cpu(lambda: time.sleep(0.03), rule).inner == 1


def test_the_memo_of_bulk_lookups_is_told_once_with_its_bounds():
    """(The read API said "repeated lookups" were answered from a memo, where `view.get` is not, and the ledger
    section told the memo again, with its bounds.) The read API section says which lookups and the bounds, once."""
    from kprof.ledger._memo import MAX_ENTRIES, MAX_SPECS

    bounds = f"at most {MAX_SPECS:,} specs' answers ({MAX_ENTRIES} requests)"
    section = README[README.index("### The Python read API"):]
    section = " ".join(section[:section.index("\n## ")].split())
    assert "Repeated bulk lookups (`get_many`, `missing`, `count_<table>`, `api.query`)" in section and bounds in section
    assert " ".join(README.split()).count(bounds) == 1


def test_what_the_readme_says_a_cpu_backend_does_with_a_cuda_method_holds(tmp_path, monkeypatch, capsys):
    """(The README said torch-cpu refuses a CUDA method "set by flag or variable", where KPROF_TIMER=events is not
    read for a CPU backend: its rows are timed by the wall clock, exit 0.) The flag is refused, the variable not."""
    from kprof.cli import main

    text = " ".join(README.split())
    assert "refuses a CUDA method given by flag with exit 2 (the variables do not apply to it" in text
    spec = ["--spec", '{"m": 1, "n": 8, "k": 8, "dtype": "fp32"}']
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    db = str(tmp_path / "p.db")
    assert main(["run", "single_gemm", "--backend", "torch-cpu", "--db", db, "--timer", "events", *spec]) == 2
    monkeypatch.setenv("KPROF_TIMER", "events")
    assert main(["run", "single_gemm", "--backend", "torch-cpu", "--db", db, "--json", *spec]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["provenance"]["timing"].startswith("cpu-wall;")


def test_what_the_readme_says_of_an_output_dir_holds(tmp_path, monkeypatch):
    """(The README said `--output-dir` must be new, where a directory holding other files takes a snapshot; only one
    holding a snapshot is refused.)"""
    from kprof.cli import main

    assert "`--output-dir` is created if absent; one that holds a snapshot already is refused, exit 2" in " ".join(
        README.split())
    monkeypatch.setenv("KPROF_TIME_BUDGET_S", "0.02")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    run = ["run", "single_gemm", "--backend", "torch-cpu", "--db", str(tmp_path / "p.db"),
           "--spec", '{"m": 1, "n": 8, "k": 8, "dtype": "fp32"}']
    assert main([*run, "--output-dir", str(tmp_path / "out")]) == 0 and (tmp_path / "out" / "request.json").exists()
    assert main([*run, "--output-dir", str(tmp_path / "out")]) == 2
    assert main([*run, "--output-dir", str(tmp_path / "new" / "dir")]) == 0


def test_the_readme_reads_in_a_first_user_s_order():
    """(The GPU section came after the pool, collectives and remote runs, which it is the ground of: a first user read
    how idle GPUs are shared out before how one GPU row is measured.) What kprof is, the two commands, the tour, the
    Python read API, then measuring on a GPU, before anything that spreads GPU work out."""
    headings = re.findall(r"^#{2,3} (.*)$", README, re.M)
    order = ["A short tour", "The Python read API", "Measuring on a GPU", "The measure diagnostic", "Sharing rows",
             "Many GPUs, one host", "Collectives", "Remote runs", "How the ledger is built"]
    at = [next(i for i, h in enumerate(headings) if h.startswith(name)) for name in order]
    assert at == sorted(at) and at[:3] == [0, 1, 2], headings


def test_the_upgraded_copy_a_reader_reads_is_told_once_and_holds(tmp_path):
    """(The read API and the ledger section each told that a reader of an older format reads an upgraded copy.) The
    ledger section tells it once, a read-only `Ledger` among the readers, and what it says holds: the file is left
    as it was, and once a writer has upgraded it the copy's reads say to open the ledger again."""
    from kprof.errors import LedgerError
    from kprof.ledger import Ledger

    text = " ".join(README.split())
    assert text.count("an upgraded copy") == 1 and "a `Ledger` opened read-only) never writes the file" in text
    db = tmp_path / "old.db"
    fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "ledgers" / "synthetic-v3.db"
    shutil.copy(fixture, db)
    with Ledger.open(str(db), readonly=True) as reader:
        assert reader.scopes() and db.read_bytes() == fixture.read_bytes()
        with Ledger.open(str(db)):
            pass
        with pytest.raises(LedgerError, match="open it again"):
            reader.scopes()


def test_every_read_verb_the_tour_names_is_a_reader_of_the_ledger_section(tmp_path, capsys):
    """(The tour named `export` a read verb; the ledger section's readers, which never write the file, left it out.)
    Both list the same verbs, and `export` of an older format's file leaves the file as it was."""
    from kprof.cli import main

    text = " ".join(README.split())
    tour = re.search(r"The read verbs \(([^)]*)\)", text).group(1)
    readers = re.search(r"A reader \(([^)]*)\) never writes the file", text).group(1)
    verbs = lambda names: {n.strip(" `") for n in names.split(",") if n.strip().startswith("`")}  # noqa: E731
    assert verbs(tour) and verbs(tour) <= verbs(readers), (tour, readers)
    db = tmp_path / "old.db"
    fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "ledgers" / "synthetic-v3.db"
    shutil.copy(fixture, db)
    assert main(["export", "-o", str(tmp_path / "all.kseg"), "--db", str(db)]) == 0
    assert db.read_bytes() == fixture.read_bytes()


def test_the_progress_lines_the_readme_shows_are_those_of_one_run(monkeypatch, capsys):
    """The README showed a run's opening line of 260 specs to measure, then `progress: 40 of 300 spec(s)`: the total
    counts the specs the run measures (those with an ok row left out), so the same run says 40 of 260. The lines are
    the ones a run of those counts prints."""
    from kprof.cli import run

    clock = iter([0.0, 0.0, 725.0])
    monkeypatch.setattr(run.time, "monotonic", lambda: next(clock))
    update = run._progress_lines()
    update(0, 260, None, opening={"present": 40, "devices": ["cpu0"], "in_process": True})
    update(40, 260, {"m": 1})
    for line in capsys.readouterr().err.splitlines():
        assert f"`{line}`" in README, line
