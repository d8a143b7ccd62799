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

import contextlib
import os
import tempfile
from typing import Any, Callable, NamedTuple

import msgspec

from ..errors import MergeConflict, Uncreated, UsageError
from ..ledger import Ledger
from ..ledger.build import failed
from ..ledger.events import Environment, Measured, Origin
from ..ledger.keys import KeyMaker
from ..specs import ShapeCodec
from .claims import own_event as _own, rounds, still_wanted
from .devices import Device, Devices, groups, need_of, pool_mode, usable_devices
from .pool import Pool, Result
from .registry import Entry

__all__ = ["fill", "Filled", "to_measure", "still_wanted", "check_settings", "spec_time_limit"]


class Filled(NamedTuple):
    errored: dict[bytes, dict]  # key -> {kind, message}: this run's attempt failed (or could not be made)
    fresh: dict[bytes, Any]  # key -> event (mode fresh: nothing was written)
    measured: int
    timed_seconds: float
    pool: dict  # where it ran: devices, forced_by, idle_guard, skipped, dropped, waited_for
    root_before: bytes | None  # the scope's view root before this run (None: no ledger file yet)
    spec_keys: list[bytes]  # each spec's key, in the request's order
    host_busy: int = 0  # rows measured while other work took the host's cores (their notes say host_busy)
    timed_rows: int = 0  # the measurements that made a row (a failure's, an oom's before building, times nothing)


def to_measure(spec_keys: list[bytes], rows: list, mode: str) -> list[int]:
    """The specs the mode leaves to measure, given their rows now (None: no row): the first of each key, every key
    for force and fresh, only those without an ok row for jit."""
    first_of: dict[bytes, int] = {}
    for i, k in enumerate(spec_keys):
        first_of.setdefault(k, i)
    return sorted(i for i in first_of.values() if mode != "jit" or still_wanted(mode, rows[i], rows[i]))


class _InProcess:
    """This process as the only worker (KPROF_POOL=off, or one CPU slot)."""

    def __init__(self, entry: Entry, gpu_key: str, spec_keys: list[bytes]):
        from .worker import prepare_device

        self.entry, self.gpu_key, self.spec_keys = entry, gpu_key, spec_keys
        self.device = prepare_device(entry, gpu_key)
        self.dropped: list[dict] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def measure(self, items, origin: Origin, failed_event, watch=None, wanted=None):
        from .worker import measure_specs

        parents = {self.spec_keys[i]: parent for i, _spec, parent in items if parent is not None}
        label = getattr(self.device, "name", "cpu")
        taken = []  # the items handed to measure_specs, in its order: outcome.index counts them

        def specs():  # lazily: each item is checked once the one before it is stored
            for item in items:
                if wanted is None or wanted(item[0]):
                    taken.append(item)
                    if watch:
                        watch(label, item[1])
                    yield item[1]

        for outcome in measure_specs(self.entry, specs(), self.gpu_key, origin=origin, parents=parents,
                                     device=self.device):
            yield Result(taken[outcome.index][0], outcome.event, None, outcome.seconds, outcome.timed_seconds, label)
        if watch:
            watch(label, None)


def check_settings(*, here: bool = True) -> None:
    """Every number a run reads from the environment, checked on any backend before anything is measured or
    written: a value no backend could use (text for seconds, a negative window) is refused even where it would not
    apply, rather than found when it first does. `here=False` (a remote run, whose workers inherit them) leaves out
    the bounds of this machine (KPROF_CPU_WORKERS up to its cores)."""
    from . import _ranks, environments, pool
    from ..measure.stats import StopRule
    from .cuda_device import capped_sample_s, energy_window_s
    from .devices import _forced_var, _parse_forced, cpu_workers, pool_mode

    StopRule.from_env()
    pool_mode()
    if here:
        cpu_workers()
    energy_window_s(), capped_sample_s(), pool.timeouts(), _ranks.start_s(), _ranks.step_s()
    if (forced := _forced_var()) is not None:
        _parse_forced(forced)
    environments.skipped()


def spec_time_limit() -> bool:
    """Whether KPROF_SPEC_TIMEOUT_S is set. A spec's time limit is kept by killing the worker that runs it: set, it
    sends the specs to workers (`run`, `audit --remeasure`); with KPROF_POOL=off, which measures in this process, it
    is refused."""
    timed = bool(os.environ.get("KPROF_SPEC_TIMEOUT_S", "").strip())
    if timed and pool_mode() == "off":
        raise UsageError("KPROF_SPEC_TIMEOUT_S is set, but KPROF_POOL=off measures in this process, where no spec "
                         "can be stopped; unset one of them")
    return timed


