"""Claims: concurrent `run`s on one ledger never measure the same key twice.

A run claims the keys it is about to measure before measuring them. Its claims live in a file of its own,
`<ledger>-claims/<run id>.claim` (the keys, hex, one per line; `-` before a key ends its claim), which it holds
under an exclusive `flock` for as long as it runs. The kernel releases that lock when the process ends however it
ends (a kill included), so a claim is alive exactly while its holder is: another run that can take the lock has
found a dead holder, and removes the file. Claiming is atomic across runs: it happens under `<ledger>-claims/lock`.

    with Claims(db_path, run_id) as claims:
        mine, held = claims.take(keys)   # mine: now claimed by this run; held: key -> the run that holds it
        ...                              # measure mine; wait for held (take them again later)
        claims.drop(done)                # ends the claims of keys measured (or given up) before the run ends

`Claims.rounds` is that loop, as `run` and a remote run both go through it (`rounds`: with a run's mode).

A run measures its own claims, ending each as its row is stored, then takes the held keys again until none is
held: a key whose holder finished it is read from the ledger (measured by the other run), one whose holder died
without measuring it is measured here. A run that waits holds no claims, so two runs never wait for each other.
Claims never enter the ledger file: they say who is measuring, not what was measured. The directory is the one
beside the file's real path, so every name of a ledger (a link, a relative path) shares it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from typing import Callable, Iterator

from .._limits import hit
from ..errors import UsageError

__all__ = ["Claims", "WAIT_S", "own_event", "rounds", "still_wanted"]

WAIT_S = 0.5  # between looks at keys another run is measuring


class Claims:
    def __init__(self, db_path: str, run_id: str):
        self.dir = f"{os.path.realpath(db_path)}-claims"  # one directory for every name of the file (a link too)
        self.named = f"{db_path}-claims"  # as messages name it: by the name the user gave
        self.run_id = run_id
        self.path = os.path.join(self.dir, f"{run_id}.claim")
        self._own = None
        self.claimed: set[bytes] = set()

    def __enter__(self) -> "Claims":
        self.check()
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot make {self._where} ({e.strerror}); run where the ledger's directory is "
                             f"writable, or copy the ledger to one") from None
        # Made and locked under the directory's lock: between the two, another run would take our unlocked file
        # for a dead run's and remove it, and our claims with it.
        with self._using(), self._lock():
            self._own = open(self.path, "a+")
            fcntl.flock(self._own, fcntl.LOCK_EX | fcntl.LOCK_NB)  # our own new file: never contended
        return self

    @contextlib.contextmanager
    def _using(self):
        """What the directory refuses (its permissions, a file of it unreadable or in the way): one line naming it."""
        try:
            yield
        except OSError as e:
            bad = self._named(e.filename)
            raise UsageError(f"cannot use {self._where}: " + (hit(e) or f"{bad}: {e.strerror}; fix or remove {bad} "
                                                                      f"(no rows are kept there)")) from None

    @property
    def _where(self) -> str:
        return f"{self.named}, where concurrent runs on the ledger record the keys they measure"

    def _named(self, path) -> str:
        return self.named + str(path)[len(self.dir):] if str(path).startswith(self.dir) else str(path)

    def check(self) -> None:
        """Refuses, creating nothing, a claims directory that is a file or whose lock is a directory: a run calls
        it before it creates a ledger."""
        for path, directory in ((self.dir, True), (os.path.join(self.dir, "lock"), False)):
            if os.path.lexists(path) and os.path.isdir(path) != directory:
                raise UsageError(f"cannot use {self._where}: {self._named(path)} is {'not ' if directory else ''}a "
                                 f"directory; fix or remove {self._named(path)} (no rows are kept there)")

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Ends every claim of this run (the file goes, then the lock with it)."""
        if self._own is None:
            return
        with contextlib.suppress(OSError):  # where it cannot go (the directory made read-only), its lock still ends
            os.unlink(self.path)  # with close: another run finds it dead and removes it
        with contextlib.suppress(OSError):  # data a full disk refused is not flushed again
            self._own.close()
        self._own = None

    def drop(self, keys) -> None:
        """Ends this run's claims of `keys` (measured, or given up), keeping its others: another run may take them."""
        gone = self.claimed.intersection(keys)
        if not gone or self._own is None:
            return
        with self._using(), self._lock():  # appended, not rewritten: a run ends each claim as it stores its row
            self.claimed -= gone
            self._record("".join("-" + k.hex() + "\n" for k in gone))

    def _record(self, lines: str) -> None:
        try:
            self._own.write(lines)
            self._own.flush()
        except OSError as e:
            raise UsageError(f"cannot record this run's claims in {self._named(self.path)} ({e.strerror}); every row "
                             f"stored before stays in the ledger: free space (or fix the directory) and run "
                             f"again") from None

    def _lock(self):
        # O_NONBLOCK: a pipe named `lock` is refused (ENXIO, no reader) where its open waited for a reader for good
        f = os.fdopen(os.open(os.path.join(self.dir, "lock"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK,
                              0o666), "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        return f

    def _held_by_others(self) -> dict[bytes, str]:
        """key -> run id, over the claim files of live runs; the files of dead runs are removed."""
        held: dict[bytes, str] = {}
        for name in os.listdir(self.dir):
            if not name.endswith(".claim") or name == os.path.basename(self.path):
                continue
            path = os.path.join(self.dir, name)
            if not os.path.isfile(path):  # a directory, pipe or device: no run's claims (a pipe's open waited for good)
                continue
            try:  # read as text whatever it holds: a line that is not a key is skipped below
                f = open(path, errors="replace")
            except (FileNotFoundError, IsADirectoryError):  # gone meanwhile, or a directory: no run's claims
                continue
            with f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    keys: dict[bytes, bool] = {}  # key -> still claimed, by this file's lines in order
                    for line in f:
                        line = line.strip()
                        with contextlib.suppress(ValueError):  # a line a full disk cut short, or garbage
                            keys[bytes.fromhex(line.lstrip("-"))] = not line.startswith("-")
                    held.update((k, name[: -len(".claim")]) for k, live in keys.items() if live)
                    continue
                with contextlib.suppress(FileNotFoundError):  # (a run ending removes its file outside our lock)
                    os.unlink(path)  # we got the lock: its holder is gone, and so are its claims
        return held

    def take(self, keys) -> tuple[list[bytes], dict[bytes, str]]:
        """Claims every key of `keys` no live run holds: (the keys claimed now, in order, including those this run
        held already; {key: holder run id} for the others)."""
        with self._using(), self._lock():
            held = self._held_by_others()
            mine = [k for k in keys if k not in held]
            new = [k for k in dict.fromkeys(mine) if k not in self.claimed]
            if new:
                self._record("".join(k.hex() + "\n" for k in new))
                self.claimed.update(new)
        return mine, {k: held[k] for k in keys if k in held}

    def rounds(self, todo: list[int], keys: list[bytes], rows_now: Callable[[], list],
               wanted: Callable[[int, object], bool]) -> Iterator[tuple[list[int], list, dict[bytes, str]]]:
        """The specs `todo` (indices into `keys`, their keys) in rounds: each takes the keys no other run holds, reads
        the rows now (`rows_now()`), and yields (the specs claimed that are still `wanted(i, row)`, the rows, the keys
        other runs hold); the claims of those not wanted (another run stored them meanwhile) end. The held ones are
        taken again, WAIT_S after the round the caller has finished with, until none is held. A key's row that another
        run stored since the run began (`wanted` says so: `still_wanted`), a failure too, is its answer: not measured
        again, whether this run waited for it or the other run had ended before this one took the key; one a holder
        left as it was (it died before storing it) is measured here."""
        pending = todo
        while pending:
            mine, held = self.take([keys[i] for i in pending])
            rows = rows_now()
            mine_set = set(mine)
            batch = [i for i in pending if keys[i] in mine_set and wanted(i, rows[i])]
            self.drop(mine_set - {keys[i] for i in batch})  # another run measured them meanwhile
            yield batch, rows, held
            pending = [i for i in pending if keys[i] in held]
            if pending:
                time.sleep(WAIT_S)


def own_event(row) -> bytes | None:
    """The event id of a spec's row under its own key: None where it has none (a stale row is another key's, of
    another profiler revision or timing, e.g. a CPU row of another thread count, which another run may store)."""
    return None if row is None or row.status == "stale" else row.event_id


def rounds(claims: Claims | None, todo: list[int], keys: list[bytes], rows_now: Callable[[], list], mode: str,
           before: list) -> Iterator[tuple[list[int], list, dict[bytes, str]]]:
    """`claims.rounds` of a run in `mode` (jit, force, fresh), a spec wanted while `still_wanted` says so; without
    claims (a --fresh run, which stores nothing), one round of every spec, as the rows were."""
    if claims is None:
        return iter([(todo, before, {})])
    return claims.rounds(todo, keys, rows_now, lambda i, row: still_wanted(mode, row, before[i]))


def still_wanted(mode: str, row, before) -> bool:
    """Whether the mode still leaves a key to measure, given its row now and when the run began. A row another writer
    (a run, or a merge) stored under the key since then, a failure too, is its answer, in either mode that stores: for
    force the refresh asked for, for jit the attempt asked for (a row of another key, e.g. another thread count's, is
    neither). Every check of a key (its round, the moment it is measured, a row found changed as it is stored) asks
    this, so none measures what another would refuse to store."""
    if mode == "fresh":
        return True
    now, was = own_event(row), own_event(before)
    if now is not None and now != was:
        return False
    return mode == "force" or row is None or row.status != "ok"
