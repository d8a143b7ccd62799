"""`kprof export` and `kprof merge`: ledger events to a segment, and segments into a ledger."""

from __future__ import annotations

from typing import Annotated

from cyclopts import Parameter

from ._options import Db, Json, whole
from ._render import console, emit_json


def export(*, output: Annotated[str, Parameter(name=["-o", "--output"], help=(
               "The new segment file; a directory (existing, or ending in /): a file there named by its content (none "
               "where a segment there holds the same events already)."))],
           table: Annotated[str | None, Parameter(name="--table", help="Only this table's events.")] = None,
           backend: Annotated[str | None, Parameter(name="--backend", help="Only this backend's events.")] = None,
           gpu_name: Annotated[str | None, Parameter(name="--gpu-name", help=(
               "Only the events of this GPU key (`kprof scopes` lists them). Default: every GPU key."))] = None,
           since: Annotated[int, Parameter(name="--since", converter=whole, help=(
               "Only events after this sequence number."))] = 0,
           db: Db = None, json: Json = False) -> int:
    """Write the ledger's events (of one table, backend or GPU key where given) to a new segment file."""
    from ..ledger import ledger_path
    from ..merge.export import export as run_export

    done = run_export(db, output, table=table, backend=backend, gpu_name=gpu_name, since=since)
    doc = {"db": ledger_path(db), "segment": done.path, "ledger_id": done.ledger_id, "events": done.events,
           "written": done.written}
    if json:
        emit_json(doc)
    elif done.path is None:
        console().print(f"no event of {doc['db']} to export{f' after seq {since}' if since else ''}: no segment "
                        f"written", markup=False)
    elif not done.written:
        console().print(f"the {done.events} event(s) of {doc['db']} are in {done.path} already (exported there "
                        f"before): no segment written", markup=False)
    else:
        console().print(f"wrote {done.events} event(s) of {doc['db']} to {done.path}", markup=False)
    return 0


def merge(segments: Annotated[list[str], Parameter(help=(
              "Segment files to merge, in order; a directory: its .kseg files, oldest first."))], *,
          output_dir: Annotated[str | None, Parameter(name="--output-dir", help=(
              "Where merge-report.json goes when a conflict stops the merge. Default: the current directory."))] = None,
          db: Db = None, json: Json = False) -> int:
    """Merge segments into the ledger: every event checked, conflicts refused, all or nothing."""
    from ..errors import MergeConflict
    from ..merge._order import _named, passed_over
    from ..merge.merge import merge as run_merge

    skipped = passed_over(segments)  # a directory's files not named *.kseg: a segment renamed merged silently not

    def say_skipped():  # once the directory was taken (a directory of no segment is refused, naming them)
        if skipped:
            console(stderr=True).print(f"note: not merged: {_named(skipped)} (not named *.kseg; a directory merges "
                                       f"its .kseg files): rename a segment to end in .kseg, or pass it by name",
                                       markup=False)

    try:
        result = run_merge(segments, db=db, output_dir=output_dir)
    except MergeConflict as exc:
        say_skipped()
        if json:
            emit_json({"ok": False, "error": str(exc), "report": exc.report})
        raise
    try:
        say_skipped()
        if json:
            emit_json({"ok": True, **result.to_json()})
        else:
            again = f", {result.repeated} repeated in the segments" if result.repeated else ""
            console().print(f"merged {result.added} new event(s) into {result.db} ({result.existing} already there"
                            f"{again}) from {len(result.segments)} segment(s)", markup=False)
    except (KeyboardInterrupt, SystemExit) as exc:  # (SIGTERM's) came after the merge: it said none was merged
        exc.add_note(f"the merge had finished: its {result.added} new event(s) are in the ledger, whole")
        raise
    return 0
