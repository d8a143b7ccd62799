"""Verified reads' bulk point lookups (kprof.ledger._verify.values): in sorted order, answered in input order,
exactly as one get per key."""

import os
import random

import lmdb

from kprof.ledger import _verify


def test_bulk_lookups_answer_as_one_get_per_key(tmp_path):
    env = lmdb.open(str(tmp_path / "t.lmdb"), subdir=False, map_size=1 << 28, max_dbs=1)
    current = env.open_db(b"current")
    rng = random.Random(3)
    stored = {os.urandom(32): os.urandom(rng.randrange(0, 60)) for _ in range(6000)}
    with env.begin(write=True) as txn:
        for k, v in stored.items():
            txn.put(k, v, db=current)
    present = list(stored)
    keys = rng.sample(present, 3000) + [os.urandom(32) for _ in range(3000)] + rng.sample(present, 500)  # repeats
    rng.shuffle(keys)
    keys += [b"\0" * 32, b"short"]  # the smallest key there is, and a key of another size
    try:
        with env.begin() as txn:
            cur = txn.cursor(current)
            assert _verify.values(cur, keys) == [stored.get(k) for k in keys]
            assert _verify.values(cur, []) == []
    finally:
        env.close()
