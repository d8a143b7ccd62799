"""Export a ledger's events to a segment (`kprof merge` merges it into another ledger: kprof.merge.merge).

    kprof export --table single_gemm --backend torch --gpu-name "NVIDIA H200" -o h200.kseg
"""

from __future__ import annotations

import operator
import os
import shlex
from typing import NamedTuple

from ..errors import UsageError
from ..ledger import Ledger, _codec, _verify
from ..ledger.events import Retracted
from . import segment

__all__ = ["export", "Exported"]


class Exported(NamedTuple):
    path: str | None  # the segment written (named by its content in a directory); None: no event to export
    ledger_id: str
    events: int
    written: bool = True  # False: no event to export, or a segment of the directory holds these events already


def export(db: str | None, output: str, *, table: str | None = None, backend: str | None = None,
           gpu_name: str | None = None, since: int = 0) -> Exported:
    """Writes the ledger's events of sequence > `since` (of one table, backend and GPU key where given) to a new
    segment, in log order, from one snapshot. A retraction goes where the event it retracts would. `output` an existing
    directory: the segment is named by its content there (see kprof.merge.segment.write), and where a segment there
    holds exactly these events of this ledger already (the same export made again, whose file would differ only by
    its header's time), none is written: `path` is that segment's, `written` False.

    Refused before anything is written: an output that cannot be written (UsageError), filters that match none of
    the ledger's scopes (UsageError, naming the scopes it holds), and any event whose bytes do not hash to its id
    (IntegrityError: a damaged event is never passed on, where a merge would store it under a new id)."""
    given = since
    try:  # a whole number (np.int64 too); a float or a bool compared as a number (since=1.5: from seq 2)
        since = operator.index(since) if not isinstance(since, bool) else None
    except TypeError:
        since = None
    if since is None:
        raise UsageError(f"since={given!r} is not a whole number; give a sequence number >= 0, e.g. since=0 (from "
                         f"the first event)")
    if since < 0:
        raise UsageError(f"--since {since}: give a sequence number >= 0 (0: from the first event)")
    if isinstance(output, os.PathLike):
        output = os.fspath(output)
    if not isinstance(output, str):
        raise UsageError(f"output={output!r} is not a path ({type(output).__name__}); give the new segment file's path, "
                         f"or a directory (ending in /), as a str")
    _check_output(output)
    with Ledger.open(db, readonly=True) as ledger:
        _check_filters(ledger, table, backend, gpu_name)
        if since > ledger.last_seq:
            raise UsageError(f"--since {since}: the ledger's last event is seq {ledger.last_seq}; give a sequence "
                             f"number up to it (events after it are exported)")
        with ledger.read() as txn:
            events_db = ledger.dbs["events"]
            chosen: list[bytes] = []

            def wanted(prov) -> bool:
                return ((table is None or prov.table == table) and (backend is None or prov.backend == backend)
                        and (gpu_name is None or prov.gpu_key == gpu_name))

            with _verify.reading(ledger.path, "log"):
                for seq, eid, data in ledger.iter_log(txn):
                    if seq <= since:
                        continue
                    event = _verify.event(ledger.path, eid, data)
                    if type(event) is Retracted:  # in the scope of the event it retracts
                        target = txn.get(event.target, db=events_db)
                        event = None if target is None else _verify.event(ledger.path, event.target, target)
                        if event is None or type(event) is Retracted:
                            continue
                    if wanted(event.provenance):
                        chosen.append(eid)
            if not chosen:  # nothing to share: no empty segment to commit or merge
                return Exported(None, ledger.ledger_id, 0, False)
            if output.endswith(("/", os.sep)):  # a directory, by its trailing separator: made where it is not yet
                os.makedirs(output, exist_ok=True)
            if os.path.isdir(output) and (before := _exported_before(output, ledger.ledger_id, chosen)):
                return Exported(before, ledger.ledger_id, len(chosen), False)
            # The same snapshot: the bytes written are those just checked.
            written = segment.write(output, (txn.get(eid, db=events_db) for eid in chosen), ledger.ledger_id,
                                    len(chosen))
        return Exported(written, ledger.ledger_id, len(chosen))


def _exported_before(directory: str, ledger_id: str, chosen: list[bytes]) -> str | None:
    """The segment of `directory` that holds exactly the events `chosen` (ids, in order) of the ledger `ledger_id`,
    whole and unaltered, else None: exported again, they would be a second file of the same events (a segment's
    name is the digest of its bytes, its header's time among them) that a directory committed to git keeps twice."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:  # a directory this user may write in but not list: nothing to compare with
        return None
    for name in names:
        path = os.path.join(directory, name)
        if not name.endswith(".kseg") or not os.path.isfile(path):
            continue
        try:
            name.encode()  # named in another encoding than UTF-8 (byte 0xff): not a path the report can give
            header = segment.header_of(path)
            if (header.ledger_id, header.events) == (ledger_id, len(chosen)) and \
                    [_codec.event_id(data) for data in segment.read(path)] == chosen:
                return path
        except (UsageError, UnicodeEncodeError):  # unreadable or damaged: not these events
            continue
    return None


def _check_output(output: str) -> None:
    """Refuses a segment path that cannot be written: empty, or in a directory that is missing or not writable (an
    existing directory is written into, an existing file refused by segment.write; a new directory, ending in /, is
    made with its missing parents, so it is checked where it would be made)."""
    fix = "give a new file path in a writable directory, or a directory (ending in /)"
    if not output.strip():
        raise UsageError(f"-o {output!r} is empty; {fix}")
    if output == "-":  # `-o=-`: a file named "-" where stdout was meant
        raise UsageError(f"-o -: a segment is a file, not stdout (a merge reads each segment twice, checked and then "
                         f"merged); {fix}, and copy the file between machines")
    where = output if os.path.isdir(output) else os.path.dirname(os.path.abspath(output))  # "rows/": its parent
    if output.endswith(("/", os.sep)):
        where = os.path.abspath(output)  # the directory itself where something is there (a file, a broken link)
        while not os.path.lexists(where) and where != os.path.dirname(where):  # "rows/h200/": the nearest there is
            where = os.path.dirname(where)
    if not os.path.isdir(where):
        what = "is not a directory" if os.path.lexists(where) else "does not exist"
        raise UsageError(f"-o {output}: {where} {what}; {fix}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"-o {output}: the directory {where} is not writable for this user; {fix}")


def _check_filters(ledger: Ledger, table: str | None, backend: str | None, gpu_name: str | None) -> None:
    """Refuses filters no scope of the ledger matches (a mistyped name would export an empty segment)."""
    if table is None and backend is None and gpu_name is None:
        return
    with _verify.reading(ledger.path, "scopes"):
        scopes = ledger.scopes()
    if any((table is None or t == table) and (backend is None or b == backend) and (gpu_name is None or g == gpu_name)
           for t, b, g, _rows in scopes):
        return
    asked = ", ".join(f"{name} {value!r}" for name, value in (("--table", table), ("--backend", backend),
                                                              ("--gpu-name", gpu_name)) if value is not None)
    held = "; ".join(f"{t} / {b} / {g}" for t, b, g, _rows in sorted(scopes)) or "no scopes (it is empty)"
    raise UsageError(f"no events in {ledger.path} match {asked}; it holds (table / backend / GPU key): {held}. "
                     f"Fix the filter (`kprof scopes --db {shlex.quote(ledger.path)}` lists them)")
