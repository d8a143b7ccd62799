"""Bulk point lookups (kprof.ledger._lookup): sorted with numpy from NUMPY_FROM keys on, with sorted()
below; both answer exactly as one get per key does, in input order."""

import os
import random

import lmdb
import pytest

from kprof.ledger import _lookup


@pytest.fixture
def store(tmp_path):
    env = lmdb.open(str(tmp_path / "t.lmdb"), subdir=False, map_size=1 << 28)
    rng = random.Random(3)
    stored = {os.urandom(32): rng.choice((b"m", b"f")) + os.urandom(rng.randrange(0, 60)) for _ in range(6000)}
    with env.begin(write=True) as txn:
        for k, v in stored.items():
            txn.put(k, v)
    yield env, stored
    env.close()


@pytest.mark.parametrize("numpy_from", [1, 10**9])  # every list through numpy, none
def test_bulk_lookups_answer_as_one_get_per_key(store, monkeypatch, numpy_from):
    env, stored = store
    monkeypatch.setattr(_lookup, "NUMPY_FROM", numpy_from)
    rng = random.Random(11)
    present = list(stored)
    keys = rng.sample(present, 3000) + [os.urandom(32) for _ in range(3000)] + rng.sample(present, 500)  # repeats
    rng.shuffle(keys)
    keys.append(b"\0" * 32)  # ties in the first 8 bytes, and the smallest key there is
    keys.append(b"\0" * 31 + b"\1")
    with env.begin() as txn:
        assert _lookup.values(txn.cursor(), keys) == [stored.get(k) for k in keys]
        want = bytes(stored.get(k, b"").startswith(b"m") for k in keys)
        assert _lookup.measured_flags(txn.cursor(), keys) == want
        assert _lookup.values(txn.cursor(), []) == [] and _lookup.measured_flags(txn.cursor(), []) == b""


def test_keys_of_other_sizes_take_sorted(store, monkeypatch):
    env, stored = store
    monkeypatch.setattr(_lookup, "NUMPY_FROM", 1)
    keys = list(stored)[:100] + [b"short"]
    with env.begin() as txn:
        assert _lookup.values(txn.cursor(), keys) == [stored.get(k) for k in keys]
