"""`kprof show`: one row's provenance, metrics and full history, by citation, key or event id."""

from __future__ import annotations

import datetime as _dt
from typing import Annotated

from cyclopts import Parameter

from .. import api
from ._options import Db, Json
from ._render import TABLE_ROWS, console, emit_json


def show(ref: Annotated[str, Parameter(help="A citation (`kprof.<hex>`), an event id or a key, or a unique "
                                        "prefix of 8 to 64 hex digits; or a measure artifact's citation "
                                        "(`kmeasure.<hex>`).")], *,
         db: Db = None, json: Json = False,
         search_dir: Annotated[list[str] | None, Parameter(name="--dir", consume_multiple=False, metavar="DIR", help=(
             "Where to look for a `kmeasure.<hex>` citation: a `kprof measure` output directory, or a directory "
             "holding some; repeatable. Default: the current directory and the directories directly in "
             "it."))] = None) -> int:
    """Show a row's provenance, metrics and full history (its latest 50 events as a table, every one with --json); or
    what a measure artifact is and where it lies."""
    if ref.strip().lower().startswith("kmeasure."):
        return _show_measure(ref, search_dir, json)
    if search_dir:
        from ..errors import UsageError

        raise UsageError("--dir is where kmeasure.<hex> citations are looked for; a kprof.<hex> citation, event id "
                         "or key is read from the ledger (--db)")
    doc = api.show(ref, db=db)
    chosen, history = doc["event"], doc["history"]
    if json:
        emit_json(doc)
        return 0
    out = console()
    out.print(f"key {doc['key']}", markup=False)
    for line in _about(doc):
        out.print(line, markup=False)
    if chosen is not None:
        prov = chosen.get("provenance") or {}
        out.print("provenance: " + ", ".join(f"{k}={v}" for k, v in prov.items()), markup=False)
        if chosen["type"] == "measured":
            out.print("metrics: " + ", ".join(f"{k}={v}" for k, v in chosen["metrics"].items()), markup=False)
            for line in _samples(chosen):
                out.print(line, markup=False)
        elif chosen["type"] == "failed":
            out.print(f"error: {chosen['error_kind']}: {chosen['message']}", markup=False)
    from rich.table import Column, Table

    # The citations are printed whole at any width, to be copied back into `kprof show`: the other columns fold,
    # and " (current)" wraps below its citation.
    width = max((len(h["citation"]) for h in history), default=None)
    table = Table(*(Column(name, overflow="fold", min_width=width if name == "event" else None)
                    for name in ("seq", "event", "kind", "at", "detail")), title="history")
    # The latest TABLE_ROWS events: a key of 20,000 (a segment merged from elsewhere) took 44 s to lay out, a table row
    # at ~2 ms; the event shown is named above, and --json has them all.
    earlier, history = history[:-TABLE_ROWS], history[-TABLE_ROWS:]
    for h in history:
        detail = {"measured": lambda: f"time_ms={h['metrics'].get('time_ms')}",
                  "failed": lambda: f"{h['error_kind']}: {h['message']}",
                  "retracted": lambda: f"retracts {h['target'][:16]}: {h['reason']}"}[h["type"]]()
        mark = " (current)" if h["current"] else ""
        at = _dt.datetime.fromtimestamp(h["measured_at"], _dt.timezone.utc).isoformat(timespec="seconds")
        table.add_row(str(h["seq"]), h["citation"] + mark, h["type"], at, detail)
    out.print(table)
    if earlier:
        out.print(f"... and {len(earlier)} earlier event(s) of this key, seq {earlier[0]['seq']} to "
                  f"{earlier[-1]['seq']}; use --json for all", markup=False)
    return 0


def _samples(event: dict) -> list[str]:
    """How the time was taken: the samples' count (and how many are kept) and spread, why sampling stopped, the method
    and its notes (a collective's rank_min_median_ms, NCCL version, GPUs), and whether other work took the host's cores
    meanwhile (a CPU row's host_busy: a 20 µs GEMM read 41 ms so, and only --json said why)."""
    stats, method = event.get("stats") or {}, event.get("method") or {}

    def ms(v):
        return "-" if v is None else f"{v:.4g}"

    n, kept = stats.get("n"), len(stats.get("samples") or ())
    # A row keeps at most 512 of its samples, evenly spaced in time (kprof.measure.stats.summarize); its statistics
    # are of all n: recomputed from the kept ones, a median reads differently, with no word why.
    thinned = f" ({kept} kept, evenly spaced in time; the statistics are of all {n})" if 0 < kept < (n or 0) else ""
    lines = [f"samples: n={n}{thinned}, median {ms(stats.get('median'))} ms (p10 {ms(stats.get('p10'))}, p90 "
             f"{ms(stats.get('p90'))}), cv {ms(stats.get('cv'))}; stop_reason={method.get('stop_reason')}"]
    notes = dict(method.get("notes") or {})
    busy = notes.pop("host_busy", None)
    rest = {k: v for k, v in method.items() if k not in ("stop_reason", "notes")}  # the timer; a collective's notes
    lines.append("method: " + ", ".join(f"{k}={v}" for k, v in rest.items())
                 + ("; notes: " + ", ".join(f"{k}={v}" for k, v in notes.items()) if notes else ""))
    if busy:
        lines.append(f"host_busy: {busy}")
    return lines


