"""Merge segments (`kprof.merge.export` writes them) into a ledger, conflict-checked and all-or-nothing.

    kprof merge h200.kseg other.kseg --db profile.db --output-dir merge-out

Merging runs in two streamed passes over the segments (neither is ever held whole), each reading runs of RUN
consecutive events at a time (kprof.merge.segment.runs: the file read and hashed a block at a time):

0. Order. Given more than one segment, a segment holding an event that another's event re-measures (its parent) or
   retracts goes before that one: parents are merged before their children, whatever order the segments came in
   (stable otherwise; segments that name each other keep their order). This pass reads each event's id and link.
1. Check. Every event decodes, is in canonical form, and its id and key are recomputed from its bytes; the
   segment's structure and digest are checked (kprof.merge.segment). Then, in order, each measured or failed
   event new to the ledger is held against the current row of its key: no row, the event's parent (a
   fast-forward), or a row an earlier event of the same segment made current (the segment's own history, in its
   log order) are fine; a row of this ledger or of another segment is a conflict. An event that follows its own
   re-measurement in one segment is refused (a log never holds a parent after its child; merged, it would supersede
   the row that re-measured it). A retraction of an event that is not the key's current row leaves that row current;
   one of the ledger's current row brings back the key's latest attempt here not retracted, which what follows is
   checked against (one of a row this merge made current leaves its key unchecked from there on).
   The rows of a run's keys are read in one sorted pass; the events tree (the ledger's largest) is asked only about
   events whose key has a history here, since no other can be stored already. The check keeps each batch's event
   ids and each of its runs' digests; it drops each decoded event as soon as it is checked.
2. Write, only where the check found nothing: the segments are read again and appended a batch of BATCH events
   per transaction, through the ledger's own append. Each run of a batch must hash to the digest the check took of
   it: a file changed since stops the merge before that batch. The bytes being those the check hashed, their ids
   are the check's, and they are decoded only as far as the views need. Where another writer committed since the
   check (a run storing a row, another merge: the ledger's last sequence number moved), the check is made again in
   the batch's transaction, under the write lock, so a row stored in between is held against as any other. A merge
   stopped half way (a kill, a full disk, a changed file) has written a verified prefix of a conflict-free merge;
   merging again completes it.
   BATCH trades memory for disk writes: events of random ids land on random pages of every tree, and a
   transaction writes each page it touches once, so fewer, larger transactions write fewer pages (at 300,000
   events into 300,000: 10,000 a transaction wrote 3.9 pages an event, 50,000 2.3). LMDB holds a transaction's
   dirty pages in memory (and keeps them for reuse): ~450 MiB at 50,000; it spills past 512 MiB.

A conflict or any damage merges nothing. A conflict writes `merge-report.json` to the output directory (each
conflicting key: both events, their metrics, the relative difference of time_ms) and raises MergeConflict (exit
3); a damaged, forged or incomplete segment raises SegmentError or UsageError (exit 2), naming what and where.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, NamedTuple

import msgspec

from .._outdir import check_output_dir
from ..errors import LedgerError, Uncreated, UsageError
from ..ledger import Ledger, _codec, _verify, ledger_path
from ..ledger._env import _identity
from ..ledger.events import EventHead, Retracted
from . import _values, segment
from ._order import expanded, ordered
from ._report import refuse, stored
from .segment import SegmentError

__all__ = ["merge", "merge_into", "MergeResult", "BATCH"]

BATCH, BATCH_BYTES = 50_000, 1 << 30  # events per write transaction, and bytes of them at most (see the docstring)
RUN = 10_000  # events per run: read, hashed, checked and looked up as one
_head_decoder = msgspec.msgpack.Decoder(EventHead)  # what the views need of an event; samples etc. skipped


class MergeResult(NamedTuple):
    db: str
    segments: list[dict]  # per segment: path, source ledger id, events
    added: int  # events newly written
    existing: int  # events the ledger held already
    seconds: float
    repeated: int = 0  # events that an earlier segment of the merge (or an earlier place in one) holds too

    def to_json(self) -> dict:
        return self._asdict()


class _Part(NamedTuple):
    """A run of consecutive events of one segment, the unit both passes read, decode and hash."""

    segment: int  # its index in the merge's list of segments
    path: str
    first: int  # the index in its segment of its first event
    run: segment.Run


def _batches(paths: list[str]) -> Iterator[list[_Part]]:
    """The segments' events in batches of about BATCH: runs of min(RUN, BATCH) events, read as one, gathered until
    a batch holds BATCH events or BATCH_BYTES (a batch may span segments; a run never does). Both passes cut the
    same files into the same batches. Each segment's footer is checked once its last run is read."""
    batch, n, size = [], 0, 0
    for s, path in enumerate(paths):
        first = 0
        for run in segment.runs(path, min(RUN, BATCH)):
            batch.append(_Part(s, path, first, run))
            first += len(run.events)
            n, size = n + len(run.events), size + sum(map(len, run.events))
            if n >= BATCH or size > BATCH_BYTES:  # large events: a batch of fewer, not 50,000 of 64 MiB held at once
                yield batch
                batch, n, size = [], 0, 0
    if batch:
        yield batch


