"""The ledger: events keyed by provenance, an LMDB store, views, replay, audit. It imports no torch, cupti or pynvml."""

from .events import (ERROR_KINDS, Contract, Environment, Event, Failed, Measured, Method, Origin, Provenance,
                     Retracted, Stats)
from ._codec import provenance_key
from .keys import KeyMaker, ShapeCodec
from .store import AppendResult, Ledger, ledger_path
from .view import STATUSES, Row, View, citation
