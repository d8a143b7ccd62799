"""Canonical bytes and content addresses: one deterministic Encoder for everything hashed, and every hash input
opened by a versioned tag (a future format's addresses cannot collide with these)."""

from __future__ import annotations

import functools

import msgspec
from blake3 import blake3

from ..errors import IntegrityError
from .events import Event, Provenance

# The ledger file's layout. 2: one history entry per key, with a status; 3: current rows with a digest that every
# read checks; 4: every stored view value a named record (see _reducer). A file of an older format has its views
# rebuilt from the log when it is opened (see store.Ledger._initialize); its events and log are never rewritten.
FORMAT_VERSION = 4
KEY_TAG, EVENT_TAG, SCOPE_TAG = b"kprof/key/v1\x00", b"kprof/event/v1\x00", b"kprof/scope/v1\x00"
SHAPE_TAG, ROOT_TAG, ROW_TAG = b"kprof/shape/v1\x00", b"kprof/root/v1\x00", b"kprof/row/v1\x00"

encoder = msgspec.msgpack.Encoder(order="deterministic")
UNDECODABLE = (msgspec.DecodeError, RecursionError)  # a stored value's decoding fails: damage (or nested too deep)
encode = encoder.encode
event_decoder = msgspec.msgpack.Decoder(Event)
# Hashers that took their tag, copied per hash and never updated: no concatenated copy of the bytes hashed.
_EVENT_HASHER, _KEY_HASHER, _SHAPE_HASHER = blake3(EVENT_TAG), blake3(KEY_TAG), blake3(SHAPE_TAG)


def stored_event(data: bytes, eid: bytes):
    """A stored event, decoded; IntegrityError (exit 3) naming it where its bytes do not fit the schema."""
    try:
        return event_decoder.decode(data)
    except UNDECODABLE as exc:
        raise IntegrityError(f"stored event {eid.hex()[:16]} cannot be decoded ({exc}); run `kprof audit` and "
                             f"restore the file from a copy") from None


def event_id(data: bytes) -> bytes:
    """blake3(EVENT_TAG + data)."""
    return _EVENT_HASHER.copy().update(data).digest()


def key_of(provenance_bytes) -> bytes:
    """blake3(KEY_TAG + a provenance's canonical bytes)."""
    return _KEY_HASHER.copy().update(provenance_bytes).digest()


def provenance_key(provenance: Provenance) -> bytes:
    return key_of(encode(provenance))


def provenance_prefix(provenance_without_shape: Provenance) -> bytes:
    """The bytes of a provenance's encoding before its shape (its last field): these + encode(shape) == the whole."""
    data, tail = encode(msgspec.structs.replace(provenance_without_shape, shape={"": 0})), encode({"": 0})
    assert data.endswith(tail)  # internal invariant of the encoding, not input validation
    return data[: -len(tail)]


@functools.lru_cache(maxsize=1024)  # a ledger's events share a few scopes
def scope_id(table: str, backend: str, gpu_key: str) -> bytes:
    return blake3(SCOPE_TAG + encode([table, backend, gpu_key])).digest()[:16]


def shape_id(shape_bytes: bytes) -> bytes:
    return _SHAPE_HASHER.copy().update(shape_bytes).digest(16)
