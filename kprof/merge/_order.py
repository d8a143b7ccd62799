"""The order a merge takes its segments in: a segment holding the row another's event re-measures goes first."""

from __future__ import annotations

import msgspec

from ..ledger import _codec
from . import segment

__all__ = ["ordered"]

RUN = 10_000  # events read (and hashed) as one


class _MeasuredLink(msgspec.Struct, tag="measured"):
    parent: bytes | None = None


class _FailedLink(msgspec.Struct, tag="failed"):
    parent: bytes | None = None


class _RetractedLink(msgspec.Struct, tag="retracted"):
    target: bytes


_link_decoder = msgspec.msgpack.Decoder(_MeasuredLink | _FailedLink | _RetractedLink)  # an event's link alone


def ordered(paths: list[str]) -> list[str]:
    """The segments in merge order: one holding the parent (or a retraction's target) of another's event goes
    before it, so a re-measurement merges after the row it re-measured whichever segment was named first; otherwise
    (and among segments that name each other) the given order. One streamed pass reads each event's id and link;
    an event that does not decode is left to the check, which names it."""
    if len(paths) < 2:
        return list(paths)
    holder: dict[bytes, int] = {}  # event id -> the first segment holding it
    links: list[tuple[int, bytes]] = []  # (segment, an event's parent or target)
    for s, path in enumerate(paths):
        for run in segment.runs(path, RUN):
            for data in run.events:
                holder.setdefault(_codec.event_id(data), s)
                try:
                    event = _link_decoder.decode(data)
                except msgspec.MsgspecError:
                    continue
                link = event.target if type(event) is _RetractedLink else event.parent
                if link is not None:
                    links.append((s, link))
    after: list[set[int]] = [set() for _ in paths]  # per segment, the segments it must follow
    for s, link in links:
        h = holder.get(link)
        if h is not None and h != s:
            after[s].add(h)
    order: list[int] = []
    placed: set[int] = set()
    while len(order) < len(paths):
        left = [s for s in range(len(paths)) if s not in placed]
        s = next((s for s in left if after[s] <= placed), left[0])  # none ready: a cycle, taken in the given order
        order.append(s)
        placed.add(s)
    return [paths[s] for s in order]
