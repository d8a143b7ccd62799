"""The LMDB ledger: one file (`subdir=False`) and its lock file (LMDB's: writers of all processes take turns), with
sub-databases `events` (event id -> bytes), `log` (seq, 8 bytes big-endian -> event id), `meta` (version, ledger id,
last seq) and `_reducer`'s views. An append writes all in one write transaction: a reader or crash sees all or none."""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Iterable, Iterator

import lmdb
import msgspec

from .. import _limits, _scratch
from ..errors import IntegrityError, LedgerError, LedgerPathError, LedgerVersionError, Uncreated, UsageError
from . import _codec
from ._env import (CREATE_WAIT_S, _FORK_FIX, _await_reads, _begin, _check_file, _envs, _identity, _inherited, _live,
                   _lock, _mapping, _read_only_file, _reads, _release, _write_txn)
from ._memo import Memo
from ._write import AppendResult, append_events, canonical, meta_number, rebuild_views
from ._path import _recognize, _with_lock, ledger_path
from ._resolve import resolve
from ._verify import damaged, event as verified_event, reading
from ._reducer import ScopeEntry, history_entry, opened, pack_seq, seq_of
from .events import Failed, Measured, Retracted

__all__ = ["Ledger", "AppendResult", "DEFAULT_MAP_SIZE", "ledger_path"]

DBS = ("events", "log", "current", "scope_index", "history", "failures", "retracted", "scopes", "meta")
VIEW_DBS = ("current", "scope_index", "history", "failures", "retracted", "scopes")
DEFAULT_MAP_SIZE = 1 << 34  # 16 GiB of address space (less under ulimit -v); the file only grows as pages are used


class _Creating(Exception):
    """The file holds no kprof sub-databases yet: a writer creating it may not have committed them."""