def _about(doc: dict) -> list[str]:
    """Which event the provenance and metrics below are of (a superseded one is named as such), the key's row
    status as `query` reads it, and the event's parent, in this ledger or not."""
    chosen, history, status = doc["event"], doc["history"], doc["status"]
    current = next((h for h in history if h["current"]), None)
    lines = []
    if chosen is not None:
        retracted_by = {h["target"]: h for h in history if h["type"] == "retracted"}
        by = retracted_by.get(chosen["event"])
        state = ("current" if chosen["current"] else
                 f"retracts kprof.{chosen['target'][:16]}: {chosen['reason']}" if chosen["type"] == "retracted" else
                 f"retracted by {by['citation']}: {by['reason']}" if by else
                 f"superseded: the key's current event is {current['citation']}" if current else "superseded")
        lines.append(f"event {chosen['citation']} (seq {chosen['seq']}, {chosen['type']}): {state}")
        if chosen.get("parent"):
            seqs = {h["event"]: h["seq"] for h in history}
            other = doc["parent_elsewhere"]
            where = (f"seq {seqs[chosen['parent']]}" if chosen["parent"] in seqs else
                     "not in this key's history here" if other is None else
                     f"of key {other['key'][:16]} here: {_contract_of(other['provenance'])}")
            lines.append(f"parent kprof.{chosen['parent'][:16]} ({where})")
    same = current is not None and (current["provenance"]["profiler_revision"], current["provenance"]["timing"]) == (
        doc["revision"], doc["timing"])
    if status in ("stale", "missing") and same:  # of another algorithm, layout or numerics (a runner's, changed since)
        prov = current["provenance"]
        lines.append(f"row: {status} ({current['type']}, of an algorithm, layout or numerics other than this kprof's "
                     f"for {prov['table']}/{prov['backend']}: query reads it as {status} where its spec has no row of "
                     f"this kprof's)")
    elif status == "stale" and current["provenance"]["profiler_revision"] == doc["revision"]:
        prov = current["provenance"]
        lines.append(f"row: stale (timed {prov['timing']}; a query of this process reads {prov['table']}/"
                     f"{prov['backend']} rows timed {doc['timing']}, and reads it as stale where its spec has no row "
                     f"timed so: a query in the row's method reads it, its flags or, on torch-cpu, OMP_NUM_THREADS "
                     f"with MKL_NUM_THREADS unset)")
    elif status == "stale":
        prov = current["provenance"]
        lines.append(f"row: stale (profiler revision {prov['profiler_revision']}; this kprof measures "
                     f"{prov['table']}/{prov['backend']} at revision {doc['revision']}; query reads it as stale "
                     f"where its spec has no row of that revision)")
    elif doc["revision"] is not None and current["provenance"]["profiler_revision"] < doc["revision"]:
        lines.append(f"row: {status} (profiler revision {current['provenance']['profiler_revision']}, older than this "
                     f"kprof's {doc['revision']}: its query reads it as missing, and `run` measures it again)")
    elif doc["revision"] is not None and current["provenance"]["profiler_revision"] > doc["revision"]:
        lines.append(f"row: {status} (profiler revision {current['provenance']['profiler_revision']}, newer than this "
                     f"kprof's {doc['revision']}: its query reads it as missing; read it with a kprof that measures "
                     f"that revision)")
    elif current and current["type"] == "failed" and doc["timing"] not in (None, current["provenance"]["timing"]):
        prov = current["provenance"]
        lines.append(f"row: {status} (failed, timed {prov['timing']}; a query of this process reads {prov['table']}/"
                     f"{prov['backend']} rows timed {doc['timing']}, and reads it as missing where its spec has no row "
                     f"timed so: a query in the row's method (its flags or, on torch-cpu, OMP_NUM_THREADS with "
                     f"MKL_NUM_THREADS unset) reads it failed)")
    elif current is None:
        lines.append(f"row: {status} (every measurement of this key is retracted; query reads it as missing)")
    else:
        lines.append(f"row: {status}")
    return lines


def _contract_of(prov: dict | None) -> str:
    """How a row of another key was taken, as the stale row a re-measurement replaced differs from it."""
    if prov is None:
        return "a retraction"
    return f"profiler revision {prov['profiler_revision']}, timing {prov['timing']}"


def _show_measure(ref: str, dirs: list[str] | None, json: bool) -> int:
    """A kmeasure.<hex> citation: the artifact's path and what it holds (its bytes hashed again on the way)."""
    from ..measure.diagnostic_files import find_artifact

    doc = find_artifact(ref, dirs)
    if json:
        emit_json(doc)
        return 0
    out = console()
    out.print(f"{doc['ref']}: {doc['path']}", markup=False)
    out.print(f"{doc['artifact']}: {doc['what']} ({doc['bytes']} bytes, blake3 {doc['blake3']})", markup=False)
    mode = doc.get("mode") or {}
    out.print(f"measure of {doc['table']}/{doc['backend']} {doc['spec']} on {doc['gpu_name']}: L2 {mode.get('l2')}, "
              f"{'graph' if mode.get('graph') else 'eager'}, {mode.get('duration_s')} s; summary {doc['summary']}",
              markup=False)
    return 0
