"""A chunk: the unit of work a worker takes, local or remote. Specs in, events out, as a segment.

A Chunk names everything a worker needs to measure its specs exactly as `run` would in-process: the table and
backend (looked up in the worker's own registry), the contract with the timing method resolved by the caller
(so a worker's environment variables cannot change what the rows mean), the GPU key the rows go under, the
canonical specs, each spec's parent event (the current row it replaces, or None), and the run's origin.

    chunk = Chunk.of(entry, gpu_key, specs, parents, origin)
    for outcome, data in measure_chunk(chunk):         # in a worker: one encoded event per spec, as they finish
        ...
    path = chunk_segment(chunk, "out/")                # remote: the whole chunk as one segment file

Imports no measurement library at import time (spawned workers import it before they choose their GPU).
"""

from __future__ import annotations

from typing import Any, Iterator

import msgspec

from ..ledger.events import Contract, Origin

__all__ = ["Chunk", "measure_chunk", "chunk_segment", "chunk_entry"]


class Chunk(msgspec.Struct, frozen=True):
    table: str
    backend: str
    contract: Contract  # the entry's contract with the caller's timing method
    gpu_key: str
    specs: list[dict[str, Any]]  # canonical specs
    parents: list[bytes | None]  # per spec: the event its new event replaces (the key's current row), or None
    origin: Origin = Origin()
    first_index: int = 0  # position of specs[0] in the caller's request (error messages name it)

    @classmethod
    def of(cls, entry, gpu_key: str, specs: list, parents: list | None = None, origin: Origin = Origin(),
           first_index: int = 0) -> "Chunk":
        return cls(entry.table, entry.backend, entry.contract, gpu_key, [dict(s) for s in specs],
                   list(parents) if parents is not None else [None] * len(specs), origin, first_index)

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> "Chunk":
        return msgspec.msgpack.decode(data, type=cls)


def chunk_entry(chunk: Chunk):
    """The registry entry of the chunk's table and backend, with the chunk's contract (its timing method)."""
    from .registry import lookup

    entry = lookup(chunk.table, chunk.backend)
    if entry.contract.profiler_revision != chunk.contract.profiler_revision:
        from ..errors import UsageError

        raise UsageError(f"{chunk.table}/{chunk.backend}: this worker's kprof measures profiler revision "
                         f"{entry.contract.profiler_revision}, the chunk asks for {chunk.contract.profiler_revision}; "
                         f"run the same kprof version on both sides")
    return msgspec.structs.replace(entry, contract=chunk.contract)


def measure_chunk(chunk: Chunk, device=None) -> Iterator[tuple[Any, bytes]]:
    """(Outcome, the event's canonical bytes) per spec of the chunk, as each finishes, measured on this process's
    device (`device`: one prepare_device made already, kept across chunks)."""
    from ..ledger._codec import encode
    from ..ledger.keys import KeyMaker
    from ..specs import ShapeCodec
    from .worker import measure_specs

    entry = chunk_entry(chunk)
    keys = KeyMaker(entry.table, entry.backend, chunk.gpu_key, entry.contract, ShapeCodec(entry.args, name=entry.table))
    parents = {keys.key(s): p for s, p in zip(chunk.specs, chunk.parents) if p is not None}
    for outcome in measure_specs(entry, chunk.specs, chunk.gpu_key, origin=chunk.origin, parents=parents,
                                 device=device):
        outcome = msgspec.structs.replace(outcome, index=outcome.index + chunk.first_index)
        yield outcome, encode(outcome.event)


def chunk_segment(chunk: Chunk, output: str, ledger_id: str = "") -> str:
    """Measures the chunk and writes its events as one segment at `output` (a directory: named by its content);
    the path written. What a remote worker returns."""
    from ..merge import segment

    return segment.write(output, (data for _outcome, data in measure_chunk(chunk)), ledger_id or chunk.origin.ledger_id,
                         len(chunk.specs))