def fill(entry: Entry, canonical: list, gpu_key: str, db: str, mode: str, origin: Origin, *,
         progress: Callable[[int, int, dict], None] | None = None,
         watch: Callable[[str, dict | None], None] | None = None, conflict_dir: str | None = None,
         waiting: Callable[[int], None] | None = None) -> Filled:
    for name, hook in (("progress", progress), ("watch", watch), ("waiting", waiting)):
        if hook is not None and not callable(hook):  # refused before anything is measured, not after the first row
            raise UsageError(f"{name}={hook!r} is not callable; pass a function (see kprof.api.run), or omit it")
    if not isinstance(origin.command, str):  # else refused by the schema once measured, naming kprof.ledger.build
        raise UsageError(f"command={origin.command!r} is not a str; pass the command line its rows record, or omit it")
    keys = KeyMaker(entry.table, entry.backend, gpu_key, entry.contract, ShapeCodec(entry.args, name=entry.table))
    spec_keys = [keys.key(s) for s in canonical]

    views: dict = {}  # one View per ledger read: making one defines its shapes' Struct, and a run asks twice a spec

    def view_of(ledger):
        if ledger not in views:
            views[ledger] = ledger.view(entry.table, entry.backend, gpu_key, entry.contract, entry.args)
        return views[ledger]

    def query(ledger):
        if ledger is None:
            return None, [None] * len(canonical)
        return view_of(ledger).query(canonical)

    def rows_of(ledger):
        return query(ledger)[1]

    # 1. what to measure, read-only
    root_before, before = query(None)
    if os.path.exists(db):
        try:
            with Ledger.open(db, readonly=True) as reader:
                root_before, before = query(reader)
        except Uncreated:  # a ledger whose creation was killed before it committed: this run makes it
            pass
    todo = to_measure(spec_keys, before, mode)
    errored: dict[bytes, dict] = {}
    info: dict = {"devices": [], "forced_by": None, "idle_guard": False, "skipped": [], "dropped": [],
                  "waited_for": 0}
    if not todo:
        return Filled(errored, {}, 0, 0.0, info, root_before, spec_keys)
    entry.make_runner()  # a runner that does not load is a UsageError here, before a ledger, claim or worker is made

    # 2. the devices
    pmode = pool_mode()
    timed = spec_time_limit()
    devices: Devices | None = None
    if pmode != "off":
        devices = usable_devices(entry, gpu_key)
    if devices is None:
        label = "cpu" if entry.device != "cuda" else "cuda:0"
        devices = Devices([Device(label, None)], None, [])
        info.update(devices=[label], in_process=True)
    else:
        # One usable device that is this process's own (the CPU, or CUDA device 0) and specs that need no more:
        # measured in this process, as a spawned worker would measure them there, without its start (a torch
        # import and a CUDA context, ~6 s a call on an H200 host), which a caller filling in a loop pays each time.
        info.update(devices.describe(), in_process=pmode == "auto" and not timed and
                    _own_device(entry, devices, todo, canonical))
    usable = len(devices.devices)
    short = [i for i in todo if need_of(entry, canonical[i]) > usable]
    verdicts = "; ".join(f"{s['gpu']}: {s['why']}" for s in devices.skipped)
    for i in short:
        errored[spec_keys[i]] = {"kind": "unavailable",
                                 "message": f"need {need_of(entry, canonical[i])} idle GPU(s), found {usable}"
                                            + (f" ({verdicts})" if verdicts else "")}
    todo = [i for i in todo if i not in set(short)]
    if not todo:
        return Filled(errored, {}, 0, 0.0, info, root_before, spec_keys)
    levels: dict[int, list[int]] = {}  # devices per spec -> the specs needing that many, each level its own workers
    for i in todo:
        levels.setdefault(need_of(entry, canonical[i]), []).append(i)
    if entry.metric_family == "comm":  # a collective's ranks stay up across specs of one world size: those in a row
        for its in levels.values():
            its.sort(key=lambda i: canonical[i].get("world_size", 0))
    if not info["in_process"]:  # a level starts no more workers than it has specs: a device left idle was not used
        used = {label for n, its in levels.items() for g in groups(devices.devices, n)[:len(its)]
                for label in g.label.split("+")}
        info["devices"] = [d.label for d in devices.devices if d.label in used]

    def workers_for(n: int):
        if info["in_process"]:
            return _InProcess(entry, gpu_key, spec_keys)
        return Pool(entry, gpu_key, groups(devices.devices, n)[:len(levels[n])])  # no idle worker: one per spec at most

    # 3. and 4.
    state = _State(entry, canonical, keys, spec_keys, mode, before, progress, watch, conflict_dir, len(todo),
                   view_of)
    state.waiting = waiting
    with contextlib.ExitStack() as stack:
        order = sorted(levels)
        first = stack.enter_context(workers_for(order[0]))  # a device that cannot measure: refused, nothing written
        if mode != "fresh":
            from .claims import Claims

            claims = Claims(db, origin.run_id)
            claims.check()  # a claims directory it cannot use is refused before a ledger is created
        ledger = None if mode == "fresh" else stack.enter_context(Ledger.open(db))
        if ledger is not None:
            origin = msgspec.structs.replace(origin, ledger_id=ledger.ledger_id)
            state.claims = stack.enter_context(claims)
        state.ledger, state.origin = ledger, origin
        if "opening" in state.keywords:  # the opening call: what is to measure, what is there already, and where
            present = len(set(spec_keys)) - len(todo) - len(short)
            progress(0, len(todo), None, **({"failed": 0} if "failed" in state.keywords else {}),
                     opening=dict(present=present, devices=info["devices"], in_process=info["in_process"]))
        try:
            for n in order:
                if n == order[0]:
                    workers = first
                else:
                    try:
                        workers = stack.enter_context(workers_for(n))
                    except UsageError as exc:  # this level's devices cannot measure: its specs say why
                        for i in levels[n]:
                            errored[spec_keys[i]] = {"kind": "unavailable", "message": str(exc)}
                        continue
                state.fill(workers, levels[n], errored, rows_of)
                info["dropped"].extend(workers.dropped)
        except (KeyboardInterrupt, SystemExit) as exc:  # the interrupt's line (the CLI) says how far the run got
            with contextlib.suppress(Exception):  # a ledger the interrupt left unreadable: no count
                if ledger is not None:
                    exc.add_note(f"this run stored {state.stored()} row(s) of the {state.total} spec(s) it had to "
                                 f"measure")
            raise
    info["waited_for"] = len(state.waited)
    return Filled(errored, state.fresh, state.measured, state.timed, info, root_before, spec_keys, state.host_busy,
                  state.timed_rows)


