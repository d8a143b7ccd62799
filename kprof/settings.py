"""Numbers kprof reads from the environment: a bad value is refused (a UsageError, exit 2) naming the variable and
an example, before anything is measured or written."""

from __future__ import annotations

import math
import os
from typing import Callable

from .errors import UsageError

__all__ = ["env_number"]


def env_number(name: str, what: str, valid: Callable[[float], bool], example: str) -> float | None:
    """The finite number environment variable `name` holds, where `valid` takes it; None where it is unset or empty;
    anything else (text, nan, inf, a value `valid` refuses) a UsageError saying it is not `what`."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and valid(value)):
        raise UsageError(f"{name}={raw!r} is not {what}; e.g. {name}={example}, or unset it")
    return value
