"""The answers of a ledger's recent bulk lookups, for a reader that asks for the same specs again and again.

A view's answer to a list of specs depends on the specs' canonical shapes and on the scope's current rows,
nothing else, and the scope's view root names those rows: an additive hash over every (key, current event id)
of the scope (see `_reducer`), so any append, re-measurement or retraction in the scope changes it. An answer is
remembered under a digest of the request's canonical shapes, with the root read in the snapshot that answered
it (and the count of `rebuild_views` repairs, which rewrite the views without an event); a later lookup whose own
snapshot reads the same stamp gets it back, exactly. The first lookup that reads another stamp drops every
answer of that view.

Bounded: at most `max_specs` specs' answers over all of a ledger's views (a request larger than that is never
remembered) and `MAX_ENTRIES` requests, the least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable

MAX_SPECS = 400_000  # get_many: ~0.1 KB a missing row, ~0.8 KB a found one (its Summary: 16 raw samples); missing: 1 B
MAX_ENTRIES = 16


class Memo:
    """(view, op, request digest) -> answer, each view's answers valid for one stamp (see the module)."""

    def __init__(self, max_specs: int = MAX_SPECS):
        self.max_specs = max_specs
        self.specs = 0  # specs answered by the entries held
        self._entries: OrderedDict[tuple, tuple[int, Any]] = OrderedDict()  # oldest first
        self._stamps: dict[bytes, bytes] = {}  # view -> the stamp its entries were read under
        self._lock = threading.Lock()

    def get(self, view: bytes, stamp: bytes, op: str, digest: Hashable):
        """The answer remembered for this request under this stamp, or None."""
        with self._lock:
            if self._stamps.get(view) != stamp:
                self._restamp(view, stamp)
                return None
            entry = self._entries.get((view, op, digest))
            if entry is None:
                return None
            self._entries.move_to_end((view, op, digest))
            return entry[1]

    def put(self, view: bytes, stamp: bytes, op: str, digest: Hashable, specs: int, answer) -> None:
        if specs > self.max_specs:
            return
        with self._lock:
            if self._stamps.get(view) != stamp:
                self._restamp(view, stamp)
            old = self._entries.pop((view, op, digest), None)
            if old is not None:
                self.specs -= old[0]
            self._entries[(view, op, digest)] = (specs, answer)
            self.specs += specs
            while self.specs > self.max_specs or len(self._entries) > MAX_ENTRIES:
                self.specs -= self._entries.popitem(last=False)[1][0]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._stamps.clear()
            self.specs = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _restamp(self, view: bytes, stamp: bytes) -> None:
        """Drops the view's answers (read under another stamp) and takes the new stamp."""
        for key in [key for key in self._entries if key[0] == view]:
            self.specs -= self._entries.pop(key)[0]
        self._stamps[view] = stamp
