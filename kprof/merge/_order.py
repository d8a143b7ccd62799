"""The order a merge takes its segments in: a directory's segments oldest first, and a segment holding the row
another's event re-measures before that one."""

from __future__ import annotations

import os
import sys

import msgspec

from ..errors import UsageError
from ..ledger import _codec
from . import segment

__all__ = ["ordered", "expanded", "passed_over"]

RUN = 10_000  # events read (and hashed) as one


class _MeasuredLink(msgspec.Struct, tag="measured"):
    parent: bytes | None = None


class _FailedLink(msgspec.Struct, tag="failed"):
    parent: bytes | None = None


class _RetractedLink(msgspec.Struct, tag="retracted"):
    target: bytes


_link_decoder = msgspec.msgpack.Decoder(_MeasuredLink | _FailedLink | _RetractedLink)  # an event's link alone


def expanded(paths) -> list[str]:
    """The segment files `paths` names, checked: a list of paths, where a directory stands for its .kseg files,
    oldest first (by the time each was written, then name), so that a row's history merges in the order it was
    made. A str (one path, which a loop would take a character at a time) or a path of another type is refused."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise UsageError(f"segments: expected a list of segment paths, got one path ({paths!r}); wrap it in a list, "
                         f"[path]")
    try:
        paths = list(paths)
    except TypeError:
        raise UsageError(f"segments: expected a list of segment paths, got {type(paths).__name__}; pass e.g. "
                         f"['rows/'] or ['gemm.kseg']") from None
    out: list[str] = []
    for i, path in enumerate(paths):
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise UsageError(f"segments[{i}] = {path!r} is not a segment path; pass each segment file (or a "
                             f"directory of them) as a non-empty str")
        if not os.path.isdir(path):
            out.append(path)
            continue
        found = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".kseg")]
        if not found:
            sub, other = os.path.join(path, "segments"), passed_over([path])
            raise UsageError(f"{path} is a directory with no .kseg segment in it; " + (
                f"a remote run's --output-dir keeps its segments in segments/: pass {sub}" if os.path.isdir(sub) else
                f"it holds {_named(other)}, not named *.kseg: rename a segment to end in .kseg, or pass it by name"
                if other else "give segment files, or the directory `kprof export -o DIR` wrote"))
        out.extend(sorted(found, key=lambda p: (segment.header_of(p).created_at, os.path.basename(p))))
    for path in out:  # a merge's report (--json, a conflict's files) names each as UTF-8 text: a traceback, merged
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            try:  # UTF-8, which Python reads in the locale's encoding (a C locale with UTF-8 mode off)
                os.fsencode(path).decode("utf-8")
                fix = (f"its name is UTF-8, read here as {sys.getfilesystemencoding()}: set PYTHONUTF8=1, or a UTF-8 "
                       f"locale (LC_ALL=C.UTF-8)")
            except UnicodeError:
                fix = "it is named in another encoding than UTF-8, which kprof reports its segments' paths in: rename it"
            raise UsageError(f"segment {path}: {fix}, and merge again (nothing was merged)") from None
    return out


def passed_over(paths) -> list[str]:
    """The files of the directories among `paths` that a merge of them leaves out: those not named *.kseg (a
    segment renamed, or a `.kseg.part` a remote run left unfinished), hidden ones (.gitkeep) aside."""
    out = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            out += sorted(os.path.join(path, n) for n in os.listdir(path) if not n.endswith(".kseg") and
                          not n.startswith(".") and os.path.isfile(os.path.join(path, n)))
    return out


def _named(files: list[str], most: int = 5) -> str:
    """Up to `most` of the files, then how many more."""
    more = f" and {len(files) - most} more" if len(files) > most else ""
    return ", ".join(files[:most]) + more


def ordered(paths: list[str]) -> list[str]:
    """The segments in merge order: one holding the parent (or a retraction's target) of another's event goes
    before it, so a re-measurement merges after the row it re-measured whichever segment was named first; otherwise
    (and among segments that name each other) the given order. One streamed pass reads each event's id and link;
    an event that does not decode is left to the check, which names it."""
    if len(paths) < 2:
        return list(paths)
    holder: dict[bytes, int] = {}  # event id -> the segments holding it, one bit each
    links: list[tuple[int, bytes]] = []  # (segment, an event's parent or target)
    for s, path in enumerate(paths):
        for run in segment.runs(path, RUN):
            for data in run.events:
                eid = _codec.event_id(data)
                holder[eid] = holder.get(eid, 0) | 1 << s
                try:
                    event = _link_decoder.decode(data)
                except (msgspec.MsgspecError, RecursionError):  # nested past the decoder's depth too
                    continue
                link = event.target if type(event) is _RetractedLink else event.parent
                if link is not None:
                    links.append((s, link))
    after: list[set[int]] = [set() for _ in paths]  # per segment, the segments it must follow
    for s, link in links:  # a segment holding the link itself follows none for it (overlapping exports hold both)
        held = holder.get(link, 0)
        if held and not held >> s & 1:
            after[s].add((held & -held).bit_length() - 1)  # the first segment holding it
    order: list[int] = []
    placed: set[int] = set()
    while len(order) < len(paths):
        left = [s for s in range(len(paths)) if s not in placed]
        s = next((s for s in left if after[s] <= placed), left[0])  # none ready: a cycle, taken in the given order
        order.append(s)
        placed.add(s)
    return [paths[s] for s in order]