class _State:
    """What the levels of one fill share: the ledger and claims, and what has been measured so far."""

    def __init__(self, entry, canonical, keys, spec_keys, mode, before, progress, watch, conflict_dir, total,
                 view_of):
        self.entry, self.canonical, self.keys, self.spec_keys = entry, canonical, keys, spec_keys
        self.mode, self.before, self.progress, self.watch = mode, before, progress, watch
        self.conflict_dir, self.total = conflict_dir, total
        self.ledger = self.claims = self.origin = None
        self.view_of = view_of  # the ledger's View of this fill's scope and contract
        self.fresh: dict[bytes, Any] = {}
        self.taken: dict[int, Any] = {}  # spec index -> its row (or None) when it was taken
        self.kept: set[int] = set()  # the specs measured whose row this run stores, or stored (what `stored` reads)
        self.measured, self.timed, self.host_busy, self.timed_rows = 0, 0.0, 0, 0
        self.waited: set[bytes] = set()
        self.elsewhere = 0  # specs of the total another run is measuring, or whose row another writer stored
        self.waiting = None  # told, each round, how many of its keys other runs hold (where any do)
        self.failed = 0  # this run's measurements that made a failed row (an oom, a crash, a timeout)
        self.keywords = _keywords(progress)

    def fill(self, workers, todo: list[int], errored: dict, rows_of) -> None:
        canonical, spec_keys, keys = self.canonical, self.spec_keys, self.keys
        self.elsewhere += len(todo)  # out of the total until a round hands it to this run
        for batch, rows, held in rounds(self.claims, todo, spec_keys, lambda: rows_of(self.ledger), self.mode,
                                        self.before):
            self.elsewhere -= len(batch)
            self.waited.update(held)
            if held and self.waiting:  # a run that only waits says nothing else for as long as the other one takes
                self.waiting(len(held))
            parent_of = {i: (rows[i].event_id if rows[i] is not None else None) for i in batch}
            self.taken.update((i, rows[i]) for i in batch)
            items = [(i, canonical[i], parent_of[i]) for i in batch]
            origin = self.origin

            def failed_event(i, kind, message, environment: Environment):
                return failed(keys.provenance(canonical[i], i), kind, message[:2000], environment=environment,
                              origin=origin, parent=parent_of.get(i))

            wanted = self._to_measure if self.claims is not None else None  # fresh writes nothing: no check
            for res in workers.measure(items, origin, failed_event, self.watch, wanted):
                self._keep(res, errored)

    def _keep(self, res: Result, errored: dict) -> None:
        k = self.spec_keys[res.index]
        self.kept.add(res.index)
        self.timed += res.timed_seconds
        self.measured += 1
        if type(res.event) is not Measured:
            errored[k] = {"kind": res.event.error_kind, "message": res.event.message}
            self.failed += 1
        else:
            self.host_busy += "host_busy" in res.event.method.notes
            self.timed_rows += 1
        if self.mode == "fresh":
            self.fresh[k] = res.event
        elif res.segment is not None:
            from ..merge.merge import merge_into

            report_dir = self.conflict_dir or tempfile.mkdtemp(prefix="kprof-")  # for a conflict's merge-report.json
            try:
                merge_into(self.ledger, [res.segment], report_dir)
            except MergeConflict as exc:  # an error only where the row another writer stored is not one asked for
                self.kept.discard(res.index)  # not this run's row: the interrupt's count leaves it out
                if still_wanted(self.mode, self._row_now(res.index), self.before[res.index]):
                    errored[k] = {"kind": "conflict", "message": str(exc)}
            finally:  # an interrupt too: no report, so not one dir per spec (or per interrupted run) left
                os.unlink(res.segment)
                if report_dir != self.conflict_dir and not os.listdir(report_dir):
                    os.rmdir(report_dir)
        else:
            try:  # one commit per spec: a crash keeps what was finished
                self.ledger.append([res.event], before=lambda _txn: self._unchanged(res.index))
            except _RowChanged as changed:
                self.kept.discard(res.index)  # the row is another writer's, not this run's (`stored`)
                # another writer (a merge) stored a row for the key while it was measured: kept, as a merge keeps
                # it, and the spec's answer (`still_wanted`); an error only where it is none (a retraction)
                if still_wanted(self.mode, changed.args[0], self.before[res.index]):
                    now = changed.args[0].event_id
                    errored[k] = {"kind": "conflict", "message": f"the key's row changed while it was measured (now "
                                  f"{now.hex()[:16] if now else 'none'}: a merge, or a retraction); this measurement "
                                  f"was not stored"}
        if self.claims is not None:  # stored (or given up): a run waiting for it reads it now, not when this one ends
            self.claims.drop([k])
        if self.progress:
            self.progress(self.measured, max(self.total - self.elsewhere, self.measured), self.canonical[res.index],
                          **({"failed": self.failed} if "failed" in self.keywords else {}))

    def stored(self) -> int:
        """The specs this run measured whose row the ledger now holds anew, as the ledger reads (a count kept as each
        was appended missed one where a signal came between its commit and the count); only those it measured are
        read, not every spec it took (a large request's, on its way out)."""
        kept = sorted(self.kept)
        rows = self.view_of(self.ledger).query([self.canonical[i] for i in kept])[1]
        return sum(_own(row) != _own(self.taken[i]) for i, row in zip(kept, rows))

    def _to_measure(self, i: int) -> bool:
        """Asked just before spec i is measured: whether it still lacks the row its mode asks for. A row another
        writer (a merge, which takes no claims) stored since the run began (ok or failed) is its answer, as in the
        key's round (`still_wanted`): the spec is skipped and its claim ended, not measured for a row that could not
        be stored."""
        if still_wanted(self.mode, self._row_now(i), self.before[i]):
            return True
        self.claims.drop([self.spec_keys[i]])
        self.elsewhere += 1
        return False

    def _unchanged(self, i: int) -> None:
        """Raises _RowChanged where spec i's row is no longer the one it was measured against (its event's parent).
        Asked under the write lock, before the event is written: no other writer can store a row in between."""
        if _own(row := self._row_now(i)) != _own(self.taken.get(i)):
            raise _RowChanged(row)

    def _row_now(self, i: int):
        """Spec i's row as the ledger holds it now (ok, failed, stale or missing); its event id is what `fill` took
        as its event's parent when it took the key."""
        return self.view_of(self.ledger).query([self.canonical[i]])[1][0]


def _keywords(progress) -> set[str]:
    """Which keywords past (done, total, spec) a progress hook takes (one of three is called with three): `failed`, the
    failed rows so far; `opening` ({present, devices, in_process}), in a first call (done 0, spec None) before any."""
    import inspect

    try:
        return {"failed", "opening"} & set(inspect.signature(progress).parameters) if progress else set()
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return set()


class _RowChanged(Exception):
    """A key's row changed while its spec was measured (`_State._unchanged`): the measurement is not stored. Its one
    argument is the row the key holds now."""


def _own_device(entry: Entry, devices: Devices, todo: list[int], canonical: list) -> bool:
    """Whether the only usable device is this process's own one (a CPU slot, or the GPU that is CUDA device 0
    here) and no spec to measure needs more than one. A collective on GPUs (an entry with `gpus_arg`) always goes
    to the pool, whose worker hands its rank processes the group's GPUs."""
    if len(devices.devices) != 1 or any(need_of(entry, canonical[i]) > 1 for i in todo):
        return False
    return entry.device != "cuda" or (not entry.gpus_arg and devices.devices[0].label == "gpu0")
