"""Provenance keys: a spec's key is blake3(KEY_TAG + the canonical provenance bytes), its shape last."""

from __future__ import annotations

from itertools import repeat

import msgspec
from blake3 import blake3

from ..specs import ShapeCodec
from . import _codec
from .events import Contract, Provenance

__all__ = ["KeyMaker", "ShapeCodec"]


class KeyMaker:
    """Keys of one (table, backend, gpu_key, contract): the provenance before the shape is hashed once, then copied."""

    def __init__(self, table: str, backend: str, gpu_key: str, contract: Contract, shapes: ShapeCodec):
        self.table, self.backend, self.gpu_key, self.contract, self.shapes = table, backend, gpu_key, contract, shapes
        self.base = Provenance(table=table, backend=backend, gpu_key=gpu_key, algorithm=contract.algorithm,
                               layout=contract.layout, numerics=contract.numerics, timing=contract.timing,
                               profiler_revision=contract.profiler_revision)
        self._hasher = blake3(_codec.KEY_TAG + _codec.provenance_prefix(self.base))  # copied per key, never updated
        self.scope = _codec.scope_id(table, backend, gpu_key)

    def shape_bytes(self, spec, index=None) -> bytes:
        return self._encoded(self.shapes.to_shape(spec, index), index)

    def keys_of(self, shapes: list) -> list[bytes]:
        """Keys of canonical shapes in bulk: chained maps over C methods, no Python frame per key."""
        try:
            return list(map(blake3.digest, map(blake3.update, map(blake3.copy, repeat(self._hasher, len(shapes))),
                                               map(_codec.encode, shapes))))
        except OverflowError:  # an int field without bounds holding an int msgpack cannot carry: name it
            for i, shape in enumerate(shapes):
                self._encoded(shape, i)
            raise

    @staticmethod
    def _encoded(shape, index=None) -> bytes:
        """A canonical shape's bytes; SpecError where a value is an int past 64 bits (msgpack's range)."""
        try:
            return _codec.encode(shape)
        except OverflowError:
            fields = shape if isinstance(shape, dict) else msgspec.structs.asdict(shape)
            name, value = next((k, v) for k, v in fields.items() if isinstance(v, int) and not
                               -(1 << 63) <= v < (1 << 64))
            raise ShapeCodec.past_64_bits(name, value, index) from None

    def key(self, spec, index=None) -> bytes:
        return self._hasher.copy().update(self.shape_bytes(spec, index)).digest()

    def provenance(self, spec, index=None) -> Provenance:
        canonical = msgspec.msgpack.decode(self.shape_bytes(spec, index))
        return msgspec.structs.replace(self.base, shape=canonical)