class Ledger:
    """An open ledger file. `Ledger.open(path, readonly=True)` for readers; writers append batches."""

    def __init__(self, path: str, env: lmdb.Environment, readonly: bool):
        self.path, self.env, self.readonly = path, env, readonly
        self.real_path = os.path.realpath(path)  # as resolved at opening: the process may change directory
        self._pid, self._forked, self.closed, self._writing = os.getpid(), False, False, threading.RLock()  # see write
        self._entry, self._temporary, self._source = _envs[self.real_path], None, None  # see _check_file, _reading_copy
        self.dbs = self._entry[5] = self._entry[5] or {n: env.open_db(n.encode(), create=False) for n in DBS}  # once
        self.memo = Memo()  # the answers of recent bulk lookups, each valid while its view root stands
        _live.add(self)

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, *, readonly: bool = False,
             map_size: int = DEFAULT_MAP_SIZE, readahead: bool = False) -> "Ledger":
        """Opens (or, unless readonly, creates) the ledger file; `readahead` suits whole-file scans, not lookups."""
        path = ledger_path(path)
        if type(map_size) is not int or not 0 < map_size < 1 << 63:
            raise UsageError(f"map_size={map_size!r} is not a size in bytes; pass a positive int, or omit it (1 << 34)")
        deadline = time.monotonic() + CREATE_WAIT_S
        while True:
            try:
                with _lock:  # one thread at a time opens or releases an environment (one per file in a process)
                    return cls._open(path, readonly, _limits.map_size(map_size), readahead, deadline)
            except _Creating:
                time.sleep(0.01)

    @classmethod
    def _open(cls, path: str, readonly: bool, map_size: int, readahead: bool, deadline: float) -> "Ledger":
        if os.path.exists(path):
            _recognize(path, deadline, readonly)
        elif os.path.islink(path):  # to nothing (it does not exist): LMDB would create `<path>-lock`, then fail
            raise LedgerPathError(f"ledger path {path} is a symbolic link to nothing (dangling, a loop); fix the link")
        elif readonly:
            raise LedgerPathError.absent(path)
        real = os.path.realpath(path)
        if real in _inherited:
            raise LedgerError(f"ledger {path} was open in the parent when this process was forked, and LMDB "
                              f"cannot open it again in a forked child; {_FORK_FIX}")
        entry = _envs.get(real)  # this process's environment of the file: [env, users, (device, inode), page size]
        if entry is not None and entry[2] != _identity(real)[:2]:  # replaced in place: close the earlier file's
            with _mapping:  # once other threads' reads of it end; none begins meanwhile (it would read a closed file)
                _await_reads(entry[0], path, " was replaced in place", "then open it again")
                _envs.pop(real)[0].close()
                entry[2] = None
            entry = None
        if entry is None:  # first, close the environments of other files whose Ledgers were all collected unclosed
            for other in [o for o, e in _envs.items() if o != real and not any(led.env is e[0] for led in list(_live))]:
                _envs.pop(other)[0].close()  # (a read holds its Ledger: none is open there)
            # Writable where the file allows, so that a reader and a writer in one process share it (Ledger enforces it)
            lock = _with_lock(path, real, readonly)  # `<real path>-lock`: one for every name of the file
            env_readonly = readonly and (not lock or not os.access(path, os.W_OK))
            try:
                entry = [lmdb.open(os.fsencode(real), subdir=False, readonly=env_readonly, max_dbs=len(DBS) + 4,
                                   map_size=map_size, lock=lock, sync=True, metasync=True, readahead=readahead,
                                   max_readers=510, mode=0o666), 0, _identity(real)[:2], 0,  # (as umask allows)
                         _identity(real + "-lock")[:2], None]
            except (lmdb.InvalidError, lmdb.VersionMismatchError) as exc:  # the header's version, or the lock file's
                lock_file = f" (or its lock file: remove {real}-lock while no process has the ledger open)" * (
                    isinstance(exc, lmdb.VersionMismatchError))
                raise IntegrityError(f"ledger {path} is damaged: LMDB finds its header invalid{lock_file}; restore "
                                     f"the file from a copy") from None
            except lmdb.Error as exc:
                if lock and os.path.exists(real + "-lock") and not os.access(real + "-lock", os.R_OK | os.W_OK):
                    raise LedgerError(f"cannot open ledger {path}: this user cannot write its lock file {real}-lock, "
                                      f"where LMDB registers every reader; have its owner make it writable (chmod "
                                      f"a+rw), or read a copy of the ledger") from None
                bad = f"its lock file {real}-lock is a directory: remove it" if os.path.isdir(real + "-lock") else (
                    exc if os.path.isdir(os.path.dirname(real)) else f"there is no directory {os.path.dirname(real)}")
                fix = _limits.hit(exc) or f"{bad}; check the path and its permissions"  # or a limit: ulimit -n, -v
                raise LedgerError(f"cannot open ledger {path}: {fix}") from None
        env, users = entry[0], entry[1]
        try:
            try:
                entry[3] = entry[3] or env.stat()["psize"]
                _check_file(path, real, entry)  # a truncated file would fault (SIGBUS) on the first read past its end
                if not cls._initialize(path, env, readonly) and not users:  # (a shared one is current: opened so)
                    return cls._reading_copy(path, real, env, map_size)
                entry[1] += 1
                _envs[real] = entry
                ledger = cls(path, env, readonly)
                ledger._check_meta()
            except lmdb.NotFoundError:  # no kprof sub-databases: a writer creating the file has not committed yet
                if time.monotonic() < deadline:
                    raise _Creating from None
                if not env.stat()["entries"]:  # nothing at all: its creation never committed (killed while made)
                    raise Uncreated(f"no ledger at {path} yet: its creation never committed (the LMDB file is empty); "
                                    f"`kprof run` makes it a ledger") from None
                raise IntegrityError(f"{path} is an LMDB file without kprof's sub-databases: not a kprof ledger; "
                                     f"check the path (a damaged ledger reads so too: run `kprof audit` for the full "
                                     f"report)") from None
            except lmdb.ReadonlyError:
                raise _read_only_file(path) from None
            except lmdb.Error as exc:
                if "mdb_txn_commit" in str(exc):  # creating or upgrading it, refused by a full disk: not damage
                    raise
                raise damaged(path, str(exc)) from None  # (the verbs add the quoted --db to its `kprof audit`)
        except BaseException:
            if not users or entry[1] > users:  # a new environment, or this open's use of a shared one
                _release(real, env)
            raise
        return ledger

    @classmethod
    def _reading_copy(cls, path: str, real: str, env: lmdb.Environment, map_size: int) -> "Ledger":
        """An older file's reader: LMDB's snapshot copy, upgraded in a temp dir removed at close, collection or exit
        (or, where the process is killed, by the next process making one: see kprof._scratch)."""
        copy, rm, was = *_scratch.make("kprof-upgraded-copy-"), (real, _identity(real))  # the file as copied
        try:
            env.copy(os.path.join(copy, "ledger.db"))
            _release(real, env)
            ledger = cls.open(os.path.join(copy, "ledger.db"), map_size=map_size)
        except BaseException as exc:
            rm()
            if isinstance(exc, lmdb.Error):  # the copy, or its upgrade, refused: the temporary directory is full
                raise LedgerError(f"cannot read ledger {path} (an older format) from its upgraded copy: writing it in "
                                  f"{os.path.dirname(copy)} failed ({exc}); free space there, or set TMPDIR") from None
            raise
        ledger.path, ledger.readonly, ledger._source = path, True, was
        ledger._temporary = weakref.finalize(ledger, rm, partial(_release, ledger.real_path, ledger.env))  # see close
        return ledger

    @staticmethod
    def _initialize(path: str, env: lmdb.Environment, readonly: bool) -> bool:
        """Makes a new file a ledger, upgrades an older one (writers); False for a reader of an older file."""
        if readonly:
            with _mapping, _begin(env, path) as txn:  # a read: a reader of a current file never waits for a writer
                found = meta_number(txn.get(b"format_version", db=env.open_db(b"meta", txn=txn, create=False)))
            return found is None or not 1 <= found < _codec.FORMAT_VERSION

        def work(txn):
            meta = env.open_db(b"meta", txn=txn, create=True)
            found = meta_number(txn.get(b"format_version", db=meta))
            if found is not None and not 1 <= found < _codec.FORMAT_VERSION:
                return
            for name in DBS:
                env.open_db(name.encode(), txn=txn, create=True)
            if found is None:
                if txn.stat(env.open_db(b"events", txn=txn))["entries"]:
                    raise IntegrityError(f"ledger {path} holds events but no format version; restore it from a copy")
                txn.put(b"ledger_id", _codec.encode(uuid.uuid4().hex), db=meta)
                txn.put(b"created_at", _codec.encode(time.time()), db=meta)
                txn.put(b"last_seq", _codec.encode(0), db=meta)
            else:
                rebuild_views(txn, {name: env.open_db(name.encode(), txn=txn) for name in DBS}, VIEW_DBS)
            txn.put(b"format_version", _codec.encode(_codec.FORMAT_VERSION), db=meta)

        try:
            _write_txn(env, path, work)
        except lmdb.ReadonlyError:  # (a reader returned above)
            raise _read_only_file(path) from None
        return True

    def _check_meta(self) -> None:
        raw = self._get("meta", b"format_version")
        if raw is None:
            raise IntegrityError(f"{self.path} is an LMDB file but not a kprof ledger (no format version)")
        found = meta_number(raw)
        if found > _codec.FORMAT_VERSION:
            raise LedgerVersionError(self.path, found, _codec.FORMAT_VERSION)
        if found < _codec.FORMAT_VERSION:  # not a version number, or older after opening upgraded the file: damage
            raise IntegrityError(f"{self.path}: its format version is damaged ({raw.hex()[:32]} is not version "
                                 f"{_codec.FORMAT_VERSION}); run `kprof audit` for the full report, and restore the "
                                 f"file from a copy")
        self.format_version = found

    def _guard(self) -> None:
        if self.closed:
            raise LedgerError(f"ledger {self.path} is closed; open it again with Ledger.open")
        if self._forked or os.getpid() != self._pid:
            self._forked = True
            raise LedgerError(f"ledger {self.path} was opened in process {self._pid} before a fork(), and LMDB "
                              f"handles cannot cross a fork; {_FORK_FIX}")

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A consistent snapshot for as long as the block lasts, of the file now at the path (see _check_file)."""
        self._guard()
        txn = None
        try:
            mine = [t for e, _txn, t in list(_reads.values()) if e is self.env and t == threading.get_ident()]
            with nullcontext() if mine else _mapping:  # no map change till in _reads (one waits for this thread's)
                _check_file(self.path, self.real_path, self._entry)
                if self._source and _identity(self._source[0]) != self._source[1]:  # the older file this copied
                    raise LedgerError(f"ledger {self.path} changed since this reader copied it; open it again")
                txn = _begin(self.env, self.path)
                _reads[id(txn)] = (self.env, txn, threading.get_ident())
            yield txn
        except (lmdb.Error, IntegrityError):  # LMDB's "closed object" (as damage, where a reading() said so)
            if self.closed:
                raise LedgerError(f"ledger {self.path} was closed during this read (view.rows() or iter_log() not "
                                  f"finished, or another thread's close); close a ledger after its reads") from None
            raise
        finally:
            if txn is not None and os.getpid() == self._pid:  # a forked child never aborts its copy (_env)
                _reads.pop(id(txn), None)
                txn.abort()

    def _get(self, db: str, k: bytes, decoded: type | None = None):
        with reading(self.path, db), self.read() as txn:  # an LMDB or decoding error: damage, naming the db
            raw = txn.get(k, db=self.dbs[db])
            return raw if decoded is None else msgspec.msgpack.decode(raw, type=decoded)

    @property
    def ledger_id(self) -> str:
        return self._get("meta", b"ledger_id", str)

    @property
    def last_seq(self) -> int:
        return self._get("meta", b"last_seq", int)

    def write(self, fn):
        """Runs fn(txn) in one write transaction, committed only where `_check_file` passes; grows a full map."""
        with nullcontext() if self._forked else self._writing:  # a close waits for it (LMDB's environment closed
            self._guard()  # under a write failed it with a raw error, or hung the close)
            if self.readonly:
                raise LedgerError(f"ledger {self.path} was opened read-only; open it with readonly=False to write")
            return _write_txn(self.env, self.path, fn, lambda: _check_file(self.path, self.real_path, self._entry))

    def append(self, events: Iterable, *, before=lambda txn: None) -> AppendResult:
        """Appends a batch atomically, skipping events present; a key not its provenance's hash refuses it whole."""
        return self.append_checked(self._prepare(events), before=before)

    def append_batches(self, batches: Iterable[Iterable]) -> list[AppendResult]:
        """`append` per batch, each in its own transaction, in order; one AppendResult per batch. A refused batch
        raises once every batch before it has committed, and nothing of it or of the batches after it is written."""
        self._guard()
        return [self.append(events) for events in batches]

    def _prepare(self, events: Iterable) -> list[tuple]:
        """(event, canonical bytes, event id) per event, every key verified against its provenance."""
        if not isinstance(events, Iterable):  # an event where a batch goes: append([event]), append_batches([[...]])
            raise UsageError(f"a batch is an iterable of events, not {type(events).__name__!r}; pass a list: [event]")
        prepared = []
        for i, given in enumerate(events):
            if type(given) not in (Measured, Failed, Retracted):
                raise UsageError(f"event {i} of the batch is a {type(given).__name__}; append Measured, Failed or "
                                 f"Retracted events (kprof.ledger.build makes them)")
            event, data = canonical(given, i)
            prepared.append((event, data, _codec.event_id(data)))
        for event, _data, eid in prepared:
            if type(event) is not Retracted and _codec.provenance_key(event.provenance) != event.key:
                raise IntegrityError(f"event {eid.hex()[:16]} carries key {event.key.hex()[:16]}, but its "
                                     f"provenance hashes to another key; build events with kprof.ledger.build")
        return prepared

    def append_checked(self, prepared: list[tuple], *, before=lambda txn: None) -> AppendResult:
        """`append` of (event, canonical bytes, event id) triples already checked (a merge's verified segment)."""
        return self.write(lambda txn: before(txn) or append_events(txn, self.dbs, prepared))  # before: under the lock

    def event(self, eid: bytes):
        """The stored event `eid`, its bytes re-hashed (IntegrityError where they do not hash to it), or None."""
        if not isinstance(eid, (bytes, bytearray, memoryview)) or not eid:  # a citation, b"": not the file's damage
            raise UsageError(f"event id {eid!r} is not an id's bytes; pass a Row's or ledger.resolve(ref)'s event_id")
        raw = self._get("events", eid)
        return None if raw is None else verified_event(self.path, eid, raw)

    def history_of(self, txn, key: bytes) -> list[tuple[int, bytes]]:
        """(seq, event id) of every event of a key, oldest first; IntegrityError where the log lacks one."""
        seqs, log = history_entry(key, txn.get(key, db=self.dbs["history"])).seqs, self.dbs["log"]
        if None in (ids := [txn.get(pack_seq(seq), db=log) for seq in seqs]):
            raise damaged(self.path, f"the history of key {key.hex()} names seq {seqs[ids.index(None)]}, which is not "
                                     f"in the log")
        return list(zip(seqs, ids))

    def iter_log(self, txn=None) -> Iterator[tuple[int, bytes, bytes]]:
        """(seq, event id, event bytes) in log order, from one snapshot."""
        if txn is None:
            with self.read() as txn:
                yield from self.iter_log(txn)
            return
        events = self.dbs["events"]
        for k, eid in txn.cursor(self.dbs["log"]):
            yield seq_of(k), eid, txn.get(eid, db=events)

    def scopes(self) -> list[tuple[str, str, str, int]]:
        """(table, backend, gpu_key, rows) of every scope in the ledger."""
        with self.read() as txn:
            entries = [opened("scopes", k, v, ScopeEntry) for k, v in txn.cursor(self.dbs["scopes"])]
        return [(e.table, e.backend, e.gpu_key, e.rows) for e in entries]

    def view(self, table: str, backend: str, gpu_key: str, contract=None, args_type=None):
        """The View of one scope under `contract`, its specs of KernelArgs type `args_type` (the ledger knows no
        registry: `kprof.api.view(ledger, table, backend, gpu_key)` takes both from the registry entry)."""
        from .view import View

        self._guard()
        if contract is None or args_type is None:
            raise UsageError(f"Ledger.view({table!r}, {backend!r}, ...) needs the registry's contract and KernelArgs "
                             f"type; call kprof.api.view(ledger, {table!r}, {backend!r}, gpu_key), which takes both")
        return View(self, table, backend, gpu_key, contract=contract, args_type=args_type)

    def rebuild_views(self) -> int:
        """Rebuilds every view from the log in one write transaction (a repair); returns the events replayed."""
        return self.write(lambda txn: rebuild_views(txn, self.dbs, VIEW_DBS))

    def resolve(self, ref: str):
        """Finds an event by citation (`kprof.<hex>`), event id or key (hex, any unique prefix of ≥ 8 chars)."""
        return resolve(self, ref)

    def close_if_idle(self) -> bool:
        """Closes the ledger where no read or write of this process is in its file; whether it is closed now."""
        with nullcontext() if self._forked else self._writing, _lock, _mapping:  # (in the order write and open take)
            if any(e is self.env for e, _txn, _thread in _reads.values()):  # (one waiting to begin: finds it closed)
                return False
            self.close()
        return True

    def close(self) -> None:
        with nullcontext() if self._forked else self._writing, _lock:  # after any write; closed first: reads say so
            release, self.closed = not self._forked and os.getpid() == self._pid and not self.closed, True
            if release:  # an upgraded copy's reader, closed or collected: the copy's environment (its own), then it
                self._temporary() if self._temporary else _release(self.real_path, self.env)
        _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
