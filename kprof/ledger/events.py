"""The ledger's records: provenance and the three immutable event kinds, frozen msgspec Structs.

New fields are appended with defaults and never retyped; `omit_defaults=True` keeps a defaulted field out of the
bytes, so adding one changes no key or id of a record written before it existed."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

__all__ = ["Scalar", "Contract", "Provenance", "Stats", "StatsHead", "Method", "Environment", "Origin", "Measured",
           "Failed", "Retracted", "Event", "EventKey", "ERROR_KINDS", "Summary", "summary_of", "EventHead", "KIND"]

Scalar = Union[bool, int, float, str]
ERROR_KINDS = ("oom", "unsupported", "crash", "timeout", "wrong_result")


class _Record(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False, gc=False):
    """Out of the cyclic GC (records hold no cycles): decoding a million would trigger full collections."""


class Contract(_Record):
    """What a registry entry supplies to every key of its (table, backend): all of Provenance but shape and GPU."""

    algorithm: str = ""
    layout: str = ""
    numerics: str = ""
    timing: str = ""  # timer, L2 state, graph/eager: rows of different methods never share a key
    profiler_revision: int = 1


class Provenance(_Record):
    """The full content of a key. `shape` is last so the rest can be pre-encoded once per view."""

    table: str
    backend: str
    gpu_key: str
    algorithm: str = ""
    layout: str = ""
    numerics: str = ""
    timing: str = ""
    profiler_revision: int = 1
    shape: dict[str, Scalar] = {}

    @property
    def contract(self) -> Contract:
        return Contract(self.algorithm, self.layout, self.numerics, self.timing, self.profiler_revision)


class StatsHead(_Record):
    """Summary of one measurement's samples (times in ms). Decoding as StatsHead skips the raw samples."""

    n: int
    median: float
    p10: float
    p90: float
    mean: float
    stdev: float
    cv: float
    min: float = 0.0
    max: float = 0.0


class Stats(StatsHead):
    """The summary with the raw samples kept beside it."""

    samples: list[float] = []


class Method(_Record):
    """How the number was taken."""

    timer: str  # cupti | events | cpu
    l2: str = "cold"  # cold | warm | n/a
    graph: bool = False
    warmup: int = 0
    budget_s: float = 0.0
    stop_reason: str = ""  # converged | resolution | budget | max_samples
    notes: dict[str, str] = {}


class Environment(_Record):
    """Where the number was taken. What could not be collected is named in `errors`, not raised."""

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


class Origin(_Record):
    """Which ledger and run produced the event."""

    ledger_id: str = ""
    run_id: str = ""
    host: str = ""
    command: str = ""


class Measured(_Record, tag="measured"):
    key: bytes
    provenance: Provenance
    metrics: dict[str, float | None]
    stats: Stats
    method: Method
    environment: Environment = Environment()
    origin: Origin = Origin()
    measured_at: float = 0.0  # unix seconds
    parent: bytes | None = None  # event id of the row this one supersedes, if any


class Failed(_Record, tag="failed"):
    key: bytes
    provenance: Provenance
    error_kind: Literal["oom", "unsupported", "crash", "timeout", "wrong_result"]
    message: str
    environment: Environment = Environment()
    origin: Origin = Origin()
    measured_at: float = 0.0
    parent: bytes | None = None


class Retracted(_Record, tag="retracted"):
    key: bytes
    target: bytes  # the event id withdrawn
    reason: str
    origin: Origin = Origin()
    measured_at: float = 0.0


Event = Union[Measured, Failed, Retracted]


class Summary(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a reader needs of a current row (the `current` view): one short flat array to decode, not the event."""

    metrics: dict[str, float | None] | None
    measured_at: float
    n: int = 0
    median: float = 0.0
    p10: float = 0.0
    p90: float = 0.0
    mean: float = 0.0
    stdev: float = 0.0
    cv: float = 0.0
    min: float = 0.0
    max: float = 0.0
    error_kind: str | None = None
    message: str | None = None

    @property
    def stats(self) -> StatsHead | None:  # no samples (a Stats would claim none): they are in the event
        return None if self.metrics is None else StatsHead(self.n, self.median, self.p10, self.p90, self.mean,
                                                           self.stdev, self.cv, self.min, self.max)


class MeasuredHead(msgspec.Struct, frozen=True, gc=False, tag="measured"):
    """What the views need of a measured event; decoding skips environment, method, origin, samples."""

    key: bytes
    provenance: Provenance
    metrics: dict[str, float | None]
    stats: StatsHead
    measured_at: float = 0.0


class FailedHead(msgspec.Struct, frozen=True, gc=False, tag="failed"):
    key: bytes
    provenance: Provenance
    error_kind: str
    message: str
    measured_at: float = 0.0


EventHead = Union[MeasuredHead, FailedHead, Retracted]


class MeasuredAudit(msgspec.Struct, frozen=True, gc=False, tag="measured"):
    """A measured event as the audit reads it: the provenance as its stored bytes (hashed for the key), and nothing
    the views do not use (method, environment, origin and samples doubled the decoding's cost; the id covers them)."""

    key: bytes
    provenance: msgspec.Raw
    metrics: dict[str, float | None]
    stats: StatsHead
    measured_at: float = 0.0


class FailedAudit(msgspec.Struct, frozen=True, gc=False, tag="failed"):
    """A failed event as the audit reads it: its error kind checked against the schema."""

    key: bytes
    provenance: msgspec.Raw
    error_kind: Literal["oom", "unsupported", "crash", "timeout", "wrong_result"]
    message: str
    measured_at: float = 0.0


EventAudit = Union[MeasuredAudit, FailedAudit, Retracted]


class MeasuredKey(msgspec.Struct, frozen=True, gc=False, tag="measured"):
    """An event's key alone: decoding skips every other field."""

    key: bytes


class FailedKey(msgspec.Struct, frozen=True, gc=False, tag="failed"):
    key: bytes


class RetractedKey(msgspec.Struct, frozen=True, gc=False, tag="retracted"):
    key: bytes


EventKey = Union[MeasuredKey, FailedKey, RetractedKey]
# The kind letter of every event type the reducer accepts (the views store it beside each row).
KIND = {Measured: "m", MeasuredHead: "m", MeasuredAudit: "m", Failed: "f", FailedHead: "f",
        FailedAudit: "f", Retracted: "r"}


def summary_of(event) -> Summary:
    """The row summary of a measured or failed event. Every event reaching the views is in its decoded form
    (float fields hold floats), so the summary's bytes are the same at append, rebuild and audit."""
    if KIND[type(event)] == "m":
        s = event.stats
        return Summary(event.metrics, event.measured_at, s.n, s.median, s.p10, s.p90, s.mean, s.stdev, s.cv,
                       s.min, s.max)
    return Summary(None, event.measured_at, error_kind=event.error_kind, message=event.message)
