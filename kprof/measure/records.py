"""What a measurement hands back, as named records of measure's own: the runner pipeline converts them into
the ledger's event records (`kprof.ledger.events.Stats`, `Environment`), so measure imports nothing of the
ledger. The fields are the ledger records' fields, in their order (a test holds them equal)."""

from __future__ import annotations

import msgspec

__all__ = ["SampleStats", "DeviceEnvironment"]


class SampleStats(msgspec.Struct, frozen=True):
    """Summary of one measurement's samples (times in ms), with the raw samples (thinned past 512)."""

    n: int
    median: float
    p10: float
    p90: float
    mean: float
    stdev: float
    cv: float
    min: float = 0.0
    max: float = 0.0
    samples: list[float] = []


class DeviceEnvironment(msgspec.Struct, frozen=True):
    """Where a number was taken. What could not be collected is named in `errors`, not raised."""

    gpu_name: str = ""
    gpu_uuid: str = ""
    driver: str = ""
    cuda: str = ""
    torch: str = ""
    cupti: str = ""
    python: str = ""
    kprof: str = ""
    host: str = ""
    power_limit_w: float | None = None
    clocks: dict[str, float] = {}
    throttle: list[str] = []
    errors: dict[str, str] = {}