class _Seen(NamedTuple):
    """What the check keeps of an event (the event itself is dropped as soon as it is checked: a run of decoded
    events held at once costs more in fresh memory than their decoding does)."""

    kind: type  # Measured, Failed or Retracted
    key: bytes
    link: bytes | None  # a measured or failed event's parent; a retraction's target


def _checked(part: _Part) -> tuple[list[_Seen], list[bytes]]:
    """(what the check keeps of each event, the event ids) of a run, every event checked: it decodes whole, its
    bytes are its canonical form, and its key is the hash of its provenance."""
    decode, encode, provenance_key = _codec.event_decoder.decode, _codec.encode, _codec.provenance_key
    path, out = part.path, []
    for i, data in enumerate(part.run.events, part.first):
        try:
            event = decode(data)
        except (msgspec.MsgspecError, RecursionError) as exc:  # nested past the decoder's depth: a RecursionError
            why = _newer(data, None) or f"does not decode ({exc}); {_FORGED}"
            raise SegmentError(f"{path}: event {i} {why}") from None
        if encode(event) != data:
            why = _newer(data, event) or f"is not in canonical form (not written by kprof); {_FORGED}"
            raise SegmentError(f"{path}: event {i} {why}")
        _values.check(event, path, i, _FORGED)
        kind = type(event)
        if kind is Retracted:
            out.append(_Seen(kind, event.key, event.target))
            continue
        if provenance_key(event.provenance) != event.key:
            raise SegmentError(f"{path}: event {i} ({_codec.event_id(data).hex()[:16]}) carries a key its "
                               f"provenance does not hash to (forged); {_FORGED}")
        out.append(_Seen(kind, event.key, event.parent))
    return out, list(map(_codec.event_id, part.run.events))


_FIX = "a newer kprof wrote it; upgrade kprof to merge it (nothing was merged)"
_FORGED = "export it again from its ledger (nothing was merged)"


def _newer(data: bytes, event) -> str | None:
    """What in an event's bytes this kprof's schema lacks, where a newer kprof added it (an event kind; fields, in
    any record of the event), said with the fix; None where nothing is unknown (the bytes are damaged or forged)."""
    try:
        doc = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    if event is None:
        kind = doc.get("type") if isinstance(doc, dict) else None
        known = kind in ("measured", "failed", "retracted") or not isinstance(kind, str)
        return None if known else f"is of a kind this kprof does not know ({kind!r}): {_FIX}"
    unknown = _unknown_fields(doc, event)
    return f"holds fields this kprof does not know ({', '.join(unknown)}): {_FIX}" if unknown else None


def _unknown_fields(doc, record, at: str = "") -> list[str]:
    """The names in a record's decoded bytes that its Struct does not declare, nested records included."""
    found = []
    for name, value in doc.items() if isinstance(doc, dict) else ():
        if name not in record.__struct_fields__ and name != record.__struct_config__.tag_field:
            found.append(at + name)
        elif isinstance(value, dict) and isinstance(getattr(record, name, None), msgspec.Struct):
            found += _unknown_fields(value, getattr(record, name), f"{at}{name}.")
    return found


