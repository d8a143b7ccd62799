"""Settings the runners read from the environment."""

from __future__ import annotations

from ..errors import UsageError
from ..settings import MAX_SECONDS, env_number, environ

__all__ = ["env_seconds"]


def env_seconds(name: str, default: float, *, zero_ok: bool = False, least: float = 0.0, why: str = "") -> float:
    """Seconds from the environment variable `name` (unset or empty: `default`); not a finite number > 0 (>= 0 where
    `zero_ok`: 0 turns the thing off) and at most MAX_SECONDS (a week): a UsageError. A value above 0 but below
    `least` is one too, saying `why` nothing could finish in it (1e-9 timed out every spec, each time)."""
    value = env_number(name, f"a number of seconds {'>=' if zero_ok else '>'} 0 and at most {MAX_SECONDS} (a week)",
                       (lambda v: 0 <= v <= MAX_SECONDS) if zero_ok else (lambda v: 0 < v <= MAX_SECONDS),
                       f"{default:g}")
    if value is not None and 0 < value < least:
        off = "0 to turn it off, or " if zero_ok else ""
        raise UsageError(f"{name}={environ()[name]!r} is below {least:g} s, the least kprof accepts: {why}; set {off}"
                         f"{least:g} or more (default {default:g}), or unset it")
    return default if value is None else value
