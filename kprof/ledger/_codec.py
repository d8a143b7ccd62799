"""Canonical bytes and content addresses. One reused Encoder with deterministic order for everything hashed.

Every hash input starts with a versioned tag, so a future format can change its bytes without any
chance of colliding with an address of this one.
"""

from __future__ import annotations

import msgspec
from blake3 import blake3

from ..errors import IntegrityError
from .events import Event, Provenance

# The ledger file's layout. 2: one history entry per key, with a status; 3: current rows with a digest that every
# read checks; 4: every stored view value a named record (see _reducer). A file of an older format has its views
# rebuilt from the log when it is opened (see store.Ledger._initialize); its events and log are never rewritten.
FORMAT_VERSION = 4
KEY_TAG = b"kprof/key/v1\x00"
EVENT_TAG = b"kprof/event/v1\x00"
SCOPE_TAG = b"kprof/scope/v1\x00"
SHAPE_TAG = b"kprof/shape/v1\x00"
ROOT_TAG = b"kprof/root/v1\x00"
ROW_TAG = b"kprof/row/v1\x00"

encoder = msgspec.msgpack.Encoder(order="deterministic")
encode = encoder.encode
event_decoder = msgspec.msgpack.Decoder(Event)


def stored_event(data: bytes, eid: bytes):
    """A stored event, decoded; IntegrityError (exit 3) naming it where its bytes do not fit the schema."""
    try:
        return event_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise IntegrityError(f"stored event {eid.hex()[:16]} cannot be decoded ({exc}); run `kprof audit` and "
                             f"restore the file from a copy") from None


def event_bytes(event) -> bytes:
    return encode(event)


_EVENT_HASHER = blake3(EVENT_TAG)


def event_id(data: bytes) -> bytes:
    """Event id of an event's canonical bytes: blake3(EVENT_TAG + data), from a copy of a hasher that has taken
    the tag (no concatenated copy of the event; ~15% faster on events of ~800 bytes)."""
    return _EVENT_HASHER.copy().update(data).digest()


_KEY_HASHER = blake3(KEY_TAG)


def key_of(provenance_bytes) -> bytes:
    """The key of a provenance's canonical bytes (any buffer): blake3(KEY_TAG + bytes)."""
    return _KEY_HASHER.copy().update(provenance_bytes).digest()


def provenance_key(provenance: Provenance) -> bytes:
    return key_of(encode(provenance))


def provenance_prefix(provenance_without_shape: Provenance) -> bytes:
    """Bytes that precede the shape in the canonical encoding (shape is the last field).

    `KEY_TAG + prefix + encode(shape)` equals `KEY_TAG + encode(provenance)`; a test holds the two equal.
    """
    data = encode(msgspec.structs.replace(provenance_without_shape, shape={"": 0}))
    tail = encode({"": 0})
    assert data.endswith(tail)  # internal invariant of the encoding, not input validation
    return data[: -len(tail)]


def scope_id(table: str, backend: str, gpu_key: str) -> bytes:
    return blake3(SCOPE_TAG + encode([table, backend, gpu_key])).digest()[:16]


_SHAPE_HASHER = blake3(SHAPE_TAG)


def shape_id(shape_bytes: bytes) -> bytes:
    """blake3(SHAPE_TAG + shape bytes), its first 16 bytes (asked of the hash's output directly: no slice)."""
    return _SHAPE_HASHER.copy().update(shape_bytes).digest(16)