class _Check:
    """Pass 1: the current event of every key the segments touch, as the merge would leave it, and the
    conflicts found on the way."""

    def __init__(self, ledger: Ledger | None, txn):
        self.ledger, self.txn = ledger, txn
        self.current: dict[bytes, bytes | None] = {}  # key -> current event id (None: no row)
        self.origin: dict[bytes, tuple[int, int]] = {}  # key -> (segment, index) of the event that made it current
        # (absent: the ledger's row)
        self.unchecked: set[bytes] = set()  # keys whose current row a segment's retraction withdrew, unknown after
        self.withdrawn: set[bytes] = set()  # the targets of the segments' retractions so far
        self.seen: dict[bytes, bytes] = {}  # event id -> key, of the segments' events so far
        self.held, self.repeated = set(), 0  # ids passed over (held here, or given before); how many were given before
        self.kept: set[bytes] = set()  # keys whose events may be stored already (a row or a history here)
        self.children: dict[bytes, tuple[int, int]] = {}  # a parent's event id -> (segment, index) of its first child
        self.conflicts, self.events = [], 0
        self.last_seq: int | None = None  # the ledger's last event as checked (None: no ledger)
        # per batch, what the write pass must find again (each run's digest) and the ids the check computed
        self.batch_digests: list[list[bytes]] = []
        self.batch_ids: list[list[bytes]] = []

    def batch(self, parts: list[_Part]) -> None:
        self.batch_digests.append([part.run.digest for part in parts])
        ids: list[bytes] = []
        for part in parts:
            events, eids = _checked(part)
            self._against_ledger(part, events, eids)
            ids += eids
        self.batch_ids.append(ids)

    def _against_ledger(self, part: _Part, events: list[_Seen], eids: list[bytes]) -> None:
        txn, led = self.txn, self.ledger
        new_keys = list({event.key for event in events} - self.current.keys())
        stored: set[bytes] = set()
        if led is not None:  # a ledger not created yet has no row, history or event
            dbs, histories = led.dbs, {}  # histories: of the keys without a row
            rows = _verify.rows(txn, dbs, led.path, new_keys, summaries=False, histories=histories)
            for key, row in zip(new_keys, rows):  # the rows here, verified as every read is
                self.current[key] = None if row is None else row.event_id
                # Every stored event's key has a history: only the events of such keys can be stored already (a
                # merge of new keys, the common one, does not read the events tree, the ledger's largest, at all).
                if row is not None or histories.get(key, b"") is not None:
                    self.kept.add(key)
            maybe = [eid for event, eid in zip(events, eids) if event.key in self.kept]
            stored = {e for e, v in zip(maybe, _verify.values(txn.cursor(dbs["events"]), maybe)) if v is not None}
        else:
            self.current.update(dict.fromkeys(new_keys))
        path, first = part.path, part.first
        for i, (event, eid) in enumerate(zip(events, eids), first):
            self.events += 1
            if eid in stored or eid in self.seen:
                self.repeated += eid in self.seen or eid in self.held
                self.held.add(eid)
                continue
            self.seen[eid] = key = event.key
            if event.kind is Retracted:
                held = None if event.link in self.seen or led is None else txn.get(event.link, db=led.dbs["events"])
                if event.link not in self.seen and held is None:
                    raise UsageError(f"{path}: event {i} retracts event {event.link.hex()[:16]}, which neither this "
                                     f"ledger nor the segments before it hold; merge the segment that holds it first "
                                     f"(nothing was merged)")
                if (self.seen[event.link] if held is None else _head_decoder.decode(held).key) != key:
                    raise SegmentError(f"{path}: event {i} retracts event {event.link.hex()[:16]}, of another key than "
                                       f"its own (forged); {_FORGED}")
                if self.current[key] == event.link:  # else the current row stays: what follows is checked against it
                    known, back = self._brought_back(key, event.link)
                    if known:
                        self.current[key] = back
                    else:
                        self.unchecked.add(key)
                self.withdrawn.add(event.link)
                continue
            if key in self.unchecked:
                continue
            child = self.children.get(eid)
            if child is not None and child[0] == part.segment:  # export writes the log's order: a parent first
                raise SegmentError(f"{path}: event {i} ({eid.hex()[:16]}) is the parent of event {child[1]} before it: "
                                   f"a segment holds a row's history oldest first, so merged, the re-measured row would "
                                   f"supersede its re-measurement; export the segment again from its ledger (nothing "
                                   f"was merged)")
            if event.link is not None:
                self.children.setdefault(event.link, (part.segment, i))
            here, origin = self.current[key], self.origin.get(key)
            if (origin is not None and origin[0] == part.segment) or here is None or here == eid or here == event.link:
                self.current[key], self.origin[key] = eid, (part.segment, i)
            else:
                incoming = _codec.event_decoder.decode(part.run.events[i - first])
                self.conflicts.append({"segment": path, "index": i, "key": key, "incoming": eid, "current": here,
                                       "current_from": origin, "incoming_event": incoming})

    def _brought_back(self, key: bytes, target: bytes) -> tuple[bool, bytes | None]:
        """(known, event id) of the row a retraction of `target`, the key's current row, makes current: the key's
        latest attempt here not retracted (None: none). Not known where this merge made `target` current."""
        led, txn = self.ledger, self.txn
        if led is None or key in self.origin:
            return False, None
        for _seq, eid in reversed(led.history_of(txn, key)):
            if eid == target or eid in self.withdrawn or txn.get(eid, db=led.dbs["retracted"]) is not None:
                continue
            if type(_codec.stored_event(txn.get(eid, db=led.dbs["events"]) or b"", eid)) is not Retracted:
                return True, eid
        return True, None


