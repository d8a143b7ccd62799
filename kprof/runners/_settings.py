"""Settings the runners read from the environment."""

from __future__ import annotations

import os

from ..errors import UsageError

__all__ = ["env_seconds"]


def env_seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    """Seconds from the environment variable `name` (unset or empty: `default`); not a number > 0 (>= 0 where
    `zero_ok`: 0 turns the thing off): a UsageError."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero_ok else value > 0):
        raise UsageError(f"{name}={raw!r} is not a number of seconds {'>=' if zero_ok else '>'} 0; e.g. "
                         f"{name}={default:g}")
    return value
