"""Settings the runners read from the environment."""

from __future__ import annotations

from ..settings import MAX_SECONDS, env_number

__all__ = ["env_seconds"]


def env_seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    """Seconds from the environment variable `name` (unset or empty: `default`); not a finite number > 0 (>= 0 where
    `zero_ok`: 0 turns the thing off) and at most MAX_SECONDS (a week): a UsageError."""
    value = env_number(name, f"a number of seconds {'>=' if zero_ok else '>'} 0 and at most {MAX_SECONDS} (a week)",
                       (lambda v: 0 <= v <= MAX_SECONDS) if zero_ok else (lambda v: 0 < v <= MAX_SECONDS),
                       f"{default:g}")
    return default if value is None else value