def merge(paths: list[str], db: str | None = None, output_dir: str | None = None) -> MergeResult:
    """Merges the segments at `paths` into the ledger, all or nothing (see the module docstring). A directory in
    `paths` stands for its .kseg files, oldest first, as `kprof merge DIR` takes them."""
    started = time.perf_counter()
    paths = expanded(paths)
    if not paths:
        raise UsageError("give at least one segment to merge")
    if output_dir is not None:  # where a conflict's report would go: checked before anything is read or written
        check_output_dir(output_dir, (), "a merge report")
    headers = {p: segment.header_of(p) for p in paths}
    paths = ordered(paths)
    early = None  # pass 1 made before the ledger is opened for writing
    if not os.path.lexists(ledger_path(db)):  # a new ledger: a damaged segment, a conflict or no event leaves none
        check = _check(None, paths)
        if check.conflicts:
            refuse(None, ledger_path(db), check.conflicts, paths, output_dir)
        early = None if check.seen else check  # segments of no event: no file made for nothing
    else:
        early = _check_before_upgrade(db, paths, output_dir)
    segments = [{"path": p, "ledger_id": headers[p].ledger_id, "events": headers[p].events} for p in paths]
    if early is not None and not early.seen:  # every event is here already: the file is not upgraded for nothing
        return MergeResult(ledger_path(db), segments, 0, early.events - early.repeated, time.perf_counter() - started,
                           early.repeated)
    with Ledger.open(db) as ledger:
        added, existing, repeated = _merge_into(ledger, paths, output_dir, early)
        db_path = ledger.path
    return MergeResult(db_path, segments, added, existing, time.perf_counter() - started, repeated)


def _check_before_upgrade(db: str | None, paths: list[str], output_dir: str | None) -> "_Check | None":
    """A writer's open of a file of an older format rewrites its views: a ledger of one is checked first through a
    reader's upgraded copy, so that a damaged segment or a conflict leaves the file as it was. The check (None for
    a file of this format, or one whose creation never committed, which the writer's open makes a ledger), which the
    write pass takes as its own: the copy holds the file's events and last seq. Where another writer (a run, another
    merge) writes the file while the copy is checked, the copy's reads are refused, and the file is checked again as
    it now is (that writer upgraded it)."""
    while True:
        was = _identity(ledger_path(db))  # as a reader's copy compares it (kprof.ledger.store)
        try:
            reader = Ledger.open(db, readonly=True)
        except Uncreated:
            return None
        with reader:
            if reader.real_path == os.path.realpath(reader.path):  # the file itself, not a copy: of this format
                return None
            try:
                check = _check(reader, paths)
            except LedgerError:
                if _identity(ledger_path(db)) == was:
                    raise
                continue
            if check.conflicts:
                refuse(reader, reader.path, check.conflicts, paths, output_dir)
            return check


