"""Constructors for events with their key filled in from the provenance."""

from __future__ import annotations

import time

import msgspec

from . import _codec
from .events import Environment, Failed, Measured, Method, Origin, Provenance, Retracted, Stats

__all__ = ["measured", "failed", "retraction"]


def _canonical(event):
    """The event as its bytes decode (an int given for a float field, e.g. an NVML clock, becomes a float), so the
    bytes hashed to its id are those a merge, an audit and a segment reader recompute."""
    try:
        return _codec.event_decoder.decode(_codec.encode(event))
    except msgspec.ValidationError:  # a value outside the schema: the ledger's append refuses it, naming it
        return event


def measured(provenance: Provenance, metrics: dict, stats: Stats, method: Method, *,
             environment: Environment = Environment(), origin: Origin = Origin(),
             measured_at: float | None = None, parent: bytes | None = None) -> Measured:
    return _canonical(Measured(key=_codec.provenance_key(provenance), provenance=provenance, metrics=metrics,
                               stats=stats, method=method, environment=environment, origin=origin,
                               measured_at=time.time() if measured_at is None else measured_at, parent=parent))


def failed(provenance: Provenance, error_kind: str, message: str, *, environment: Environment = Environment(),
           origin: Origin = Origin(), measured_at: float | None = None, parent: bytes | None = None) -> Failed:
    return _canonical(Failed(key=_codec.provenance_key(provenance), provenance=provenance, error_kind=error_kind,
                             message=message, environment=environment, origin=origin,
                             measured_at=time.time() if measured_at is None else measured_at, parent=parent))


def retraction(target_event_id: bytes, key: bytes, reason: str, *, origin: Origin = Origin(),
               at: float | None = None) -> Retracted:
    return Retracted(key=key, target=target_event_id, reason=reason, origin=origin,
                     measured_at=time.time() if at is None else at)
