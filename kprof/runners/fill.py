"""What `run` does between validating the request and reporting the rows: decide what to measure, claim it,
measure it (in this process or on the pool), and write each event as it finishes.

1. The ledger is read (read-only) for what the mode leaves to measure: jit the specs without an ok row, force and
   fresh every spec, each key once. Nothing to measure: nothing is started.
2. The devices are chosen and prepared (kprof.runners.pool): a device that cannot measure is refused here, before
   any file is written. A spec that needs more devices than are usable is not measured: its row reports
   `need N idle GPU(s), found M`, and the others go on.
3. The ledger is opened for writing, and the keys are claimed (kprof.runners.claims), so that a concurrent run
   on the same ledger measures none of them again. What another run holds is waited for, then read; what its
   holder died without measuring is measured here.
4. Each event is written as it finishes: appended in this process, or merged from the worker's segment
   (conflict-checked). `fresh` writes nothing and returns the events.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable, NamedTuple

import msgspec

from ..errors import MergeConflict
from ..ledger import Ledger
from ..ledger.build import failed
from ..ledger.events import Environment, Measured, Origin
from ..ledger.keys import KeyMaker, ShapeCodec
from .pool import Device, Devices, Pool, Result, need_of, pool_mode, usable_devices
from .registry import Entry

__all__ = ["fill", "Filled"]

WAIT_S = 0.5  # between looks at keys another run is measuring


class Filled(NamedTuple):
    errored: dict[bytes, dict]  # key -> {kind, message}: this run's attempt failed (or could not be made)
    fresh: dict[bytes, Any]  # key -> event (mode fresh: nothing was written)
    measured: int
    timed_seconds: float
    pool: dict  # where it ran: devices, forced_by, idle_guard, skipped, dropped, waited_for
    root_before: bytes | None  # the scope's view root before this run (None: no ledger file yet)


class _InProcess:
    """This process as the only worker (KPROF_POOL=off, or one CPU slot)."""

    def __init__(self, entry: Entry, gpu_key: str):
        from .worker import prepare_device

        self.entry, self.gpu_key = entry, gpu_key
        self.device = prepare_device(entry, gpu_key)
        self.dropped: list[dict] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def measure(self, items, origin: Origin, failed_event, watch=None):
        from .worker import measure_specs

        keys = KeyMaker(self.entry.table, self.entry.backend, self.gpu_key, self.entry.contract,
                        ShapeCodec(self.entry.args))
        parents = {keys.key(spec): parent for _i, spec, parent in items if parent is not None}
        label = getattr(self.device, "name", "cpu")
        for n, outcome in enumerate(measure_specs(self.entry, [spec for _i, spec, _p in items], self.gpu_key,
                                                  origin=origin, parents=parents, device=self.device)):
            if watch:
                watch(label, None)
            yield Result(items[outcome.index][0], outcome.event, None, outcome.seconds, outcome.timed_seconds, label)
            if watch and n + 1 < len(items):
                watch(label, items[n + 1][1])


def fill(entry: Entry, canonical: list, gpu_key: str, db: str, mode: str, origin: Origin, *,
         progress: Callable[[int, int, dict], None] | None = None,
         watch: Callable[[str, dict | None], None] | None = None, conflict_dir: str | None = None) -> Filled:
    keys = KeyMaker(entry.table, entry.backend, gpu_key, entry.contract, ShapeCodec(entry.args))
    spec_keys = [keys.key(s) for s in canonical]
    first_of: dict[bytes, int] = {}
    for i, k in enumerate(spec_keys):
        first_of.setdefault(k, i)

    def query(ledger):
        if ledger is None:
            return None, [None] * len(canonical)
        return ledger.view(entry.table, entry.backend, gpu_key, entry.contract, entry.args).query(canonical)

    def rows_of(ledger):
        return query(ledger)[1]

    def wanted(rows, before) -> list[int]:
        """The first index of each key the mode still leaves to measure, given the rows now."""
        out = []
        for k, i in first_of.items():
            row = rows[i]
            if mode == "jit" and row is not None and row.status == "ok":
                continue
            if mode == "force" and row is not None and before[i] is not None and row.event_id != before[i].event_id:
                continue  # another run re-measured it since this one began
            out.append(i)
        return sorted(out)

    # 1. what to measure, read-only
    if os.path.exists(db):
        with Ledger.open(db, readonly=True) as reader:
            root_before, before = query(reader)
    else:
        root_before, before = query(None)
    todo = list(first_of.values()) if mode in ("force", "fresh") else wanted(before, before)
    errored: dict[bytes, dict] = {}
    info: dict = {"devices": [], "forced_by": None, "idle_guard": False, "skipped": [], "dropped": [],
                  "waited_for": 0}
    if not todo:
        return Filled(errored, {}, 0, 0.0, info, root_before)

    # 2. the devices
    pmode = pool_mode()
    devices: Devices | None = None
    if pmode != "off":
        devices = usable_devices(entry, gpu_key)
        if pmode == "auto" and entry.device != "cuda" and len(devices.devices) == 1:
            devices = None
    if devices is None:
        label = "cpu" if entry.device != "cuda" else "cuda:0"
        devices = Devices([Device(label, None)], None, [])
        info.update(devices=[label], in_process=True)
    else:
        info.update(devices.describe(), in_process=False)
    usable = len(devices.devices)
    short = [i for i in todo if need_of(entry, canonical[i]) > usable]
    verdicts = "; ".join(f"{s['gpu']}: {s['why']}" for s in devices.skipped)
    for i in short:
        errored[spec_keys[i]] = {"kind": "unavailable",
                                 "message": f"need {need_of(entry, canonical[i])} idle GPU(s), found {usable}"
                                            + (f" ({verdicts})" if verdicts else "")}
    todo = [i for i in todo if i not in set(short)]
    if not todo:
        return Filled(errored, {}, 0, 0.0, info, root_before)
    workers = _InProcess(entry, gpu_key) if info.get("in_process") else Pool(entry, gpu_key, devices.devices)

    # 3. and 4.
    fresh: dict[bytes, Any] = {}
    measured = 0
    timed = 0.0
    with workers:
        ledger = None if mode == "fresh" else Ledger.open(db)
        try:
            if ledger is not None:
                origin = msgspec.structs.replace(origin, ledger_id=ledger.ledger_id)
            claims = None
            if ledger is not None:
                from .claims import Claims

                claims = Claims(ledger.path, origin.run_id).__enter__()
            try:
                pending = todo
                waited: set[bytes] = set()
                while pending:
                    if claims is not None:
                        mine, held = claims.take([spec_keys[i] for i in pending])
                        rows = rows_of(ledger)
                        mine_set = set(mine)
                        batch = [i for i in wanted(rows, before) if i in set(pending) and spec_keys[i] in mine_set]
                        waiting = [i for i in pending if spec_keys[i] in held]
                        waited.update(held)
                    else:
                        rows, batch, waiting = before, pending, []
                    parent_of = {i: (rows[i].event_id if rows[i] is not None else None) for i in batch}
                    items = [(i, canonical[i], parent_of[i]) for i in batch]

                    def failed_event(i, kind, message, environment: Environment):
                        return failed(keys.provenance(canonical[i], i), kind, message[:2000],
                                      environment=environment, origin=origin, parent=parent_of.get(i))

                    for res in workers.measure(items, origin, failed_event, watch):
                        k = spec_keys[res.index]
                        timed += res.timed_seconds
                        measured += 1
                        if type(res.event) is not Measured:
                            errored[k] = {"kind": res.event.error_kind, "message": res.event.message}
                        if mode == "fresh":
                            fresh[k] = res.event
                        elif res.segment is not None:
                            from ..merge.merge import merge_into

                            try:
                                merge_into(ledger, [res.segment], conflict_dir or tempfile.mkdtemp(prefix="kprof-"))
                            except MergeConflict as exc:
                                errored[k] = {"kind": "conflict", "message": str(exc)}
                            os.unlink(res.segment)
                        else:
                            ledger.append([res.event])  # one commit per spec: a crash keeps what was finished
                        if progress:
                            progress(measured, max(len(todo), measured), canonical[res.index])
                    pending = waiting
                    if pending:
                        time.sleep(WAIT_S)
                info["waited_for"] = len(waited)
            finally:
                if claims is not None:
                    claims.release()
        finally:
            if ledger is not None:
                ledger.close()
        info["dropped"] = list(workers.dropped)
    return Filled(errored, fresh, measured, timed, info, root_before)