def merge_into(ledger: Ledger, paths: list[str], output_dir: str | None = None) -> tuple[int, int]:
    """Merges the segments at `paths` into the open (writable) ledger, all or nothing: (events added, events the
    ledger held already). A conflict writes `merge-report.json` to `output_dir` (default: the working directory)
    and raises MergeConflict. The pool merges each worker's segments through it as they arrive."""
    return _merge_into(ledger, ordered(paths), output_dir)[:2]


def _check(ledger: Ledger | None, paths: list[str], txn=None) -> _Check:
    """Pass 1 over the segments, against the ledger (None: one not created yet, where no key has a row), as a read
    of it finds it (or as `txn` does)."""
    with contextlib.nullcontext(txn) if ledger is None or txn is not None else ledger.read() as txn:
        check = _Check(ledger, txn)
        check.last_seq = None if ledger is None else _last_seq(ledger, txn)
        for parts in _batches(paths):
            check.batch(parts)
    return check


def _last_seq(ledger: Ledger, txn) -> int:
    with _verify.reading(ledger.path, "meta"):
        return msgspec.msgpack.decode(txn.get(b"last_seq", db=ledger.dbs["meta"]), type=int)


def _merge_into(ledger: Ledger, paths: list[str], output_dir: str | None,
                check: _Check | None = None) -> tuple[int, int, int]:
    """merge_into of segments already in their merge order (`check`: pass 1, made already), and repeated events."""
    check = check or _check(ledger, paths)
    if check.conflicts:
        refuse(ledger, ledger.path, check.conflicts, paths, output_dir)
    if not check.seen:  # every event is here already: no write transaction (the file stays byte for byte as it was)
        return 0, check.events - check.repeated, check.repeated
    added = existing = 0
    seq = check.last_seq  # the ledger's state the check holds for this merge's batches

    def still_checked(txn) -> None:
        """Under the write lock, before a batch is written: where another writer committed since the check (a run's
        row, another merge), the segments are checked again against the ledger as it now is; a conflict now found
        merges nothing more (without this, a row stored in between was superseded as if it had been no conflict)."""
        if _last_seq(ledger, txn) != seq:
            again = _check(ledger, paths, txn)
            if again.conflicts:
                refuse(ledger, ledger.path, again.conflicts, paths, output_dir, (added + existing, added))

    try:
        for n, parts in enumerate(_batches(paths)):
            verified = check.batch_digests[n] if n < len(check.batch_digests) else None
            if [part.run.digest for part in parts] != verified:  # a file changed since the check: stop before it
                raise SegmentError(f"{parts[0].path} changed while it was merged ({added + existing} event(s) before "
                                   f"the change were merged); merge it again")
            # The bytes are those the check decoded whole and hashed: decoded as far as the views need, with its ids.
            datas = [data for part in parts for data in part.run.events]
            heads = list(map(_head_decoder.decode, datas))
            result = ledger.append_checked(list(zip(heads, datas, check.batch_ids[n])), before=still_checked)
            added, existing, seq = added + len(result.added), existing + len(result.existing), result.last_seq
    except BaseException as exc:  # an interrupt, a full disk: what it left (the CLI), after a batch's commit too
        with contextlib.suppress(Exception):  # a ledger the failure left unreadable (a map not grown): no count
            if done := stored(ledger, check.batch_ids, check.seen):
                rest = ", the rest are not," if done < check.events else ""
                exc.add_note(f"the first {done} of the merge's {check.events} event(s) are in the ledger (whole "
                             f"batches of {BATCH}, each checked){rest} and nothing half-written is; the same merge "
                             f"again merges the rest")
        raise
    return added, existing - check.repeated, check.repeated
