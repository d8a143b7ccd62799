"""Output directories written once: the checks made before any work, so a refusal leaves nothing behind; and the
staging folder inside one that its files are written in, then renamed from, so an interrupted write leaves no part."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from typing import Iterator

from ._scratch import hold, unheld
from .errors import UsageError

__all__ = ["check_output_dir", "staged", "drop_unfinished", "write_once", "make_read_only", "replace_whole",
           "new_file", "as_text"]

_FIX = "pass a new directory (it is created if absent)"
READ_ONLY = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # the mode of an output's files
_ROOM = 64  # bytes of a path kept for the staging folder and a file's name inside an output directory


def as_text(path: str) -> str:
    """`path` as a record's UTF-8 text: a byte of a name in another encoding (a directory named with 0xff, which
    Python reads as a surrogate no JSON encoder takes) escaped, `\\xff`."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def check_output_dir(path: str, names, what: str) -> None:
    """Refuses a directory the files `names` (`what` they make, e.g. "a snapshot") could not be written to: empty,
    holding any of them already (outputs are immutable), not a directory, or not writable, nor creatable (a
    directory is made and removed again in its parent to prove it). Leaves nothing. With no `names` (a merge's
    report, replaced), an existing directory is as good as a new one, and the messages say so."""
    fix = _FIX if names else "pass a directory (it is created if absent)"
    if not path.strip():
        raise UsageError(f"--output-dir {path!r} is empty; {fix}, or omit --output-dir")
    bare = path.rstrip(os.sep) or path  # `notes.txt/`: lexists() and abspath() would not see the file notes.txt
    if os.path.isdir(path):
        held = [name for name in names if os.path.lexists(os.path.join(path, name))]
        if held:
            raise UsageError(f"--output-dir {path} already holds {what} ({', '.join(held)}); outputs are immutable: "
                             f"{fix}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--output-dir {path} is not writable for this user; {fix}, or fix its permissions")
        return
    if os.path.lexists(bare):
        kind = "a file" if os.path.exists(bare) else "a broken link"
        raise UsageError(f"--output-dir {path} is {kind}, not a directory; {fix}")
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(ancestor):  # the nearest existing directory it would be created in
        if os.path.lexists(ancestor):
            raise UsageError(f"--output-dir {path} passes through {ancestor}, which is not a directory; {fix}")
        ancestor = os.path.dirname(ancestor)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {path} cannot be created: {ancestor} is not writable for this user; {fix}")
    try:  # permissions are not all: a read-only mount, or /proc and /sys, refuse a directory whatever they say
        os.rmdir(tempfile.mkdtemp(prefix=".kprof-probe-", dir=ancestor))
    except OSError as exc:
        raise UsageError(f"--output-dir {path} cannot be created in {ancestor} ({exc.strerror}); {fix}") from None
    _check_names(path, ancestor, fix)


def _check_names(path: str, ancestor: str, fix: str) -> None:
    """Refuses a directory to be created whose name is longer than the file system takes: the probe above makes a
    short name, so a 300-byte one passed it and failed only when the output was written, after the work."""
    def limit(name: str, default: int) -> int:
        try:
            return os.pathconf(ancestor, name)
        except (OSError, ValueError):
            return default

    most = limit("PC_NAME_MAX", 255)
    for name in os.path.relpath(os.path.abspath(path), ancestor).split(os.sep):
        if len(os.fsencode(name)) > most:
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise UsageError(f"--output-dir {path} cannot be created: the name {shown} is {len(os.fsencode(name))} "
                             f"bytes, longer than the {most} a name may have in {ancestor}; {fix}")
    whole, room = len(os.fsencode(os.path.abspath(path))), limit("PC_PATH_MAX", 4096) - _ROOM
    if whole > room:  # the files go in a staging folder inside it: their paths must fit too
        raise UsageError(f"--output-dir {path[:60]}... cannot be created: its path is {whole} bytes, and the files in "
                         f"it need the path to be at most {room}; {fix}")


def write_once(path: str, data: bytes) -> None:
    """A new file `path` holding `data`, read-only (never written over an existing file)."""
    with open(path, "xb") as f:  # "x": never overwrite
        f.write(data)
    make_read_only(path)


def make_read_only(path: str) -> None:
    """An output's file made read-only for those the umask let read it as it was made (umask 077: its owner alone).
    (The umask is never read: reading it means setting it, and another thread's file made meanwhile took that.)"""
    os.chmod(path, os.stat(path).st_mode & READ_ONLY)


def new_file(directory: str, prefix: str, suffix: str) -> tuple[int, str]:
    """(descriptor, path) of a new file of a name of its own in `directory`, made as open() makes one: its mode as the
    umask allows (mkstemp's is its owner's alone, whatever the umask)."""
    while True:
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666), path
        except FileExistsError:
            continue


def replace_whole(path: str, data: bytes) -> None:
    """The file `path` holding `data`, whole or as it was: written under a name of its own beside it, then renamed
    over it (two writers at once leave one's file whole, an interrupt leaves no part, and a link planted as `path` is
    replaced, never written through). Its mode is the one open() would give a new file."""
    fd, tmp = new_file(os.path.dirname(path) or ".", f".{os.path.basename(path)}-", ".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def staged(path: str, prefix: str) -> Iterator[str]:
    """A new staging folder `prefix*` inside `path`, held by an exclusive flock while the block writes in it (the kernel
    lets go when the process ends, however it ends), removed after. The block renames its files into `path`; a kill
    among those renames leaves the folder with the files not yet renamed, for `drop_unfinished` to take back."""
    staging = tempfile.mkdtemp(prefix=prefix, dir=path)
    fd = hold(staging)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def drop_unfinished(path: str, prefix: str, names) -> None:
    """Removes the staging folders `prefix*` of `path` that no live writer holds: a write killed before its end. One
    that still holds files was killed among its renames: the files of `names` it had renamed into `path` go too
    (none was there before it: the write checked that). An empty one is let be: a writer locks its folder before it
    writes a file, so an empty unlocked one may be a live writer's, and holds no part of an output."""
    for staging, _fd in unheld(path, prefix):
        try:
            left = os.listdir(staging)
        except OSError:
            continue
        if not left:  # empty: maybe a live writer's, made but not yet locked; no part of anything
            continue
        for done in (n for n in names if n not in left):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, done))
        shutil.rmtree(staging, ignore_errors=True)
