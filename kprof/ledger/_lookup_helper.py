"""The lookup helper process (see _parallel): `python -m kprof.ledger._lookup_helper PATH`.

It opens the ledger read-only, writes one READY byte, then answers requests on stdin until end of file.
A request is one frame (8-byte big-endian length, then msgpack):

    [op, [ledger id, txn id, last seq], table, backend, gpu key, contract, args module, args qualname,
     requester holds a key index (bool), specs]

op "flags" answers View._ok_flags of the specs, op "tail" View._tail, op "index" the state of this process's key
index (see _index; the specs are ignored). The answer is one frame: a tag
byte and its payload: OK and the bytes, MOVED when this process's read transaction is not the requester's
snapshot (another transaction, or another file with the same transaction id), or REFUSED and the reason
for anything else (an invalid spec, specs that are not canonical, an
args type that cannot be imported here).
"""

from __future__ import annotations

import importlib
import sys

import msgspec

from ._parallel import MOVED, OK, READY, REFUSED, read_frame, write_frame
from .events import Contract
from .store import Ledger

_contract = msgspec.msgpack.Decoder(Contract)
_request = msgspec.msgpack.Decoder(tuple[str, tuple[bytes, int, bytes], str, str, str, bytes, str, str, bool,
                                         msgspec.Raw])


def _args_type(module: str, qualname: str) -> type:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, msgspec.Struct)):
        raise TypeError(f"{module}.{qualname} is not a msgspec Struct")
    return obj


def serve(path: str, stdin, stdout) -> None:
    import numpy  # noqa: F401  (bulk lookups sort with it: imported before the first request, not during it)

    ledger = Ledger.open(path, readonly=True)
    views: dict[tuple, object] = {}
    stdout.write(READY)
    stdout.flush()
    while (frame := read_frame(stdin)) is not None:
        try:
            op, snapshot, table, backend, gpu_key, contract, module, qualname, indexed, specs = _request.decode(frame)
            ledger.indexer.requested = indexed  # the requester's lookups earned it one: read ours too (see _index)
            config = (table, backend, gpu_key, contract, module, qualname)
            view = views.get(config)
            if view is None:
                view = views[config] = ledger.view(table, backend, gpu_key, contract=_contract.decode(contract),
                                                   args_type=_args_type(module, qualname))
            with ledger.read() as txn:
                meta = ledger.dbs["meta"]
                if [txn.get(b"ledger_id", db=meta), txn.id(), txn.get(b"last_seq", db=meta)] != list(snapshot):
                    tag, payload = MOVED, b""
                elif op in ("flags", "tail"):
                    # Decoded straight into canonical shapes; a spec that needs normalizing (an int given as
                    # 4096.0) or is invalid takes the general path (flags) or is refused (tail: the requester
                    # builds rows of converted specs itself, and names an invalid spec by its index).
                    shapes = view.shapes.shapes_from_msgpack(specs)
                    if op == "tail":
                        tag, payload = (REFUSED, b"specs not canonical") if shapes is None else (OK, view._tail(txn, shapes))
                    elif shapes is None:
                        tag, payload = OK, view._ok_flags(txn, msgspec.msgpack.decode(specs))
                    else:
                        tag, payload = OK, view._shape_flags(txn, shapes)
                elif op == "index":  # this process's key index: [indexes read, one held now]
                    tag, payload = OK, msgspec.msgpack.encode([ledger.indexer.builds, ledger.indexer.index is not None])
                else:
                    tag, payload = REFUSED, f"unknown op {op!r}".encode()
        except Exception as exc:  # the requester answers the whole lookup itself (and names a bad spec)
            tag, payload = REFUSED, f"{type(exc).__name__}: {exc}".encode()
        write_frame(stdout, payload, tag)


if __name__ == "__main__":
    try:
        serve(sys.argv[1], sys.stdin.buffer, sys.stdout.buffer)
    except (BrokenPipeError, KeyboardInterrupt):
        pass
