"""Scratch directories that go with the process that made them: removed when it lets go of one, and, where it was
killed before it could (SIGKILL, the OOM killer: no cleanup runs), by the next process that makes one. A live owner
holds a shared `flock` on its directory, which the kernel releases when the process ends however it ends; a
directory that no process holds is left over. No kprof imports."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from typing import Iterator

__all__ = ["make", "keep", "hold", "unheld"]

# An empty directory younger than this is never taken for left over: its owner may be between making and locking it
# (one holding anything was locked before it was written, so no live process holds it: it goes at once).
SETTLE_S = 60.0


def make(prefix: str, tag: str = "") -> tuple[str, object]:
    """(a new directory under the temporary directory, named prefix + tag + a random part; the function that removes
    it, after `before()`: what must let go of the directory's files first): removal happens once, and only in the
    process that made it (a forked child calling it lets its parent's directory be, and calls no `before`). Left-over
    directories of the same prefix, whatever their tag, are removed first."""
    _sweep(prefix)
    path = tempfile.mkdtemp(prefix=prefix + tag)
    fd = hold(path, shared=True)  # held while the process lives (or until removed); forked children share it
    pid, done = os.getpid(), []

    def remove(before=lambda: None) -> None:
        if not done:
            done.append(True)
            if os.getpid() == pid:
                before()
                shutil.rmtree(path, ignore_errors=True)
            if fd is not None:
                os.close(fd)

    return path, remove


def keep(path: str, prefix: str, as_prefix: str) -> str:
    """Moves the scratch directory `path` (made with `prefix`) out of the swept ones, renamed with `as_prefix` in its
    place, and returns its new path (`path` itself where it cannot be moved): what a message names stays after its
    maker has gone. Its remover then removes nothing and only lets go of it."""
    kept = os.path.join(os.path.dirname(path), as_prefix + os.path.basename(path)[len(prefix):])
    try:
        os.rename(path, kept)
    except OSError:
        return path
    return kept


def hold(path: str, *, shared: bool = False, wait: bool = True) -> int | None:
    """An fd holding a flock (exclusive, or shared) on the directory `path`, which the kernel lets go when the process
    ends however it ends; None where another process holds it (and `wait` is False), or it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone, another user's, or not a directory
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def unheld(root: str, prefix: str) -> Iterator[tuple[str, int]]:
    """(path, fd holding it) of each directory `prefix*` in `root` that no process holds; each fd is closed as the
    loop moves on."""
    try:
        names = [name for name in os.listdir(root) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        fd = hold(path, wait=False)  # None while its owner holds it
        if fd is not None:
            try:
                yield path, fd
            finally:
                os.close(fd)


def _sweep(prefix: str) -> None:
    """Removes the directories of `prefix` under the temporary directory that no live process holds."""
    for path, fd in unheld(tempfile.gettempdir(), prefix):
        if os.listdir(fd) or time.time() - os.fstat(fd).st_mtime > SETTLE_S:
            shutil.rmtree(path, ignore_errors=True)
