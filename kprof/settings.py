"""Numbers kprof reads from the environment: a bad value is refused (a UsageError, exit 2) naming the variable and
an example, before anything is measured or written."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Mapping

from .errors import UsageError

__all__ = ["environ", "given", "env_number", "env_seconds", "env_alias", "env_ordered", "MAX_SECONDS"]

# The most seconds any KPROF_*_S setting may hold: a week. Far more is a typo or a "never", and past ~1e9 s the
# waits that take it overflow (OverflowError from select and timedelta) rather than wait.
MAX_SECONDS = 7 * 24 * 3600
_given: ContextVar[Mapping[str, str] | None] = ContextVar("kprof_settings_given", default=None)


def environ() -> Mapping[str, str]:
    """Where kprof reads its settings: the process environment, or within `given(...)` the values given over it."""
    over = _given.get()
    return os.environ if over is None else over


@contextmanager
def given(values: Mapping[str, str]) -> Iterator[None]:
    """Settings read in this thread (or task) see `values` over the process environment, as a remote task will (its
    env_vars over what it inherits); os.environ itself never changes, so other threads read it as it is."""
    token = _given.set({**os.environ, **values})
    try:
        yield
    finally:
        _given.reset(token)


def env_number(name: str, what: str, valid: Callable[[float], bool], example: str) -> float | None:
    """The finite number environment variable `name` holds, where `valid` takes it; None where it is unset or empty;
    anything else (text, nan, inf, a value `valid` refuses) a UsageError saying it is not `what`."""
    raw = environ().get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and valid(value)):
        raise UsageError(f"{name}={raw!r} is not {what}; e.g. {name}={example}, or unset it")
    return value


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


def env_alias(*names: str) -> str | None:
    """The one variable of `names` (aliases of one setting, the first the documented one) that is set, or None where
    none is. Two set to different values are a UsageError naming both: which one was meant is not kprof's guess."""
    env = environ()
    set_ = [(name, env[name]) for name in names if env.get(name, "").strip()]
    for name, raw in set_[1:]:
        if "".join(raw.split()) != "".join(set_[0][1].split()):
            raise UsageError(f"{set_[0][0]}={set_[0][1]!r} and {name}={raw!r} are the same setting and differ; "
                             f"unset {name} (or give both one value)")
    return set_[0][0] if set_ else None


def env_ordered(least_name: str, least: float, most_name: str, most: float) -> None:
    """Two variables bounding one range, both set with the least above the most: a UsageError naming both values (one
    set alone stays as it is; its reader decides what the other's default means beside it)."""
    env = environ()
    if least > most and all(env.get(n, "").strip() for n in (least_name, most_name)):
        raise UsageError(f"{least_name}={env[least_name]!r} is above {most_name}={env[most_name]!r}: "
                         f"the least cannot exceed the most; lower {least_name} or raise {most_name}")
