"""A refused merge's report, `merge-report.json`: per conflicting key, both events and where each comes from; and
what a merge that failed or was interrupted left in the ledger."""

from __future__ import annotations

import errno
import os

import msgspec

from .._outdir import replace_whole
from ..errors import MergeConflict
from ..ledger import Ledger, _codec
from . import segment

__all__ = ["refuse", "stored"]

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit (ulimit -f)


def refuse(ledger: Ledger | None, db_path: str, conflicts: list[dict], paths: list[str],
           output_dir: str | None, merged: tuple[int, int] = (0, 0)) -> None:
    """Writes the conflicts' report to `output_dir` (default: the working directory) and raises MergeConflict, saying
    which conflicts are with the ledger's rows and which between the segments (`ledger` None: not created yet).
    `merged`: the events of this merge's earlier batches, now in the ledger, and how many of them it did not hold
    before (a conflict found when a later batch was written)."""
    out = output_dir or "."
    report = _report(ledger, db_path, conflicts, paths)
    where = os.path.join(out, "merge-report.json")
    try:
        os.makedirs(out, exist_ok=True)
        # whole or not at all: two merges refused at once in one directory wrote into one file, an interrupted one left
        # a part of it, and a link planted as merge-report.json was written through (msgspec's JSON: NaN as null)
        replace_whole(where, msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
        told = f"the conflicts are in {where}"
    except OSError as exc:  # the report is lost, the refusal is not
        full = "free space there or raise the file size limit (ulimit -f), or " * (exc.errno in _FULL)
        told = f"their report could not be written to {where} ({exc.strerror}); {full}give --output-dir another " \
               f"directory"
    rows = report["keys"]
    between = sum(1 for r in rows if r["current"]["segment"] is not None)
    said = [f"{n} incoming event(s) conflict with the ledger's current rows" for n in [len(rows) - between] if n]
    said += [f"{n} event(s) of the segments conflict with each other (attempts at one key, neither re-measuring "
             f"the other)" for n in [between] if n]
    done = "nothing was merged" if not merged[0] else (
        f"the first {merged[0]} event(s) of the segments were merged ({merged[1]} of them new to the ledger; whole "
        f"batches, each checked, before another writer stored the row in conflict), nothing after them")
    first, now, came = rows[0], rows[0]["current"], rows[0]["incoming"]
    here = f"of {now['segment']}" if now["segment"] else "here"
    # A ledger's row stays its latest attempt: the row a re-measurement held here re-measured cannot be merged after it.
    late = (f"; it is the parent of the row {here}, which a ledger cannot take after the row: merge the segments "
            f"into a ledger that holds neither, or leave it out") if now["parent"] == came["event"] else ""
    raise MergeConflict(f"{' and '.join(said)} (first: key {first['key'][:16]}, current {now['event'][:16]} {here}, "
                        f"incoming {came['event'][:16]} of {first['segment']}{late}); {done}{_fix(rows) * (not late)}; "
                        f"{told}", report)


def _fix(rows: list[dict]) -> str:
    """The fix: leave out each segment in conflict with the ledger's rows (which stay), and one of each two segments
    in conflict with each other."""
    def named(paths) -> str:
        return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more (see the report)" if len(paths) > 3 else "")

    theirs = sorted({r["segment"] for r in rows if r["current"]["segment"] is None})
    pairs = sorted({(r["current"]["segment"], r["segment"]) for r in rows if r["current"]["segment"] is not None})
    ways = [f"leave out {named(theirs)} (the ledger keeps its rows)"] * bool(theirs)
    ways += [f"leave out one of {named([f'{a} or {b}' for a, b in pairs])}"] * bool(pairs)
    return f"; the fix: {' and '.join(ways)}"


def _report(ledger: Ledger | None, db_path: str, conflicts: list[dict], paths: list[str]) -> dict:
    """The merge report: per conflicting key, both events (each with the segment it comes from; null: the ledger's
    row), their metrics and the relative difference of time_ms."""
    wanted: dict[int, set[int]] = {}  # segment -> indices of the current events the segments hold
    for c in conflicts:
        if c["current_from"] is not None:
            wanted.setdefault(c["current_from"][0], set()).add(c["current_from"][1])
    held: dict[tuple[int, int], object] = {}
    for s, indices in wanted.items():  # read again: the check keeps no event
        for i, data in enumerate(segment.read(paths[s])):
            if i in indices:
                held[s, i] = _codec.event_decoder.decode(data)
    rows = []
    for c in conflicts:
        origin = c["current_from"]
        here = ledger.event(c["current"]) if origin is None else held[origin]
        theirs = c["incoming_event"]
        mine_m, theirs_m = getattr(here, "metrics", None), getattr(theirs, "metrics", None)
        diff = None
        if mine_m and theirs_m and mine_m.get("time_ms") and theirs_m.get("time_ms") is not None:
            diff = theirs_m["time_ms"] / mine_m["time_ms"] - 1
        rows.append({"key": c["key"].hex(), "segment": c["segment"], "index": c["index"],
                     "provenance": msgspec.structs.asdict(theirs.provenance),  # defaults too
                     "current": {"event": c["current"].hex(), "segment": None if origin is None else paths[origin[0]],
                                 "index": None if origin is None else origin[1], "kind": type(here).__name__.lower(),
                                 "parent": here.parent.hex() if here.parent else None, "metrics": mine_m},
                     "incoming": {"event": c["incoming"].hex(), "segment": c["segment"], "index": c["index"],
                                  "kind": type(theirs).__name__.lower(),
                                  "parent": theirs.parent.hex() if theirs.parent else None, "metrics": theirs_m},
                     "time_ms_relative_difference": diff})
    return {"ledger": db_path, "conflicts": len(rows), "keys": rows}


def stored(ledger: Ledger, batch_ids: list[list[bytes]], new) -> int:
    """The events of a merge's batches the ledger holds, counted from the first (they commit whole and in order): read
    from the ledger, since an interrupt can come between a batch's commit and the count of it. A batch is looked for by
    the last of its events in `new` (those the ledger did not hold) that no batch before holds: its last event alone
    may be held whether it committed or not (merged before from an incremental export, or an earlier batch's), which
    said every event of an uncommitted merge was in the ledger."""
    before: set[bytes] = set()
    with ledger.read() as txn:
        for n, ids in enumerate(batch_ids):
            own = [eid for eid in ids if eid in new and eid not in before]
            before.update(own)
            if own and txn.get(own[-1], db=ledger.dbs["events"]) is None:
                return sum(map(len, batch_ids[:n]))
    return sum(map(len, batch_ids))
