"""Values a merge refuses in an event that decodes, is canonical and hashes right: ones no kprof writes, which the
reads could not show (a forged or hand-made segment's). Held to the same rule as every refusal of a segment: the
whole segment is refused, nothing written."""

from __future__ import annotations

import math

from .segment import SegmentError

__all__ = ["check"]

# The unix seconds `query` and `show` can print as a date (years 1 to 9999, UTC): outside (nan, inf, 1e12), a
# traceback there
_FIRST, _LAST = -62135596800.0, 253402300799.0


def check(event, path: str, index: int, fix: str) -> None:
    """SegmentError naming the event's first value that no measurement has."""
    at, odd = event.measured_at, None
    if not _FIRST <= at <= _LAST:
        odd = f"measured_at {at!r}, which is not a time (unix seconds, of years 1 to 9999)"
    metrics = getattr(event, "metrics", None) or {}
    if odd is None and not math.isfinite(sum(v for v in metrics.values() if v is not None)):
        name, value = next((k, v) for k, v in metrics.items() if v is not None and not math.isfinite(v))
        odd = f"metric {name!r} = {value!r}, which no measurement gives (JSON would read it as null, no value)"
    if odd is not None:
        raise SegmentError(f"{path}: event {index} holds {odd} (not written by kprof); {fix}")
