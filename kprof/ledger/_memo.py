"""The answers of a ledger's recent bulk lookups, for a reader that asks for the same specs again and again.

An answer depends only on the request's canonical shapes and the scope's current rows, named by its view root (any
append, re-measurement or retraction changes it) and the count of `rebuild_views` repairs: kept under a digest of the
shapes with that stamp, it is given back to a lookup reading the same stamp; one reading another drops the view's
answers. Bounded: `max_specs` specs in all (a larger request is never kept), `MAX_ENTRIES` requests, LRU."""

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
            entry = self._entries.get((view, op, digest)) if self._stamped(view, stamp) else None
            if entry is not None:
                self._entries.move_to_end((view, op, digest))
            return entry and entry[1]

    def put(self, view: bytes, stamp: bytes, op: str, digest: Hashable, specs: int, answer) -> None:
        if specs > self.max_specs:
            return
        with self._lock:
            self._stamped(view, stamp)
            self.specs += specs - self._entries.pop((view, op, digest), (0,))[0]
            self._entries[(view, op, digest)] = (specs, answer)
            while self.specs > self.max_specs or len(self._entries) > MAX_ENTRIES:
                self.specs -= self._entries.popitem(last=False)[1][0]

    def __len__(self) -> int:
        return len(self._entries)

    def _stamped(self, view: bytes, stamp: bytes) -> bool:
        """Whether the view's answers were read under `stamp`; where not, drops them and takes `stamp`."""
        if self._stamps.get(view) == stamp:
            return True
        for key in [key for key in self._entries if key[0] == view]:
            self.specs -= self._entries.pop(key)[0]
        self._stamps[view] = stamp
        return False
